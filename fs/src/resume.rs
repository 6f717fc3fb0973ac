//! Serving a FUSE connection another process started: the mount survives
//! the death of the process that served it.
//!
//! A mount's `/dev/fuse` file stays open as long as any process holds it.
//! When the serving process dies (kill -9, OOM) while another one (the
//! keeper, `arbor mount`'s parent process) still holds the same open file,
//! the kernel keeps the connection and the mount: new requests wait on its
//! pending queue, and requests the dead process had read but not answered
//! wait on the file's processing list. A new process given that file
//! writes `FUSE_NOTIFY_RESEND` (Linux 6.9), which puts every unanswered
//! request back on the pending queue, then reads and answers requests as
//! the first process did. INIT was answered long ago, so this is no
//! fuser session: requests are read with `read(2)` on several threads,
//! decoded by [`crate::ring::dispatch`] (the io_uring transport's decoder)
//! and answered with `write(2)`.
//!
//! What the new process does not have is the dead one's memory: the file
//! handles the kernel holds were handed out by the dead process (arbor
//! needs nothing from them: every request names its inode, and inode
//! numbers are the engine's), and the dead process's open files count as
//! closed (a file unlinked while open may be gone; locks are the kernel's
//! on a local mount). Its invalidations are written on the same file
//! (`notify.rs`).
//!
//! Requests in flight on FUSE over io_uring die with the process's rings,
//! so a mount that may be resumed is served on `/dev/fuse` from the start
//! (`MountOptions::restartable`).

use crate::adapter::ArborFs;
use crate::ring::{dispatch, dispatch_resent, op, InHeader, IoIn, Request, MAX_WRITE};
use arbor_engine::files::Files;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use zerocopy::{FromBytes, IntoBytes};

/// The notify code that puts every request not answered yet back on the
/// connection's pending queue (`FUSE_NOTIFY_RESEND`, Linux 6.9).
const NOTIFY_RESEND: i32 = 7;

/// The bit the kernel sets in the `unique` of a request it sends again.
const RESENT: u64 = 1 << 63;

/// Requests that take no answer.
const FORGET: u32 = 2;
const INTERRUPT: u32 = 36;
const BATCH_FORGET: u32 = 42;
const DESTROY: u32 = 38;
const INIT: u32 = 26;

/// The most a request can be: its headers and the largest write.
const REQUEST_MAX: usize = MAX_WRITE as usize + 64 * 1024;

/// The threads answering a resumed connection.
pub(crate) struct Resumed {
    threads: Vec<std::thread::JoinHandle<()>>,
    running: Arc<AtomicUsize>,
}

impl Resumed {
    /// Whether every thread has ended (the connection is over).
    pub(crate) fn is_finished(&self) -> bool {
        self.running.load(Ordering::SeqCst) == 0
    }

