//! The chunk store: every immutable chunk this node keeps on its disk (or,
//! for a memory-only mount, in its memory files), in one budget of bytes,
//! ranked in one [`Ledger`] and evicted as [`super::policy::CHUNK_STORE`]
//! says (least recently used first, in batches down to 90 %), whatever
//! its kind: a segment chunk may leave for an imported one and the other
//! way round.
//!
//! The store keeps the accounting; each kind's bytes stay where they are
//! best kept:
//! - a segment chunk ([`ChunkKey::Segment`]) in its segment's sparse cache
//!   file (`sparse.rs`), owned by the segment tier (`tier/remote`), which
//!   registers itself as the [`SegmentFiles`] that punch evicted chunks out;
//! - an imported object's chunk ([`ChunkKey::Object`]) in a file of its own
//!   in the chunk-files folder ([`super::ChunkFiles`]), removed on eviction.
//!
//! One store serves one segment tier (its keys name segments, not tiers)
//! and one chunk-files folder. Memory-only mounts have no chunk files: their
//! store holds segment chunks alone.
//!
//! Locks, in order: `evicting` → the segment tier's locks (its punch
//! runs under `evicting`) → `held`, and `files` → `held`. `held` and
//! `segments` are innermost: nothing else is taken while either is held,
//! and neither is held across a call out of the store. `files` is taken
//! with no other lock of the store held, never across a call out of it.
//! A reader of segment chunks holds `evicting`
//! shared ([`ChunkStore::hold`]) from "is the chunk present" to the end of
//! its pread, and fresh segment bytes land under it too
//! ([`ChunkStore::land`]); an eviction whose victims hold a segment chunk
//! holds it exclusively while it picks them and punches, so a punch never
//! races a read, nor follows fresh bytes. Chunk files need no such lock:
//! their readers read a whole file at once, which an unlink does not cut
//! short, and a reader that finds a file gone forgets the chunk. So an
//! eviction of chunk files alone never takes `evicting` (never waits for a
//! segment reader, who may be sending to a slow client), and chunk files
//! are removed after it is released. What keeps the ledger true to the
//! folder is `files`: a put renames its file into place and inserts its
//! chunk under it, and an eviction removes a file under it only if its
//! chunk was not put again since it was picked; a reader that lost a file
//! (or found it damaged) forgets the chunk only if it is still the put it
//! found.

use super::object_files;
use super::policy::{Ledger, CHUNK_STORE};
use crate::error::{Error, Result};
use crate::format::SegId;
use crate::metrics::Counter;
use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, Weak};

/// A segment chunk: (segment, chunk index).
pub(crate) type SegChunk = (SegId, u32);

/// A segment chunk and where it lies in its cache file: key, length, offset.
pub(crate) type PlacedChunk = (SegChunk, u32, u64);

/// One chunk in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum ChunkKey {
    /// Chunk `index` of a sealed segment object.
    Segment(SegId, u32),
    /// Chunk `index` of an imported object, by the hash of its id.
    Object(u64, u64),
}

impl From<SegChunk> for ChunkKey {
    fn from((seg, index): SegChunk) -> ChunkKey {
        ChunkKey::Segment(seg, index)
    }
}

/// Where a chunk's bytes are, as the ledger keeps them (its last use is
/// its rank).
#[derive(Clone, Copy, Debug)]
enum Spot {
    /// At `off` of its segment's cache file; `verified`: checked in this
    /// process.
    Segment { len: u32, off: u64, verified: bool },
    /// In its own file, put there by the store's `put`th insert of a chunk
    /// file: a reader that lost a file forgets the chunk only if it was not
    /// put again since.
    Object { put: u64 },
}

/// Which chunks an eviction drops.
#[derive(Clone, Copy, Debug)]
enum Pick {
    /// Down to the policy's low water mark, if over the capacity.
    Over,
    /// Every chunk last used before this tick.
    UnusedSince(u64),
}

impl Pick {
    /// Whether the chunks this would drop now hold a segment chunk.
    fn any_segment(self, ledger: &Ledger<ChunkKey, Spot>, capacity: u64) -> bool {
        let segment = |(_, spot): (&ChunkKey, &Spot)| matches!(spot, Spot::Segment { .. });
        match self {
            Pick::Over => ledger.trimmed(capacity).any(segment),
            Pick::UnusedSince(before) => ledger.unused(before).any(segment),
        }
    }

