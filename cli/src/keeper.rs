//! The keeper: `arbor mount --foreground` holds the mount's `/dev/fuse`
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
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
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
    send_fd(sock, dev.as_raw_fd())?;
    tracing::info!("the keeper holds the FUSE connection: this process can be restarted under the mount");
    Ok(())
}

/// For a serving child: passes a state for systemd (`READY=1`,
/// `STOPPING=1`) to the keeper, which is the process systemd started and
/// the only one it hears from (`NotifyAccess=main`). False without a
/// keeper.
pub fn tell_keeper(state: &str) -> bool {
    let Some(sock) = std::env::var(KEEPER_FD).ok().and_then(|s| s.parse::<RawFd>().ok()) else { return false };
    // SAFETY: a valid socket and buffer.
    let sent = unsafe { libc::send(sock, state.as_ptr().cast(), state.len(), 0) };
    if sent < 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot tell the keeper {state}");
    }
    true
}

fn send_fd(sock: RawFd, fd: RawFd) -> std::io::Result<()> {
    let byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_ptr() as *mut _, iov_len: 1 };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: a zeroed msghdr is valid; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer has room for one header with one fd.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
    }
    // SAFETY: a valid socket and message.
    if unsafe { libc::sendmsg(sock, &msg, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// One message from a child: a descriptor, or a text (a state for
/// systemd, or the keeper's own marker). `None`: the socket failed.
enum Message {
    Device(OwnedFd),
    Text(String),
}

fn receive(sock: &UnixDatagram) -> Option<Message> {
    let mut text = [0u8; 256];
    let mut iov = libc::iovec { iov_base: text.as_mut_ptr().cast(), iov_len: text.len() };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: as in send_fd.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: a valid socket and message; MSG_CMSG_CLOEXEC keeps the fd ours.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return None;
        }
    };
    // SAFETY: the kernel filled the control buffer.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if !c.is_null() && (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
            let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
            return Some(Message::Device(OwnedFd::from_raw_fd(fd)));
        }
    }
    Some(Message::Text(String::from_utf8_lossy(&text[..n]).into_owned()))
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
