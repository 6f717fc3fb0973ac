//! Source objects: files whose bytes stay plain objects in a bucket.
//!
//! An imported file's extents are ranges of one object, named by the
//! file's `'S'` key ([`Source`]: bucket, key, size, ETag). Reads are ranged
//! GETs made conditional on that ETag, in aligned chunks kept in a memory
//! cache and fetched in parallel and ahead of a sequential reader: a
//! fixed window of `AHEAD` chunks (`chunks::ahead::Window`), its runs
//! fetched by the reader's pool of fetch workers (`chunks::ahead::Workers`),
//! while a run holding a chunk the read needs is fetched on the reader's
//! own thread, never behind read-ahead: a worker claims a run's chunks
//! only when it takes the run, so a chunk still queued is fetched by the
//! read that needs it. An object changed or deleted
//! since import fails the read with
//! [`Error::SourceChanged`] (EIO, and a log line naming the object): never
//! other bytes.
//!
//! With cache servers (`arbor serve`), a chunk is asked of its server
//! before the bucket: the server keeps it keyed by (bucket, key, ETag,
//! index), which names one version's bytes forever, so it needs no
//! invalidation either. A chunk the server does not give, or gives with
//! the wrong length, is read from the bucket. What a server gives is
//! checked against the bucket only where the bucket says something about
//! it: an object of one chunk whose ETag is the MD5 of its body (put in one
//! piece, without KMS) is checked whole. The chunks of larger objects, and
//! of objects whose ETag is no MD5 (multipart uploads, KMS, and every
//! object of a bucket seen to name other ETags), have no checksum in the
//! bucket: those are taken from the server on its word (its token).
//!
//! A mount (and a server) also keeps the chunks it fetched on local disk
//! ([`ChunkFiles`], in its cache folder, within the node's one chunk store
//! beside the segment chunks): memory, then disk, then the servers, then
//! the bucket. The chunk files are written by threads of their own, never
//! by a fetch, and with a bound on the chunks waiting for them (past it a
//! chunk is not kept). The caches themselves, and their eviction policy, live in
//! [`crate::chunks`].

use crate::bucket::{ObjectStore, RetryPolicy, S3Config};
use crate::chunks::ahead::{Job, Stream, Window, Workers};
use crate::chunks::fetch::{self, Claim, Fetch, InFlight};
use crate::chunks::{ChunkFiles, ChunkSource, MemoryChunks};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

pub use crate::format::Source;

/// Opens the bucket a source object lives in.
pub trait Sources: Send + Sync {
    fn store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>>;
}

/// S3 buckets reached with the AWS settings of the environment
/// ([`S3Config::from_env`]), each opened once, with `retries`.
#[derive(Default)]
pub struct S3Sources {
    retries: RetryPolicy,
    stores: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
}

impl S3Sources {
    pub fn new(retries: RetryPolicy) -> S3Sources {
        S3Sources { retries, stores: Mutex::default() }
    }
}

impl Sources for S3Sources {
    fn store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
        let mut stores = self.stores.lock();
        if let Some(s) = stores.get(bucket) {
            return Ok(s.clone());
        }
        let store = crate::bucket::open_s3(&S3Config::from_env(bucket, ""), self.retries.clone())?;
        stores.insert(bucket.to_string(), store.clone());
        Ok(store)
    }
}

/// Stores given by name: tests, and callers that opened them already.
#[derive(Default)]
pub struct FixedSources {
    stores: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
}

impl FixedSources {
    pub fn with(bucket: &str, store: Arc<dyn ObjectStore>) -> Arc<FixedSources> {
        let s = FixedSources::default();
        s.stores.lock().insert(bucket.to_string(), store);
        Arc::new(s)
    }
}

impl Sources for FixedSources {
    fn store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
        self.stores.lock().get(bucket).cloned().ok_or_else(|| Error::NoSuchObject(format!("s3://{bucket}")))
    }
}

/// The unit of source reads, caching and read-ahead.
pub const CHUNK: u64 = 1 << 20;
/// Chunks a volume keeps in memory (96 MiB): more than a reader's
/// read-ahead plus a run, so chunks fetched ahead are still there when the
/// reader comes. Eviction is in insertion order (`chunks::policy`), so
/// the chunks of one GET leave together and at most two bodies are held in
/// part: memory stays under 96 MiB plus two runs.
const CACHED_CHUNKS: usize = 96;
/// Chunks fetched ahead of a sequential reader, in the background (64 MiB,
/// as much as a plain parallel download of 8 MiB ranges, 8 in flight,
/// keeps; 16 ahead in runs of 4 reached 0.64× of it, 32 in runs of 8
/// 0.75–0.85×, 64 in runs of 8 0.88×).
const AHEAD: u64 = 64;
/// Consecutive chunks fetched by one GET at most.
const RUN: usize = 8;
/// Chunk fetches in flight or queued for read-ahead at most (a reader's
/// own misses always go).
const IN_FLIGHT: usize = 64;
/// Fetch workers for read-ahead at most: one per chunk that may be in
/// flight, as many GETs at once as a thread per run sent (a reader that
/// goes on a chunk per read claims runs of one chunk; streaming 1 GiB in
/// 1 MiB reads from a store taking 60 ms a GET ran at 690 MiB/s either way).
const FETCH_WORKERS: usize = IN_FLIGHT;
/// Threads writing fetched chunks to the chunk files: a write to the page
/// cache is much faster than a GET.
const FILE_WRITERS: usize = 2;
/// Chunks waiting to be written to the chunk files at most (as much
/// memory as the chunks in memory and in flight): past that, a fetch's
/// chunks are not kept.
const KEEPING: usize = 2 * IN_FLIGHT;

