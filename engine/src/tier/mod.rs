//! The bucket tier: a [`Device`] whose durable copy is an object store and
//! whose local directory is a cache.
//!
//! - The log writes segments into `<cache>/segments/` as on a local disk.
//!   A sealed segment (and the last one of a closed log) is uploaded whole,
//!   with a footer of chunk checksums, under `segments/` (multipart when
//!   large); then its file moves into the chunk cache, evictable.
//! - Durability [`Durability::Local`]: fsync is local; uploads run in the
//!   background. [`Durability::Bucket`]: fsync returns once every sealed
//!   segment is uploaded and the open segment's new bytes are in the bucket
//!   as a WAL piece (`wal/`), one PUT per group commit. WAL pieces of a
//!   segment are deleted once the segment itself is uploaded.
//! - A branch head is replaced only once the bucket holds every byte its
//!   commit needs (`Replica::publish_when_stored`), so a node with an
//!   empty cache can always open it.
//! - Segments not on this node are read from the bucket through
//!   `remote`: ranged GETs of aligned chunks, checksummed, cached,
//!   evicted least-recently-used first, fetched in parallel and ahead of
//!   sequential readers.
//! - While the bucket is unreachable, writes go on into the local log
//!   until `max_pending` bytes wait for upload, then block.

mod object;
mod remote;
mod serve;

pub use object::{
    chunk_digest, leaf_hashes, prove_part, segment_key, segment_of_key, wal_key, wal_prefix, Footer, LEAF,
};
pub use remote::CacheStats;
pub use serve::{SegmentCache, ServedChunk};

use crate::bucket::ObjectStore;
use crate::chunks::{ChunkRequest, ChunkSource, ChunkStore};
use crate::device::{Device, FileDevice, Replica, SegmentFile};
use crate::error::{Error, Result};
use crate::format::{Addr, SegId};
use crate::io::IoMode;
use parking_lot::{Condvar, Mutex};
use remote::Remote;
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// fsync is durable on the local disk; the bucket catches up.
    Local,
    /// fsync returns once the bytes are in the bucket.
    Bucket,
}

impl std::str::FromStr for Durability {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "local" => Ok(Durability::Local),
            "bucket" => Ok(Durability::Bucket),
            _ => Err(format!("durability must be local or bucket (got {s:?})")),
        }
    }
}

/// Bytes of segment data a mount's cache keeps by default.
pub const CACHE_SIZE: u64 = 10 << 30;
/// Bytes of chunks a memory-only cache keeps by default.
pub const CACHE_MEMORY: u64 = 2 << 30;
/// How far ahead of a sequential reader chunks are fetched, at first.
pub const READ_AHEAD: u64 = 4 << 20;

#[derive(Clone, Debug)]
pub struct TierConfig {
    pub durability: Durability,
    /// Bytes of uploaded and fetched segment data the cache keeps, with
    /// the chunk files of imported objects that share its chunk store.
    pub cache_size: u64,
    /// How far ahead of a sequential reader chunks are fetched.
    pub read_ahead: u64,
    /// The unit of ranged GETs, checksums and eviction.
    pub chunk_size: u32,
    /// Ranged GETs in flight for one large read.
    pub parallel_gets: usize,
    /// Bytes of sealed segments waiting for upload before writers block.
    pub max_pending: u64,
    /// How long close waits for uploads; `None` waits as long as it takes.
    pub drain_timeout: Option<Duration>,
    /// Delete the cache directory when the device is dropped (a command's
    /// short-lived cache, as opposed to a mount's).
    pub ephemeral: bool,
    pub io: IoMode,
    /// Cache servers asked for a chunk before the bucket.
    pub peers: Option<Arc<dyn ChunkSource>>,
    /// Keep fetched chunks in memory only (`cache_size` bytes of it),
    /// never on the cache folder's disk; for read-only opens.
    pub memory_cache: bool,
}

impl std::fmt::Debug for dyn ChunkSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChunkSource")
    }
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            durability: Durability::Local,
            cache_size: CACHE_SIZE,
            read_ahead: READ_AHEAD,
            chunk_size: 1 << 20,
            parallel_gets: 8,
            max_pending: 1 << 30,
            drain_timeout: None,
            ephemeral: false,
            io: IoMode::Auto,
            peers: None,
            memory_cache: false,
        }
    }
}

