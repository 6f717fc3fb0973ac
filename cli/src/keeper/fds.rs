//! Passing a file descriptor to another process over a Unix socket
//! (`SCM_RIGHTS`), with a short message beside it: what the in-process
//! keeper and `arbor keeper` both speak.

use nix::errno::Errno;
use nix::sys::socket::{
    self, recvmsg, sendmsg, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr,
};
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

/// The longest message either side sends.
pub const MESSAGE_MAX: usize = 4096;

/// Room for this many descriptors in one message: more are refused (and
/// the kernel closes those that did not fit).
const FDS_MAX: usize = 4;

/// Sends `bytes` and, if given, a copy of `fd` as one message.
pub fn send(sock: BorrowedFd<'_>, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let iov = [IoSlice::new(bytes)];
    let fds = fd.map(|f| [f.as_raw_fd()]);
    let cmsgs: Vec<ControlMessage<'_>> = fds.as_ref().map(|f| ControlMessage::ScmRights(f)).into_iter().collect();
    loop {
        match sendmsg::<UnixAddr>(sock.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives one message: its bytes and the descriptor that came with it
/// (close-on-exec). End of stream: `Ok(None)`.
pub fn receive(sock: BorrowedFd<'_>) -> io::Result<Option<(Vec<u8>, Option<OwnedFd>)>> {
    let mut buf = vec![0u8; MESSAGE_MAX];
    let mut space = nix::cmsg_space!([RawFd; FDS_MAX]);
    let (n, fds) = loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match recvmsg::<UnixAddr>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let mut fds = Vec::new();
                for c in msg.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(got) = c {
                        // SAFETY: the kernel just installed these descriptors for us.
                        fds.extend(got.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
                    }
                }
                break (msg.bytes, fds);
            }
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    if fds.len() > 1 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "more than one descriptor in a message"));
    }
    buf.truncate(n);
    Ok(Some((buf, fds.into_iter().next())))
}

/// A `SOCK_SEQPACKET` Unix socket listening at `path` (one message is one
/// request or one answer, and a descriptor travels with its message).
pub fn listen(path: &Path) -> io::Result<OwnedFd> {
    let sock = socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)?;
    socket::bind(sock.as_raw_fd(), &UnixAddr::new(path)?)?;
    socket::listen(&sock, Backlog::new(64)?)?;
    Ok(sock)
}

/// The next connection on a listening socket.
pub fn accept(listener: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    loop {
        match socket::accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
            // SAFETY: accept4 returned a new descriptor, ours alone.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
            Err(Errno::EINTR) | Err(Errno::ECONNABORTED) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// A connection to the socket at `path`.
pub fn connect(path: &Path) -> io::Result<OwnedFd> {
    let sock = socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)?;
    socket::connect(sock.as_raw_fd(), &UnixAddr::new(path)?)?;
    Ok(sock)
}

/// Bounds every wait on `sock` (a peer that stops answering fails the call).
pub fn set_timeouts(sock: &OwnedFd, secs: i64) -> io::Result<()> {
    let t = nix::sys::time::TimeVal::new(secs, 0);
    socket::setsockopt(sock, socket::sockopt::ReceiveTimeout, &t)?;
    socket::setsockopt(sock, socket::sockopt::SendTimeout, &t)?;
    Ok(())
}

/// The uid of the process at the other end of `sock`.
pub fn peer_uid(sock: &OwnedFd) -> io::Result<u32> {
    Ok(socket::getsockopt(sock, socket::sockopt::PeerCredentials)?.uid())
}

/// A pidfd of the process at the other end of `sock` (`SO_PEERPIDFD`,
/// Linux 6.5): it names that process, not its pid.
pub fn peer_pidfd(sock: &OwnedFd) -> io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: fd and len are valid for getsockopt to fill.
    let rc = unsafe {
        libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERPIDFD, (&raw mut fd).cast(), &mut len)
    };
    if rc != 0 || fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A pidfd of the process `pid` now (which may not be the process that
/// had that pid a moment ago).
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    if pid <= 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    // SAFETY: plain syscall; a non-negative result is a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// Whether the process of `pidfd` has exited, waiting up to `ms` for it
/// (a pidfd polls readable once its process is gone).
pub fn exited(pidfd: &OwnedFd, ms: u16) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut p = [PollFd::new(std::os::fd::AsFd::as_fd(pidfd), PollFlags::POLLIN)];
    match poll(&mut p, PollTimeout::from(ms)) {
        Ok(n) => n > 0,
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_descriptor_and_its_message_arrive_together() {
        let (a, b) = socket::socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
            .expect("socketpair");
        let file = tempfile::tempfile().expect("tempfile");
        send(a.as_fd(), b"hello", Some(file.as_fd())).expect("send");
        send(a.as_fd(), b"plain", None).expect("send");
        let (text, fd) = receive(b.as_fd()).expect("receive").expect("a message");
        assert_eq!(text, b"hello");
        let got = fd.expect("the descriptor");
        let same = |x: BorrowedFd<'_>| {
            let st = nix::sys::stat::fstat(x).expect("fstat");
            (st.st_dev, st.st_ino)
        };
        assert_eq!(same(got.as_fd()), same(file.as_fd()));
        let (text, fd) = receive(b.as_fd()).expect("receive").expect("a message");
        assert_eq!((text.as_slice(), fd.is_none()), (b"plain".as_slice(), true));
        drop(a);
        assert!(receive(b.as_fd()).expect("end").is_none());
    }

    #[test]
    fn two_descriptors_in_one_message_are_refused_and_closed() {
        let (a, b) = socket::socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
            .expect("socketpair");
        let (f, g) = (tempfile::tempfile().expect("tempfile"), tempfile::tempfile().expect("tempfile"));
        let fds = [f.as_raw_fd(), g.as_raw_fd()];
        let cmsgs = [ControlMessage::ScmRights(&fds)];
        sendmsg::<UnixAddr>(a.as_raw_fd(), &[IoSlice::new(b"two")], &cmsgs, MsgFlags::empty(), None).expect("send");
        let e = receive(b.as_fd()).expect_err("two descriptors");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        // The socket goes on.
        send(a.as_fd(), b"next", None).expect("send");
        assert_eq!(receive(b.as_fd()).expect("receive").expect("a message").0, b"next");
    }
}
