//! Reading segments that live in the bucket: ranged GETs of aligned
//! chunks, each verified against the object's footer before use, kept in
//! a local cache bounded by bytes and evicted least-recently-used first.
//!
//! A chunk's bytes live in a sparse file per segment under the cache
//! directory; an evicted chunk's bytes are punched out of it. Which chunks
//! are present is kept in memory, and rebuilt from the files' data extents
//! when a segment is first opened after a restart.

use super::object::{segment_key, split_verified, wal_offset, wal_prefix, Footer, TRAILER_LEN};
use crate::bucket::ObjectStore;
use crate::device::SegmentFile;
use crate::error::{Error, Result};
use crate::format::SegId;
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

type ChunkKey = (SegId, u32);

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

#[derive(Default)]
struct Lru {
    tick: u64,
    /// Present chunks: when each was last used, its length and offset,
    /// and whether its bytes were checked in this process.
    chunks: HashMap<ChunkKey, (u64, u32, u64, bool)>,
    bytes: u64,
}

/// Counters for `status` and the benchmarks.
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheStats {
    pub cached_bytes: u64,
    pub capacity: u64,
    pub gets: u64,
    pub fetched_bytes: u64,
    pub hits: u64,
    pub evicted_bytes: u64,
    pub checksum_retries: u64,
    /// WAL pieces read, for segments whose writers never sealed them.
    pub wal_pieces_read: u64,
}

pub(crate) struct Remote {
    store: Arc<dyn ObjectStore>,
    dir: PathBuf,
    capacity: u64,
    read_ahead: u64,
    parallel: usize,
    lru: Mutex<Lru>,
    /// Readers hold it shared from "is the chunk present" to the end of
    /// their pread; eviction holds it exclusively while it punches holes.
    evicting: RwLock<()>,
    inflight: Mutex<HashSet<ChunkKey>>,
    landed: Condvar,
    segs: RwLock<HashMap<SegId, Arc<RemoteSeg>>>,
    /// Read-ahead jobs for the fetch workers, started on first use.
    prefetch: Mutex<Option<crossbeam::channel::Sender<Run>>>,
    /// Chunks queued for read-ahead and not yet taken by a worker.
    queued: Mutex<HashSet<ChunkKey>>,
    /// Segments read-ahead looked for and did not find (it looks once).
    absent: Mutex<HashSet<SegId>>,
    /// The segment a streaming reader is about to enter, and its window.
    stream: Mutex<Option<(SegId, u64)>>,
    /// Segments this node wrote whose files became cached copies: reads
    /// through an older local handle go through the cache instead.
    adopted: Mutex<HashSet<SegId>>,
    /// One open at a time: two opens of one segment must not both set up
    /// its cache file.
    opening: Mutex<()>,
    gets: AtomicU64,
    fetched: AtomicU64,
    hits: AtomicU64,
    evicted: AtomicU64,
    retries: AtomicU64,
    /// WAL pieces fetched to read segments their writers never sealed.
    wal_pieces: AtomicU64,
}

enum Source {
    /// A sealed segment object, read chunk by chunk through the cache.
    Object { file: File },
    /// The WAL pieces of a segment that was never sealed: small, read whole.
    Wal(Vec<u8>),
}

pub(crate) struct RemoteSeg {
    remote: Arc<Remote>,
    id: SegId,
    key: String,
    footer: Footer,
    source: Source,
    /// End of the last read, to spot sequential readers.
    last_end: AtomicU64,
    /// The read-ahead window: the configured size after a random read,
    /// growing fourfold with each sequential one up to [`MAX_READ_AHEAD`].
    window: AtomicU64,
    me: Weak<RemoteSeg>,
}

/// Work for the fetch workers: a run of `count` chunks from `first`, to
/// fetch ahead of a reader with one GET.
struct Run {
    seg: Arc<RemoteSeg>,
    first: usize,
    count: usize,
}