type PublishFn = Box<dyn Fn() -> Result<()> + Send>;

struct Publish {
    upto: Addr,
    /// Every segment sealed before this ticket must be uploaded first.
    need: u64,
    run: PublishFn,
}

#[derive(Default)]
struct Uploads {
    /// Sealed segments waiting for upload, oldest first, with their tickets.
    queue: VecDeque<(u64, SegId, u64)>,
    next_ticket: u64,
    /// Every ticket below this is uploaded.
    done_through: u64,
    queued_bytes: u64,
    /// Segments whose whole object is in the bucket.
    in_bucket: HashSet<SegId>,
    /// Bytes of open segments shipped as WAL pieces.
    shipped: HashMap<SegId, u64>,
    publish: Option<Publish>,
    /// A publish taken by the uploader and not finished yet.
    publishing: bool,
    /// Upload failures so far, and the newest one.
    failures: u64,
    last_error: Option<String>,
    /// Set when another writer replaced our branch head.
    fenced: Option<String>,
    stop: bool,
    uploaded_bytes: u64,
    wal_pieces: u64,
}

struct Shared {
    store: Arc<dyn ObjectStore>,
    local: Arc<FileDevice>,
    remote: Arc<Remote>,
    cfg: TierConfig,
    up: Mutex<Uploads>,
    changed: Condvar,
    /// Serialises WAL shipping, so pieces stay contiguous.
    ship_lock: Mutex<()>,
}

/// Upload counters for `status`.
#[derive(Clone, Debug, Default)]
pub struct TierStats {
    pub durability: Option<Durability>,
    pub pending_bytes: u64,
    pub queued_segments: usize,
    pub uploaded_bytes: u64,
    pub wal_pieces: u64,
    pub upload_failures: u64,
    pub last_error: Option<String>,
    pub cache: CacheStats,
}

pub struct BucketDevice {
    shared: Arc<Shared>,
    uploader: Mutex<Option<std::thread::JoinHandle<()>>>,
    cache_dir: PathBuf,
}

impl BucketDevice {
    /// Opens `cache_dir` (its only user until dropped) in front of `store`.
    /// Segments left in the cache by an earlier life that never reached the
    /// bucket are queued for upload; the uploads start with the first write.
    pub fn open(store: Arc<dyn ObjectStore>, cache_dir: &Path, cfg: TierConfig) -> Result<Arc<BucketDevice>> {
        let local = open_cache(&cache_dir.join(crate::layout::SEGMENT_DIR), cfg.io)?;
        let remote = Remote::new(
            store.clone(),
            cache_dir.join("chunks"),
            ChunkStore::new(cfg.cache_size),
            cfg.read_ahead,
            cfg.parallel_gets,
            cfg.memory_cache,
            cfg.peers.clone(),
        )?;
        let mut up = Uploads::default();
        for id in local.list_segments()? {
            let path = local.path_of(id);
            match store.size(&object::segment_key(id)) {
                Ok(_) => {
                    // Uploaded, but the move into the cache did not happen:
                    // kept if it is the object's data, else dropped.
                    if !remote.adopt_uploaded(id, &path) {
                        std::fs::remove_file(&path)?;
                    }
                    continue;
                }
                Err(Error::NoSuchObject(_)) => {}
                Err(e) => return Err(e),
            }
            let len = std::fs::metadata(&path)?.len();
            up.queue.push_back((up.next_ticket, id, len));
            up.next_ticket += 1;
            up.queued_bytes += len;
        }
        let shared = Arc::new(Shared {
            store,
            local,
            remote,
            cfg,
            up: Mutex::new(up),
            changed: Condvar::new(),
            ship_lock: Mutex::new(()),
        });
        Ok(Arc::new(BucketDevice { shared, uploader: Mutex::new(None), cache_dir: cache_dir.to_path_buf() }))
    }

    pub fn cache_dir_segments(&self) -> &Path {
        self.shared.local.dir()
    }

