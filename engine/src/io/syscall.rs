use std::io;
use std::os::fd::RawFd;

/// pwrite and fdatasync, retried on EINTR and short writes.
pub struct SyscallIo;

impl super::IoBackend for SyscallIo {
    fn name(&self) -> &'static str {
        "syscall"
    }

    fn write_at(&self, fd: RawFd, mut buf: &[u8], mut off: u64) -> io::Result<()> {
        while !buf.is_empty() {
            // SAFETY: buf is a valid slice for its length; the kernel only reads it.
            let n = unsafe { libc::pwrite(fd, buf.as_ptr().cast(), buf.len(), off as libc::off_t) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::WriteZero, "pwrite wrote nothing"));
            }
            buf = &buf[n as usize..];
            off += n as u64;
        }
        Ok(())
    }

    fn fdatasync(&self, fd: RawFd) -> io::Result<()> {
        loop {
            // SAFETY: plain syscall on a descriptor.
            if unsafe { libc::fdatasync(fd) } == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}