/// [`Source::id`], built once per read and shared by the ids of its chunks.
type ObjectId = Arc<str>;

/// (object, chunk index).
type ChunkId = (ObjectId, u64);

fn object_id(src: &Source) -> ObjectId {
    src.id().into()
}

/// A chunk's bytes: a range of one GET's body, shared by the chunks it held.
#[derive(Clone)]
struct Chunk {
    body: Arc<Vec<u8>>,
    start: usize,
    len: usize,
}

impl Chunk {
    fn bytes(&self) -> &[u8] {
        &self.body[self.start..self.start + self.len]
    }
}

/// What a chunk's fetch tells its waiters.
type Outcome = std::result::Result<Chunk, Failed>;

/// A chunk's fetch in flight (`chunks::fetch`).
type Pending = Fetch<Outcome>;

/// A failed fetch, for every waiter.
#[derive(Clone)]
enum Failed {
    Changed(String),
    Other(String),
}

impl From<Failed> for Error {
    fn from(f: Failed) -> Error {
        match f {
            Failed::Changed(m) => Error::SourceChanged(m),
            Failed::Other(m) => Error::Io(std::io::Error::other(m)),
        }
    }
}

crate::counters! {
    /// What a [`SourceReader`] counts, read as [`SourceStats`].
    struct SourceCounters;
    /// What a volume's reads of source objects did, for status.
    #[derive(Copy, PartialEq, Eq)]
    pub struct SourceStats {
        /// Ranged GETs sent, and the bytes they brought.
        gets: Counter,
        fetched_bytes: Counter,
        /// Chunks a read found in memory or already on their way.
        hits: Counter,
        /// Chunks a read had to fetch.
        misses: Counter,
        /// GETs refused because the object changed or is gone.
        changed: Counter,
        /// GETs that failed otherwise (after the store's retries).
        errors: Counter,
        /// Chunks cache servers gave (and so were not read from the bucket).
        from_servers: Counter,
        /// Chunks found in the local chunk files.
        from_disk: Counter,
        /// Of `from_servers`, those checked against the object's ETag (an
        /// object of one chunk with an MD5 ETag); the rest were taken unchecked.
        server_checked: Counter,
        /// Chunks a server gave that failed that check (read from the bucket).
        server_rejected: Counter,
    } and {
        /// The local chunk files: bytes held, the most the node's chunk
        /// store may hold (shared with the segment chunks of the same cache
        /// folder), and files that failed their checks.
        disk_bytes: u64,
        disk_capacity: u64,
        disk_damaged: u64,
    }
}

#[derive(Default)]
struct Counters {
    counts: SourceCounters,
    /// Buckets whose ETags were seen not to be the MD5 of the bytes.
    etags_not_md5: Mutex<std::collections::HashSet<String>>,
}

/// A reader of source objects: a volume's, or a cache server's.
pub struct SourceReader {
    sources: Arc<dyn Sources>,
    cache: Arc<Mutex<Table>>,
    counters: Arc<Counters>,
    /// How far ahead of a sequential reader to fetch, in bytes.
    ahead: Window,
    /// Cache servers asked for a chunk before the bucket.
    servers: Option<Arc<dyn ChunkSource>>,
    /// Chunks kept on local disk.
    files: Option<Arc<ChunkFiles>>,
    /// The workers read-ahead's runs go to (a reader's own misses are
    /// fetched on its thread), drained when the reader goes (so that what
    /// they fetched is on disk when its process ends).
    workers: Workers,
    /// Writes fetched chunks to `files`, if any.
    file_writer: Option<Arc<FileWriter>>,
}

impl Drop for SourceReader {
    fn drop(&mut self) {
        self.drain();
    }
}

impl std::fmt::Debug for SourceReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceReader").field("ahead", &self.ahead).field("stats", &self.stats()).finish()
    }
}

/// A reader's memory of chunks, and what it is doing.
struct Table {
    /// The chunks at hand.
    memory: MemoryChunks<ChunkId, Chunk>,
    /// Fetches in flight, under the same lock as `memory`: a chunk is
    /// at hand or on its way in one look.
    pending: InFlight<ChunkId, Outcome>,
    /// Chunks queued for read-ahead and not yet claimed: a fetch worker
    /// claims them when it takes their run, and a read that needs one
    /// first claims it itself (so no read waits for a worker).
    queued: HashSet<ChunkId>,
    /// Where the last read of each object ended, and its window, to see
    /// sequential readers.
    ends: HashMap<ObjectId, Stream>,
}

impl Table {
    fn new(capacity: usize) -> Table {
        Table {
            memory: MemoryChunks::new(capacity),
            pending: InFlight::new(),
            queued: HashSet::new(),
            ends: HashMap::new(),
        }
    }

    /// Claims chunk `i` of `object` if it is still queued for read-ahead
    /// (and so neither at hand nor on its way).
    fn claim_queued(&mut self, object: &ObjectId, i: u64) -> Option<(u64, Arc<Pending>)> {
        let id = (object.clone(), i);
        if !self.queued.remove(&id) || self.memory.get(&id).is_some() {
            return None;
        }
        match self.pending.join(id) {
            Claim::Mine(p) => Some((i, p)),
            Claim::Theirs(_) => None,
        }
    }
}