    /// Bytes of segment chunks in the cache now (cheap; `stats` also walks
    /// the local segments).
    pub fn cached_bytes(&self) -> u64 {
        self.shared.remote.stats().cached_bytes
    }

    /// The node's chunk store this tier keeps its segment chunks in (of
    /// `cache_size` bytes): imported objects' chunk files in the same
    /// cache folder go in it too ([`crate::chunks::ChunkFiles::open`]),
    /// one budget for both.
    pub fn chunk_store(&self) -> Arc<ChunkStore> {
        self.shared.remote.chunk_store().clone()
    }

    pub fn stats(&self) -> TierStats {
        let pending_bytes = self.pending_upload_bytes();
        let up = self.shared.up.lock();
        TierStats {
            durability: Some(self.shared.cfg.durability),
            pending_bytes,
            queued_segments: up.queue.len(),
            uploaded_bytes: up.uploaded_bytes,
            wal_pieces: up.wal_pieces,
            upload_failures: up.failures,
            last_error: up.last_error.clone(),
            cache: self.shared.remote.stats(),
        }
    }

    fn start_uploader(&self) -> Result<()> {
        let mut slot = self.uploader.lock();
        if slot.is_none() {
            let shared = self.shared.clone();
            let handle = std::thread::Builder::new()
                .name("arbor-upload".into())
                .spawn(move || shared.run_uploader())
                .map_err(Error::Io)?;
            *slot = Some(handle);
        }
        Ok(())
    }

    /// Waits until `done` says so, a failure newer than the start is
    /// reported, or this device is fenced.
    fn wait_for(&self, what: &str, done: impl Fn(&Uploads) -> bool, fail_fast: bool) -> Result<()> {
        self.start_uploader()?;
        let started = Instant::now();
        let mut up = self.shared.up.lock();
        let failures_before = up.failures;
        let mut last_note = Instant::now();
        loop {
            if let Some(why) = &up.fenced {
                return Err(Error::Fenced(why.clone()));
            }
            if done(&up) {
                return Ok(());
            }
            if fail_fast && up.failures > failures_before {
                let why = up.last_error.clone().unwrap_or_default();
                return Err(Error::Io(std::io::Error::other(format!("{what}: the bucket is unreachable: {why}"))));
            }
            if let Some(limit) = self.shared.cfg.drain_timeout {
                if started.elapsed() > limit {
                    let why = up.last_error.clone().unwrap_or_else(|| "uploads are slow".into());
                    return Err(Error::Io(std::io::Error::other(format!(
                        "{what}: {} bytes still waiting for the bucket after {limit:?}: {why}",
                        up.queued_bytes
                    ))));
                }
            }
            if last_note.elapsed() > Duration::from_secs(10) {
                tracing::warn!(what, queued = up.queued_bytes, error = ?up.last_error, "still waiting for the bucket");
                last_note = Instant::now();
            }
            self.shared.changed.wait_for(&mut up, Duration::from_millis(200));
        }
    }

    /// Everything sealed so far is uploaded and `upto` is in the bucket.
    fn store_through(&self, what: &str, upto: Addr, fail_fast: bool) -> Result<()> {
        let need = self.shared.up.lock().next_ticket;
        self.wait_for(what, |up| up.done_through >= need, fail_fast)?;
        self.shared.ship(upto)
    }
}

