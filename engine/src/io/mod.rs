//! How writes and syncs reach the kernel: plain pwrite/fdatasync by
//! default, io_uring on request. Reads use pread on any thread: they must
//! run in parallel and never queue behind a write.
//!
//! Why not io_uring by default: the log writes from a thread of its own
//! (write-behind) and each write is one buffered copy into the page cache
//! (or, for a large record's aligned data, one O_DIRECT write; see
//! `FileSegment::write_at`) that must finish before the next. io_uring
//! gains nothing there, and on
//! ext4 it hands buffered writes and syncs to its worker threads, one more
//! hop each: sequential writes through the mount measured 10-25 % slower
//! with it (see docs/benchmarks.md).

mod syscall;
mod uring;

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

pub use syscall::SyscallIo;
pub use uring::UringIo;

/// Which backend a device uses for log writes and syncs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum IoMode {
    /// The default: plain syscalls (see the module comment for why).
    #[default]
    Auto,
    Uring,
    Syscall,
    /// Plain syscalls, every byte through the page cache: no O_DIRECT for
    /// large log writes (for a node whose disk reads are slow and whose
    /// readers ask for what was just written).
    Buffered,
}

impl std::str::FromStr for IoMode {
    type Err = String;
    /// `auto` (or empty), `uring`, `syscall` or `buffered`.
    fn from_str(s: &str) -> std::result::Result<IoMode, String> {
        match s {
            "" | "auto" => Ok(IoMode::Auto),
            "uring" => Ok(IoMode::Uring),
            "syscall" => Ok(IoMode::Syscall),
            "buffered" => Ok(IoMode::Buffered),
            other => Err(format!("expected auto, uring, syscall or buffered (got {other:?})")),
        }
    }
}

impl IoMode {
    /// Whether large log writes may go past the page cache.
    pub fn direct(self) -> bool {
        self != IoMode::Buffered
    }
}

pub trait IoBackend: Send + Sync {
    fn name(&self) -> &'static str;
    /// Writes all of `buf` at `off`.
    fn write_at(&self, fd: RawFd, buf: &[u8], off: u64) -> io::Result<()>;
    fn fdatasync(&self, fd: RawFd) -> io::Result<()>;
}

pub fn backend(mode: IoMode) -> io::Result<Arc<dyn IoBackend>> {
    match mode {
        IoMode::Syscall | IoMode::Auto | IoMode::Buffered => Ok(Arc::new(SyscallIo)),
        IoMode::Uring => Ok(Arc::new(UringIo::new()?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    fn exercise(io: &dyn IoBackend) {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .expect("open");
        let big = vec![0xabu8; 3 << 20];
        io.write_at(f.as_raw_fd(), b"hello", 0).expect("write");
        io.write_at(f.as_raw_fd(), &big, 4096).expect("big write");
        io.fdatasync(f.as_raw_fd()).expect("sync");
        let mut back = vec![0u8; 5];
        f.read_exact_at(&mut back, 0).expect("read");
        assert_eq!(&back, b"hello");
        let mut tail = vec![0u8; big.len()];
        f.read_exact_at(&mut tail, 4096).expect("read");
        assert!(tail == big);
        assert!(io.write_at(-1, b"x", 0).is_err(), "{} accepted a bad fd", io.name());
    }

    #[test]
    fn syscall_backend_writes_and_syncs() {
        exercise(&SyscallIo);
    }

    #[test]
    fn uring_backend_writes_and_syncs_where_the_kernel_allows_it() {
        match UringIo::new() {
            Ok(u) => exercise(&u),
            Err(e) if std::env::var_os("ARBOR_TEST_REQUIRE_URING").is_some() => panic!("io_uring must work here: {e}"),
            Err(e) => eprintln!("SKIPPED: io_uring unavailable here: {e}"),
        }
    }
}