    /// Waits until the connection is over.
    pub(crate) fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// Asks the kernel to send again every request of this connection that was
/// read but not answered (by a process now dead).
pub(crate) fn resend(dev: &OwnedFd) -> io::Result<()> {
    crate::notify::write_notification(dev, NOTIFY_RESEND, &[])
        .map_err(|e| io::Error::new(e.kind(), format!("FUSE_NOTIFY_RESEND (needs Linux 6.9): {e}")))
}

/// Starts `threads` threads answering requests on `dev` with `fs`. Ends
/// (each thread) when the connection does (an unmount).
pub(crate) fn serve<F: Files + ?Sized>(fs: Arc<ArborFs<F>>, dev: Arc<OwnedFd>, threads: usize) -> io::Result<Resumed> {
    let running = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for i in 0..threads.max(1) {
        let (fs, dev, running2) = (fs.clone(), dev.clone(), running.clone());
        running.fetch_add(1, Ordering::SeqCst);
        let spawned = std::thread::Builder::new().name(format!("arbor-fuse-{i}")).spawn(move || {
            if let Err(e) = answer_loop(&fs, &dev) {
                tracing::error!(error = %e, "a resumed FUSE thread stopped");
            }
            running2.fetch_sub(1, Ordering::SeqCst);
        });
        match spawned {
            Ok(h) => handles.push(h),
            Err(e) => {
                running.fetch_sub(1, Ordering::SeqCst);
                return Err(e);
            }
        }
    }
    Ok(Resumed { threads: handles, running })
}

/// Reads and answers requests until the connection ends.
fn answer_loop<F: Files + ?Sized>(fs: &ArborFs<F>, dev: &OwnedFd) -> io::Result<()> {
    let mut buf = vec![0u8; REQUEST_MAX];
    let mut read_buf = Vec::new();
    loop {
        // SAFETY: a valid fd and buffer.
        let n = unsafe { libc::read(dev.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // Interrupted, or the request went away while it was read.
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                // Unmounted (or aborted): the session is over.
                Some(libc::ENODEV) | Some(libc::ENOTCONN) | Some(libc::ECONNABORTED) => return Ok(()),
                _ => return Err(e),
            }
        }
        let n = n as usize;
        let Ok((head, _)) = InHeader::read_from_prefix(&buf[..n]) else { continue };
        let body = &buf[std::mem::size_of::<InHeader>()..n];
        if let Some(answer) = answer(fs, head, body, &mut read_buf) {
            if let Err(e) = write_answer(dev, head.unique, answer) {
                tracing::warn!(error = %e, opcode = head.opcode, "an answer the kernel refused");
            }
        }
    }
}

/// What answers one request: an errno or the bytes after the out header;
/// `None` for a request that takes no answer.
fn answer<F: Files + ?Sized>(
    fs: &ArborFs<F>,
    head: InHeader,
    body: &[u8],
    read_buf: &mut Vec<u8>,
) -> Option<Result<Vec<u8>, fuser::Errno>> {
    match head.opcode {
        FORGET | BATCH_FORGET | INTERRUPT => return None,
        DESTROY => return Some(Ok(Vec::new())),
        // The connection was initialised by the first process.
        INIT => return Some(Err(fuser::Errno::EPROTO)),
        _ => {}
    }
    if head.total_extlen != 0 {
        return Some(Err(fuser::Errno::EINVAL));
    }
    if head.opcode == op::READ {
        let r = IoIn::read_from_prefix(body).map_err(|_| fuser::Errno::EINVAL).and_then(|(a, _)| {
            let want = (a.size as usize).min(REQUEST_MAX);
            if read_buf.len() < want {
                read_buf.resize(want, 0);
            }
            fs.read(head.nodeid, a.offset, &mut read_buf[..want]).map(|n| read_buf[..n].to_vec())
        });
        return Some(r);
    }
    let split = op_size(head.opcode).min(body.len());
    let req = Request { head, op: &body[..split], payload: &body[split..] };
    if head.unique & RESENT != 0 {
        return Some(dispatch_resent(fs, &req));
    }
    Some(dispatch(fs, &req))
}

/// The size of each request's own header on `/dev/fuse` (`fuse_*_in` of
/// include/uapi/linux/fuse.h), before its names and data; 0 for requests
/// with none or that [`dispatch`] does not know.
fn op_size(opcode: u32) -> usize {
    match opcode {
        op::GETATTR | op::FSYNC | op::FSYNCDIR | op::MKNOD | op::CREATE | op::RENAME2 => 16,
        op::SETATTR => 88,
        op::MKDIR | op::RENAME | op::LINK | op::OPEN | op::OPENDIR => 8,
        op::SETXATTR | op::GETXATTR | op::LISTXATTR => 8,
        op::READ | op::WRITE | op::READDIR | op::READDIRPLUS => 40,
        op::RELEASE | op::RELEASEDIR | op::FLUSH => 24,
        op::GETLK | op::SETLK | op::SETLKW => 48,
        op::IOCTL | op::FALLOCATE => 32,
        op::COPY_FILE_RANGE => 56,
        _ => 0,
    }
}

/// Writes one answer. ENOENT: the request was interrupted and is gone.
fn write_answer(dev: &OwnedFd, unique: u64, answer: Result<Vec<u8>, fuser::Errno>) -> io::Result<()> {
    let (error, body) = match answer {
        Ok(b) => (0i32, b),
        Err(e) => (-i32::from(e), Vec::new()),
    };
    let mut out = Vec::with_capacity(16 + body.len());
    out.extend_from_slice(((16 + body.len()) as u32).as_bytes());
    out.extend_from_slice(error.as_bytes());
    out.extend_from_slice(unique.as_bytes());
    out.extend_from_slice(&body);
    // SAFETY: a valid fd and buffer.
    let n = unsafe { libc::write(dev.as_raw_fd(), out.as_ptr().cast(), out.len()) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENODEV) | Some(libc::ENOTCONN) => Ok(()),
            _ => Err(e),
        };
    }
    Ok(())
}

/// The high half of every handle this process gives out when it resumes a
/// connection: random, nonzero, 31 bits. Not the pid: a process revived in
/// a fresh PID namespace has its predecessor's pid, and would then count
/// the releases of the predecessor's opens (never counted here) as its
/// own, freeing an unlinked file still open.
pub fn incarnation() -> u64 {
    let mut b = [0u8; 4];
    // SAFETY: b is valid for 4 bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let mut r = u64::from(u32::from_le_bytes(b));
    if n != 4 {
        // No entropy source: the clock, mixed with the pid.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        r = u64::from(t.subsec_nanos()) ^ (t.as_secs() << 7) ^ u64::from(std::process::id()).rotate_left(17);
    }
    match r & 0x7fff_ffff {
        0 => 1,
        x => x,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_incarnations_in_one_pid_have_different_handle_prefixes() {
        let (a, b) = (super::incarnation(), super::incarnation());
        assert_ne!(a, b, "a process revived with its predecessor's pid would share its handles");
        assert!((1..1 << 31).contains(&a) && (1..1 << 31).contains(&b), "{a:#x} {b:#x}");
    }

    use super::*;

    #[test]
    fn request_headers_have_the_kernels_sizes() {
        // fuse_read_in and fuse_write_in, fuse_lk_in, fuse_setattr_in.
        assert_eq!(op_size(op::WRITE), std::mem::size_of::<IoIn>());
        assert_eq!(op_size(op::SETLK), 48);
        assert_eq!(op_size(op::SETATTR), 88);
        assert_eq!(op_size(op::LOOKUP), 0);
        assert_eq!(op_size(op::COPY_FILE_RANGE), 56);
        assert_eq!(op_size(9999), 0);
    }
}