impl SourceReader {
    /// A volume's reader: a small cache in memory, read-ahead for
    /// sequential readers, then `files` and `servers` (if any) before the
    /// bucket.
    pub fn new(
        sources: Arc<dyn Sources>,
        servers: Option<Arc<dyn ChunkSource>>,
        files: Option<Arc<ChunkFiles>>,
    ) -> SourceReader {
        SourceReader {
            sources,
            cache: Arc::new(Mutex::new(Table::new(CACHED_CHUNKS))),
            counters: Arc::default(),
            ahead: Window::fixed(AHEAD * CHUNK),
            servers,
            file_writer: files.clone().map(FileWriter::new),
            files,
            workers: Workers::new("arbor-source", FETCH_WORKERS),
        }
    }

    /// A cache server's reader: `capacity` bytes of chunks in memory and
    /// no read-ahead (its clients read ahead, and each server is asked
    /// only for its own share of the chunks).
    /// Behind the memory, `files` (if any).
    pub fn serving(sources: Arc<dyn Sources>, capacity: u64, files: Option<Arc<ChunkFiles>>) -> SourceReader {
        SourceReader {
            sources,
            cache: Arc::new(Mutex::new(Table::new((capacity / CHUNK).max(1) as usize))),
            counters: Arc::default(),
            ahead: Window::fixed(0),
            servers: None,
            file_writer: files.clone().map(FileWriter::new),
            files,
            workers: Workers::new("arbor-source", FETCH_WORKERS),
        }
    }

    pub fn stats(&self) -> SourceStats {
        let now = self.counters.counts.snapshot();
        let Some(files) = &self.files else { return now };
        let disk = files.stats();
        SourceStats { disk_bytes: disk.bytes, disk_capacity: disk.capacity, disk_damaged: disk.damaged, ..now }
    }

    /// Waits for the fetches started so far (and their chunk files).
    pub fn drain(&self) {
        self.workers.drain();
        if let Some(writer) = &self.file_writer {
            writer.writers.drain();
        }
    }

    /// Chunk `index` of `src` (the last one may be short) and whether it
    /// was cached already: what a cache server answers.
    pub fn chunk(&self, src: &Source, index: u64) -> Result<(Vec<u8>, bool)> {
        let start = index.checked_mul(CHUNK).filter(|&s| s < src.size);
        let Some(start) = start else {
            return Err(Error::NoSuchObject(format!("{} has no chunk {index}", src.url())));
        };
        let (mut have, missed) = self.gather(src, start, (start + CHUNK).min(src.size))?;
        let (_, chunk) = have.pop().ok_or_else(|| Error::corrupted("a chunk went missing", src.url()))?;
        Ok((chunk.bytes().to_vec(), !missed))
    }

    /// Fills `dst` with the object's bytes from `off`. The range must lie
    /// inside the size recorded at import.
    pub fn read(&self, src: &Source, off: u64, dst: &mut [u8]) -> Result<()> {
        let end = off + dst.len() as u64;
        if end > src.size {
            return Err(Error::corrupted("external extent past its object's end", src.url()));
        }
        if dst.is_empty() {
            return Ok(());
        }
        let (have, _) = self.gather(src, off, end)?;
        for (i, chunk) in have {
            let chunk = chunk.bytes();
            let base = i * CHUNK;
            let (from, to) = (off.max(base), end.min(base + chunk.len() as u64));
            if from < to {
                dst[(from - off) as usize..(to - off) as usize]
                    .copy_from_slice(&chunk[(from - base) as usize..(to - base) as usize]);
            }
        }
        Ok(())
    }

    /// The chunks holding `off..end` (not empty, inside the object), and
    /// whether any of them had to be fetched; starts the read-ahead of a
    /// sequential reader.
    fn gather(&self, src: &Source, off: u64, end: u64) -> Result<(Vec<(u64, Chunk)>, bool)> {
        let (first, last) = (off / CHUNK, (end - 1) / CHUNK);
        let mut have: Vec<(u64, Chunk)> = Vec::new();
        let mut wait: Vec<(u64, Arc<Pending>)> = Vec::new();
        let object = object_id(src);
        let mut missed = false;
        let (mine, ahead) = {
            let mut c = self.cache.lock();
            if c.ends.len() > 4096 && !c.ends.contains_key(&object) {
                c.ends.clear();
            }
            let stream = c.ends.entry(object.clone()).or_insert_with(|| Stream::new(self.ahead.base));
            let ahead = stream.read(&self.ahead, off, end, || None).ahead();
            let ahead_end = (end + ahead).min(src.size);
            // Chunks to fetch: those this read needs, claimed, and those
            // ahead of it, queued.
            let mut start: Vec<(u64, Option<Arc<Pending>>)> = Vec::new();
            for i in first..=(ahead_end - 1) / CHUNK {
                let id = (object.clone(), i);
                if let Some(b) = c.memory.get(&id) {
                    if i <= last {
                        have.push((i, b.clone()));
                        self.counters.counts.hits.inc();
                    }
                } else if i <= last {
                    // Queued for read-ahead and not yet taken by a worker:
                    // this read fetches it, not waiting for a worker.
                    c.queued.remove(&id);
                    match c.pending.join(id) {
                        Claim::Theirs(p) => {
                            wait.push((i, p));
                            self.counters.counts.hits.inc();
                        }
                        Claim::Mine(p) => {
                            wait.push((i, p.clone()));
                            self.counters.counts.misses.inc();
                            missed = true;
                            start.push((i, Some(p)));
                        }
                    }
                } else if c.pending.len() + c.queued.len() < IN_FLIGHT
                    && !c.pending.contains(&id)
                    && c.queued.insert(id)
                {
                    start.push((i, None));
                }
            }
            // Consecutive chunks go in one GET, up to RUN of them: fewer,
            // larger requests for a streaming reader. A run holding a chunk
            // this read needs starts at once, its other chunks claimed with
            // it; runs fetched only ahead go to the workers.
            let (mut mine, mut ahead) = (Vec::new(), Vec::new());
            for run in fetch::runs(start, RUN, false) {
                if run.iter().all(|(_, p)| p.is_none()) {
                    ahead.push(run.into_iter().map(|(i, _)| i).collect::<Vec<u64>>());
                    continue;
                }
                let claimed =
                    run.into_iter().filter_map(|(i, p)| p.map(|p| (i, p)).or_else(|| c.claim_queued(&object, i)));
                mine.push(claimed.collect::<Vec<_>>());
            }
            (mine, ahead)
        };
        // Runs no worker can take are fetched here, after this read's own.
        let later: Vec<Job> = ahead.into_iter().filter_map(|run| self.fetch_ahead(src, &object, run)).collect();
        self.fetch_now(src, &object, mine);
        for job in later {
            self.workers.run_here(job);
        }
        for (i, p) in wait {
            have.push((i, p.wait()?));
        }
        Ok((have, missed))
    }