impl Shared {
    fn run_uploader(self: Arc<Self>) {
        enum Job {
            Upload(u64, SegId, u64),
            Publish(Publish),
        }
        loop {
            let job = {
                let mut up = self.up.lock();
                loop {
                    if up.stop {
                        return;
                    }
                    if let Some(&(t, id, len)) = up.queue.front() {
                        break Job::Upload(t, id, len);
                    }
                    let done = up.done_through;
                    if let Some(p) = up.publish.take_if(|p| done >= p.need) {
                        up.publishing = true;
                        break Job::Publish(p);
                    }
                    self.changed.wait_for(&mut up, Duration::from_secs(1));
                }
            };
            match job {
                Job::Upload(ticket, id, len) => match self.upload(id) {
                    Ok(bytes) => {
                        let mut up = self.up.lock();
                        up.queue.pop_front();
                        up.done_through = ticket + 1;
                        up.queued_bytes = up.queued_bytes.saturating_sub(len);
                        up.in_bucket.insert(id);
                        up.shipped.remove(&id);
                        up.uploaded_bytes += bytes;
                        drop(up);
                        self.changed.notify_all();
                    }
                    Err(e) => self.failed(&format!("uploading segment {id}"), e),
                },
                Job::Publish(p) => {
                    let upto = p.upto;
                    let shipped = self.ship(upto);
                    let outcome = match shipped {
                        Err(e) => Err((e, Some(p))),
                        Ok(()) => match (p.run)() {
                            Ok(()) => Ok(()),
                            Err(Error::Fenced(why)) => Err((Error::Fenced(why), None)),
                            Err(e) => Err((e, Some(p))),
                        },
                    };
                    self.up.lock().publishing = false;
                    match outcome {
                        Ok(()) => {
                            self.changed.notify_all();
                        }
                        Err((e, Some(p))) => {
                            // Try again later, unless a newer head replaced it.
                            self.up.lock().publish.get_or_insert(p);
                            self.failed("publishing a branch head", e);
                        }
                        Err((e, None)) => {
                            let why = match e {
                                Error::Fenced(why) => why,
                                e => e.to_string(),
                            };
                            tracing::error!(%why, "this writer was fenced off its branch; refusing further writes");
                            self.up.lock().fenced = Some(why);
                            self.changed.notify_all();
                        }
                    }
                }
            }
        }
    }

    fn failed(&self, what: &str, e: Error) {
        tracing::warn!(error = %e, "{what} failed; retrying");
        {
            let mut up = self.up.lock();
            up.failures += 1;
            up.last_error = Some(format!("{what}: {e}"));
        }
        self.changed.notify_all();
        // Backoff between rounds; the store retries each call itself too.
        let mut up = self.up.lock();
        if !up.stop {
            self.changed.wait_for(&mut up, Duration::from_millis(500));
        }
    }

    /// Uploads sealed segment `id` and moves its file into the cache.
    /// Deletes every WAL piece of segment `id`; returns how many there were.
    fn retire_wal(&self, id: SegId) -> Result<u64> {
        let pieces = self.store.list(&object::wal_prefix(id))?;
        for key in &pieces {
            self.store.delete(key)?;
        }
        Ok(pieces.len() as u64)
    }

    fn upload(&self, id: SegId) -> Result<u64> {
        let path = self.local.path_of(id);
        let body = std::fs::read(&path)?;
        let len = body.len() as u64;
        let (body, footer) = object::with_footer(body, self.cfg.chunk_size);
        self.store.put_large(&object::segment_key(id), &body)?;
        // The segment is in the bucket whole: its WAL pieces are spare.
        self.retire_wal(id)?;
        self.local.forget(id);
        self.remote.adopt(id, &path, footer)?;
        Ok(len)
    }

    /// Puts the bytes of `upto.seg` up to `upto.end()` that are not in the
    /// bucket yet there as one WAL piece.
    fn ship(&self, upto: Addr) -> Result<()> {
        let _one = self.ship_lock.lock();
        let end = upto.end();
        let from = {
            let up = self.up.lock();
            if up.in_bucket.contains(&upto.seg) {
                return Ok(());
            }
            up.shipped.get(&upto.seg).copied().unwrap_or(0)
        };
        if from >= end {
            return Ok(());
        }
        // Only segments this node writes are local before they are in the
        // bucket; any other segment got there before its commit was
        // published by the writer that made it.
        let Some(file) = self.local.open_segment(upto.seg)? else { return Ok(()) };
        let mut buf = vec![0u8; (end - from) as usize];
        self.remote.read_local(upto.seg, file.as_ref(), &mut buf, from)?;
        let (body, _) = object::with_footer(buf, self.cfg.chunk_size);
        self.store.put(&object::wal_key(upto.seg, from), &body)?;
        let mut up = self.up.lock();
        let shipped = up.shipped.entry(upto.seg).or_insert(0);
        *shipped = (*shipped).max(end);
        up.wal_pieces += 1;
        Ok(())
    }
}

