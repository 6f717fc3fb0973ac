use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;
use std::io;
use std::os::fd::RawFd;

/// One ring shared by the log writer; each call submits and waits for its
/// own completion, so buffers outlive the kernel's use of them.
pub struct UringIo {
    ring: Mutex<IoUring>,
}

impl UringIo {
    pub fn new() -> io::Result<Self> {
        let ring = IoUring::new(8)?;
        Ok(UringIo { ring: Mutex::new(ring) })
    }

    fn run(&self, entry: io_uring::squeue::Entry) -> io::Result<i32> {
        let mut ring = self.ring.lock();
        // SAFETY: the entry's buffer (if any) is borrowed by our caller for
        // the whole call, and we wait for its completion before returning.
        unsafe {
            ring.submission().push(&entry).map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        let cqe = ring.completion().next().ok_or_else(|| io::Error::other("io_uring returned no completion"))?;
        let res = cqe.result();
        if res < 0 {
            return Err(io::Error::from_raw_os_error(-res));
        }
        Ok(res)
    }
}

impl super::IoBackend for UringIo {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn write_at(&self, fd: RawFd, mut buf: &[u8], mut off: u64) -> io::Result<()> {
        while !buf.is_empty() {
            let len = buf.len().min(u32::MAX as usize >> 1) as u32;
            let entry = opcode::Write::new(types::Fd(fd), buf.as_ptr(), len).offset(off).build();
            let n = self.run(entry)? as usize;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::WriteZero, "io_uring write wrote nothing"));
            }
            buf = &buf[n..];
            off += n as u64;
        }
        Ok(())
    }

    fn fdatasync(&self, fd: RawFd) -> io::Result<()> {
        let entry = opcode::Fsync::new(types::Fd(fd)).flags(types::FsyncFlags::DATASYNC).build();
        self.run(entry).map(|_| ())
    }
}
