//! Write-only opens write past the kernel's page cache.
//!
//! A file opened write-only (`torch.save`, safetensors, `numpy.save`, `dd`,
//! `cp`: every checkpoint writer) is answered with `FOPEN_DIRECT_IO`. Its
//! writes then reach arbor straight from the writer's own pages: the kernel
//! no longer copies each write into its page cache first, nor allocates,
//! ages and reclaims those pages, and nobody could read them through that
//! descriptor anyway. Writes stay synchronous, one request per `write`
//! (up to `max_write`), so the crash promise is unchanged. A read-write
//! open keeps the page cache: it reads what it writes, and may `mmap`.
//!
//! Other descriptors' cached pages must not go stale. From Linux 6.6 the
//! kernel drops the cached pages of a range before a direct write to it;
//! pages a reader's read-ahead brings in while the write is in flight are
//! dropped after it only by later kernels (6.19, and the stable kernels
//! that fix was taken back to). So this is used from 6.6 on, and while a
//! file has readers open, each direct write to it is followed by an
//! invalidation of its range, sent from a thread of its own: dropping a
//! page waits for a read-ahead that holds it, which a request thread must
//! stay free to answer.
//!
//! [`MountOptions::direct_writes`](crate::MountOptions) turns it off
//! (write-only opens then write through the page cache like any other).

use crate::Notify;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;

/// A file's open descriptors, as far as cache coherence cares.
#[derive(Default, Clone, Copy, Debug, PartialEq)]
struct Opens {
    /// Opens that may read (and so cache pages).
    readers: u32,
    /// Write-only opens answered with direct I/O.
    direct: u32,
}

impl Opens {
    /// A direct writer and a reader at once: its writes need invalidations.
    fn mixed(&self) -> bool {
        self.direct > 0 && self.readers > 0
    }
}

pub(crate) struct DirectWrites {
    enabled: bool,
    open: parking_lot::Mutex<HashMap<u64, Opens>>,
    /// Files with [`Opens::mixed`]: while there are none, a write looks no
    /// further (writers on many threads share no lock).
    mixed: AtomicUsize,
    /// Ranges (inode, offset, length) to drop from the kernel's cache.
    drop: OnceLock<Sender<(u64, u64, u64)>>,
}

fn write_only(flags: i32) -> bool {
    flags & libc::O_ACCMODE == libc::O_WRONLY
}

impl DirectWrites {
    /// Direct writes where `wanted` and the kernel allows them.
    pub fn new(wanted: bool) -> DirectWrites {
        DirectWrites::with(wanted && kernel_version().is_some_and(|v| v >= (6, 6)))
    }

    fn with(enabled: bool) -> DirectWrites {
        DirectWrites { enabled, open: Default::default(), mixed: AtomicUsize::new(0), drop: OnceLock::new() }
    }

    /// Starts the thread that sends invalidations through `n`; until it
    /// runs, every open uses the page cache.
    pub fn start(&self, n: Notify) {
        if !self.enabled || self.drop.get().is_some() {
            return;
        }
        let (tx, rx) = channel::<(u64, u64, u64)>();
        // Ends when the sender goes with the file system.
        let spawned = std::thread::Builder::new().name("arbor-fuse-inval".into()).spawn(move || {
            for (ino, off, len) in rx {
                let (off, len) = (i64::try_from(off).unwrap_or(i64::MAX), i64::try_from(len).unwrap_or(i64::MAX));
                // ENOENT: the kernel no longer holds the inode.
                if let Err(e) = n.inval_inode(ino, off, len.max(1)) {
                    if e.raw_os_error() != Some(libc::ENOENT) {
                        tracing::warn!(ino, error = %e, "dropping cached pages after a direct write failed");
                    }
                }
            }
        });
        match spawned {
            Ok(_) => {
                let _ = self.drop.set(tx);
            }
            Err(e) => tracing::warn!(error = %e, "no thread for invalidations; write-only opens use the page cache"),
        }
    }

