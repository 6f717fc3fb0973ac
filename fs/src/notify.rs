//! Where the mount tells the kernel to drop what it cached: fuser's
//! notifier for a session fuser runs, or notifications written on the
//! `/dev/fuse` file itself for a connection taken over from a dead process
//! (`resume.rs`), which has no fuser session.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use zerocopy::IntoBytes;

/// `FUSE_NOTIFY_INVAL_INODE` and `FUSE_NOTIFY_INVAL_ENTRY`.
const INVAL_INODE: i32 = 2;
const INVAL_ENTRY: i32 = 3;

#[derive(Clone)]
pub enum Notify {
    Fuser(fuser::Notifier),
    Device(Arc<OwnedFd>),
}

impl Notify {
    /// Drops inode `ino`'s attributes, and its cached pages from `off` for
    /// `len` bytes (`len` 0: to the end; `off` -1: no pages).
    pub fn inval_inode(&self, ino: u64, off: i64, len: i64) -> io::Result<()> {
        match self {
            Notify::Fuser(n) => n.inval_inode(fuser::INodeNo(ino), off, len),
            Notify::Device(dev) => {
                let mut body = Vec::with_capacity(24);
                body.extend_from_slice(ino.as_bytes());
                body.extend_from_slice(off.as_bytes());
                body.extend_from_slice(len.as_bytes());
                write_notification(dev, INVAL_INODE, &body)
            }
        }
    }

    /// Drops the name `name` in directory `parent`.
    pub fn inval_entry(&self, parent: u64, name: &[u8]) -> io::Result<()> {
        match self {
            Notify::Fuser(n) => {
                use std::os::unix::ffi::OsStrExt;
                n.inval_entry(fuser::INodeNo(parent), std::ffi::OsStr::from_bytes(name))
            }
            Notify::Device(dev) => {
                let namelen = u32::try_from(name.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
                let mut body = Vec::with_capacity(16 + name.len() + 1);
                body.extend_from_slice(parent.as_bytes());
                body.extend_from_slice(namelen.as_bytes());
                body.extend_from_slice(0u32.as_bytes());
                body.extend_from_slice(name);
                body.push(0);
                write_notification(dev, INVAL_ENTRY, &body)
            }
        }
    }
}

/// One notification: an out header whose error field is the notify code
/// and whose unique is 0, then its body.
pub(crate) fn write_notification(dev: &OwnedFd, code: i32, body: &[u8]) -> io::Result<()> {
    let mut out = Vec::with_capacity(16 + body.len());
    out.extend_from_slice(((16 + body.len()) as u32).as_bytes());
    out.extend_from_slice(code.as_bytes());
    out.extend_from_slice(0u64.as_bytes());
    out.extend_from_slice(body);
    // SAFETY: a valid fd and buffer.
    if unsafe { libc::write(dev.as_raw_fd(), out.as_ptr().cast(), out.len()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::FromRawFd;

    /// What a notification writes, read back through a pipe.
    fn written(send: impl FnOnce(&Notify) -> io::Result<()>) -> Vec<u8> {
        let mut fds = [0; 2];
        // SAFETY: a two-element array for pipe(2).
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both ends are ours alone.
        let (r, w) = unsafe { (std::fs::File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        send(&Notify::Device(Arc::new(w))).expect("write");
        let mut out = Vec::new();
        r.take(4096).read_to_end(&mut out).expect("read");
        out
    }

    #[test]
    fn notifications_have_the_kernels_layout() {
        let entry = written(|n| n.inval_entry(5, b"ab"));
        let mut want = Vec::new();
        want.extend_from_slice(35u32.as_bytes());
        want.extend_from_slice(INVAL_ENTRY.as_bytes());
        want.extend_from_slice(0u64.as_bytes());
        want.extend_from_slice(5u64.as_bytes());
        want.extend_from_slice(2u32.as_bytes());
        want.extend_from_slice(0u32.as_bytes());
        want.extend_from_slice(b"ab\0");
        assert_eq!(entry, want);
        let inode = written(|n| n.inval_inode(9, -1, 0));
        assert_eq!(inode.len(), 16 + 24);
        assert_eq!((&inode[..4], &inode[4..8]), (40u32.as_bytes(), INVAL_INODE.as_bytes()));
        assert_eq!(&inode[16..24], 9u64.as_bytes());
        assert_eq!(&inode[24..32], (-1i64).as_bytes());
    }
}