    /// Drops the chunks this picks: (key, weight, where).
    fn take(self, ledger: &mut Ledger<ChunkKey, Spot>, capacity: u64) -> Vec<(ChunkKey, u64, Spot)> {
        match self {
            Pick::Over => ledger.trim(capacity),
            Pick::UnusedSince(before) => ledger.unused_since(before),
        }
    }
}

/// The owner of the segment chunks' sparse files: punches evicted chunks
/// out of them. Called with the store's eviction lock held exclusively.
pub(crate) trait SegmentFiles: Send + Sync {
    fn punch(&self, victims: &[PlacedChunk]);
}

/// The ledger and the bytes of its object chunks (the rest are segment
/// chunks).
struct Held {
    ledger: Ledger<ChunkKey, Spot>,
    object_bytes: u64,
    /// Chunk files inserted so far.
    puts: u64,
}

impl Held {
    fn insert(&mut self, key: ChunkKey, weight: u64, spot: Spot, cold: bool) {
        self.remove(&key);
        if let Spot::Object { .. } = spot {
            self.object_bytes += weight;
        }
        self.ledger.insert(key, weight, spot, cold);
    }

    fn remove(&mut self, key: &ChunkKey) -> Option<Spot> {
        let (weight, spot) = self.ledger.remove(key)?;
        self.gone(weight, &spot);
        Some(spot)
    }

    /// Accounts for a chunk the ledger dropped.
    fn gone(&mut self, weight: u64, spot: &Spot) {
        if let Spot::Object { .. } = spot {
            self.object_bytes -= weight;
        }
    }

    /// Holds chunk file `key` of `len` bytes.
    fn insert_object(&mut self, (hash, index): (u64, u64), len: u64, cold: bool) {
        self.puts += 1;
        let spot = Spot::Object { put: self.puts };
        self.insert(ChunkKey::Object(hash, index), len, spot, cold);
    }
}

/// The node's chunks on disk, of segments and of imported objects, in one
/// budget of bytes and one order of eviction (see the module docs: what it
/// keeps, where each kind's bytes are, and its locks). Shared as an `Arc`
/// by the segment tier of a cache folder and the chunk files beside it.
pub struct ChunkStore {
    capacity: u64,
    held: Mutex<Held>,
    evicting: RwLock<()>,
    /// A chunk file's name in the folder and its entry in the ledger change
    /// together under it: a put's rename and insert, a removal by an
    /// eviction or a reader and the look at the ledger before it.
    files: Mutex<()>,
    evicted: Counter,
    /// The chunk-files folder, once [`super::ChunkFiles`] opened it.
    objects: OnceLock<PathBuf>,
    /// Who punches segment chunks out. Once it is gone (its tier closed)
    /// evicted segment chunks are only forgotten: a later process finds
    /// their bytes again, counts them and evicts them in turn.
    segments: Mutex<Option<Weak<dyn SegmentFiles>>>,
}

impl ChunkStore {
    /// An empty store of at most `capacity` bytes of chunks.
    pub fn new(capacity: u64) -> Arc<ChunkStore> {
        Arc::new(ChunkStore {
            capacity,
            held: Mutex::new(Held { ledger: Ledger::new(CHUNK_STORE), object_bytes: 0, puts: 0 }),
            evicting: RwLock::new(()),
            files: Mutex::new(()),
            evicted: Counter::new(),
            objects: OnceLock::new(),
            segments: Mutex::new(None),
        })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of every chunk present.
    pub fn bytes(&self) -> u64 {
        self.held.lock().ledger.weight()
    }

    /// Bytes of the segment chunks present.
    pub fn segment_bytes(&self) -> u64 {
        let held = self.held.lock();
        held.ledger.weight() - held.object_bytes
    }

    /// Bytes of the imported objects' chunk files present.
    pub fn object_bytes(&self) -> u64 {
        self.held.lock().object_bytes
    }

    /// Bytes evicted so far, of both kinds.
    pub fn evicted_bytes(&self) -> u64 {
        self.evicted.get()
    }

    /// The store's clock: the tick of the newest use so far.
    pub(crate) fn tick(&self) -> u64 {
        self.held.lock().ledger.tick()
    }

    /// Makes `files` the one that punches evicted segment chunks out.
    pub(crate) fn register_segments(&self, files: Weak<dyn SegmentFiles>) {
        *self.segments.lock() = Some(files);
    }

    /// No eviction punches a hole while the guard lives.
    pub(crate) fn hold(&self) -> RwLockReadGuard<'_, ()> {
        self.evicting.read()
    }

