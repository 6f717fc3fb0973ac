//! Reading segments that live in the bucket: ranged GETs of aligned
//! chunks, each verified against the object's footer before use, kept in
//! the node's chunk store ([`crate::chunks::ChunkStore`]: which chunks are
//! on local disk, of segments and of imported objects, in one budget, and
//! the lock that keeps a reader's pread and a hole punch apart). The
//! segment chunks' bytes are in this tier's sparse cache files, one per
//! segment: `Remote` registers with the store as the
//! [`crate::chunks::SegmentFiles`] that punches the chunks it evicts, an
//! eviction an insert of either kind may start.
//!
//! Rooms, one job each:
//! - `segment.rs`: one segment in the bucket, its footer, on-demand chunk
//!   fetches and reads (`SegmentFile`);
//! - `prefetch.rs`: `Fetches` (what is in flight, queued, and carried
//!   from segment to segment), read-ahead and its runs for the fetch
//!   workers, and streaming across a writer's segments; the window's
//!   growth and the worker pool are `chunks::ahead`'s, shared with the
//!   source reader. On-demand fetches run on the reader's thread;
//!   read-ahead runs on the workers;
//! - this file: `Remote`, which opens segments (objects, or the WAL pieces
//!   of a segment never sealed) and owns the rest.
//!
//! Lock order (a thread holding one may take those after it, never before):
//! `opening` → `chunks` eviction lock (`ChunkStore::exclusive`/`hold`; an
//! eviction with segment chunks to punch takes it, whichever kind of
//! insert started it, then calls `Remote::punch`) → `segs` → `let_go` →
//! `fetches.inflight` → `fetches.queued` → the store's ledger →
//! `fetches.stream`, `fetches.absent`, `adopted`, `fetches.workers`. The store's ledger is never held across a call into
//! this tier, and `RemoteSeg::landing` is released before an eviction. A
//! fetch's outcome (`chunks::fetch::Fetch`) is taken alone: its waiters
//! wait on it with `inflight` released.

mod prefetch;
mod segment;
#[cfg(test)]
mod tests;

use super::object::{segment_key, split_verified, wal_offset, wal_prefix, Footer, TRAILER_LEN};
use crate::bucket::ObjectStore;
use crate::chunks::{is_data, punch_hole, ChunkRequest, ChunkSource, ChunkStore, PlacedChunk, SegmentFiles};
use crate::device::SegmentFile;
use crate::error::{Error, Result};
use crate::format::SegId;
use parking_lot::{Mutex, RwLock};
use prefetch::Fetches;
use segment::Backing;
pub(crate) use segment::RemoteSeg;
use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

type ChunkKey = crate::chunks::SegChunk;

/// Remote segments whose handles are kept (each holds a descriptor).
const MAX_OPEN: usize = 1024;
/// Chunks read-ahead fetches with one GET at most (and asks for at once).
const RUN_CHUNKS: usize = 8;
/// The largest read-ahead window a streaming reader ramps up to.
const MAX_READ_AHEAD: u64 = 64 << 20;
/// How much of a segment object's tail is fetched to find its footer.
const FOOTER_GUESS: u64 = 16 << 10;
/// How many of the writer's following segments read-ahead may reach into.
const SPILL_SEGMENTS: usize = 4;
/// Tries per chunk before a checksum mismatch is reported as corruption.
const GET_TRIES: usize = 4;
/// WAL pieces fetched at once when a segment is read from them.
const PIECE_FETCHES: usize = 16;
/// A kept segment footer's name: the segment's cache file name and this.
/// Only footers read from the bucket (or written by this node) are kept.
const FOOTER_SUFFIX: &str = ".bucket-footer";
/// Kept footers of earlier builds, which may have come from a cache
/// server: never read, removed when their segment is opened.
const OLD_FOOTER_SUFFIX: &str = ".footer";
/// The largest read a cache server answers with part of a chunk (larger
/// ones fetch the whole chunk): a quarter chunk, more than the kernel's
/// read-ahead for one random read.
const PART_MAX: u64 = 256 << 10;