    /// Fetches `runs`, each holding a chunk the caller needs, at once and
    /// never behind read-ahead: the first on the caller's thread, any
    /// others on threads of their own, all finished when this returns.
    /// What they fetched is written to the chunk files by the file writer,
    /// after the caller has its bytes.
    fn fetch_now(&self, src: &Source, object: &ObjectId, runs: Vec<Vec<(u64, Arc<Pending>)>>) {
        let fetch = self.fetcher(src.clone(), object.clone());
        let fetch = &fetch;
        let mut jobs = runs.into_iter().map(|run| move || fetch(run));
        let Some(first) = jobs.next() else { return };
        let others: Vec<Mutex<Option<_>>> = jobs.map(|job| Mutex::new(Some(job))).collect();
        let fetched = Mutex::new(Vec::new());
        fn take_and_run<J: FnOnce() -> Keep>(slot: &Mutex<Option<J>>, fetched: &Mutex<Vec<Keep>>) {
            let job = slot.lock().take();
            if let Some(job) = job {
                let kept = job();
                fetched.lock().push(kept);
            }
        }
        let first = Mutex::new(Some(first));
        let run = |slot| take_and_run(slot, &fetched);
        std::thread::scope(|s| {
            for slot in &others {
                let spawned = std::thread::Builder::new().name("arbor-source".into()).spawn_scoped(s, || run(slot));
                if spawned.is_err() {
                    // Not started: fetched here instead.
                    run(slot);
                }
            }
            run(&first);
        });
        if let Some(writer) = &self.file_writer {
            for kept in fetched.into_inner() {
                writer.keep(object, kept);
            }
        }
    }

    /// Has a fetch worker fetch `run`, consecutive chunks queued for
    /// read-ahead, and keep them in the chunk files. The worker claims
    /// the chunks when it takes the job, those still queued: a chunk a
    /// read needed meanwhile was fetched by that read. A job no worker can
    /// take is given back, for the caller to run after its own fetches.
    #[must_use]
    fn fetch_ahead(&self, src: &Source, object: &ObjectId, run: Vec<u64>) -> Option<Job> {
        let fetch = self.fetcher(src.clone(), object.clone());
        let (cache, object, writer) = (self.cache.clone(), object.clone(), self.file_writer.clone());
        self.workers.offer(Box::new(move || {
            let claimed: Vec<_> = {
                let mut c = cache.lock();
                run.iter().filter_map(|&i| c.claim_queued(&object, i)).collect()
            };
            // Every claim is finished before the chunks go to the file writer.
            let kept: Vec<Keep> = fetch::runs(claimed, RUN, false).into_iter().map(&fetch).collect();
            if let Some(writer) = &writer {
                for kept in kept {
                    writer.keep(&object, kept);
                }
            }
        }))
    }