    /// No reader is between its presence check and its pread while the
    /// guard lives.
    pub(crate) fn exclusive(&self) -> RwLockWriteGuard<'_, ()> {
        self.evicting.write()
    }

    /// Whether segment chunk `key` is present and already checked in this
    /// process.
    pub(crate) fn verified(&self, (seg, i): SegChunk) -> Option<bool> {
        match self.held.lock().ledger.get(&ChunkKey::Segment(seg, i)) {
            Some(Spot::Segment { verified, .. }) => Some(*verified),
            _ => None,
        }
    }

    pub(crate) fn mark_verified(&self, (seg, i): SegChunk) {
        if let Some(Spot::Segment { verified, .. }) = self.held.lock().ledger.get_mut(&ChunkKey::Segment(seg, i)) {
            *verified = true;
        }
    }

    pub(crate) fn contains(&self, key: impl Into<ChunkKey>) -> bool {
        self.held.lock().ledger.contains(&key.into())
    }

    /// A use of chunk `key`.
    pub(crate) fn touch(&self, key: impl Into<ChunkKey>) {
        self.held.lock().ledger.touch(&key.into());
    }

    /// Drops one chunk (one that failed its check, or whose file is gone).
    pub(crate) fn forget(&self, key: impl Into<ChunkKey>) {
        self.held.lock().remove(&key.into());
    }

    /// Drops every chunk of segment `seg` (deleted, or its cache file
    /// started anew).
    pub(crate) fn forget_segment(&self, seg: SegId) {
        // Segment chunks only: the bytes of object chunks stay as counted.
        self.held.lock().ledger.remove_where(|k| matches!(k, ChunkKey::Segment(s, _) if *s == seg));
    }

    /// Marks segment chunks (key, length, offset) present. `old` chunks
    /// (found in a cache file from before) go to the cold end and are
    /// checked when first read: a crash may have left a chunk half written,
    /// and a punched partial block reads as zeros yet counts as data. An
    /// `old` chunk the store holds already (its file opened again in this
    /// process) keeps its place and its check.
    pub(crate) fn insert_segments(&self, chunks: &[PlacedChunk], old: bool) {
        let mut held = self.held.lock();
        for &((seg, i), len, off) in chunks {
            let key = ChunkKey::Segment(seg, i);
            if old && held.ledger.contains(&key) {
                continue;
            }
            held.insert(key, len as u64, Spot::Segment { len, off, verified: !old }, old);
        }
    }

    /// Writes fetched segment chunks (key, bytes, offset) into `file` and
    /// marks them present, both while no eviction runs: an eviction that
    /// chose a chunk (before a reader fetched it again) must punch its hole
    /// before the fresh bytes land, never after. A chunk that cannot be
    /// written (a full disk) stays uncached; its reader has the bytes in
    /// hand.
    pub(crate) fn land(&self, file: &File, chunks: &[(SegChunk, &[u8], u64)]) {
        let _no_eviction = self.evicting.read();
        let mut landed = Vec::with_capacity(chunks.len());
        for &(key, bytes, off) in chunks {
            match file.write_all_at(bytes, off) {
                Ok(()) => landed.push((key, bytes.len() as u32, off)),
                Err(e) => tracing::warn!(error = %e, "cannot write a chunk to the cache; it stays uncached"),
            }
        }
        self.insert_segments(&landed, false);
    }

    /// Takes `dir` as the chunk-files folder, with the chunks found there
    /// (key, file length; the least recently written first) at the cold
    /// end; a folder taken already is not looked at again. Another folder
    /// is refused: one store, one folder.
    pub(crate) fn open_objects(&self, dir: &Path, found: impl FnOnce() -> Vec<((u64, u64), u64)>) -> Result<()> {
        // Another opener of the folder waits here until its chunks are in.
        let taken = self.objects.get_or_init(|| {
            let found = found();
            let mut held = self.held.lock();
            for (key, len) in found {
                held.insert_object(key, len, true);
            }
            dir.to_path_buf()
        });
        if taken != dir {
            return Err(Error::Invalid("a chunk store keeps the chunk files of one folder"));
        }
        self.evict_if_over();
        Ok(())
    }

    /// Puts the chunk file of `key` (hash of the object id, index) in
    /// place with `place` and, if it is, marks it present, `len` bytes
    /// long; then evicts if the store is over its capacity.
    pub(crate) fn insert_object(
        &self,
        key: (u64, u64),
        len: u64,
        place: impl FnOnce() -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        {
            let _files = self.files.lock();
            place()?;
            self.held.lock().insert_object(key, len, false);
        }
        self.evict_if_over();
        Ok(())
    }

    /// Which put of chunk file `key` the store holds, if any (for
    /// [`ChunkStore::forget_object`]).
    pub(crate) fn object(&self, (hash, index): (u64, u64)) -> Option<u64> {
        match self.held.lock().ledger.get(&ChunkKey::Object(hash, index)) {
            Some(Spot::Object { put }) => Some(*put),
            _ => None,
        }
    }

    /// Drops chunk file `key` and removes its file (one that failed its
    /// check, or is gone), if the store still holds put `put` of it, as
    /// its reader found it: a chunk put again since is another file.
    pub(crate) fn forget_object(&self, (hash, index): (u64, u64), put: u64) {
        let _files = self.files.lock();
        let key = ChunkKey::Object(hash, index);
        {
            let mut held = self.held.lock();
            if !matches!(held.ledger.get(&key), Some(Spot::Object { put: p }) if *p == put) {
                return;
            }
            held.remove(&key);
        }
        if let Some(dir) = self.objects.get() {
            let _ = std::fs::remove_file(object_files::path(dir, (hash, index)));
        }
    }

    /// When the store holds more than its capacity, drops the chunks its
    /// policy picks (the least recently used, of either kind, down to 90 %
    /// of it) and removes their bytes.
    pub(crate) fn evict_if_over(&self) {
        if self.held.lock().ledger.weight() <= self.capacity {
            return;
        }
        self.evict(Pick::Over);
    }

    /// Drops every chunk last used before tick `before`, of either kind:
    /// what nobody read for a while goes, however much room is left.
    pub(crate) fn evict_unused_since(&self, before: u64) {
        self.evict(Pick::UnusedSince(before));
    }

    /// Drops the chunks `pick` takes from the ledger and removes their
    /// bytes.
    fn evict(&self, pick: Pick) {
        let files = self.drop_victims(pick);
        self.remove_files(files);
    }

    /// Drops the chunks `pick` takes from the ledger and punches the
    /// segment chunks among them out, while no reader is between its
    /// presence check and its pread; the chunk files to remove. Only an
    /// eviction with segment chunks to punch takes the eviction lock: one
    /// of chunk files alone never waits for a segment reader (a server may
    /// hold one across a send to a slow client).
    fn drop_victims(&self, pick: Pick) -> Vec<(u64, u64)> {
        let mut files = Vec::new();
        // Dropped once the lock is released: should it be the segment
        // tier's last handle, the tier goes with no lock of the store held.
        let mut owner = None;
        {
            let mut exclusive = None;
            let victims = loop {
                let mut held = self.held.lock();
                if exclusive.is_none() && pick.any_segment(&held.ledger, self.capacity) {
                    // Picked again under the lock: what was picked before
                    // may have been fetched again since, its fresh bytes
                    // landed, which a punch must not follow.
                    drop(held);
                    exclusive = Some(self.evicting.write());
                    continue;
                }
                let victims = pick.take(&mut held.ledger, self.capacity);
                for (_, weight, spot) in &victims {
                    held.gone(*weight, spot);
                }
                break victims;
            };
            if victims.is_empty() {
                return files;
            }
            self.evicted.add(victims.iter().map(|v| v.1).sum());
            let mut punched = Vec::new();
            for (key, _, spot) in victims {
                match (key, spot) {
                    (ChunkKey::Segment(seg, i), Spot::Segment { len, off, .. }) => punched.push(((seg, i), len, off)),
                    (ChunkKey::Object(hash, index), _) => files.push((hash, index)),
                    (ChunkKey::Segment(..), Spot::Object { .. }) => {}
                }
            }
            if !punched.is_empty() {
                owner = self.segments.lock().as_ref().and_then(Weak::upgrade);
                if let Some(owner) = &owner {
                    owner.punch(&punched);
                }
            }
        }
        drop(owner);
        files
    }

    /// Removes the files of evicted chunk files `keys`, but for those put
    /// again since they were picked (a file of that name now is the new
    /// one).
    fn remove_files(&self, keys: Vec<(u64, u64)>) {
        let Some(dir) = self.objects.get() else { return };
        if keys.is_empty() {
            return;
        }
        let _files = self.files.lock();
        let keys: Vec<(u64, u64)> = {
            let held = self.held.lock();
            keys.into_iter().filter(|&(hash, index)| !held.ledger.contains(&ChunkKey::Object(hash, index))).collect()
        };
        for key in keys {
            let _ = std::fs::remove_file(object_files::path(dir, key));
        }
    }

    /// Where chunk `key` stands in the order of leaving (0: the cold end).
    #[cfg(test)]
    fn rank(&self, key: ChunkKey) -> Option<u64> {
        self.held.lock().ledger.rank(&key)
    }
}