/// An anonymous file in memory (sparse, holes punched like any file).
fn memory_file(name: &str) -> Result<File> {
    use std::os::fd::FromRawFd;
    let name = std::ffi::CString::new(format!("arbor-{name}")).map_err(|_| Error::Invalid("memory file name"))?;
    // SAFETY: memfd_create with a valid C string; the descriptor is ours.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::Io(std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

crate::counters! {
    /// What [`Remote`] counts: bumped on the read path (a relaxed add
    /// each), read as [`CacheStats`].
    pub(crate) struct RemoteCounters;
    /// Counters for `status` and the benchmarks.
    #[derive(Copy)]
    pub struct CacheStats {
        /// Ranged GETs of chunks from the bucket, and their bytes.
        gets: Counter,
        fetched_bytes: Counter,
        /// Reads answered from chunks on local disk.
        hits: Counter,
        /// Chunks and footers read again after failing their checksum.
        checksum_retries: Counter,
        /// WAL pieces read, for segments whose writers never sealed them.
        wal_pieces_read: Counter,
        /// Chunks and bytes cache servers gave (and that passed their check).
        peer_chunks: Counter,
        peer_bytes: Counter,
        /// Parts of chunks cache servers gave for small reads, their bytes,
        /// and how many failed the reader's check (read again whole).
        peer_parts: Counter,
        peer_part_bytes: Counter,
        part_rejected: Counter,
        /// Segment footers another cache of this process gave (each saving
        /// a bucket GET). A cache server's footers are never taken: a footer
        /// is what every chunk is checked against, so it comes from the bucket.
        peer_footers: Counter,
        /// Segment footers read from this cache's own folder, kept there by an
        /// earlier process after it read them from the bucket (each saving a
        /// bucket GET).
        kept_footers: Counter,
        /// Segment footer reads from the bucket that found the object (one
        /// GET each, two for a footer longer than 16 KiB).
        bucket_footers: Counter,
    } and {
        /// Bytes of segment chunks on local disk (or in memory files), of
        /// imported objects' chunk files, and the most the two may hold
        /// together (the node's chunk store, one budget).
        cached_bytes: u64,
        object_bytes: u64,
        capacity: u64,
        /// Bytes of chunks of either kind evicted since the start.
        evicted_bytes: u64,
    }
}

pub(crate) struct Remote {
    store: Arc<dyn ObjectStore>,
    dir: PathBuf,
    /// Chunks live in anonymous memory files (memfd), never on a disk:
    /// for nodes without a local SSD. Nothing survives the process.
    memory: bool,
    /// Which chunks are on local disk, and evicting them: the node's one
    /// budget, shared with the chunk files of imported objects.
    chunks: Arc<ChunkStore>,
    segs: RwLock<HashMap<SegId, Arc<RemoteSeg>>>,
    /// Segments read from a cache file that `segs` let go of (too many
    /// open) while a reader or a fetch worker may still hold them: opening
    /// one again takes that handle back rather than setting up its cache
    /// file anew, so a segment's chunks are in one file at a time (a
    /// memory-only cache's file is its handle's own: a second one would
    /// hold none of the chunks the store counts, nor get those landed
    /// through the first).
    let_go: Mutex<HashMap<SegId, std::sync::Weak<RemoteSeg>>>,
    /// Segments this node wrote whose files became cached copies: reads
    /// through an older local handle go through the cache instead.
    adopted: Mutex<HashSet<SegId>>,
    /// One open at a time: two opens of one segment must not both set up
    /// its cache file.
    opening: Mutex<()>,
    /// Cache servers asked before the bucket.
    peers: Option<Arc<dyn ChunkSource>>,
    /// Chunk fetches in flight, read-ahead's queue, windows and workers.
    fetches: Fetches,
    counts: RemoteCounters,
}

impl Remote {
    pub(crate) fn new(
        store: Arc<dyn ObjectStore>,
        dir: PathBuf,
        chunks: Arc<ChunkStore>,
        read_ahead: u64,
        parallel: usize,
        memory: bool,
        peers: Option<Arc<dyn ChunkSource>>,
    ) -> Result<Arc<Remote>> {
        if !memory {
            crate::private::create_dir_all(&dir)?;
        }
        let remote = Arc::new(Remote {
            store,
            dir,
            memory,
            chunks,
            segs: RwLock::new(HashMap::new()),
            let_go: Mutex::new(HashMap::new()),
            adopted: Mutex::new(HashSet::new()),
            opening: Mutex::new(()),
            peers,
            fetches: Fetches::new(read_ahead, parallel),
            counts: RemoteCounters::default(),
        });
        let punches: Arc<dyn SegmentFiles> = remote.clone();
        remote.chunks.register_segments(Arc::downgrade(&punches));
        Ok(remote)
    }

    /// The node's chunk store this tier keeps its chunks in.
    pub(crate) fn chunk_store(&self) -> &Arc<ChunkStore> {
        &self.chunks
    }

    /// Asks the cache servers for chunks `wanted` of segment `seg` (with
    /// `footer`) and keeps those that pass their check: (index, bytes).
    fn ask_peers(&self, seg: SegId, footer: &Footer, wanted: &[usize]) -> Vec<(usize, Vec<u8>)> {
        let mut good = Vec::new();
        self.ask_peers_each(seg, footer, wanted, &mut |i, bytes| good.push((i, bytes)));
        good
    }

    /// As [`Remote::ask_peers`], but hands each chunk that passes its
    /// check to `good` as soon as it comes (the first can land, and its
    /// readers go on, while the rest are on their way).
    fn ask_peers_each(&self, seg: SegId, footer: &Footer, wanted: &[usize], good: &mut dyn FnMut(usize, Vec<u8>)) {
        let Some(peers) = &self.peers else { return };
        let asks: Vec<ChunkRequest> = wanted
            .iter()
            .map(|&i| {
                let (s, e) = footer.chunk_range(i);
                ChunkRequest { index: i as u32, range: s..e }
            })
            .collect();
        peers.fetch_each(seg, &asks, &mut |k, got| {
            let (Some(&i), Some(bytes)) = (wanted.get(k), got) else { return };
            if footer.verify(i, &bytes) {
                self.counts.peer_chunks.inc();
                self.counts.peer_bytes.add(bytes.len() as u64);
                good(i, bytes);
            } else {
                tracing::warn!(seg = %seg, chunk = i, got = bytes.len(), "a chunk from a cache server failed its checksum; reading it from the bucket");
                peers.rejected(seg, i as u32);
            }
        });
    }

    pub(crate) fn stats(&self) -> CacheStats {
        CacheStats {
            cached_bytes: self.chunks.segment_bytes(),
            object_bytes: self.chunks.object_bytes(),
            capacity: self.chunks.capacity(),
            evicted_bytes: self.chunks.evicted_bytes(),
            ..self.counts.snapshot()
        }
    }

    fn path(&self, id: SegId) -> PathBuf {
        self.dir.join(id.file_name())
    }

    /// Writes fetched chunks into the segment's cache file (one writer
    /// per segment at a time, see `RemoteSeg::landing`), then evicts if
    /// the cache grew past its capacity.
    fn land(&self, seg: &RemoteSeg, chunks: &[(ChunkKey, &[u8], u64)]) {
        let Backing::Object { file } = &seg.backing else { return };
        {
            let _turn = seg.landing.lock();
            self.chunks.land(file, chunks);
        }
        self.evict_if_over();
    }

    /// Marks chunks present, then evicts if the store grew past its
    /// capacity. `old` chunks go to the cold end.
    fn add(&self, keys: &[PlacedChunk], old: bool) {
        self.chunks.insert_segments(keys, old);
        self.evict_if_over();
    }

    /// The largest read-ahead window: [`MAX_READ_AHEAD`], or a quarter of
    /// a smaller cache. Chunks fetched ahead wait in the cache for their
    /// reader; a window near the cache's size would evict them before the
    /// reader came (a memory-only client with 64 MiB streaming a 256 MiB
    /// file pulled 558 MiB from its cache server).
    pub(super) fn max_window(&self) -> u64 {
        MAX_READ_AHEAD.min(self.chunks.capacity() / 4)
    }

    /// The chunk store's clock (see [`ChunkStore::tick`]).
    pub(crate) fn tick(&self) -> u64 {
        self.chunks.tick()
    }

    /// Evicts every chunk (of either kind) last used before tick `before`.
    pub(crate) fn evict_unused_since(&self, before: u64) {
        self.chunks.evict_unused_since(before);
    }

    /// Evicts down to 90 % of the store's capacity when over it; the store
    /// calls back [`SegmentFiles::punch`] for segment chunks.
    fn evict_if_over(&self) {
        self.chunks.evict_if_over();
    }
}

impl SegmentFiles for Remote {
    /// Punches evicted chunks out of their segments' cache files (the
    /// store holds its eviction lock exclusively meanwhile).
    fn punch(&self, victims: &[PlacedChunk]) {
        {
            let mut by_seg: HashMap<SegId, Vec<(u32, u64)>> = HashMap::new();
            for &((seg, _), len, off) in victims {
                by_seg.entry(seg).or_default().push((len, off));
            }
            for (seg, chunks) in by_seg {
                // Both maps under `segs`, so a handle moving from
                // `let_go` back into `segs` is found in one of them.
                let held = {
                    let segs = self.segs.read();
                    segs.get(&seg).cloned().or_else(|| self.still_held(seg))
                };
                let opened;
                let file = match held.as_deref().map(|s| &s.backing) {
                    Some(Backing::Object { file }) => file,
                    _ => match File::options().write(true).open(self.path(seg)) {
                        Ok(f) => {
                            opened = f;
                            &opened
                        }
                        Err(_) => continue,
                    },
                };
                for (len, off) in chunks {
                    punch_hole(file, off, len as u64);
                }
            }
        }
    }
}

impl Remote {
    /// A segment this node wrote and has just uploaded: its file becomes
    /// the cached copy, every chunk present.
    /// Done while no read of the old local file is under way (they hold
    /// `evicting` shared), so none can see a hole punched later.
    pub(crate) fn adopt(self: &Arc<Self>, id: SegId, local: &std::path::Path, footer: Footer) -> Result<()> {
        if self.memory {
            // No cache folder to move it into, and memory to give back: the
            // local file (in a tmpfs) goes, and reads of the segment go
            // through the memory cache and the bucket from now on.
            let _no_readers = self.chunks.exclusive();
            self.adopted.lock().insert(id);
            match fs::remove_file(local) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
            return Ok(());
        }
        {
            // No open of the segment meanwhile either: one that opened the
            // cache file this rename replaces would keep a handle of the
            // old file (holes where the new one has bytes).
            let _no_opens = self.opening.lock();
            let _no_readers = self.chunks.exclusive();
            let path = self.path(id);
            fs::rename(local, &path)?;
            self.adopted.lock().insert(id);
            let file = File::options().read(true).write(true).open(&path)?;
            let chunks: Vec<PlacedChunk> = (0..footer.crcs.len())
                .map(|i| {
                    let (s, e) = footer.chunk_range(i);
                    ((id, i as u32), (e - s) as u32, s)
                })
                .collect();
            self.keep_footer(id, &footer);
            self.forget_handles(id);
            self.insert_seg(id, footer, Backing::Object { file });
            self.chunks.insert_segments(&chunks, false);
        }
        self.evict_if_over();
        Ok(())
    }

    /// A segment this node uploaded whose file was not moved into the cache
    /// yet when the process stopped (between the upload and [`Remote::adopt`]):
    /// adopted after all if the file holds exactly the object's data, every
    /// chunk checked against the object's footer, so the segment is not
    /// fetched again. `false` where it is not kept (a memory-only cache, a
    /// file that differs from the object, or the footer out of reach): the
    /// caller drops the file and the bucket's copy is read instead.
    pub(crate) fn adopt_uploaded(self: &Arc<Self>, id: SegId, local: &std::path::Path) -> bool {
        if self.memory {
            return false;
        }
        let same = (|| -> Result<Option<Footer>> {
            let footer = self.read_footer(&segment_key(id))?;
            let file = File::open(local)?;
            if file.metadata()?.len() != footer.data_len {
                return Ok(None);
            }
            let mut buf = vec![0u8; footer.chunk_size as usize];
            use std::os::unix::fs::FileExt;
            for i in 0..footer.crcs.len() {
                let (start, end) = footer.chunk_range(i);
                let chunk = &mut buf[..(end - start) as usize];
                file.read_exact_at(chunk, start)?;
                if !footer.verify(i, chunk) {
                    return Ok(None);
                }
            }
            Ok(Some(footer))
        })();
        match same {
            Ok(Some(footer)) => match self.adopt(id, local, footer) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(seg = %id, error = %e, "cannot keep an uploaded segment's local copy");
                    false
                }
            },
            Ok(None) => {
                tracing::warn!(seg = %id, "a local segment differs from its object in the bucket; the bucket's copy is used");
                false
            }
            Err(e) => {
                tracing::warn!(seg = %id, error = %e, "cannot check an uploaded segment's local copy; the bucket's copy is used");
                false
            }
        }
    }

    /// Bytes `within` (offsets inside it; all of it when `None`) of chunk
    /// `index` of segment `id` if the chunk is cached here and checked: a
    /// read that cannot wait for the bucket and will not (`None`
    /// otherwise).
    pub(crate) fn cached_range(&self, id: SegId, index: u32, within: Option<std::ops::Range<u64>>) -> Option<Vec<u8>> {
        let seg = self.seg(id)?;
        self.read_cached(&seg, index, within, true)
    }

    /// Like [`Remote::cached_range`], but hands `send` the cache file and
    /// where the bytes lie in it (offset, length) instead of reading them,
    /// for a caller that moves them on without copying (`sendfile`): no
    /// eviction punches them out while `send` runs. `None` when the chunk
    /// is not cached here and checked, or `send` gave `None`.
    pub(crate) fn send_cached<T>(
        &self,
        id: SegId,
        index: u32,
        within: Option<std::ops::Range<u64>>,
        send: impl FnOnce(&File, u64, usize) -> Option<T>,
    ) -> Option<T> {
        let seg = self.seg(id)?;
        self.with_cached(&seg, index, within, true, send)
    }

    /// Whether chunk `index` of segment `id` is cached here (checked since
    /// this process started or not).
    pub(crate) fn holds(&self, id: SegId, index: u32) -> bool {
        self.chunks.contains((id, index))
    }

    /// Bytes `within` (all of it when `None`) of chunk `index` of `seg` if
    /// the chunk is in this cache, and (with `checked`) checked since this
    /// process started.
    fn read_cached(
        &self,
        seg: &RemoteSeg,
        index: u32,
        within: Option<std::ops::Range<u64>>,
        checked: bool,
    ) -> Option<Vec<u8>> {
        self.with_cached(seg, index, within, checked, |file, off, len| {
            let mut buf = vec![0u8; len];
            use std::os::unix::fs::FileExt;
            file.read_exact_at(&mut buf, off).ok()?;
            Some(buf)
        })
    }

    /// `f` of the cache file holding bytes `within` (all of it when
    /// `None`) of chunk `index` of `seg`, and where they lie in it, if the
    /// chunk is in this cache (and, with `checked`, checked since this
    /// process started); no eviction punches it out while `f` runs. A
    /// `Some` from `f` counts as a hit.
    fn with_cached<T>(
        &self,
        seg: &RemoteSeg,
        index: u32,
        within: Option<std::ops::Range<u64>>,
        checked: bool,
        f: impl FnOnce(&File, u64, usize) -> Option<T>,
    ) -> Option<T> {
        let segment::Backing::Object { file } = &seg.backing else { return None };
        if index as usize >= seg.footer.crcs.len() {
            return None;
        }
        let (start, end) = seg.footer.chunk_range(index as usize);
        let within = within.unwrap_or(0..end - start);
        if within.start >= within.end || within.end > end - start {
            return None;
        }
        let key = (seg.id, index);
        let _no_eviction = self.chunks.hold();
        let there = if checked { self.chunks.verified(key) == Some(true) } else { self.chunks.contains(key) };
        if !there {
            return None;
        }
        let out = f(file, start + within.start, (within.end - within.start) as usize)?;
        self.chunks.touch(key);
        self.counts.hits.inc();
        Some(out)
    }

    /// The footer of segment `id` if this cache holds it (see
    /// [`Remote::held`]), as its object ends.
    pub(crate) fn cached_footer(self: &Arc<Self>, id: SegId) -> Option<Vec<u8>> {
        let seg = self.held(id)?;
        let segment::Backing::Object { .. } = &seg.backing else { return None };
        let mut out = Vec::with_capacity(seg.footer.encoded_len());
        seg.footer.encode(&mut out);
        Some(out)
    }

    /// Segment `id` as this cache holds it: open already, or a cache file
    /// of it kept from before a restart, which is opened now (with its
    /// kept footer, or the bucket's if none was kept; its chunks checked
    /// before they are used). `None` when this node holds none of it.
    fn held(self: &Arc<Self>, id: SegId) -> Option<Arc<RemoteSeg>> {
        if let Some(seg) = self.segs.read().get(&id) {
            return Some(seg.clone());
        }
        if self.memory || !self.path(id).exists() {
            return None;
        }
        self.open_object(id).ok().flatten()
    }

    /// Chunk `index` of segment `id` if this cache holds it, checked or
    /// not since a restart: for a caller that checks it against the footer
    /// itself (a cache server in this process serving this node's chunks).
    pub(crate) fn held_chunk(self: &Arc<Self>, id: SegId, index: u32) -> Option<Vec<u8>> {
        let seg = self.held(id)?;
        self.read_cached(&seg, index, None, false)
    }

    /// Reads `buf` at `off` of segment `id` through `local` (this node's
    /// file of it), unless the segment has since become a cached copy:
    /// then through the cache, which knows which chunks were evicted.
    pub(crate) fn read_local(
        self: &Arc<Self>,
        id: SegId,
        local: &dyn SegmentFile,
        buf: &mut [u8],
        off: u64,
    ) -> Result<()> {
        {
            let _no_eviction = self.chunks.hold();
            if !self.adopted.lock().contains(&id) {
                return local.read_at(buf, off);
            }
        }
        let seg = self.open(id)?.ok_or_else(|| Error::corrupted("missing segment", id))?;
        seg.read_at(buf, off)
    }

    fn insert_seg(self: &Arc<Self>, id: SegId, footer: Footer, backing: Backing) -> Arc<RemoteSeg> {
        let seg = Arc::new_cyclic(|me| RemoteSeg {
            remote: self.clone(),
            id,
            key: segment_key(id),
            footer,
            backing,
            stream: crate::chunks::ahead::Stream::new(self.fetches.base_window()),
            part_run: AtomicU64::new(u64::MAX),
            ahead: AtomicU64::new(0),
            landing: parking_lot::Mutex::new(()),
            me: me.clone(),
        });
        let mut segs = self.segs.write();
        self.bound_open(&mut segs);
        segs.entry(id).or_insert(seg).clone()
    }

    /// Lets go of a quarter of the open segments when [`MAX_OPEN`] are
    /// open.
    fn bound_open(&self, segs: &mut HashMap<SegId, Arc<RemoteSeg>>) {
        if segs.len() >= MAX_OPEN {
            let victims: Vec<SegId> = segs.keys().take(MAX_OPEN / 4).copied().collect();
            self.let_go(segs, &victims);
        }
    }

    /// Takes open segments `ids` out of `segs`, keeping track of those
    /// read from a cache file until nobody holds them (see `let_go`).
    fn let_go(&self, segs: &mut HashMap<SegId, Arc<RemoteSeg>>, ids: &[SegId]) {
        let mut let_go = self.let_go.lock();
        let_go.retain(|_, seg| seg.strong_count() > 0);
        for id in ids {
            if let Some(seg) = segs.remove(id).filter(|s| matches!(s.backing, Backing::Object { .. })) {
                let_go.insert(*id, Arc::downgrade(&seg));
            }
        }
    }

    /// Drops this tier's handles of segment `id`, open or let go of, both
    /// under `segs`: an open racing this finds neither, and opens the
    /// segment's file as it is now.
    fn forget_handles(&self, id: SegId) {
        let mut segs = self.segs.write();
        segs.remove(&id);
        self.let_go.lock().remove(&id);
    }

    /// Segment `id` if `segs` let go of it and somebody still holds it.
    fn still_held(&self, id: SegId) -> Option<Arc<RemoteSeg>> {
        let mut let_go = self.let_go.lock();
        let seg = let_go.get(&id)?.upgrade();
        if seg.is_none() {
            let_go.remove(&id);
        }
        seg
    }

    /// Segment `id` if it is open here (a segment object or WAL pieces).
    fn seg(&self, id: SegId) -> Option<Arc<RemoteSeg>> {
        self.segs.read().get(&id).cloned()
    }

    /// Opens segment `id` from the bucket, or `None` if it is not there.
    pub(crate) fn open(self: &Arc<Self>, id: SegId) -> Result<Option<Arc<RemoteSeg>>> {
        self.open_as(id, true)
    }

    /// Opens sealed segment `id` from its object alone (never from WAL
    /// pieces), or `None` if it has no object.
    pub(crate) fn open_object(self: &Arc<Self>, id: SegId) -> Result<Option<Arc<RemoteSeg>>> {
        match self.open_as(id, false)? {
            Some(seg) if matches!(seg.backing, Backing::Wal(_)) => Ok(None),
            other => Ok(other),
        }
    }

    /// Sealed segment `id` if it is open here already (its object's
    /// bytes, final): found without a system call.
    pub(crate) fn open_sealed(&self, id: SegId) -> Option<Arc<RemoteSeg>> {
        self.segs.read().get(&id).filter(|s| matches!(s.backing, Backing::Object { .. })).cloned()
    }

    fn open_as(self: &Arc<Self>, id: SegId, wal: bool) -> Result<Option<Arc<RemoteSeg>>> {
        if let Some(s) = self.segs.read().get(&id) {
            return Ok(Some(s.clone()));
        }
        let _one = self.opening.lock();
        if let Some(s) = self.segs.read().get(&id) {
            return Ok(Some(s.clone()));
        }
        {
            // Taken back from `let_go` under `segs`, so an `adopt` or a
            // `remove` (which clear both under it) cannot put it back.
            let mut segs = self.segs.write();
            let held = self.let_go.lock().remove(&id).and_then(|seg| seg.upgrade());
            if let Some(seg) = held {
                self.bound_open(&mut segs);
                return Ok(Some(segs.entry(id).or_insert(seg).clone()));
            }
        }
        let key = segment_key(id);
        if let Some(footer) = self.kept_footer(id, &key) {
            let file = self.cache_file(id, &footer)?;
            return Ok(Some(self.insert_seg(id, footer, Backing::Object { file })));
        }
        let footer = match self.footer_from_local_peers(id, &key) {
            Some(footer) => footer,
            None => match self.read_footer(&key) {
                Ok(footer) => footer,
                Err(Error::NoSuchObject(_)) if !wal => return Ok(None),
                Err(Error::NoSuchObject(_)) => match self.open_wal(id)? {
                    Some(seg) => return Ok(Some(seg)),
                    // Gone, or sealed and uploaded between the two looks.
                    None => match self.read_footer(&key) {
                        Ok(footer) => footer,
                        Err(Error::NoSuchObject(_)) => return Ok(None),
                        Err(e) => return Err(e),
                    },
                },
                Err(e) => return Err(e),
            },
        };
        self.keep_footer(id, &footer);
        let file = self.cache_file(id, &footer)?;
        Ok(Some(self.insert_seg(id, footer, Backing::Object { file })))
    }

    /// Where the footer of sealed segment `id` is kept beside its cache
    /// file, so that a later process opens the segment without asking
    /// anyone (a segment object never changes and its name is never
    /// reused, so a footer once read from the bucket stays true). The
    /// folder is private to its owner, and nothing but a footer read from
    /// the bucket or written by this node is kept here.
    fn footer_path(&self, id: SegId) -> PathBuf {
        self.dir.join(format!("{}{FOOTER_SUFFIX}", id.file_name()))
    }

    /// The kept footer of segment `id`, if there is one and it passes its
    /// own check (its crc32c and lengths); one that does not is removed.
    fn kept_footer(&self, id: SegId, key: &str) -> Option<Footer> {
        if self.memory {
            return None;
        }
        let old = self.dir.join(format!("{}{OLD_FOOTER_SUFFIX}", id.file_name()));
        if fs::remove_file(&old).is_ok() {
            tracing::debug!(seg = %id, "removed a kept footer of an earlier build (it may have come from a cache server)");
        }
        let path = self.footer_path(id);
        let bytes = fs::read(&path).ok()?;
        match Footer::decode(&bytes, key) {
            Ok(footer) => {
                self.counts.kept_footers.inc();
                Some(footer)
            }
            Err(e) => {
                tracing::warn!(seg = %id, error = %e, "a kept segment footer failed its check; reading it again");
                let _ = fs::remove_file(&path);
                None
            }
        }
    }

    /// Keeps `footer` of segment `id` for later processes (see
    /// [`Remote::footer_path`]). Written aside and renamed into place, so a
    /// reader sees all of it or none; a footer that cannot be kept is read
    /// again next time, nothing worse.
    fn keep_footer(&self, id: SegId, footer: &Footer) {
        if self.memory {
            return;
        }
        let mut bytes = Vec::with_capacity(footer.encoded_len());
        footer.encode(&mut bytes);
        let path = self.footer_path(id);
        let aside = path.with_extension("bucket-footer-new");
        // Private to the cache's owner, as the cache files are.
        let kept = crate::private::create(&aside)
            .and_then(|mut f| std::io::Write::write_all(&mut f, &bytes))
            .and_then(|()| fs::rename(&aside, &path));
        if let Err(e) = kept {
            tracing::debug!(seg = %id, error = %e, "cannot keep a segment footer");
            let _ = fs::remove_file(&aside);
        }
    }

    /// The footer of sealed segment `id` from another cache of this
    /// process (whose footers came from the bucket, or from the segment's
    /// own writer here), checked (its own crc32c, its lengths). A cache
    /// server is never asked: every chunk it gives is checked against the
    /// footer, so a footer it gave would let it vouch for itself.
    fn footer_from_local_peers(&self, id: SegId, key: &str) -> Option<Footer> {
        let peers = self.peers.as_ref().filter(|p| p.is_local())?;
        let bytes = peers.fetch_footer(id)?;
        match Footer::decode(&bytes, key) {
            Ok(footer) => {
                self.counts.peer_footers.inc();
                Some(footer)
            }
            Err(e) => {
                tracing::warn!(seg = %id, error = %e, "a segment footer from this node's own cache failed its check; reading it from the bucket");
                peers.footer_rejected(id);
                None
            }
        }
    }

    /// The cache file of segment `id`, set up for `footer`: the chunks an
    /// earlier process left in it are taken in (checked on first read).
    fn cache_file(&self, id: SegId, footer: &Footer) -> Result<File> {
        let file = if self.memory {
            memory_file(&id.file_name())?
        } else {
            crate::private::options().read(true).write(true).create(true).truncate(false).open(self.path(id))?
        };
        if file.metadata()?.len() != footer.data_len {
            // A new cache file, or one from another life of this name: start empty.
            let _no_readers = self.chunks.exclusive();
            self.chunks.forget_segment(id);
            file.set_len(0)?;
            file.set_len(footer.data_len)?;
        } else {
            let present: Vec<PlacedChunk> = (0..footer.crcs.len())
                .filter_map(|i| {
                    let (s, e) = footer.chunk_range(i);
                    is_data(&file, s, e).then_some(((id, i as u32), (e - s) as u32, s))
                })
                .collect();
            self.add(&present, true);
        }
        Ok(file)
    }

    /// The footer of segment object `key`, read from the bucket: one GET
    /// of the object's tail (a suffix range) holds the whole footer of any
    /// segment up to 454 chunks (36 bytes each, crc32c and digest);
    /// larger ones take two.
    fn read_footer(&self, key: &str) -> Result<Footer> {
        let mut last = None;
        for _ in 0..GET_TRIES {
            let attempt = (|| {
                let (tail, size) = self.store.get_tail(key, FOOTER_GUESS)?;
                self.counts.bucket_footers.inc();
                if size < TRAILER_LEN as u64 {
                    return Err(Error::corrupted("segment object (too short)", key));
                }
                let guess = size.min(FOOTER_GUESS);
                if tail.len() as u64 != guess {
                    return Err(Error::corrupted("segment object footer (short read)", key));
                }
                let table = Footer::table_len(&tail[tail.len() - TRAILER_LEN..], size, key)? as u64;
                let need = table + TRAILER_LEN as u64;
                if need <= guess {
                    return Footer::decode(&tail[(guess - need) as usize..], key);
                }
                let whole = self.store.get_range(key, size - need..size)?;
                Footer::decode(&whole, key)
            })();
            match attempt {
                Err(e @ Error::Corrupted { .. }) => {
                    self.counts.checksum_retries.inc();
                    last = Some(e);
                }
                other => return other,
            }
        }
        Err(last.unwrap_or_else(|| Error::corrupted("segment object footer", key)))
    }

    /// A segment only its WAL pieces hold: its writer stopped before sealing it;
    /// `None` when it has no WAL pieces either. Called under `opening`.
    fn open_wal(self: &Arc<Self>, id: SegId) -> Result<Option<Arc<RemoteSeg>>> {
        let keys = self.store.list(&wal_prefix(id))?;
        if keys.is_empty() {
            return Ok(None);
        }
        let mut pieces: Vec<(u64, String)> = keys.into_iter().filter_map(|k| Some((wal_offset(&k)?, k))).collect();
        pieces.sort();
        let Some(bodies) = self.fetch_pieces(&pieces)? else { return Ok(None) };
        let mut data = Vec::new();
        for ((off, _), bytes) in pieces.iter().zip(bodies) {
            if *off != data.len() as u64 {
                // A gap: pieces after it are unusable, as a torn log tail is.
                tracing::warn!(%id, at = data.len(), "WAL pieces of a segment leave a gap; reading up to it");
                break;
            }
            data.extend_from_slice(&bytes);
        }
        let footer = Footer::of(&data, data.len().max(1) as u32);
        Ok(Some(self.insert_seg(id, footer, Backing::Wal(data))))
    }

    /// The verified bodies of WAL pieces `pieces`, fetched many at a time
    /// (a dead writer leaves one piece per fsync), in their order; `None`
    /// when one vanished since it was listed: its segment is in the bucket
    /// whole now (pieces are deleted only after that), so look there.
    fn fetch_pieces(&self, pieces: &[(u64, String)]) -> Result<Option<Vec<Vec<u8>>>> {
        let next = AtomicU64::new(0);
        // Per piece: not fetched yet, or its bytes, gone, or an error.
        type Slot = Mutex<Option<Result<Option<Vec<u8>>>>>;
        let slots: Vec<Slot> = pieces.iter().map(|_| Mutex::new(None)).collect();
        let fetch_one = |key: &str| -> Result<Option<Vec<u8>>> {
            for _ in 0..GET_TRIES {
                let body = match self.store.get(key) {
                    Ok((body, _)) => body,
                    Err(Error::NoSuchObject(_)) => return Ok(None),
                    Err(e) => return Err(e),
                };
                match split_verified(&body, key) {
                    Ok((bytes, _)) => return Ok(Some(bytes)),
                    Err(_) => {
                        self.counts.checksum_retries.inc();
                    }
                }
            }
            Err(Error::corrupted("WAL piece", key))
        };
        std::thread::scope(|s| {
            for _ in 0..pieces.len().min(PIECE_FETCHES) {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some((_, key)) = pieces.get(i) else { return };
                    let got = fetch_one(key);
                    let failed = !matches!(got, Ok(Some(_)));
                    *slots[i].lock() = Some(got);
                    if failed {
                        // No piece after this one can be used.
                        next.store(pieces.len() as u64, Ordering::Relaxed);
                    }
                });
            }
        });
        self.counts.wal_pieces_read.add(pieces.len() as u64);
        let mut bodies = Vec::with_capacity(pieces.len());
        for slot in slots {
            match slot.into_inner() {
                Some(Ok(Some(bytes))) => bodies.push(bytes),
                Some(Ok(None)) => return Ok(None),
                Some(Err(e)) => return Err(e),
                // Not fetched: a piece before it failed, handled above.
                None => break,
            }
        }
        Ok(Some(bodies))
    }

    /// The bytes of segment `id` if this process read it from its WAL
    /// pieces (its writer never sealed it).
    pub(crate) fn wal_bytes(&self, id: SegId) -> Option<Vec<u8>> {
        match &self.segs.read().get(&id)?.backing {
            Backing::Wal(data) => Some(data.clone()),
            Backing::Object { .. } => None,
        }
    }

    /// Forgets what this process read of segment `id` from its WAL pieces,
    /// so the next read opens the segment object.
    pub(crate) fn forget_wal(&self, id: SegId) {
        let mut segs = self.segs.write();
        if segs.get(&id).is_some_and(|s| matches!(s.backing, Backing::Wal(_))) {
            segs.remove(&id);
        }
    }

    /// Opens `stale` (a segment read from its WAL pieces) again, as the
    /// bucket holds it now: more pieces, or the sealed object.
    fn reopen(self: &Arc<Self>, stale: &RemoteSeg) -> Result<Option<Arc<RemoteSeg>>> {
        {
            let mut segs = self.segs.write();
            if segs.get(&stale.id).is_some_and(|s| std::ptr::eq(Arc::as_ptr(s), stale)) {
                segs.remove(&stale.id);
            }
        }
        Ok(self.open(stale.id)?.filter(|f| !std::ptr::eq(Arc::as_ptr(f), stale)))
    }

    /// Lets go of every open segment and stops the fetch workers (once
    /// their queue is empty). Segments hold the cache, so without this the
    /// two would keep each other, and the workers, alive.
    pub(crate) fn shutdown(&self) {
        self.fetches.stop_workers();
        self.segs.write().clear();
        self.let_go.lock().clear();
    }

    /// Forgets a deleted segment.
    pub(crate) fn remove(&self, id: SegId) {
        self.forget_handles(id);
        self.adopted.lock().remove(&id);
        let _x = self.chunks.exclusive();
        self.chunks.forget_segment(id);
        let _ = fs::remove_file(self.path(id));
        let _ = fs::remove_file(self.footer_path(id));
        let _ = fs::remove_file(self.dir.join(format!("{}{OLD_FOOTER_SUFFIX}", id.file_name())));
    }
}
