//! The in-process keeper: `arbor mount --foreground --restartable` holds the mount's `/dev/fuse`
//! file and runs the process that serves it as its child. When that child
//! dies (kill -9, OOM, a panic) while the mount is still there, the keeper
//! starts another one on the same file, which takes the connection over
//! (`arbor_fs::resume`): processes using the mount see a stall, not an
//! error. The keeper opens no disk and does nothing else, so little can
//! kill it; if it dies, its child is killed with it (`PR_SET_PDEATHSIG`)
//! and the mount is dead, as a mount without a keeper would be.
//!
//! The first child mounts (and answers INIT) as any mount does, then sends
//! the keeper a copy of its `/dev/fuse` file over a Unix socket
//! (`SCM_RIGHTS`); later children inherit that file.

use anyhow::Result;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Set for the serving child: the keeper's socket.
const KEEPER_FD: &str = "ARBOR_KEEPER_FD";
/// Set for a child that takes a live connection over: its `/dev/fuse` file.
const RESUME_FD: &str = "ARBOR_RESUME_FD";

/// More restarts than this within [`RESTART_WINDOW`] and the keeper gives
/// up (the mount then dies with it): a child that cannot start again.
const MAX_RESTARTS: usize = 10;
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// Whether this process is a keeper's serving child.
pub fn is_child() -> bool {
    std::env::var_os(KEEPER_FD).is_some()
}

/// Whether `arbor mount --foreground --restartable` should run as the
/// keeper (its serving child runs with the same arguments).
pub fn wanted(restartable: bool) -> bool {
    restartable && !is_child()
}

/// The keeper's pid, for a serving child.
pub fn keeper_pid() -> Option<u32> {
    // SAFETY: plain syscall.
    is_child().then(|| unsafe { libc::getppid() } as u32)
}