#[cfg(test)]
mod tests {
    use super::super::sparse::{is_data, punch_hole};
    use super::super::ChunkFiles;
    use super::*;

    fn seg(n: u32) -> SegId {
        SegId { writer: 1, seq: n }
    }

    /// A segment tier's stand-in: records what it was asked to punch.
    #[derive(Default)]
    struct Punches(Mutex<Vec<PlacedChunk>>);

    impl SegmentFiles for Punches {
        fn punch(&self, victims: &[PlacedChunk]) {
            self.0.lock().extend_from_slice(victims);
        }
    }

    fn with_punches(capacity: u64) -> (Arc<ChunkStore>, Arc<Punches>) {
        let store = ChunkStore::new(capacity);
        let punches = Arc::new(Punches::default());
        let weak: Weak<dyn SegmentFiles> = Arc::downgrade(&(punches.clone() as Arc<dyn SegmentFiles>));
        store.register_segments(weak);
        (store, punches)
    }

    #[test]
    fn evicts_least_recently_used_down_to_ninety_percent_and_punches_them() {
        let (store, punches) = with_punches(1000);
        let s = seg(1);
        store.insert_segments(&[((s, 1), 300, 0), ((s, 2), 300, 300), ((s, 3), 300, 600)], false);
        store.touch(ChunkKey::Segment(s, 1));
        store.evict_if_over();
        assert!(punches.0.lock().is_empty(), "900 of 1000 bytes: nothing to evict");
        store.insert_segments(&[((s, 4), 300, 900)], false);
        store.evict_if_over();
        // 1200 > 1000: down to <= 900, oldest first (2; 1 was touched).
        assert_eq!(*punches.0.lock(), vec![((s, 2), 300, 300)]);
        assert_eq!((store.bytes(), store.segment_bytes(), store.evicted_bytes()), (900, 900, 300));
        for (i, there) in [(1, true), (2, false), (3, true), (4, true)] {
            assert_eq!(store.contains(ChunkKey::Segment(s, i)), there, "chunk {i}");
        }
    }