/// A segment this node is writing or has not uploaded yet. Once uploaded,
/// its file becomes a cached copy whose chunks may be evicted; reads through
/// a handle taken before that go through the cache.
struct LocalSeg {
    id: SegId,
    file: Arc<dyn SegmentFile>,
    remote: Arc<Remote>,
}

impl SegmentFile for LocalSeg {
    fn write_at(&self, buf: &[u8], off: u64) -> Result<()> {
        self.file.write_at(buf, off)
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()> {
        self.remote.read_local(self.id, self.file.as_ref(), buf, off)
    }
    fn sync(&self) -> Result<()> {
        self.file.sync()
    }
    fn size(&self) -> Result<u64> {
        self.file.size()
    }
    fn truncate(&self, len: u64) -> Result<()> {
        self.file.truncate(len)
    }
    fn start_writeback(&self) {
        self.file.start_writeback()
    }
    fn sealed(&self) {
        self.file.sealed()
    }
}

impl Drop for BucketDevice {
    fn drop(&mut self) {
        self.shared.up.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(h) = self.uploader.lock().take() {
            // The uploader itself may drop the last handle (through a head
            // it was publishing); it then just ends its loop.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        self.shared.remote.shutdown();
        if self.shared.cfg.ephemeral {
            let _ = std::fs::remove_dir_all(&self.cache_dir);
        }
    }
}

/// The chunks a bucket device holds in its own cache (the segments this
/// node wrote and uploaded, and those it fetched), as a [`ChunkSource`]:
/// what `arbor serve --branch` serves of its own segments without asking
/// the bucket for bytes it has, also those kept from before a restart.
/// Never fetches a chunk (a kept segment whose footer was not kept costs
/// one footer read).
struct CachedHere {
    remote: std::sync::Weak<Remote>,
}

impl ChunkSource for CachedHere {
    fn fetch(&self, seg: SegId, wanted: &[ChunkRequest]) -> Vec<Option<Vec<u8>>> {
        let Some(r) = self.remote.upgrade() else { return vec![None; wanted.len()] };
        // Whole chunks, which the asking cache checks against the footer.
        wanted.iter().map(|w| r.held_chunk(seg, w.index)).collect()
    }
    fn rejected(&self, seg: SegId, index: u32) {
        tracing::warn!(seg = %seg, chunk = index, "a chunk of this node's own cache failed its checksum");
    }
    fn fetch_footer(&self, seg: SegId) -> Option<Vec<u8>> {
        self.remote.upgrade()?.cached_footer(seg)
    }
    fn is_local(&self) -> bool {
        true
    }
}

impl BucketDevice {
    /// This device's cached chunks as a source for another reader of the
    /// same bucket (a cache server in this process).
    pub fn cached_chunks(&self) -> Arc<dyn ChunkSource> {
        Arc::new(CachedHere { remote: Arc::downgrade(&self.shared.remote) })
    }
}

impl Device for BucketDevice {
    fn create_segment(&self, id: SegId) -> Result<Arc<dyn SegmentFile>> {
        self.start_uploader()?;
        let max = self.shared.cfg.max_pending;
        {
            let mut up = self.shared.up.lock();
            let mut waited = Instant::now();
            // Backpressure: while the bucket lags (or is unreachable), the
            // local log may hold `max_pending` bytes more than it; then
            // writers wait for the uploads.
            while up.queued_bytes > max && !up.stop {
                if waited.elapsed() > Duration::from_secs(10) {
                    tracing::warn!(queued = up.queued_bytes, error = ?up.last_error, "writes wait for the bucket");
                    waited = Instant::now();
                }
                self.shared.changed.wait_for(&mut up, Duration::from_millis(200));
            }
        }
        self.shared.local.create_segment(id)
    }

    fn open_segment(&self, id: SegId) -> Result<Option<Arc<dyn SegmentFile>>> {
        // A sealed segment read through the cache already: its object's
        // bytes are final, and no local file of it is looked for (a failed
        // open walks the path, once per read of a block: 5 % of a client
        // reading through a cache server).
        if let Some(s) = self.shared.remote.open_sealed(id) {
            return Ok(Some(s as Arc<dyn SegmentFile>));
        }
        if let Some(f) = self.shared.local.open_segment(id)? {
            return Ok(Some(Arc::new(LocalSeg { id, file: f, remote: self.shared.remote.clone() })));
        }
        Ok(self.shared.remote.open(id)?.map(|s| s as Arc<dyn SegmentFile>))
    }