fn punch(file: &File, off: u64, len: u64) {
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
fn is_data(file: &File, off: u64, end: u64) -> bool {
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

impl Remote {
    pub fn new(
        store: Arc<dyn ObjectStore>,
        dir: PathBuf,
        capacity: u64,
        read_ahead: u64,
        parallel: usize,
    ) -> Result<Arc<Remote>> {
        crate::private::create_dir_all(&dir)?;
        Ok(Arc::new(Remote {
            store,
            dir,
            capacity,
            read_ahead,
            parallel: parallel.max(1),
            lru: Mutex::new(Lru::default()),
            evicting: RwLock::new(()),
            inflight: Mutex::new(HashSet::new()),
            landed: Condvar::new(),
            segs: RwLock::new(HashMap::new()),
            prefetch: Mutex::new(None),
            queued: Mutex::new(HashSet::new()),
            absent: Mutex::new(HashSet::new()),
            stream: Mutex::new(None),
            adopted: Mutex::new(HashSet::new()),
            opening: Mutex::new(()),
            gets: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            wal_pieces: AtomicU64::new(0),
        }))
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            cached_bytes: self.lru.lock().bytes,
            capacity: self.capacity,
            gets: self.gets.load(Ordering::Relaxed),
            fetched_bytes: self.fetched.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            evicted_bytes: self.evicted.load(Ordering::Relaxed),
            checksum_retries: self.retries.load(Ordering::Relaxed),
            wal_pieces_read: self.wal_pieces.load(Ordering::Relaxed),
        }
    }

    fn path(&self, id: SegId) -> PathBuf {
        self.dir.join(id.file_name())
    }

    /// Whether chunk `key` is present and already checked in this process.
    fn verified(&self, key: ChunkKey) -> Option<bool> {
        self.lru.lock().chunks.get(&key).map(|e| e.3)
    }

    fn mark_verified(&self, key: ChunkKey) {
        if let Some(e) = self.lru.lock().chunks.get_mut(&key) {
            e.3 = true;
        }
    }

    /// Drops one chunk that failed its check.
    fn forget_chunk(&self, key: ChunkKey) {
        let mut lru = self.lru.lock();
        if let Some((_, len, _, _)) = lru.chunks.remove(&key) {
            lru.bytes -= len as u64;
        }
    }

    fn present(&self, key: ChunkKey) -> bool {
        self.lru.lock().chunks.contains_key(&key)
    }

    fn touch(&self, key: ChunkKey) {
        let mut lru = self.lru.lock();
        lru.tick += 1;
        let tick = lru.tick;
        if let Some(e) = lru.chunks.get_mut(&key) {
            e.0 = tick;
        }
    }

    /// Writes fetched chunks into `file` and marks them present, both while
    /// no eviction runs: an eviction that chose a chunk (before a reader
    /// fetched it again) must punch its hole before the fresh bytes land,
    /// never after.
    fn land(&self, file: &File, chunks: &[(ChunkKey, &[u8], u64)]) {
        let mut landed = Vec::with_capacity(chunks.len());
        {
            let _no_eviction = self.evicting.read();
            for &(key, bytes, off) in chunks {
                match file.write_all_at(bytes, off) {
                    Ok(()) => landed.push((key, bytes.len() as u32, off)),
                    Err(e) => tracing::warn!(error = %e, "cannot write a chunk to the cache; it stays uncached"),
                }
            }
            self.insert(&landed, false);
        }
        self.evict_if_over();
    }

    /// Marks chunks present; `old` chunks go to the cold end.
    fn insert(&self, keys: &[(ChunkKey, u32, u64)], old: bool) {
        let mut lru = self.lru.lock();
        for &(key, len, off) in keys {
            lru.tick += 1;
            let tick = if old { 0 } else { lru.tick };
            // Chunks found in a cache file from before (`old`) are checked
            // against the footer when first read: a crash may have left
            // a chunk half written, and a punched partial block reads as
            // zeros yet counts as data.
            if lru.chunks.insert(key, (tick, len, off, !old)).is_none() {
                lru.bytes += len as u64;
            }
        }
    }

    fn evict_if_over(&self) {
        let over = self.lru.lock().bytes > self.capacity;
        if over {
            self.evict();
        }
    }

    /// Marks chunks present, then evicts down to 90 % of the capacity if
    /// the cache grew past it. `old` chunks go to the cold end.
    fn add(&self, keys: impl IntoIterator<Item = (ChunkKey, u32, u64)>, old: bool) {
        let keys: Vec<_> = keys.into_iter().collect();
        self.insert(&keys, old);
        self.evict_if_over();
    }

    fn evict(&self) {
        let _x = self.evicting.write();
        let victims: Vec<(ChunkKey, u32, u64)> = {
            let mut lru = self.lru.lock();
            let target = self.capacity / 10 * 9;
            if lru.bytes <= self.capacity {
                return;
            }
            let mut all: Vec<(u64, ChunkKey, u32, u64)> =
                lru.chunks.iter().map(|(k, (t, l, o, _))| (*t, *k, *l, *o)).collect();
            all.sort_unstable();
            let mut out = Vec::new();
            for (_, key, len, off) in all {
                if lru.bytes <= target {
                    break;
                }
                lru.chunks.remove(&key);
                lru.bytes -= len as u64;
                out.push((key, len, off));
            }
            out
        };
        let mut by_seg: HashMap<SegId, Vec<(u32, u64)>> = HashMap::new();
        for ((seg, _), len, off) in victims {
            by_seg.entry(seg).or_default().push((len, off));
            self.evicted.fetch_add(len as u64, Ordering::Relaxed);
        }
        for (seg, chunks) in by_seg {
            let held = self.segs.read().get(&seg).cloned();
            let opened;
            let file = match held.as_deref().map(|s| &s.source) {
                Some(Source::Object { file }) => file,
                _ => match File::options().write(true).open(self.path(seg)) {
                    Ok(f) => {
                        opened = f;
                        &opened
                    }
                    Err(_) => continue,
                },
            };
            for (len, off) in chunks {
                punch(file, off, len as u64);
            }
        }
    }

    /// A segment this node wrote and has just uploaded: its file becomes
    /// the cached copy, every chunk present.
    /// Done while no read of the old local file is under way (they hold
    /// `evicting` shared), so none can see a hole punched later.
    pub fn adopt(self: &Arc<Self>, id: SegId, local: &std::path::Path, footer: Footer) -> Result<()> {
        {
            let _no_readers = self.evicting.write();
            let path = self.path(id);
            fs::rename(local, &path)?;
            self.adopted.lock().insert(id);
            let file = File::options().read(true).write(true).open(&path)?;
            let chunks: Vec<(ChunkKey, u32, u64)> = (0..footer.crcs.len())
                .map(|i| {
                    let (s, e) = footer.chunk_range(i);
                    ((id, i as u32), (e - s) as u32, s)
                })
                .collect();
            self.segs.write().remove(&id);
            self.insert_seg(id, footer, Source::Object { file });
            self.insert(&chunks, false);
        }
        self.evict_if_over();
        Ok(())
    }

    /// Reads `buf` at `off` of segment `id` through `local` (this node's
    /// file of it), unless the segment has since become a cached copy:
    /// then through the cache, which knows which chunks were evicted.
    pub fn read_local(self: &Arc<Self>, id: SegId, local: &dyn SegmentFile, buf: &mut [u8], off: u64) -> Result<()> {
        {
            let _no_eviction = self.evicting.read();
            if !self.adopted.lock().contains(&id) {
                return local.read_at(buf, off);
            }
        }
        let seg = self.open(id)?.ok_or_else(|| Error::corrupted("missing segment", id))?;
        seg.read_at(buf, off)
    }

    fn insert_seg(self: &Arc<Self>, id: SegId, footer: Footer, source: Source) -> Arc<RemoteSeg> {
        let seg = Arc::new_cyclic(|me| RemoteSeg {
            remote: self.clone(),
            id,
            key: segment_key(id),
            footer,
            source,
            last_end: AtomicU64::new(u64::MAX),
            window: AtomicU64::new(self.read_ahead),
            me: me.clone(),
        });
        let mut segs = self.segs.write();
        crate::device::bound_handles(&mut segs, MAX_OPEN);
        segs.entry(id).or_insert(seg).clone()
    }

    /// Opens segment `id` from the bucket, or `None` if it is not there.
    pub fn open(self: &Arc<Self>, id: SegId) -> Result<Option<Arc<RemoteSeg>>> {
        if let Some(s) = self.segs.read().get(&id) {
            return Ok(Some(s.clone()));
        }
        let _one = self.opening.lock();
        if let Some(s) = self.segs.read().get(&id) {
            return Ok(Some(s.clone()));
        }
        let key = segment_key(id);
        let size = match self.store.size(&key) {
            Ok(size) => size,
            Err(Error::NoSuchObject(_)) => match self.open_wal(id)? {
                Some(seg) => return Ok(Some(seg)),
                // Gone, or sealed and uploaded between the two looks.
                None => match self.store.size(&key) {
                    Ok(size) => size,
                    Err(Error::NoSuchObject(_)) => return Ok(None),
                    Err(e) => return Err(e),
                },
            },
            Err(e) => return Err(e),
        };
        let footer = self.read_footer(&key, size)?;
        let path = self.path(id);
        let file = crate::private::options().read(true).write(true).create(true).truncate(false).open(&path)?;
        if file.metadata()?.len() != footer.data_len {
            // A new cache file, or one from another life of this name: start empty.
            let _no_readers = self.evicting.write();
            self.forget_chunks(id);
            file.set_len(0)?;
            file.set_len(footer.data_len)?;
        } else {
            let present: Vec<(ChunkKey, u32, u64)> = (0..footer.crcs.len())
                .filter_map(|i| {
                    let (s, e) = footer.chunk_range(i);
                    is_data(&file, s, e).then_some(((id, i as u32), (e - s) as u32, s))
                })
                .collect();
            self.add(present, true);
        }
        Ok(Some(self.insert_seg(id, footer, Source::Object { file })))
    }

    fn read_footer(&self, key: &str, size: u64) -> Result<Footer> {
        let mut last = None;
        for _ in 0..GET_TRIES {
            let attempt = (|| {
                if size < TRAILER_LEN as u64 {
                    return Err(Error::corrupted("segment object (too short)", key));
                }
                // One GET of the object's tail holds the whole footer of any
                // segment up to FOOTER_GUESS / 4 chunks; larger ones take two.
                let guess = size.min(FOOTER_GUESS);
                let tail = self.store.get_range(key, size - guess..size)?;
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
                    self.retries.fetch_add(1, Ordering::Relaxed);
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
        Ok(Some(self.insert_seg(id, footer, Source::Wal(data))))
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
                        self.retries.fetch_add(1, Ordering::Relaxed);
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
        self.wal_pieces.fetch_add(pieces.len() as u64, Ordering::Relaxed);
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
    pub fn wal_bytes(&self, id: SegId) -> Option<Vec<u8>> {
        match &self.segs.read().get(&id)?.source {
            Source::Wal(data) => Some(data.clone()),
            Source::Object { .. } => None,
        }
    }

    /// Forgets what this process read of segment `id` from its WAL pieces,
    /// so the next read opens the segment object.
    pub fn forget_wal(&self, id: SegId) {
        let mut segs = self.segs.write();
        if segs.get(&id).is_some_and(|s| matches!(s.source, Source::Wal(_))) {
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
    pub fn shutdown(&self) {
        self.prefetch.lock().take();
        self.segs.write().clear();
    }

    /// Forgets a deleted segment.
    pub fn remove(&self, id: SegId) {
        self.segs.write().remove(&id);
        self.adopted.lock().remove(&id);
        let _x = self.evicting.write();
        self.forget_chunks(id);
        let _ = fs::remove_file(self.path(id));
    }

    fn forget_chunks(&self, id: SegId) {
        let mut lru = self.lru.lock();
        let keys: Vec<ChunkKey> = lru.chunks.keys().filter(|k| k.0 == id).copied().collect();
        for k in keys {
            if let Some((_, len, _, _)) = lru.chunks.remove(&k) {
                lru.bytes -= len as u64;
            }
        }
    }
}

impl RemoteSeg {
    /// The chunk after the last one holding bytes before `end`, rounded up
    /// to a whole run (so each worker GET is a large one).
    fn run_end(&self, end: u64) -> usize {
        (end.min(self.footer.data_len).div_ceil(self.chunk_size()) as usize)
            .next_multiple_of(RUN_CHUNKS)
            .min(self.footer.crcs.len())
    }

    fn chunk_size(&self) -> u64 {
        self.footer.chunk_size as u64
    }

    /// Fetches chunk `i` from the bucket unless it is present or another
    /// thread brings it; returns its bytes when this call fetched them.
    fn fetch(&self, i: usize) -> Result<Option<Vec<u8>>> {
        let Source::Object { file } = &self.source else { return Ok(None) };
        let r = &self.remote;
        let key = (self.id, i as u32);
        let mut run = 1;
        {
            let mut inflight = r.inflight.lock();
            // Bounded: a fetch ends in at most GET_TRIES retried calls.
            for _ in 0..10_000 {
                if r.present(key) {
                    return Ok(None);
                }
                if inflight.insert(key) {
                    break;
                }
                r.landed.wait_for(&mut inflight, Duration::from_millis(100));
            }
            // A reader that caught up with read-ahead takes the chunks
            // queued right after its own, for one larger GET.
            let mut queued = r.queued.lock();
            while run < RUN_CHUNKS && i + run < self.footer.crcs.len() {
                let next = (self.id, (i + run) as u32);
                if !queued.contains(&next) || r.present(next) || !inflight.insert(next) {
                    break;
                }
                queued.remove(&next);
                run += 1;
            }
        }
        if run > 1 {
            // Lands what passes its check; the caller reads it from the
            // cache (or comes back for a chunk that failed).
            self.fetch_claimed(&(i..i + run).collect::<Vec<_>>());
            return Ok(None);
        }
        let res = (|| {
            let (s, e) = self.footer.chunk_range(i);
            for attempt in 0..GET_TRIES {
                r.gets.fetch_add(1, Ordering::Relaxed);
                let bytes = r.store.get_range(&self.key, s..e)?;
                if self.footer.verify(i, &bytes) {
                    r.fetched.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    return Ok(bytes);
                }
                r.retries.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(seg = %self.id, chunk = i, attempt, got = bytes.len(), "chunk from the bucket failed its checksum; fetching again");
            }
            Err(Error::corrupted("segment chunk from the bucket", format!("{}#{i}", self.id)))
        })();
        if let Ok(bytes) = &res {
            r.land(file, &[(key, bytes, self.footer.chunk_range(i).0)]);
        }
        r.inflight.lock().remove(&key);
        r.landed.notify_all();
        res.map(Some)
    }

    /// Read-ahead: fetches chunks `first..first + count` (those no other
    /// thread has or brings) with one ranged GET, checking each chunk on
    /// its own. A chunk that fails its check is left for an on-demand fetch.
    fn fetch_run(&self, first: usize, count: usize) {
        let r = &self.remote;
        // Claim the chunks nobody else has or is fetching.
        let mut claimed = Vec::new();
        {
            let mut inflight = r.inflight.lock();
            for i in first..first + count {
                let key = (self.id, i as u32);
                if !r.present(key) && inflight.insert(key) {
                    claimed.push(i);
                }
            }
        }
        self.fetch_claimed(&claimed);
    }

    /// One GET from the first to the last of `claimed` (ascending chunk
    /// numbers the caller claimed in `inflight`); lands those that pass
    /// their check and releases the claims.
    fn fetch_claimed(&self, claimed: &[usize]) {
        let r = &self.remote;
        let (Some(&lo), Some(&hi)) = (claimed.first(), claimed.last()) else { return };
        if let Source::Object { file } = &self.source {
            let (start, _) = self.footer.chunk_range(lo);
            let (_, end) = self.footer.chunk_range(hi);
            r.gets.fetch_add(1, Ordering::Relaxed);
            match r.store.get_range(&self.key, start..end) {
                Ok(bytes) => {
                    let mut good = Vec::new();
                    for &i in claimed {
                        let (s, e) = self.footer.chunk_range(i);
                        match bytes.get((s - start) as usize..(e - start) as usize) {
                            Some(part) if self.footer.verify(i, part) => {
                                r.fetched.fetch_add(part.len() as u64, Ordering::Relaxed);
                                good.push(((self.id, i as u32), part, s));
                            }
                            _ => {
                                r.retries.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    // One large write per run: the page cache keeps it in
                    // large pages (a write per network piece would leave
                    // small ones, and re-reads from the cache run slower).
                    r.land(file, &good);
                }
                Err(e) => tracing::debug!(error = %e, "read-ahead GET failed; the reader fetches on demand"),
            }
        }
        let mut inflight = r.inflight.lock();
        for &i in claimed {
            inflight.remove(&(self.id, i as u32));
        }
        drop(inflight);
        r.landed.notify_all();
    }

    /// Fetches the missing chunks of `chunks`, up to `parallel` at a time.
    fn fetch_all(&self, chunks: &[usize]) -> Result<HashMap<usize, Vec<u8>>> {
        let missing: Vec<usize> =
            chunks.iter().copied().filter(|&i| !self.remote.present((self.id, i as u32))).collect();
        let mut got = HashMap::new();
        // Chunks already on their way (read-ahead) are waited for in turn:
        // threads only help where GETs are still to be sent.
        let unclaimed = {
            let inflight = self.remote.inflight.lock();
            missing.iter().filter(|&&i| !inflight.contains(&(self.id, i as u32))).count()
        };
        if unclaimed <= 1 {
            for &i in &missing {
                if let Some(b) = self.fetch(i)? {
                    got.insert(i, b);
                }
            }
            return Ok(got);
        }
        let next = AtomicU64::new(0);
        let results = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..self.remote.parallel.min(missing.len()) {
                s.spawn(|| loop {
                    let k = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some(&i) = missing.get(k) else { break };
                    let r = self.fetch(i);
                    let failed = r.is_err();
                    results.lock().push((i, r));
                    if failed {
                        break;
                    }
                });
            }
        });
        for (i, r) in results.into_inner() {
            if let Some(b) = r? {
                got.insert(i, b);
            }
        }
        Ok(got)
    }

    /// Keeps the `read_ahead` bytes after `end` coming: every chunk there
    /// that is neither present nor on its way is queued for the fetch
    /// workers, so a sequential reader finds a full pipeline of GETs ahead
    /// of it. Past the segment's end the window continues into the next
    /// segment of the same writer, where a file written in one go goes on.
    fn read_ahead(&self, end: u64, window: u64) {
        let r = &self.remote;
        if window == 0 {
            return;
        }
        let Some(me) = self.me.upgrade() else { return };
        let window_end = end + window;
        if end < self.footer.data_len {
            let first = (end / self.chunk_size()) as usize;
            r.enqueue_chunks(&me, first, self.run_end(window_end));
        }
        if !matches!(self.source, Source::Object { .. }) {
            return;
        }
        // Past this segment's end the window goes on through the writer's
        // next segments. The next one is opened as soon as a reader streams
        // through this one, so its footer is at hand before the reader is.
        let mut spill = window_end.saturating_sub(self.footer.data_len.max(end));
        let mut id = self.id;
        for _ in 0..SPILL_SEGMENTS {
            id = id.next();
            let known = r.segs.read().get(&id).cloned();
            match known {
                Some(seg) if matches!(seg.source, Source::Object { .. }) => {
                    r.enqueue_first(&seg, spill);
                    spill = spill.saturating_sub(seg.footer.data_len);
                    if spill == 0 {
                        break;
                    }
                }
                Some(_) => break,
                None => {
                    r.open_ahead(id, spill);
                    break;
                }
            }
        }
    }
}

impl Remote {
    /// Opens segment `id` (once) on a thread of its own, not behind the
    /// queued chunk fetches, then queues its first `spill` bytes.
    fn open_ahead(self: &Arc<Self>, id: SegId, spill: u64) {
        if !self.absent.lock().insert(id) {
            return;
        }
        let remote = self.clone();
        let spawned = std::thread::Builder::new().name("arbor-open".into()).spawn(move || {
            if let Ok(Some(seg)) = remote.open(id) {
                remote.absent.lock().remove(&id);
                remote.enqueue_first(&seg, spill);
            }
        });
        if let Err(e) = spawned {
            // Read-ahead stops at this segment's end; the reader opens the next itself.
            tracing::warn!(error = %e, "cannot start a thread to open the next segment");
            self.absent.lock().remove(&id);
        }
    }

    /// Queues the chunks holding the first `bytes` of `seg`, in whole runs.
    fn enqueue_first(self: &Arc<Self>, seg: &Arc<RemoteSeg>, bytes: u64) {
        self.enqueue_chunks(seg, 0, seg.run_end(bytes));
    }

    /// Queues chunks `first..last` of `seg` that are neither present, on
    /// their way nor queued, as jobs of up to [`RUN_CHUNKS`] neighbours
    /// (split at multiples of it), each fetched with one GET.
    fn enqueue_chunks(self: &Arc<Self>, seg: &Arc<RemoteSeg>, first: usize, last: usize) {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        {
            let inflight = self.inflight.lock();
            let mut queued = self.queued.lock();
            for i in first..last {
                let key = (seg.id, i as u32);
                if self.present(key) || inflight.contains(&key) || !queued.insert(key) {
                    continue;
                }
                match runs.last_mut() {
                    Some((s, n)) if *s + *n == i && i % RUN_CHUNKS != 0 => *n += 1,
                    _ => runs.push((i, 1)),
                }
            }
        }
        for (first, count) in runs {
            self.enqueue(Run { seg: seg.clone(), first, count });
        }
    }

    fn enqueue(self: &Arc<Self>, job: Run) {
        let mut tx = self.prefetch.lock();
        if tx.is_none() {
            let (send, recv) = crossbeam::channel::unbounded::<Run>();
            for n in 0..self.parallel {
                let recv = recv.clone();
                let spawned = std::thread::Builder::new().name(format!("arbor-fetch-{n}")).spawn(move || {
                    for Run { seg, first, count } in recv {
                        // Chunks a reader took for itself meanwhile are no
                        // longer queued; fetch_run skips them.
                        {
                            let mut queued = seg.remote.queued.lock();
                            for i in first..first + count {
                                queued.remove(&(seg.id, i as u32));
                            }
                        }
                        seg.fetch_run(first, count);
                    }
                });
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "cannot start a fetch worker");
                }
            }
            *tx = Some(send);
        }
        if let Some(tx) = tx.as_ref() {
            let _ = tx.send(job);
        }
    }
}

impl SegmentFile for RemoteSeg {
    fn write_at(&self, _buf: &[u8], _off: u64) -> Result<()> {
        Err(Error::ReadOnly)
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()> {
        let end = off + buf.len() as u64;
        if end > self.footer.data_len {
            if matches!(self.source, Source::Wal(_)) {
                // Read as its WAL pieces while its writer went on: the bytes
                // asked for came later. Look again, once.
                if let Some(fresh) = self.remote.reopen(self)? {
                    if end <= fresh.footer.data_len {
                        return fresh.read_at(buf, off);
                    }
                }
            }
            return Err(Error::corrupted("segment (short read)", off));
        }
        if buf.is_empty() {
            return Ok(());
        }
        let file = match &self.source {
            Source::Wal(data) => {
                buf.copy_from_slice(&data[off as usize..end as usize]);
                return Ok(());
            }
            Source::Object { file } => file,
        };
        let cs = self.chunk_size();
        let chunks: Vec<usize> = ((off / cs) as usize..=((end - 1) / cs) as usize).collect();
        let prev = self.last_end.swap(end, Ordering::Relaxed);
        // A reader that streamed to the end of the previous segment goes on
        // at the start of this one with the window it had there.
        let carried = if prev == u64::MAX && off < cs {
            let mut stream = self.remote.stream.lock();
            match *stream {
                Some((id, w)) if id == self.id => {
                    *stream = None;
                    Some(w)
                }
                _ => None,
            }
        } else {
            None
        };
        let base = self.remote.read_ahead;
        if let Some(w) = carried {
            self.window.store(w, Ordering::Relaxed);
            self.read_ahead(end, w);
        } else if prev != u64::MAX && off <= prev.saturating_add(cs) && end > prev {
            // Sequential: the window grows fast (x4 a read) to its largest.
            let w = self.window.load(Ordering::Relaxed);
            let grown = if base == 0 { 0 } else { (w * 4).clamp(base, MAX_READ_AHEAD.max(base)) };
            self.window.store(grown, Ordering::Relaxed);
            self.read_ahead(end, grown);
            if end + cs >= self.footer.data_len {
                *self.remote.stream.lock() = Some((self.id.next(), grown));
            }
        } else {
            self.window.store(base, Ordering::Relaxed);
        }
        let mut fetched = self.fetch_all(&chunks)?;
        for &i in &chunks {
            let (cstart, cend) = self.footer.chunk_range(i);
            let (from, to) = (off.max(cstart), end.min(cend));
            let dst = &mut buf[(from - off) as usize..(to - off) as usize];
            // Bounded: a chunk evicted between the fetch and the read is
            // fetched again, and kept in hand the second time.
            let mut filled = false;
            for _ in 0..GET_TRIES {
                if let Some(bytes) = fetched.get(&i) {
                    dst.copy_from_slice(&bytes[(from - cstart) as usize..(to - cstart) as usize]);
                    filled = true;
                    break;
                }
                {
                    let _x = self.remote.evicting.read();
                    let key = (self.id, i as u32);
                    match self.remote.verified(key) {
                        Some(true) => {
                            file.read_exact_at(dst, from)?;
                            self.remote.touch(key);
                            self.remote.hits.fetch_add(1, Ordering::Relaxed);
                            filled = true;
                            break;
                        }
                        Some(false) => {
                            // Cached by an earlier process: check it once.
                            let mut whole = vec![0u8; (cend - cstart) as usize];
                            file.read_exact_at(&mut whole, cstart)?;
                            if self.footer.verify(i, &whole) {
                                self.remote.mark_verified(key);
                                dst.copy_from_slice(&whole[(from - cstart) as usize..(to - cstart) as usize]);
                                self.remote.touch(key);
                                self.remote.hits.fetch_add(1, Ordering::Relaxed);
                                filled = true;
                                break;
                            }
                            tracing::debug!(seg = %self.id, chunk = i, "a cached chunk failed its check; fetching it again");
                            self.remote.forget_chunk(key);
                        }
                        None => {}
                    }
                }
                if let Some(b) = self.fetch(i)? {
                    fetched.insert(i, b);
                }
            }
            if !filled {
                return Err(Error::Io(std::io::Error::other(format!(
                    "chunk {i} of segment {} kept leaving the cache before it could be read; the cache is too small",
                    self.id
                ))));
            }
        }
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn size(&self) -> Result<u64> {
        Ok(self.footer.data_len)
    }

    /// The bucket's copy is immutable; a torn tail is cut by every reader
    /// the same way, so there is nothing to truncate.
    fn truncate(&self, _len: u64) -> Result<()> {
        Ok(())
    }
}
