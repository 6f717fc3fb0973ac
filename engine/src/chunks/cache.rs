//! The chunk cache: which chunks are on local disk, bounded by bytes and
//! evicted as [`super::policy::SEGMENT_CHUNKS`] says (least recently used
//! first, in batches down to 90 %). A chunk's bytes live in a sparse
//! file (one per object, the caller's); an evicted chunk is punched out of
//! it. The index is in memory, and rebuilt from the files' data extents
//! (`is_data`) when an object is opened after a restart; chunks found that
//! way are checked once before use.
//!
//! Generic over the chunk's key, so every reader of immutable objects can
//! use it: a mount's segment reader keys chunks by (segment, index).
//!
//! Locks: `evicting` before `index`. A reader holds `evicting` shared
//! ([`ChunkCache::hold`]) from "is the chunk present" to the end of its
//! pread; eviction holds it exclusively while it punches holes.

use super::policy::{Ledger, SEGMENT_CHUNKS};
use crate::metrics::Counter;
use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::fs::File;
use std::hash::Hash;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// One chunk on local disk, as the tests see it.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// When it was last used (a tick of the cache; 0: the cold end).
    pub last_used: u64,
    pub len: u32,
    /// Where its bytes start in the object's cache file.
    pub off: u64,
    /// Whether its bytes were checked in this process.
    pub verified: bool,
}

/// Where a chunk is, as the index keeps it (its last use is its rank in
/// the ledger).
#[derive(Clone, Copy)]
struct Spot {
    len: u32,
    off: u64,
    verified: bool,
}

pub struct ChunkCache<K> {
    capacity: u64,
    index: Mutex<Ledger<K, Spot>>,
    evicting: RwLock<()>,
    evicted: Counter,
}

