//! Source objects: files whose bytes stay plain objects in a bucket.
//!
//! An imported file's extents are ranges of one object, named by the
//! file's `'S'` key ([`Source`]: bucket, key, size, ETag). Reads are ranged
//! GETs made conditional on that ETag, in aligned chunks kept in a memory
//! cache and fetched in parallel and ahead of a sequential reader. An
//! object changed or deleted since import fails the read with
//! [`Error::SourceChanged`] (EIO, and a log line naming the object): never
//! other bytes.

use crate::bucket::{ObjectStore, RetryPolicy, RetryStore, S3Config, S3Store};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// `'S' ino` → the object an imported file's external extents read from.
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Source {
    pub bucket: String,
    pub key: String,
    /// The object's size when it was imported.
    pub size: u64,
    /// Its ETag then; every read is conditional on it.
    pub etag: String,
    /// Its version id, where the bucket keeps versions (reserved: imports
    /// record none yet).
    pub version: Option<String>,
}

impl Source {
    pub fn url(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.key)
    }
}

/// Opens the bucket a source object lives in.
pub trait Sources: Send + Sync {
    fn store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>>;
}

/// S3 buckets reached with the settings of the environment
/// ([`S3Config::from_env`]), each opened once, with retries.
#[derive(Default)]
pub struct EnvSources {
    stores: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
}

impl Sources for EnvSources {
    fn store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
        let mut stores = self.stores.lock();
        if let Some(s) = stores.get(bucket) {
            return Ok(s.clone());
        }
        let s3: Arc<dyn ObjectStore> = Arc::new(S3Store::open(&S3Config::from_env(bucket, ""))?);
        let store: Arc<dyn ObjectStore> = RetryStore::new(s3, RetryPolicy::default());
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
/// Chunks a volume keeps in memory (64 MiB).
const CACHED_CHUNKS: usize = 64;
/// Chunks fetched ahead of a sequential reader, in the same batch.
const AHEAD: u64 = 8;
/// Ranged GETs in flight for one batch.
const PARALLEL: usize = 16;

/// (bucket, key, etag, chunk index).
type ChunkId = (String, String, String, u64);

/// A volume's reader of source objects.
pub struct SourceReader {
    sources: Arc<dyn Sources>,
    cache: Mutex<ChunkCache>,
}

#[derive(Default)]
struct ChunkCache {
    chunks: HashMap<ChunkId, Arc<Vec<u8>>>,
    /// Oldest first; a hit moves nothing (a clock would be fairer, this
    /// is enough for streaming readers).
    order: VecDeque<ChunkId>,
    /// Where the last read of each object ended, to see sequential readers.
    ends: HashMap<(String, String), u64>,
}

impl SourceReader {
    pub fn new(sources: Arc<dyn Sources>) -> SourceReader {
        SourceReader { sources, cache: Mutex::new(ChunkCache::default()) }
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
        let (first, last) = (off / CHUNK, (end - 1) / CHUNK);
        let chunks = src.size.div_ceil(CHUNK);
        let mut want: Vec<u64> = Vec::new();
        let mut have: HashMap<u64, Arc<Vec<u8>>> = HashMap::new();
        {
            let mut c = self.cache.lock();
            let object = (src.bucket.clone(), src.key.clone());
            let sequential = c.ends.get(&object) == Some(&off) && off > 0;
            if c.ends.len() > 4096 {
                c.ends.clear();
            }
            c.ends.insert(object, end);
            let ahead = if sequential { AHEAD } else { 0 };
            for i in first..=(last + ahead).min(chunks - 1) {
                match c.chunks.get(&chunk_id(src, i)) {
                    Some(b) if i <= last => drop(have.insert(i, b.clone())),
                    Some(_) => {}
                    None => want.push(i),
                }
            }
        }
        // Read-ahead only once the reader needs a chunk it does not have:
        // a batch then fetches what it needs and what follows, in parallel.
        if want.iter().any(|&i| i <= last) {
            for (i, bytes) in self.fetch(src, &want)? {
                if i <= last {
                    have.insert(i, bytes);
                }
            }
        }
        for i in first..=last {
            let chunk = have.get(&i).ok_or_else(|| Error::corrupted("source chunk", src.url()))?;
            let base = i * CHUNK;
            let (from, to) = (off.max(base), end.min(base + chunk.len() as u64));
            dst[(from - off) as usize..(to - off) as usize]
                .copy_from_slice(&chunk[(from - base) as usize..(to - base) as usize]);
        }
        Ok(())
    }

    /// Fetches chunks `which` of the object, [`PARALLEL`] at a time, and
    /// caches them.
    fn fetch(&self, src: &Source, which: &[u64]) -> Result<Vec<(u64, Arc<Vec<u8>>)>> {
        let store = self.sources.store(&src.bucket)?;
        let mut out = Vec::with_capacity(which.len());
        for batch in which.chunks(PARALLEL) {
            let results: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
                let handles: Vec<_> = batch
                    .iter()
                    .map(|&i| {
                        let store = &store;
                        s.spawn(move || {
                            let range = i * CHUNK..((i + 1) * CHUNK).min(src.size);
                            let want = range.end - range.start;
                            let bytes = store.get_range_if(&src.key, range, &src.etag)?;
                            if bytes.len() as u64 != want {
                                return Err(Error::PreconditionFailed(src.key.clone()));
                            }
                            Ok(bytes)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap_or(Err(Error::Invalid("source fetch")))).collect()
            });
            for (&i, r) in batch.iter().zip(results) {
                let bytes = Arc::new(r.map_err(|e| changed(src, e))?);
                out.push((i, bytes.clone()));
                let mut c = self.cache.lock();
                let id = chunk_id(src, i);
                if c.chunks.insert(id.clone(), bytes).is_none() {
                    c.order.push_back(id);
                }
                while c.chunks.len() > CACHED_CHUNKS {
                    let Some(old) = c.order.pop_front() else { break };
                    c.chunks.remove(&old);
                }
            }
        }
        Ok(out)
    }
}

fn chunk_id(src: &Source, i: u64) -> ChunkId {
    (src.bucket.clone(), src.key.clone(), src.etag.clone(), i)
}

/// A failed conditional read: the object is not what was imported.
fn changed(src: &Source, e: Error) -> Error {
    match e {
        Error::PreconditionFailed(_) | Error::NoSuchObject(_) => {
            let why = if matches!(e, Error::NoSuchObject(_)) { "deleted" } else { "changed" };
            tracing::error!(object = %src.url(), etag = %src.etag, "source object {why} since import; its file reads fail");
            Error::SourceChanged(format!("{} ({why} since import)", src.url()))
        }
        e => e,
    }
}