    fn list_segments(&self) -> Result<Vec<SegId>> {
        let mut all: HashSet<SegId> = self.shared.local.list_segments()?.into_iter().collect();
        for prefix in [crate::layout::SEGMENTS, crate::layout::WAL] {
            all.extend(self.shared.store.list(prefix)?.iter().filter_map(|k| object::segment_of_key(k)));
        }
        let mut out: Vec<SegId> = all.into_iter().collect();
        out.sort();
        Ok(out)
    }

    fn remove_segment(&self, id: SegId) -> Result<()> {
        self.shared.local.remove_segment(id)?;
        self.shared.remote.remove(id);
        self.shared.store.delete(&object::segment_key(id))?;
        self.shared.retire_wal(id)?;
        let mut up = self.shared.up.lock();
        up.in_bucket.remove(&id);
        up.shipped.remove(&id);
        Ok(())
    }

    fn read_superblock(&self) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }

    fn write_superblock(&self, _sb: &crate::format::Superblock) -> Result<()> {
        Err(Error::Invalid("a bucket device keeps no superblock; branch heads live in the catalog"))
    }

    fn check_writable(&self) -> Result<()> {
        match &self.shared.up.lock().fenced {
            Some(why) => Err(Error::Fenced(why.clone())),
            None => Ok(()),
        }
    }

    fn direct_bytes(&self) -> u64 {
        self.shared.local.direct_bytes()
    }
    fn io_name(&self) -> &'static str {
        self.shared.local.io_name()
    }

    /// When the segment was last written: here, or else in the bucket
    /// (its object, or its newest WAL piece), so that gc on a node that
    /// never held a segment still gives a writer elsewhere its grace
    /// period. The bucket's time is the store's own `LastModified`.
    fn segment_modified(&self, id: SegId) -> Result<Option<std::time::SystemTime>> {
        if let Some(t) = self.shared.local.segment_modified(id)? {
            return Ok(Some(t));
        }
        self.bucket_modified(id)
    }

    /// The bucket's time, read as the `LastModified` of an empty object
    /// written now.
    /// Where the object cannot be written (a credential limited to the
    /// segments, say), this node's clock stands in, and the log says so.
    fn clocks(&self) -> Result<crate::device::Clocks> {
        let here = std::time::SystemTime::now();
        let key = crate::layout::CLOCK;
        if let Err(e) = self.shared.store.put(key, b"") {
            tracing::warn!(error = %e, "cannot read the bucket's clock (writing {key}); aging segments by this node's");
            return Ok(crate::device::Clocks { here, store: None });
        }
        let store = self.shared.store.list_objects(key)?.into_iter().find(|o| o.key == key).and_then(|o| o.modified);
        Ok(crate::device::Clocks { here, store })
    }

    /// A segment in this cache is aged by this node's clock; one only in
    /// the bucket by the bucket's.
    fn segment_age(&self, id: SegId, at: crate::device::Clocks) -> Result<Option<std::time::Duration>> {
        if let Some(t) = self.shared.local.segment_modified(id)? {
            return Ok(Some(at.here.duration_since(t).unwrap_or_default()));
        }
        let now = at.store.unwrap_or(at.here);
        Ok(self.bucket_modified(id)?.map(|m| now.duration_since(m).unwrap_or_default()))
    }

    fn free_bytes(&self) -> Option<u64> {
        self.shared.local.free_bytes()
    }

    fn replica(&self) -> Option<&dyn Replica> {
        Some(self)
    }
}

impl BucketDevice {
    /// When segment `id` was last written in the bucket (its object, or its
    /// newest WAL piece), by the bucket's clock.
    fn bucket_modified(&self, id: SegId) -> Result<Option<std::time::SystemTime>> {
        let mut newest = None;
        for prefix in [crate::layout::segment_key(id), crate::layout::wal_prefix(id)] {
            for o in self.shared.store.list_objects(&prefix)? {
                newest = newest.max(o.modified);
            }
        }
        Ok(newest)
    }
}