    #[test]
    fn chunks_unused_since_a_tick_go_whatever_the_room() {
        let (store, punches) = with_punches(1 << 30);
        let s = seg(1);
        store.insert_segments(&[((s, 1), 10, 0), ((s, 2), 10, 10)], false);
        let mark = store.tick() + 1;
        store.insert_segments(&[((s, 3), 10, 20)], false);
        store.touch(ChunkKey::Segment(s, 1));
        store.evict_unused_since(mark);
        assert_eq!(*punches.0.lock(), vec![((s, 2), 10, 10)], "only chunk 2 was not used since the mark");
        assert_eq!((store.bytes(), store.evicted_bytes()), (20, 10));
    }

    #[test]
    fn chunks_from_before_are_cold_and_unchecked_until_marked() {
        let store = ChunkStore::new(1 << 20);
        let (a, b) = (seg(1), seg(2));
        store.insert_segments(&[((a, 7), 10, 0)], true);
        assert_eq!(store.verified((a, 7)), Some(false));
        assert_eq!(store.rank(ChunkKey::Segment(a, 7)), Some(0));
        store.mark_verified((a, 7));
        assert_eq!(store.verified((a, 7)), Some(true));
        store.forget(ChunkKey::Segment(a, 7));
        assert_eq!((store.verified((a, 7)), store.bytes()), (None, 0));
        store.insert_segments(&[((a, 1), 5, 0), ((a, 2), 5, 5), ((b, 1), 5, 0)], false);
        store.forget_segment(a);
        assert_eq!((store.contains(ChunkKey::Segment(b, 1)), store.bytes()), (true, 5));
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
        let store = ChunkStore::new(1 << 30);
        let bytes = vec![7u8; 1 << 20];
        store.land(&file, &[((seg(1), 0), &bytes, 0)]);
        assert!(store.contains(ChunkKey::Segment(seg(1), 0)) && is_data(&file, 0, 1 << 20));
        assert!(!is_data(&file, 1 << 20, 2 << 20), "the second chunk was never written");
        punch_hole(&file, 0, 1 << 20);
        assert!(!is_data(&file, 0, 1 << 20));
    }