    /// The fetch of a run of consecutive chunks of `object` the caller
    /// claimed: from the local chunk files, the cache servers, then the
    /// bucket (one GET for the rest), each where the one before had
    /// nothing. Their waiters wake when they are cached (or failed), a
    /// panic anywhere included. It returns what it fetched from the
    /// servers and the bucket, for the chunk files.
    fn fetcher(
        &self,
        src: Source,
        object: ObjectId,
    ) -> impl Fn(Vec<(u64, Arc<Pending>)>) -> Keep + Send + Sync + 'static {
        let sources = self.sources.clone();
        let cache = self.cache.clone();
        let counters = self.counters.clone();
        let (servers, files) = (self.servers.clone(), self.files.clone());
        move |run| {
            let fetch = std::panic::AssertUnwindSafe(|| {
                let mut kept = Vec::new();
                // Waiters sleep until every chunk is finished: a panic in
                // a tier or the store must finish them too.
                let tiers = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut rest: Vec<&(u64, Arc<Pending>)> = run.iter().collect();
                    if let Some(files) = &files {
                        rest = from_files(files, &object, rest, &cache, &counters);
                    }
                    if let Some(servers) = servers.as_ref().filter(|_| !rest.is_empty()) {
                        rest = from_servers(&**servers, &src, &object, rest, &cache, &counters, &mut kept);
                    }
                    rest
                }));
                let rest = tiers.unwrap_or_else(|_| run.iter().collect());
                let (Some((first, _)), Some((last, _))) = (rest.first(), rest.last()) else { return kept };
                let range = first * CHUNK..((last + 1) * CHUNK).min(src.size);
                let want = range.end - range.start;
                // The bucket is opened only when it is needed: a node with
                // every chunk on disk or on its servers reads without it.
                let fetched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    sources.store(&src.bucket)?.get_range_if(&src.key, range, &src.etag, src.version.as_deref())
                }))
                .unwrap_or_else(|_| Err(Error::Io(std::io::Error::other("a source fetch panicked"))));
                counters.counts.gets.inc();
                let (counter, n) = match &fetched {
                    Ok(b) => (&counters.counts.fetched_bytes, b.len() as u64),
                    Err(Error::PreconditionFailed(_) | Error::NoSuchObject(_)) => (&counters.counts.changed, 1),
                    Err(_) => (&counters.counts.errors, 1),
                };
                counter.add(n);
                let got = match fetched {
                    Ok(b) if b.len() as u64 == want => Ok(b),
                    Ok(_) => Err(changed(&src, Error::PreconditionFailed(src.key.clone()))),
                    Err(e) => Err(changed(&src, e)),
                };
                match got {
                    Ok(bytes) => {
                        if *first == 0 && bytes.len() as u64 == src.size && src.size <= CHUNK {
                            counters.learn_etags(&src, &bytes);
                        }
                        let body = Arc::new(bytes);
                        for (i, p) in rest {
                            let start = ((i - first) * CHUNK) as usize;
                            let len = (body.len() - start).min(CHUNK as usize);
                            let chunk = Chunk { body: body.clone(), start, len };
                            finish(&cache, &object, *i, p, Ok(chunk.clone()));
                            kept.push((*i, chunk));
                        }
                    }
                    Err(e) => {
                        let f = match e {
                            Error::SourceChanged(m) => Failed::Changed(m),
                            e => Failed::Other(format!("{}: {e}", src.url())),
                        };
                        for (i, p) in rest {
                            finish(&cache, &object, *i, p, Err(f.clone()));
                        }
                    }
                }
                kept
            });
            std::panic::catch_unwind(fetch).unwrap_or_else(|_| {
                // Chunks finished already keep their outcome.
                for (i, p) in &run {
                    finish(
                        &cache,
                        &object,
                        *i,
                        p,
                        Err(Failed::Other(format!("{}: a source fetch panicked", src.url()))),
                    );
                }
                Vec::new()
            })
        }
    }
}

/// Chunks a fetch brought from the servers or the bucket, for the chunk
/// files.
type Keep = Vec<(u64, Chunk)>;

/// Writes what fetches brought to the chunk files, once their readers
/// have them, on threads of its own: no fetch waits for a disk. A chunk
/// file is only a cache: past [`KEEPING`] chunks waiting, a fetch's
/// chunks are not kept.
struct FileWriter {
    files: Arc<ChunkFiles>,
    writers: Workers,
    /// Chunks handed to `writers` and not yet written.
    waiting: AtomicUsize,
}

impl FileWriter {
    fn new(files: Arc<ChunkFiles>) -> Arc<FileWriter> {
        Arc::new(FileWriter { files, writers: Workers::new("arbor-keep", FILE_WRITERS), waiting: AtomicUsize::new(0) })
    }

    /// Keeps `kept` of `object` on local disk, unless too many chunks wait.
    fn keep(self: &Arc<Self>, object: &ObjectId, kept: Keep) {
        let n = kept.len();
        if n == 0 {
            return;
        }
        if self.waiting.fetch_add(n, Ordering::AcqRel) + n > KEEPING {
            self.waiting.fetch_sub(n, Ordering::AcqRel);
            tracing::debug!(object = %object, chunks = n, "the chunk files are behind; these chunks are not kept");
            return;
        }
        let (me, object) = (self.clone(), object.clone());
        self.writers.submit(Box::new(move || {
            let _written = Written(&me.waiting, n);
            for (i, chunk) in kept {
                me.files.put(&object, i, chunk.bytes());
            }
        }));
    }
}

/// Counts `n` chunks no longer waiting in `waiting` when dropped (a
/// write that panics included).
struct Written<'a>(&'a AtomicUsize, usize);

impl Drop for Written<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

/// Finishes the chunks of `run` the local files have; the rest.
fn from_files<'a>(
    files: &ChunkFiles,
    object: &ObjectId,
    run: Vec<&'a (u64, Arc<Pending>)>,
    cache: &Mutex<Table>,
    counters: &Counters,
) -> Vec<&'a (u64, Arc<Pending>)> {
    let mut rest = Vec::new();
    for entry in run {
        let (i, p) = entry;
        match files.get(object, *i) {
            Some(found) => {
                counters.counts.from_disk.inc();
                let (file, start) = found.into_parts();
                let len = file.len() - start;
                finish(cache, object, *i, p, Ok(Chunk { body: Arc::new(file), start, len }));
            }
            None => rest.push(entry),
        }
    }
    rest
}

/// The length of chunk `i` of an object of `size` bytes.
fn chunk_len(size: u64, i: u64) -> u64 {
    size.saturating_sub(i * CHUNK).min(CHUNK)
}