impl<K: Copy + Eq + Hash + Ord> ChunkCache<K> {
    pub fn new(capacity: u64) -> ChunkCache<K> {
        ChunkCache {
            capacity,
            index: Mutex::new(Ledger::new(SEGMENT_CHUNKS)),
            evicting: RwLock::new(()),
            evicted: Counter::new(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of the chunks present.
    pub fn bytes(&self) -> u64 {
        self.index.lock().weight()
    }

    /// Bytes evicted so far.
    pub fn evicted_bytes(&self) -> u64 {
        self.evicted.get()
    }

    /// No eviction punches a hole while the guard lives.
    pub fn hold(&self) -> RwLockReadGuard<'_, ()> {
        self.evicting.read()
    }

    /// No reader is between its presence check and its pread while the
    /// guard lives.
    pub fn exclusive(&self) -> RwLockWriteGuard<'_, ()> {
        self.evicting.write()
    }

    #[cfg(test)]
    pub fn get(&self, key: K) -> Option<Chunk> {
        let index = self.index.lock();
        let (last_used, s) = index.ranked(&key)?;
        Some(Chunk { last_used, len: s.len, off: s.off, verified: s.verified })
    }

    /// Whether chunk `key` is present and already checked in this process.
    pub fn verified(&self, key: K) -> Option<bool> {
        self.index.lock().get(&key).map(|s| s.verified)
    }

    pub fn mark_verified(&self, key: K) {
        if let Some(s) = self.index.lock().get_mut(&key) {
            s.verified = true;
        }
    }

    pub fn present(&self, key: K) -> bool {
        self.index.lock().contains(&key)
    }

    pub fn touch(&self, key: K) {
        self.index.lock().touch(&key);
    }

    /// Drops one chunk (one that failed its check).
    pub fn forget(&self, key: K) {
        self.index.lock().remove(&key);
    }

    /// Drops every chunk whose key `pred` picks (an object deleted, or its
    /// cache file started anew).
    pub fn forget_where(&self, pred: impl Fn(&K) -> bool) {
        self.index.lock().remove_where(pred);
    }

    /// Marks chunks (key, length, offset) present. `old` chunks (found in
    /// a cache file from before) go to the cold end and are checked when
    /// first read: a crash may have left a chunk half written, and a
    /// punched partial block reads as zeros yet counts as data.
    pub fn insert(&self, keys: &[(K, u32, u64)], old: bool) {
        let mut index = self.index.lock();
        for &(key, len, off) in keys {
            index.insert(key, len as u64, Spot { len, off, verified: !old }, old);
        }
    }

    /// Writes fetched chunks (key, bytes, offset) into `file` and marks
    /// them present, both while no eviction runs: an eviction that chose a
    /// chunk (before a reader fetched it again) must punch its hole before
    /// the fresh bytes land, never after. A chunk that cannot be written
    /// (a full disk) stays uncached; its reader has the bytes in hand.
    pub fn land(&self, file: &File, chunks: &[(K, &[u8], u64)]) {
        let _no_eviction = self.evicting.read();
        let mut landed = Vec::with_capacity(chunks.len());
        for &(key, bytes, off) in chunks {
            match file.write_all_at(bytes, off) {
                Ok(()) => landed.push((key, bytes.len() as u32, off)),
                Err(e) => tracing::warn!(error = %e, "cannot write a chunk to the cache; it stays uncached"),
            }
        }
        self.insert(&landed, false);
    }

    /// The cache's clock: the tick of the newest use so far.
    pub fn tick(&self) -> u64 {
        self.index.lock().tick()
    }

    /// Drops every chunk last used before tick `before` and hands them to
    /// `punch` like [`ChunkCache::evict_if_over`]: what nobody read for a
    /// while goes, however much room is left.
    pub fn evict_unused_since(&self, before: u64, punch: impl FnOnce(&[(K, u32, u64)])) {
        let _x = self.evicting.write();
        let victims: Vec<(K, u32, u64)> =
            self.index.lock().unused_since(before).into_iter().map(|(k, _, s)| (k, s.len, s.off)).collect();
        if victims.is_empty() {
            return;
        }
        self.evicted.add(victims.iter().map(|v| v.1 as u64).sum());
        punch(&victims);
    }

    /// When the cache holds more than its capacity, drops the chunks its
    /// policy picks (the least recently used, down to 90 % of it) and
    /// hands them (key, length, offset) to `punch`, which removes their
    /// bytes, while no reader is between its presence check and its pread.
    pub fn evict_if_over(&self, punch: impl FnOnce(&[(K, u32, u64)])) {
        if self.index.lock().weight() <= self.capacity {
            return;
        }
        let _x = self.evicting.write();
        let victims: Vec<(K, u32, u64)> =
            self.index.lock().trim(self.capacity).into_iter().map(|(k, _, s)| (k, s.len, s.off)).collect();
        if victims.is_empty() {
            return;
        }
        self.evicted.add(victims.iter().map(|v| v.1 as u64).sum());
        punch(&victims);
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_down_to_ninety_percent_and_punches_them() {
        let cache: ChunkCache<u32> = ChunkCache::new(1000);
        cache.insert(&[(1, 300, 0), (2, 300, 300), (3, 300, 600)], false);
        cache.touch(1);
        let mut punched = Vec::new();
        cache.evict_if_over(|v| punched.extend_from_slice(v));
        assert!(punched.is_empty(), "900 of 1000 bytes: nothing to evict");
        cache.insert(&[(4, 300, 900)], false);
        cache.evict_if_over(|v| punched.extend_from_slice(v));
        // 1200 > 1000: down to <= 900, oldest first (2, then 3; 1 was touched).
        assert_eq!(punched, vec![(2, 300, 300)]);
        assert_eq!(cache.bytes(), 900);
        assert!(!cache.present(2) && cache.present(1) && cache.present(3) && cache.present(4));
        assert_eq!(cache.evicted_bytes(), 300);
    }

    #[test]
    fn chunks_unused_since_a_tick_go_whatever_the_room() {
        let cache: ChunkCache<u32> = ChunkCache::new(1 << 30);
        cache.insert(&[(1, 10, 0), (2, 10, 10)], false);
        let mark = cache.tick() + 1;
        cache.insert(&[(3, 10, 20)], false);
        cache.touch(1);
        let mut punched = Vec::new();
        cache.evict_unused_since(mark, |v| punched.extend_from_slice(v));
        assert_eq!(punched, vec![(2, 10, 10)], "only chunk 2 was not used since the mark");
        assert_eq!((cache.bytes(), cache.evicted_bytes()), (20, 10));
        assert!(cache.present(1) && cache.present(3));
    }

    #[test]
    fn chunks_from_before_are_cold_and_unchecked_until_marked() {
        let cache: ChunkCache<u32> = ChunkCache::new(1 << 20);
        cache.insert(&[(7, 10, 0)], true);
        assert_eq!(cache.verified(7), Some(false));
        assert_eq!(cache.get(7).map(|c| c.last_used), Some(0));
        cache.mark_verified(7);
        assert_eq!(cache.verified(7), Some(true));
        cache.forget(7);
        assert_eq!((cache.verified(7), cache.bytes()), (None, 0));
        cache.insert(&[(1, 5, 0), (2, 5, 5), (11, 5, 0)], false);
        cache.forget_where(|k| *k < 10);
        assert_eq!((cache.present(11), cache.bytes()), (true, 5));
    }

    #[test]
    fn landed_chunks_are_in_the_file_and_punched_ones_are_holes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("c"))
            .expect("file");
        file.set_len(2 << 20).expect("len");
        let cache: ChunkCache<u32> = ChunkCache::new(1 << 30);
        let bytes = vec![7u8; 1 << 20];
        cache.land(&file, &[(0, &bytes, 0)]);
        assert!(cache.present(0) && is_data(&file, 0, 1 << 20));
        assert!(!is_data(&file, 1 << 20, 2 << 20), "the second chunk was never written");
        punch_hole(&file, 0, 1 << 20);
        assert!(!is_data(&file, 0, 1 << 20));
    }
}
