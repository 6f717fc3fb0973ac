//! Source objects: files whose bytes stay plain objects in a bucket.
//!
//! An imported file's extents are ranges of one object, named by the
//! file's `'S'` key ([`Source`]: bucket, key, size, ETag). Reads are ranged
//! GETs made conditional on that ETag, in aligned chunks kept in a memory
//! cache and fetched in parallel and ahead of a sequential reader. An
//! object changed or deleted since import fails the read with
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
//! the bucket. The caches themselves, and their eviction policy, live in
//! [`crate::chunks`].

use crate::bucket::{ObjectStore, RetryPolicy, S3Config};
use crate::chunks::fetch::{self, Claim, Fetch, InFlight};
use crate::chunks::{ChunkFiles, ChunkSource, MemoryChunks};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
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
/// Chunk fetches in flight at most, read-ahead included (a reader's own
/// misses always go).
const IN_FLIGHT: usize = 64;

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
    /// Chunks fetched ahead of a sequential reader.
    ahead: u64,
    /// Cache servers asked for a chunk before the bucket.
    servers: Option<Arc<dyn ChunkSource>>,
    /// Chunks kept on local disk.
    files: Option<Arc<ChunkFiles>>,
    /// The fetch threads that may still run, joined when the reader goes
    /// (so that what they fetched is on disk when its process ends).
    fetches: Mutex<Vec<std::thread::JoinHandle<()>>>,
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
    /// Where the last read of each object ended, to see sequential readers.
    ends: HashMap<ObjectId, u64>,
}

impl Table {
    fn new(capacity: usize) -> Table {
        Table { memory: MemoryChunks::new(capacity), pending: InFlight::new(), ends: HashMap::new() }
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
            ahead: AHEAD,
            servers,
            files,
            fetches: Mutex::default(),
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
            ahead: 0,
            servers: None,
            files,
            fetches: Mutex::default(),
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
        let fetches = std::mem::take(&mut *self.fetches.lock());
        for t in fetches {
            let _ = t.join();
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
        let chunks = src.size.div_ceil(CHUNK);
        let mut have: Vec<(u64, Chunk)> = Vec::new();
        let mut wait: Vec<(u64, Arc<Pending>)> = Vec::new();
        let mut start: Vec<(u64, Arc<Pending>)> = Vec::new();
        let object = object_id(src);
        let mut missed = false;
        {
            let mut c = self.cache.lock();
            let sequential = off > 0 && c.ends.get(&object) == Some(&off);
            if c.ends.len() > 4096 {
                c.ends.clear();
            }
            c.ends.insert(object.clone(), end);
            let ahead = if sequential { self.ahead } else { 0 };
            for i in first..=(last + ahead).min(chunks - 1) {
                let id = (object.clone(), i);
                let needed = i <= last;
                if let Some(b) = c.memory.get(&id) {
                    if needed {
                        have.push((i, b.clone()));
                    }
                } else if needed || c.pending.len() < IN_FLIGHT || c.pending.contains(&id) {
                    match c.pending.join(id) {
                        Claim::Theirs(p) => {
                            if needed {
                                wait.push((i, p));
                            }
                        }
                        Claim::Mine(p) => {
                            if needed {
                                wait.push((i, p.clone()));
                                self.counters.counts.misses.inc();
                                missed = true;
                            }
                            start.push((i, p));
                            continue;
                        }
                    }
                }
                if needed {
                    self.counters.counts.hits.inc();
                }
            }
        }
        if !start.is_empty() {
            // Consecutive chunks go in one GET, up to RUN of them: fewer,
            // larger requests for a streaming reader.
            for run in fetch::runs(start, RUN, false) {
                self.spawn_fetch(src.clone(), object.clone(), run);
            }
        }
        for (i, p) in wait {
            have.push((i, p.wait()?));
        }
        Ok((have, missed))
    }

    /// Fetches the consecutive chunks of `run` on a thread of its own:
    /// from the local chunk files, the cache servers, then the bucket
    /// (one GET for the rest), each where the one before had nothing.
    /// Their waiters wake when they are cached (or failed).
    fn spawn_fetch(&self, src: Source, object: ObjectId, run: Vec<(u64, Arc<Pending>)>) {
        let sources = self.sources.clone();
        let cache = self.cache.clone();
        let counters = self.counters.clone();
        let (servers, files) = (self.servers.clone(), self.files.clone());
        let shared = Arc::new(run);
        let spawned = std::thread::Builder::new().name("arbor-source".into()).spawn({
            let (src, object, run) = (src.clone(), object.clone(), shared.clone());
            move || {
                // Waiters sleep until every chunk is finished: a panic in
                // a tier or the store must finish them too.
                let tiers = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut rest: Vec<&(u64, Arc<Pending>)> = run.iter().collect();
                    if let Some(files) = &files {
                        rest = from_files(files, &object, rest, &cache, &counters);
                    }
                    if let Some(servers) = servers.as_ref().filter(|_| !rest.is_empty()) {
                        rest = from_servers(&**servers, &src, &object, rest, &cache, &counters, files.as_deref());
                    }
                    rest
                }));
                let rest = tiers.unwrap_or_else(|_| run.iter().collect());
                let (Some((first, _)), Some((last, _))) = (rest.first(), rest.last()) else { return };
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
                        let chunks: Vec<(u64, Chunk)> = rest
                            .iter()
                            .map(|(i, _)| {
                                let start = ((i - first) * CHUNK) as usize;
                                let len = (body.len() - start).min(CHUNK as usize);
                                (*i, Chunk { body: body.clone(), start, len })
                            })
                            .collect();
                        for ((i, p), (_, chunk)) in rest.iter().zip(&chunks) {
                            finish(&cache, &object, *i, p, Ok(chunk.clone()));
                        }
                        // Kept on disk once the readers have their bytes.
                        if let Some(files) = &files {
                            for (i, chunk) in &chunks {
                                files.put(&object, *i, chunk.bytes());
                            }
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
            }
        });
        match spawned {
            Ok(t) => {
                let mut fetches = self.fetches.lock();
                fetches.retain(|t| !t.is_finished());
                fetches.push(t);
            }
            Err(e) => {
                for (i, p) in shared.iter() {
                    finish(&self.cache, &object, *i, p, Err(Failed::Other(format!("cannot start a fetch: {e}"))));
                }
            }
        }
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
/// (and keeps them in `files`); the rest, still to be read from the bucket.
fn from_servers<'a>(
    servers: &dyn ChunkSource,
    src: &Source,
    object: &ObjectId,
    run: Vec<&'a (u64, Arc<Pending>)>,
    cache: &Mutex<Table>,
    counters: &Counters,
    files: Option<&ChunkFiles>,
) -> Vec<&'a (u64, Arc<Pending>)> {
    let wanted: Vec<u64> = run.iter().map(|(i, _)| *i).collect();
    let mut given = servers.fetch_object(src, &wanted).into_iter();
    let mut rest = Vec::new();
    let mut keep = Vec::new();
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
    if let Some(files) = files {
        for (i, chunk) in keep {
            files.put(object, i, chunk.bytes());
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
fn finish(cache: &Mutex<Table>, object: &ObjectId, i: u64, p: &Pending, got: Outcome) {
    {
        let mut c = cache.lock();
        let id = (object.clone(), i);
        c.pending.finish(&id);
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
}