    /// Counts an open with `flags`; true when it is to be answered with
    /// direct I/O.
    pub fn opened(&self, ino: u64, flags: i32) -> bool {
        if !self.enabled {
            return false;
        }
        let direct = write_only(flags) && self.drop.get().is_some();
        if direct || !write_only(flags) {
            let mut open = self.open.lock();
            let o = open.entry(ino).or_default();
            let was = o.mixed();
            if direct {
                o.direct += 1;
            } else {
                o.readers += 1;
            }
            if o.mixed() && !was {
                self.mixed.fetch_add(1, Ordering::SeqCst);
            }
        }
        direct
    }

    /// Counts the close of an open made with `flags` (a RELEASE carries
    /// them; the access mode of a descriptor never changes).
    pub fn released(&self, ino: u64, flags: i32) {
        if !self.enabled {
            return;
        }
        let mut open = self.open.lock();
        let Some(o) = open.get_mut(&ino) else { return };
        let was = o.mixed();
        if write_only(flags) {
            o.direct = o.direct.saturating_sub(1);
        } else {
            o.readers = o.readers.saturating_sub(1);
        }
        if was && !o.mixed() {
            self.mixed.fetch_sub(1, Ordering::SeqCst);
        }
        if *o == Opens::default() {
            open.remove(&ino);
        }
    }

    /// After a write of `len` bytes at `off`: drops the range from the
    /// kernel's cache when a direct writer and a reader share the file.
    pub fn written(&self, ino: u64, off: u64, len: u64) {
        let Some(tx) = self.drop.get() else { return };
        if self.mixed.load(Ordering::SeqCst) == 0 {
            return;
        }
        let shared = self.open.lock().get(&ino).is_some_and(Opens::mixed);
        if shared {
            let _ = tx.send((ino, off, len));
        }
    }
}

/// The running kernel's (major, minor) version.
fn kernel_version() -> Option<(u32, u32)> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    parse_version(&release)
}

fn parse_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_parse_from_their_release_strings() {
        assert_eq!(parse_version("6.18.44-fc-v1252\n"), Some((6, 18)));
        assert_eq!(parse_version("6.1.0-37-amd64"), Some((6, 1)));
        assert_eq!(parse_version("5.15.0"), Some((5, 15)));
        assert_eq!(parse_version("weird"), None);
        assert!(parse_version("6.6-rc1").is_some_and(|v| v >= (6, 6)));
        assert!(parse_version("6.5.13").is_some_and(|v| v < (6, 6)));
    }

    #[test]
    fn only_write_only_opens_go_direct_and_only_once_invalidations_can_be_sent() {
        let d = DirectWrites::with(true);
        // No thread for invalidations yet: nothing goes direct.
        assert!(!d.opened(7, libc::O_WRONLY));
        let off = DirectWrites::with(false);
        assert!(!off.opened(7, libc::O_WRONLY | libc::O_TRUNC));
        let d = DirectWrites::with(true);
        let (tx, rx) = channel();
        d.drop.set(tx).unwrap();
        assert!(d.opened(7, libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC));
        assert!(!d.opened(7, libc::O_RDWR));
        assert!(!d.opened(8, libc::O_RDONLY));
        // A direct writer and a reader share 7: its writes are dropped
        // from the cache; 8 has no direct writer.
        d.written(7, 4096, 100);
        d.written(8, 0, 10);
        assert_eq!(rx.try_recv(), Ok((7, 4096, 100)));
        assert!(rx.try_recv().is_err());
        // The reader closes: no more invalidations for 7.
        d.released(7, libc::O_RDWR);
        d.written(7, 0, 1);
        assert!(rx.try_recv().is_err());
        d.released(7, libc::O_WRONLY);
        d.released(8, libc::O_RDONLY);
        assert!(d.open.lock().is_empty(), "every open was released");
        assert_eq!(d.mixed.load(Ordering::Relaxed), 0, "no file has a direct writer and a reader");
        // A release the table never saw changes nothing.
        d.released(9, libc::O_RDONLY);
        assert!(d.open.lock().is_empty());
    }
}