    const ID: &str = "corpus\0shards/a.tar\0\"etag-1\"";

    /// Files in a chunk-files folder.
    fn files_in(dir: &Path) -> usize {
        std::fs::read_dir(dir).expect("dir").flatten().map(|s| std::fs::read_dir(s.path()).expect("sub").count()).sum()
    }

    #[test]
    fn one_least_recently_used_order_across_both_kinds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let body = vec![1u8; 1000];
        let one = object_files::file_len(ID, body.len());
        // Room for four chunks; a fifth trims to 90 %, that is to three.
        let (store, punches) = with_punches(4 * one);
        let files = ChunkFiles::open(dir.path(), &store).expect("files");
        let s = seg(9);
        store.insert_segments(&[((s, 0), one as u32, 0)], false);
        files.put(ID, 0, &body);
        store.insert_segments(&[((s, 1), one as u32, one)], false);
        files.put(ID, 1, &body);
        assert_eq!((store.segment_bytes(), store.object_bytes()), (2 * one, 2 * one));
        assert!(punches.0.lock().is_empty() && files_in(dir.path()) == 2, "four fit");
        // Segment chunk 0 is used: object chunk 0 is now the oldest, then
        // segment chunk 1.
        store.touch((s, 0));
        // A segment chunk comes in: those two go, the object chunk's file
        // removed and the segment chunk punched.
        store.insert_segments(&[((s, 2), one as u32, 2 * one)], false);
        store.evict_if_over();
        assert!(files.get(ID, 0).is_none(), "object chunk 0 was the least recently used");
        assert_eq!(files_in(dir.path()), 1, "its file is gone");
        assert_eq!(*punches.0.lock(), vec![((s, 1), one as u32, one)]);
        assert_eq!((store.segment_bytes(), store.object_bytes()), (2 * one, one));
        // Now the other way: object chunk 1 is used, so segment chunks 0
        // and 2 are the oldest; object chunks come in and push them out.
        assert!(files.get(ID, 1).is_some());
        files.put(ID, 2, &body);
        assert_eq!(punches.0.lock().len(), 1, "four fit");
        files.put(ID, 3, &body);
        assert_eq!(
            punches.0.lock()[1..],
            [((s, 0), one as u32, 0), ((s, 2), one as u32, 2 * one)],
            "segment chunks punched for object chunks"
        );
        assert!(!store.contains((s, 0)) && !store.contains((s, 2)));
        for i in 1..4 {
            assert!(files.get(ID, i).is_some(), "object chunk {i} stays");
        }
        assert_eq!((store.segment_bytes(), store.object_bytes()), (0, 3 * one));
        assert_eq!(store.evicted_bytes(), 4 * one, "one counter for both kinds");
    }

    #[test]
    fn chunks_found_on_disk_at_open_leave_first_whatever_their_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let body = vec![2u8; 1000];
        let one = object_files::file_len(ID, body.len());
        {
            let earlier = ChunkStore::new(1 << 30);
            let files = ChunkFiles::open(dir.path(), &earlier).expect("files");
            files.put(ID, 0, &body);
        }
        let (store, punches) = with_punches(4 * one);
        let s = seg(3);
        // Used in this process before the chunk files are opened.
        store.insert_segments(&[((s, 0), one as u32, 0), ((s, 1), one as u32, one)], false);
        let files = ChunkFiles::open(dir.path(), &store).expect("files");
        assert_eq!(store.rank(ChunkKey::Object(super::super::fnv1a(ID.as_bytes()), 0)), Some(0), "found: cold");
        // A segment chunk from an earlier process, found when its file opens.
        store.insert_segments(&[((s, 5), one as u32, 5 * one)], true);
        store.insert_segments(&[((s, 2), one as u32, 2 * one)], false);
        assert_eq!(store.bytes(), 5 * one);
        store.evict_if_over();
        // 5 > 4 chunks: down to 3.6, so two go: both found ones.
        assert_eq!(*punches.0.lock(), vec![((s, 5), one as u32, 5 * one)]);
        assert!(files.get(ID, 0).is_none() && files_in(dir.path()) == 0);
        assert_eq!((store.segment_bytes(), store.object_bytes()), (3 * one, 0));
    }

    #[test]
    fn chunks_found_again_keep_their_place_and_their_check() {
        let store = ChunkStore::new(1 << 20);
        let s = seg(4);
        store.insert_segments(&[((s, 0), 10, 0), ((s, 1), 10, 10)], false);
        store.touch(ChunkKey::Segment(s, 1));
        let hot = store.rank(ChunkKey::Segment(s, 1));
        // The segment's cache file is opened again and its chunks found.
        store.insert_segments(&[((s, 0), 10, 0), ((s, 1), 10, 10), ((s, 2), 10, 20)], true);
        assert_eq!((store.verified((s, 1)), store.rank(ChunkKey::Segment(s, 1))), (Some(true), hot), "used: stays");
        assert_eq!(store.verified((s, 0)), Some(true));
        assert_eq!((store.verified((s, 2)), store.rank(ChunkKey::Segment(s, 2))), (Some(false), Some(0)), "new: cold");
        assert_eq!(store.bytes(), 30);
    }

    #[test]
    fn chunk_files_found_at_open_leave_oldest_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let body = vec![3u8; 1000];
        let one = object_files::file_len(ID, body.len());
        let hash = super::super::fnv1a(ID.as_bytes());
        {
            let earlier = ChunkStore::new(1 << 30);
            let files = ChunkFiles::open(dir.path(), &earlier).expect("files");
            for i in 0..4 {
                files.put(ID, i, &body);
            }
        }
        // Chunk 3 was written longest ago, then 1, 0 and 2.
        let now = std::time::SystemTime::now();
        for (i, age) in [(3, 400), (1, 300), (0, 200), (2, 100)] {
            let f = File::options().write(true).open(object_files::path(dir.path(), (hash, i))).expect("file");
            f.set_modified(now - std::time::Duration::from_secs(age)).expect("mtime");
        }
        // Room for three of the four: trimmed to 90 %, two stay.
        let store = ChunkStore::new(3 * one);
        let files = ChunkFiles::open(dir.path(), &store).expect("files");
        let kept: Vec<u64> = (0..4).filter(|&i| files.get(ID, i).is_some()).collect();
        assert_eq!(kept, vec![0, 2], "the two written last stay");
    }

    #[test]
    fn evicting_chunk_files_alone_does_not_wait_for_a_segment_reader() {
        let dir = tempfile::tempdir().expect("tempdir");
        let body = vec![4u8; 1000];
        let one = object_files::file_len(ID, body.len());
        let (store, punches) = with_punches(3 * one);
        let files = ChunkFiles::open(dir.path(), &store).expect("files");
        for i in 0..3 {
            files.put(ID, i, &body);
        }
        store.insert_segments(&[((seg(1), 0), 10, 0)], false);
        // A reader of segment chunks is between its presence check and its
        // pread (or a server is sending a chunk to a slow client).
        let reading = store.hold();
        let (done, put) = std::sync::mpsc::channel();
        let writer = {
            let files = files.clone();
            let body = body.clone();
            std::thread::spawn(move || {
                files.put(ID, 3, &body);
                let _ = done.send(());
            })
        };
        let finished = put.recv_timeout(std::time::Duration::from_secs(10));
        drop(reading);
        writer.join().expect("writer");
        assert!(finished.is_ok(), "the put waited for the segment reader");
        assert!(punches.0.lock().is_empty() && store.contains((seg(1), 0)), "only chunk files left");
        assert_eq!((store.object_bytes(), files_in(dir.path()) as u64), (2 * one, 2));
    }

    /// Bytes of the chunk files in a chunk-files folder.
    fn bytes_in(dir: &Path) -> u64 {
        let subs = std::fs::read_dir(dir).expect("dir").flatten();
        subs.flat_map(|s| std::fs::read_dir(s.path()).expect("sub").flatten())
            .map(|f| f.metadata().expect("len").len())
            .sum()
    }

    #[test]
    fn a_chunk_file_put_again_while_it_is_evicted_stays_counted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let body = vec![5u8; 1000];
        let store = ChunkStore::new(1 << 20);
        let files = ChunkFiles::open(dir.path(), &store).expect("files");
        files.put(ID, 0, &body);
        let mark = store.tick() + 1;
        files.put(ID, 1, &body);
        // An eviction drops chunk 0 from the ledger; before it removes the
        // file, the chunk is fetched again and put.
        let gone = store.drop_victims(Pick::UnusedSince(mark));
        files.put(ID, 0, &body);
        store.remove_files(gone);
        assert_eq!(store.object_bytes(), bytes_in(dir.path()), "the ledger counts the bytes on disk");
        assert!(files.get(ID, 0).is_some(), "the chunk put again is there");
    }

    #[test]
    fn a_reader_that_lost_a_chunk_file_does_not_forget_it_put_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let body = vec![6u8; 1000];
        let store = ChunkStore::new(1 << 20);
        let files = ChunkFiles::open(dir.path(), &store).expect("files");
        files.put(ID, 0, &body);
        let key = (super::super::fnv1a(ID.as_bytes()), 0);
        // A reader finds chunk 0 present; an eviction removes it before
        // the reader reads its file; a put brings it back before the
        // reader, who found no file, forgets it.
        let found = store.object(key).expect("present");
        store.evict_unused_since(store.tick() + 1);
        assert!(std::fs::read(object_files::path(dir.path(), key)).is_err());
        files.put(ID, 0, &body);
        store.forget_object(key, found);
        assert_eq!(store.object_bytes(), bytes_in(dir.path()), "the ledger counts the bytes on disk");
        assert!(files.get(ID, 0).is_some(), "the chunk put again is there");
    }

    #[test]
    fn capacity_is_bytes_of_either_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = ChunkStore::new(10_000);
        let files = ChunkFiles::open(dir.path(), &store).expect("files");
        files.put(ID, 0, &[0u8; 3000]);
        store.insert_segments(&[((seg(1), 0), 4000, 0)], false);
        let file = object_files::file_len(ID, 3000);
        assert_eq!((store.object_bytes(), store.segment_bytes(), store.bytes()), (file, 4000, file + 4000));
        assert_eq!(files.stats().capacity, 10_000, "the chunk files report the store's one capacity");
        store.evict_if_over();
        assert_eq!(store.evicted_bytes(), 0, "under 10 000 bytes: nothing goes");
        // 3000 more bytes: over by a few dozen, trimmed to 9000 (the oldest,
        // the first chunk file, goes).
        store.insert_segments(&[((seg(1), 1), 3000, 4000)], false);
        store.evict_if_over();
        assert_eq!((store.evicted_bytes(), store.bytes(), store.object_bytes()), (file, 7000, 0));
        // Another folder on the same store is refused.
        let other = tempfile::tempdir().expect("tempdir");
        assert!(ChunkFiles::open(other.path(), &store).is_err());
    }
}
