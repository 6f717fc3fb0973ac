//! Segment chunks' backing: one sparse file per segment object (on the
//! cache folder's disk, or a memory file), a chunk's bytes at their own
//! offset in it. An evicted chunk is punched out, keeping the file's size;
//! the chunks an earlier process left are found again from the file's data
//! extents.

use std::fs::File;
use std::os::fd::AsRawFd;

/// Frees `len` bytes at `off` of `file`, keeping its size.
pub fn punch_hole(file: &File, off: u64, len: u64) {
    // SAFETY: plain syscall on a descriptor we own.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            len as libc::off_t,
        )
    };
    if rc != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "punching an evicted chunk out of the cache failed");
    }
}

/// Whether `[off, end)` of `file` is all data (no hole).
pub fn is_data(file: &File, off: u64, end: u64) -> bool {
    // SAFETY: plain syscalls on a descriptor we own.
    unsafe {
        let d = libc::lseek(file.as_raw_fd(), off as libc::off_t, libc::SEEK_DATA);
        if d < 0 || d as u64 != off {
            return false;
        }
        let h = libc::lseek(file.as_raw_fd(), off as libc::off_t, libc::SEEK_HOLE);
        h >= 0 && h as u64 >= end
    }
}