/// For a child started to take a live connection over: its `/dev/fuse`
/// file (taken once).
pub fn resume_device() -> Option<OwnedFd> {
    let fd: RawFd = std::env::var(RESUME_FD).ok()?.parse().ok()?;
    std::env::remove_var(RESUME_FD);
    // Inherited across exec, it is ours alone from here: a program this
    // process starts must not hold the connection.
    // SAFETY: plain syscall on the descriptor the keeper passed.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    // SAFETY: the keeper passed this descriptor open, for us alone.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends the keeper a copy of the mount's `/dev/fuse` file. Without a
/// keeper, nothing.
pub fn hand_over(dev: BorrowedFd<'_>) -> Result<()> {
    let Some(sock) = std::env::var(KEEPER_FD).ok().and_then(|s| s.parse::<RawFd>().ok()) else { return Ok(()) };
    // SAFETY: the keeper's socket, open for this process's whole life.
    let sock = unsafe { BorrowedFd::borrow_raw(sock) };
    super::fds::send(sock, b"device", Some(dev))?;
    tracing::info!("the keeper holds the FUSE connection: this process can be restarted under the mount");
    Ok(())
}

/// For a serving child: passes a state for systemd (`READY=1`,
/// `STOPPING=1`) to the keeper, which is the process systemd started and
/// the only one it hears from (`NotifyAccess=main`). False without a
/// keeper.
pub fn tell_keeper(state: &str) -> bool {
    let Some(sock) = std::env::var(KEEPER_FD).ok().and_then(|s| s.parse::<RawFd>().ok()) else { return false };
    // SAFETY: the keeper's socket, open for this process's whole life.
    let sock = unsafe { BorrowedFd::borrow_raw(sock) };
    if let Err(e) = super::fds::send(sock, state.as_bytes(), None) {
        tracing::warn!(error = %e, "cannot tell the keeper {state}");
    }
    true
}

/// One message from a child: a descriptor, or a text (a state for
/// systemd, or the keeper's own marker). `None`: the socket failed.
enum Message {
    Device(OwnedFd),
    Text(String),
}

fn receive(sock: &UnixDatagram) -> Option<Message> {
    let (text, fd) = super::fds::receive(sock.as_fd()).ok()??;
    Some(match fd {
        Some(fd) => Message::Device(fd),
        None => Message::Text(String::from_utf8_lossy(&text).into_owned()),
    })
}

/// The keeper's marker: every message a dead child sent before it is read.
const SYNC: &str = "arbor-keeper-sync";

/// Reads the children's messages: keeps the last device, passes states on
/// to systemd, and answers each [`SYNC`] on `synced`.
fn listen(sock: UnixDatagram, device: Arc<parking_lot::Mutex<Option<OwnedFd>>>, synced: mpsc::Sender<()>) {
    while let Some(m) = receive(&sock) {
        match m {
            Message::Device(fd) => *device.lock() = Some(fd),
            Message::Text(t) if t == SYNC => {
                let _ = synced.send(());
            }
            Message::Text(state) => crate::session::tell_systemd(sd_notify::NotifyState::Custom(&state)),
        }
    }
}

/// Runs this command again as the serving child, and again whenever a
/// child dies under a live mount, until one ends by itself (an unmount,
/// a signal passed on, a failure to mount); exits with its status.
pub fn run(mountpoint: &Path) -> Result<()> {
    let (ours, theirs) = UnixDatagram::pair()?;
    let device = Arc::new(parking_lot::Mutex::new(None::<OwnedFd>));
    let (synced_tx, synced) = mpsc::channel();
    let d = device.clone();
    std::thread::Builder::new().name("arbor-keeper".into()).spawn(move || listen(ours, d, synced_tx))?;
    let child_pid = Arc::new(AtomicI32::new(0));
    let stopping = Arc::new(AtomicBool::new(false));
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM, libc::SIGHUP])?;
    let (pid, stop) = (child_pid.clone(), stopping.clone());
    std::thread::spawn(move || {
        for sig in signals.forever() {
            stop.store(true, Ordering::SeqCst);
            let p = pid.load(Ordering::SeqCst);
            if p > 0 {
                // SAFETY: a signal to our own child.
                unsafe { libc::kill(p, sig) };
            }
        }
    });
    let mut restarts: Vec<Instant> = Vec::new();
    loop {
        let dev = device.lock().as_ref().map(|d| d.as_raw_fd());
        let mut child = spawn(theirs.as_raw_fd(), dev)?;
        child_pid.store(child.id() as i32, Ordering::SeqCst);
        if stopping.load(Ordering::SeqCst) {
            // A signal that came before there was a child to pass it to.
            // SAFETY: a signal to our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        let status = child.wait()?;
        child_pid.store(0, Ordering::SeqCst);
        // Whatever the child sent before it ended is read before this goes on.
        theirs.send(SYNC.as_bytes())?;
        let _ = synced.recv_timeout(Duration::from_secs(5));
        if status.success() {
            return Ok(());
        }
        let code = status.code().unwrap_or(1);
        let held = device.lock().is_some();
        if !held || stopping.load(Ordering::SeqCst) || !arbor_fs::is_mountpoint(mountpoint) {
            std::process::exit(code);
        }
        restarts.retain(|t| t.elapsed() < RESTART_WINDOW);
        if restarts.len() >= MAX_RESTARTS {
            tracing::error!(%status, "the serving process died {MAX_RESTARTS} times in a minute; giving up the mount");
            std::process::exit(code.max(1));
        }
        restarts.push(Instant::now());
        match status.signal() {
            Some(sig) => tracing::warn!(signal = sig, "the serving process was killed; starting another on the mount"),
            None => tracing::warn!(%status, "the serving process failed; starting another on the mount"),
        }
    }
}

/// The binary to run: this one, or the one installed in its place (an
/// upgrade: a child killed on purpose comes back as the new version).
fn program() -> std::io::Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let s = exe.to_string_lossy();
    Ok(match s.strip_suffix(" (deleted)") {
        Some(path) => path.into(),
        None => exe,
    })
}

/// Starts this command as the serving child, with the keeper's socket and
/// (to take a live connection over) the mount's `/dev/fuse` file.
fn spawn(sock: RawFd, dev: Option<RawFd>) -> Result<std::process::Child> {
    let mut cmd = std::process::Command::new(program()?);
    cmd.args(std::env::args_os().skip(1)).env(KEEPER_FD, sock.to_string());
    // It tells systemd through the keeper (see `tell_keeper`).
    cmd.env_remove("NOTIFY_SOCKET");
    match dev {
        Some(d) => cmd.env(RESUME_FD, d.to_string()),
        None => cmd.env_remove(RESUME_FD),
    };
    // SAFETY: fcntl, prctl and getppid are async-signal-safe.
    unsafe {
        let keeper = libc::getpid();
        cmd.pre_exec(move || {
            for fd in std::iter::once(sock).chain(dev) {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // The child dies with the keeper: a mount nobody can restart
            // must not outlive it half-kept.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 || libc::getppid() != keeper {
                return Err(std::io::Error::other("the keeper is gone"));
            }
            Ok(())
        });
    }
    Ok(cmd.spawn()?)
}