/// Asks `servers` for the chunks of `run` and finishes those given whole
/// (and adds them to `keep`, for the chunk files); the rest, still to be
/// read from the bucket.
fn from_servers<'a>(
    servers: &dyn ChunkSource,
    src: &Source,
    object: &ObjectId,
    run: Vec<&'a (u64, Arc<Pending>)>,
    cache: &Mutex<Table>,
    counters: &Counters,
    keep: &mut Keep,
) -> Vec<&'a (u64, Arc<Pending>)> {
    let wanted: Vec<u64> = run.iter().map(|(i, _)| *i).collect();
    let mut given = servers.fetch_object(src, &wanted).into_iter();
    let mut rest = Vec::new();
    for entry in run {
        let (i, p) = entry;
        match given.next().flatten() {
            Some(bytes) if bytes.len() as u64 == chunk_len(src.size, *i) => {
                match counters.etag_check(src, &bytes) {
                    Some(false) => {
                        tracing::warn!(object = %src.url(), chunk = i, "an object from a cache server is not what its ETag names; reading it from the bucket");
                        counters.counts.server_rejected.inc();
                        servers.object_rejected(src, *i);
                        rest.push(entry);
                        continue;
                    }
                    Some(true) => {
                        counters.counts.server_checked.inc();
                    }
                    None => {}
                }
                counters.counts.from_servers.inc();
                let chunk = Chunk { start: 0, len: bytes.len(), body: Arc::new(bytes) };
                finish(cache, object, *i, p, Ok(chunk.clone()));
                keep.push((*i, chunk));
            }
            Some(_) => {
                servers.object_rejected(src, *i);
                rest.push(entry);
            }
            None => rest.push(entry),
        }
    }
    rest
}