impl Replica for BucketDevice {
    fn seal_recovered(&self, segments: &[SegId]) -> Result<(u64, u64)> {
        let (mut sealed, mut deleted) = (0, 0);
        for &id in segments {
            // A segment in this cache is uploaded whole by the uploader,
            // which drops its pieces itself.
            if self.shared.local.open_segment(id)?.is_some() {
                continue;
            }
            let key = object::segment_key(id);
            if let Some(data) = self.shared.remote.wal_bytes(id) {
                let (body, _) = object::with_footer(data, self.shared.cfg.chunk_size);
                // Create-once: an upload by the segment's own writer (whole,
                // so a superset of these bytes) is never replaced.
                match self.shared.store.put_if_absent(&key, &body) {
                    Ok(_) => sealed += 1,
                    Err(Error::AlreadyExists(_)) => {}
                    Err(e) => return Err(e),
                }
                self.shared.remote.forget_wal(id);
            }
            match self.shared.store.size(&key) {
                Ok(_) => deleted += self.shared.retire_wal(id)?,
                Err(Error::NoSuchObject(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok((sealed, deleted))
    }

    fn segment_sealed(&self, id: SegId, len: u64) {
        let mut up = self.shared.up.lock();
        if up.in_bucket.contains(&id) || up.queue.iter().any(|q| q.1 == id) {
            return;
        }
        let ticket = up.next_ticket;
        up.next_ticket += 1;
        up.queue.push_back((ticket, id, len));
        up.queued_bytes += len;
        drop(up);
        self.shared.changed.notify_all();
    }

    fn fsync_reaches_bucket(&self) -> bool {
        self.shared.cfg.durability == Durability::Bucket
    }

    fn log_synced(&self, id: SegId, len: u64) -> Result<()> {
        if self.shared.cfg.durability != Durability::Bucket {
            return Ok(());
        }
        self.store_through("fsync", Addr { seg: id, off: 0, len: len as u32 }, true)
    }

    fn publish_when_stored(&self, upto: Addr, run: PublishFn) -> Result<()> {
        self.start_uploader()?;
        let mut up = self.shared.up.lock();
        if let Some(why) = &up.fenced {
            return Err(Error::Fenced(why.clone()));
        }
        let need = up.next_ticket;
        up.publish = Some(Publish { upto, need, run });
        drop(up);
        self.shared.changed.notify_all();
        Ok(())
    }

    fn flush_to_bucket(&self, upto: Addr) -> Result<()> {
        self.store_through("storing a commit in the bucket", upto, false)
    }

    fn drain(&self) -> Result<()> {
        self.wait_for("waiting for uploads", |up| up.queue.is_empty() && up.publish.is_none() && !up.publishing, false)
    }

    /// In the bucket as an object: uploaded by this device, or never
    /// written here (another writer's, or an earlier process's that
    /// recovery stored). A segment written here waits for its upload.
    fn segment_shared(&self, id: SegId) -> bool {
        self.shared.up.lock().in_bucket.contains(&id) || !self.shared.local.path_of(id).exists()
    }

    fn pending_upload_bytes(&self) -> u64 {
        let shipped: HashMap<SegId, u64> = self.shared.up.lock().shipped.clone();
        let ids = self.shared.local.list_segments().unwrap_or_default();
        ids.into_iter()
            .map(|id| {
                let len = std::fs::metadata(self.shared.local.path_of(id)).map_or(0, |m| m.len());
                len.saturating_sub(shipped.get(&id).copied().unwrap_or(0))
            })
            .sum()
    }
}

/// Opens the cache directory as its one user. A device of this process
/// that is still shutting down (its uploader finishing a call) is waited
/// for, briefly; another process holding it is an error at once.
fn open_cache(dir: &Path, io: IoMode) -> Result<Arc<FileDevice>> {
    let me = std::process::id().to_string();
    for _ in 0..100 {
        match FileDevice::open_exclusive(dir, io) {
            Err(Error::Busy(why)) if why.ends_with(&format!("pid {me}")) => {
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other,
        }
    }
    FileDevice::open_exclusive(dir, io)
}
