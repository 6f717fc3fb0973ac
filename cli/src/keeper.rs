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
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Set for the serving child: the keeper's socket.
const KEEPER_FD: &str = "ARBOR_KEEPER_FD";
/// Set for a child that takes a live connection over: its `/dev/fuse` file.
const RESUME_FD: &str = "ARBOR_RESUME_FD";
/// `ARBOR_KEEPER=0`: serve in this process, without a keeper.
const KEEPER_SWITCH: &str = "ARBOR_KEEPER";

/// More restarts than this within [`RESTART_WINDOW`] and the keeper gives
/// up (the mount then dies with it): a child that cannot start again.
const MAX_RESTARTS: usize = 10;
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// Whether this process is a keeper's serving child.
pub fn is_child() -> bool {
    std::env::var_os(KEEPER_FD).is_some()
}

/// Whether `arbor mount --foreground` should run as a keeper.
pub fn wanted() -> bool {
    !is_child() && std::env::var(KEEPER_SWITCH).as_deref() != Ok("0")
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

/// A descriptor waiting on `sock`, if one was sent.
fn receive_fd(sock: &UnixDatagram) -> Option<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: as in send_fd.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: a valid socket and message; MSG_CMSG_CLOEXEC keeps the fd ours.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return None;
    }
    // SAFETY: the kernel filled the control buffer.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() || (*c).cmsg_level != libc::SOL_SOCKET || (*c).cmsg_type != libc::SCM_RIGHTS {
            return None;
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
        Some(OwnedFd::from_raw_fd(fd))
    }
}

/// Runs this command again as the serving child, and again whenever a
/// child dies under a live mount, until one ends by itself (an unmount,
/// a signal passed on, a failure to mount); exits with its status.
pub fn run(mountpoint: &Path) -> Result<()> {
    let (ours, theirs) = UnixDatagram::pair()?;
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
    let mut dev: Option<OwnedFd> = None;
    let mut restarts: Vec<Instant> = Vec::new();
    loop {
        let mut child = spawn(theirs.as_raw_fd(), dev.as_ref().map(|d| d.as_raw_fd()))?;
        child_pid.store(child.id() as i32, Ordering::SeqCst);
        let status = child.wait()?;
        child_pid.store(0, Ordering::SeqCst);
        while let Some(fd) = receive_fd(&ours) {
            dev = Some(fd);
        }
        if status.success() {
            return Ok(());
        }
        let code = status.code().unwrap_or(1);
        if dev.is_none() || stopping.load(Ordering::SeqCst) || !arbor_fs::is_mountpoint(mountpoint) {
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

/// Starts this command as the serving child, with the keeper's socket and
/// (to take a live connection over) the mount's `/dev/fuse` file.
fn spawn(sock: RawFd, dev: Option<RawFd>) -> Result<std::process::Child> {
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1)).env(KEEPER_FD, sock.to_string());
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