/// The MD5 an ETag names: 32 hex digits (quoted or not), as S3 gives for an
/// object put in one piece without KMS; `None` for any other ETag.
fn etag_md5(etag: &str) -> Option<[u8; 16]> {
    let hex = etag.trim_matches('"');
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn md5(bytes: &[u8]) -> [u8; 16] {
    use md5::Digest;
    md5::Md5::digest(bytes).into()
}

impl Counters {
    /// Checks `body`, all of `src` as a cache server gave it, against the
    /// bucket's ETag: `Some(true)` if it is the MD5 the ETag names,
    /// `Some(false)` if not, `None` where the ETag says nothing (an object
    /// of more than one chunk, an ETag that is no MD5, a bucket seen to name
    /// other ETags).
    fn etag_check(&self, src: &Source, body: &[u8]) -> Option<bool> {
        if src.size > CHUNK || body.len() as u64 != src.size || self.etags_not_md5.lock().contains(&src.bucket) {
            return None;
        }
        let want = etag_md5(&src.etag)?;
        Some(md5(body) == want)
    }

    /// `body`, all of `src` as the bucket gave it (a GET conditional on its
    /// ETag): if it is not the MD5 its ETag names, that bucket's ETags are
    /// something else (KMS, another store) and say nothing of a server's copy.
    fn learn_etags(&self, src: &Source, body: &[u8]) {
        if etag_md5(&src.etag).is_some_and(|want| md5(body) != want)
            && self.etags_not_md5.lock().insert(src.bucket.clone())
        {
            tracing::info!(bucket = %src.bucket, "this bucket's ETags are not MD5s of the bytes: objects from cache servers are taken unchecked");
        }
    }
}

/// Records a fetch's result: cached if it worked, then its waiters woken.
/// A fetch finished already (a panic finishes every chunk of its run)
/// keeps its first outcome and leaves a later fetch of the chunk alone;
/// one whose claim ended with no outcome told (a panic in between) is
/// told this one.
fn finish(cache: &Mutex<Table>, object: &ObjectId, i: u64, p: &Pending, got: Outcome) {
    {
        let mut c = cache.lock();
        let id = (object.clone(), i);
        if !c.pending.finish_fetch(&id, p) {
            drop(c);
            p.done_if_unset(got);
            return;
        }
        if let Ok(b) = &got {
            c.memory.insert(id, b.clone());
        }
    }
    p.done(got);
}

/// A failed conditional read: the object is not what was imported.
fn changed(src: &Source, e: Error) -> Error {
    match e {
        Error::PreconditionFailed(_) | Error::NoSuchObject(_) => {
            let why = if matches!(e, Error::NoSuchObject(_)) { "deleted" } else { "changed" };
            tracing::error!(object = %src.url(), etag = %src.etag, version = src.version.as_deref().unwrap_or("-"), "source object {why} since import; its file reads fail");
            Error::SourceChanged(format!("{} ({why} since import)", src.url()))
        }
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::MemObjectStore;
    use parking_lot::Condvar;
    use std::time::{Duration, Instant};

    /// What holds up a store's conditional GETs of `gated` from its third
    /// chunk on (up to `through_from`) until the gate opens (read-ahead of
    /// a streaming reader's object); every other call goes through.
    struct Gate {
        gated: &'static str,
        /// Where GETs go through the gate again.
        through_from: std::sync::atomic::AtomicU64,
        /// Open, and GETs waiting at the gate.
        gate: Mutex<(bool, usize)>,
        cv: Condvar,
        /// Those GETs panic instead of waiting.
        panics: std::sync::atomic::AtomicBool,
        /// Where each conditional GET of `gated` started, in turn.
        starts: Mutex<Vec<u64>>,
    }

    type GatedStore = crate::bucket::Watched<Gate>;

    impl crate::bucket::BeforeGet for Gate {
        fn before_get(&self, key: &str, range: &std::ops::Range<u64>, conditional: bool) {
            if !conditional || key != self.gated {
                return;
            }
            self.starts.lock().push(range.start / CHUNK);
            let through_from = self.through_from.load(std::sync::atomic::Ordering::SeqCst);
            if range.start >= 2 * CHUNK && range.start < through_from {
                if self.panics.load(std::sync::atomic::Ordering::SeqCst) {
                    panic!("a GET panics");
                }
                let mut gate = self.gate.lock();
                gate.1 += 1;
                self.cv.notify_all();
                while !gate.0 {
                    self.cv.wait(&mut gate);
                }
            }
        }
    }

    impl GatedStore {
        fn new(gated: &'static str) -> Arc<GatedStore> {
            let gate = Gate {
                gated,
                through_from: u64::MAX.into(),
                gate: Mutex::new((false, 0)),
                cv: Condvar::new(),
                panics: false.into(),
                starts: Mutex::default(),
            };
            Arc::new(crate::bucket::Watched { inner: MemObjectStore::new(), watch: gate })
        }

        fn source(&self, key: &str, body: &[u8]) -> Source {
            let etag = self.put(key, body).expect("put");
            Source { bucket: "b".into(), key: key.into(), size: body.len() as u64, etag, version: None }
        }

        fn open(&self) {
            self.gate.lock().0 = true;
            self.cv.notify_all();
        }

        /// Waits (bounded) until `n` GETs wait at the gate.
        fn waiting(&self, n: usize) -> bool {
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut gate = self.gate.lock();
            while gate.1 < n {
                if self.cv.wait_until(&mut gate, deadline).timed_out() {
                    return false;
                }
            }
            true
        }
    }

    fn body(len: u64, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 20) as u8).collect()
    }

    #[test]
    fn a_read_is_not_held_up_by_a_full_read_ahead_queue() {
        let store = GatedStore::new("stream");
        let (stream_body, other_body) = (body(30 * CHUNK, 1), body(8 * CHUNK, 2));
        let (stream, other) = (store.source("stream", &stream_body), store.source("other", &other_body));
        // Two workers: the read-ahead of the streaming reader below is
        // three runs (chunks 9-16, 17-24, 25-29), two of them at the gate
        // and one queued behind them.
        let mut reader = SourceReader::new(FixedSources::with("b", store.clone()), None, None);
        reader.workers = Workers::new("test-source", 2);
        let mut buf = vec![0u8; CHUNK as usize];
        reader.read(&stream, 0, &mut buf).expect("first read");
        // Sequential: chunk 1 (with 2-8) is fetched for the reader itself
        // (its GET starts before the gate), the rest of the window ahead.
        reader.read(&stream, CHUNK, &mut buf).expect("sequential read");
        assert_eq!(buf, stream_body[CHUNK as usize..2 * CHUNK as usize]);
        assert!(store.waiting(2), "read-ahead occupies both workers");
        // A random read of another object, while read-ahead waits.
        let (tx, rx) = std::sync::mpsc::channel();
        let got = std::thread::scope(|s| {
            s.spawn(|| {
                let mut part = vec![0u8; 100];
                let r = reader.read(&other, 5 * CHUNK + 7, &mut part).map(|()| part);
                let _ = tx.send(r);
            });
            let got = rx.recv_timeout(Duration::from_secs(10));
            // Whatever happened, let the queued fetches finish.
            store.open();
            got
        });
        let part = got.expect("the random read waited behind read-ahead").expect("random read");
        assert_eq!(part, other_body[(5 * CHUNK + 7) as usize..(5 * CHUNK + 107) as usize]);
        // Drain waits for every run fetched ahead: each chunk is then in
        // memory, and nothing is fetched again.
        reader.drain();
        let gets = reader.stats().gets;
        assert_eq!(gets, 6, "chunk 0, chunks 1-8, three runs ahead, the other object");
        reader.read(&stream, 9 * CHUNK, &mut buf).expect("read ahead");
        assert_eq!(buf, stream_body[9 * CHUNK as usize..10 * CHUNK as usize]);
        assert_eq!(reader.stats().gets, gets, "read from memory");
    }

    #[test]
    fn a_fetch_left_without_an_outcome_is_finished_by_its_panic_handler() {
        let cache = Mutex::new(Table::new(4));
        let object: ObjectId = "o".into();
        let id = (object.clone(), 3);
        let Claim::Mine(p) = cache.lock().pending.join(id.clone()) else { panic!("claimed already") };
        // A panic between ending the claim and telling the waiters leaves this.
        assert!(cache.lock().pending.finish_fetch(&id, &p));
        let panicked = || Err(Failed::Other("a source fetch panicked".into()));
        finish(&cache, &object, 3, &p, panicked());
        assert!(p.wait_for(Duration::ZERO).is_some_and(|o| o.is_err()), "its waiters were left waiting");
        // A later claim of the chunk is left alone.
        let Claim::Mine(later) = cache.lock().pending.join(id.clone()) else { panic!("claimed already") };
        finish(&cache, &object, 3, &p, panicked());
        assert!(cache.lock().pending.contains(&id) && later.wait_for(Duration::ZERO).is_none());
    }

    #[test]
    fn a_read_of_a_chunk_queued_for_read_ahead_is_not_held_up_by_the_queue() {
        let store = GatedStore::new("stream");
        // Read-ahead's runs 9-16 and 17-24 wait at the gate, on both
        // workers; run 25-29 is queued behind them, its GET not gated.
        store.through_from.store(25 * CHUNK, std::sync::atomic::Ordering::SeqCst);
        let stream_body = body(30 * CHUNK, 4);
        let stream = store.source("stream", &stream_body);
        let mut reader = SourceReader::new(FixedSources::with("b", store.clone()), None, None);
        reader.workers = Workers::new("test-source", 2);
        let mut buf = vec![0u8; CHUNK as usize];
        reader.read(&stream, 0, &mut buf).expect("first read");
        reader.read(&stream, CHUNK, &mut buf).expect("sequential read");
        assert!(store.waiting(2), "read-ahead occupies both workers");
        let (tx, rx) = std::sync::mpsc::channel();
        let got = std::thread::scope(|s| {
            s.spawn(|| {
                let mut chunk = vec![0u8; CHUNK as usize];
                let r = reader.read(&stream, 25 * CHUNK, &mut chunk).map(|()| chunk);
                let _ = tx.send(r);
            });
            let got = rx.recv_timeout(Duration::from_secs(10));
            store.open();
            got
        });
        let got = got.expect("the read waited for a run queued for read-ahead").expect("read");
        assert!(got == stream_body[25 * CHUNK as usize..26 * CHUNK as usize]);
        // Each chunk was fetched once: 0, 1-8, 9-16, 17-24, 25 by the
        // reader, and 26-29 by the worker that took the queued run.
        reader.drain();
        assert_eq!(reader.stats().gets, 6);
        for i in 9..30 {
            reader.read(&stream, i * CHUNK, &mut buf).expect("read ahead");
            assert!(buf == stream_body[(i * CHUNK) as usize..((i + 1) * CHUNK) as usize], "chunk {i}");
        }
        assert_eq!(reader.stats().gets, 6, "every chunk read ahead was in memory");
    }

    #[test]
    fn without_fetch_workers_a_read_fetches_its_own_chunks_before_read_ahead() {
        let store = GatedStore::new("stream");
        store.open();
        let stream_body = body(30 * CHUNK, 5);
        let stream = store.source("stream", &stream_body);
        let mut reader = SourceReader::new(FixedSources::with("b", store.clone()), None, None);
        reader.workers = Workers::threadless("test-source");
        let mut buf = vec![0u8; CHUNK as usize];
        reader.read(&stream, 0, &mut buf).expect("first read");
        reader.read(&stream, CHUNK, &mut buf).expect("sequential read");
        assert!(buf == stream_body[CHUNK as usize..2 * CHUNK as usize]);
        assert_eq!(*store.starts.lock(), [0, 1, 9, 17, 25], "chunks 1-8, then the runs fetched ahead");
        reader.read(&stream, 20 * CHUNK, &mut buf).expect("read ahead");
        assert_eq!(reader.stats().gets, 5, "read ahead all the same");
    }

    #[test]
    fn only_an_etag_of_32_hex_digits_names_an_md5() {
        let body = b"hello";
        let etag = "\"5d41402abc4b2a76b9719d911017c592\"";
        assert_eq!(etag_md5(etag), Some(md5(body)));
        assert_eq!(etag_md5(etag.trim_matches('"')), Some(md5(body)));
        assert_eq!(etag_md5("\"5d41402abc4b2a76b9719d911017c592-2\""), None, "multipart");
        assert_eq!(etag_md5("\"1\""), None);
        assert_eq!(etag_md5("\"zz41402abc4b2a76b9719d911017c592\""), None);
        let src = Source { bucket: "b".into(), key: "k".into(), size: 5, etag: etag.into(), version: None };
        let c = Counters::default();
        assert_eq!(c.etag_check(&src, body), Some(true));
        assert_eq!(c.etag_check(&src, b"jello"), Some(false));
        // A bucket whose own bytes do not match their ETag: nothing checked there.
        let kms = Source { etag: "\"00000000000000000000000000000000\"".into(), ..src.clone() };
        c.learn_etags(&kms, body);
        assert_eq!(c.etag_check(&src, b"jello"), None);
        let big = Source { size: CHUNK + 1, ..src };
        assert_eq!(Counters::default().etag_check(&big, body), None);
    }

    /// Runs `f` on a thread of its own: its result, or `None` if it did
    /// not end within ten seconds (a read or drain left waiting).
    fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(10)).ok()
    }

    #[test]
    fn a_fetch_that_panics_finishes_its_waiters_and_the_workers_go_on() {
        let store = GatedStore::new("stream");
        store.panics.store(true, std::sync::atomic::Ordering::SeqCst);
        let stream_body = body(30 * CHUNK, 3);
        let stream = store.source("stream", &stream_body);
        let mut reader = SourceReader::new(FixedSources::with("b", store.clone()), None, None);
        reader.workers = Workers::new("test-source", 1);
        let reader = Arc::new(reader);
        let read = |off: u64| {
            let (reader, stream) = (reader.clone(), stream.clone());
            within(move || {
                let mut buf = vec![0u8; CHUNK as usize];
                reader.read(&stream, off, &mut buf).map(|()| buf)
            })
        };
        read(0).expect("ended").expect("first read");
        // Sequential: the runs fetched ahead (chunks 9 on) panic on the worker.
        read(CHUNK).expect("ended").expect("sequential read");
        let r = reader.clone();
        within(move || r.drain()).expect("drained after the panics");
        // A read that needs a chunk whose fetch panics fails; it is not left waiting.
        let err = read(9 * CHUNK).expect("a read of a panicking fetch ended").expect_err("failed");
        assert_eq!(err.errno(), libc::EIO, "{err}");
        // Nothing was left claimed: once GETs work, every chunk reads, and
        // the worker that saw the panics fetches ahead again.
        store.panics.store(false, std::sync::atomic::Ordering::SeqCst);
        store.open();
        for i in 9..12 {
            let got = read(i * CHUNK).expect("ended").expect("read");
            assert!(got == stream_body[(i * CHUNK) as usize..((i + 1) * CHUNK) as usize], "chunk {i}");
        }
        let r = reader.clone();
        within(move || r.drain()).expect("drained");
        let gets = reader.stats().gets;
        read(20 * CHUNK).expect("ended").expect("read ahead");
        assert_eq!(reader.stats().gets, gets, "chunk 20 was fetched ahead by the worker");
    }
}
