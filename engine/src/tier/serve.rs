//! The chunk cache as a cache server uses it (`arbor serve`): chunks of
//! sealed segment objects fetched from the bucket once, checked against
//! the object's footer, kept on local disk (bounded, least recently used
//! out first, in one chunk store with the server's chunk files of imported
//! objects) and found again after a restart (checked again before they are
//! served). The same code as a mount's cache, with no read-ahead: a
//! server holds the chunks its clients ask for, and with several servers
//! each asks only for its own share.

use super::remote::{CacheStats, Remote};
use crate::bucket::ObjectStore;
use crate::chunks::{ChunkSource, ChunkStore};
use crate::error::Result;
use crate::format::SegId;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// The chunk asked for, and whether it was already in the cache.
#[derive(Debug)]
pub struct ServedChunk {
    pub bytes: Vec<u8>,
    pub hit: bool,
}

pub struct SegmentCache {
    remote: Arc<Remote>,
    /// The leaf hashes of chunks parts were proved of (2 KiB a 1 MiB
    /// chunk): a chunk is hashed once, not for each small read of it.
    leaves: quick_cache::sync::Cache<(SegId, u32), Arc<Vec<u8>>>,
}

/// Chunks whose leaf hashes a cache server keeps.
const LEAF_HASHES_KEPT: usize = 8192;

impl SegmentCache {
    /// Opens the cache in `dir` (its only user while open) in front of
    /// `store`, keeping at most `capacity` bytes of chunks.
    pub fn open(store: Arc<dyn ObjectStore>, dir: &Path, capacity: u64) -> Result<SegmentCache> {
        Self::with_sources(store, Some(dir), capacity, None)
    }

    /// A cache in memory alone (nothing on disk, nothing kept across a
    /// restart), of at most `capacity` bytes of chunks.
    pub fn in_memory(store: Arc<dyn ObjectStore>, capacity: u64) -> Result<SegmentCache> {
        Self::with_sources(store, None, capacity, None)
    }

    /// A cache in `dir` (in memory when `None`) that asks `sources` for a
    /// chunk before the bucket, checking what they give as it checks a GET
    /// (and for a footer, where they are caches of this process).
    pub fn with_sources(
        store: Arc<dyn ObjectStore>,
        dir: Option<&Path>,
        capacity: u64,
        sources: Option<Arc<dyn ChunkSource>>,
    ) -> Result<SegmentCache> {
        let (dir, memory) = match dir {
            Some(d) => (d.to_path_buf(), false),
            None => (std::path::PathBuf::new(), true),
        };
        Ok(SegmentCache {
            remote: Remote::new(store, dir, ChunkStore::new(capacity), 0, 1, memory, sources)?,
            leaves: quick_cache::sync::Cache::new(LEAF_HASHES_KEPT),
        })
    }

    /// Chunk `index` of sealed segment `seg`; `None` when the segment has
    /// no object in the bucket (never sealed, or removed) or no such chunk.
    /// Many callers asking for one chunk at once share one bucket GET.
    pub fn chunk(&self, seg: SegId, index: u32) -> Result<Option<ServedChunk>> {
        self.chunk_part(seg, index, None)
    }

    /// The footer of sealed segment `seg` as its object ends (as
    /// `Footer::encode` writes it); `None` when the segment has no object.
    pub fn footer(&self, seg: SegId) -> Result<Option<Vec<u8>>> {
        let Some(s) = self.remote.open_object(seg)? else { return Ok(None) };
        let mut out = Vec::with_capacity(s.footer.encoded_len());
        s.footer.encode(&mut out);
        Ok(Some(out))
    }

    /// Bytes `within` (offsets inside the chunk; all of it when `None`) of
    /// chunk `index` of sealed segment `seg`, the whole chunk cached
    /// either way; `None` when there is no such chunk or part.
    pub fn chunk_part(&self, seg: SegId, index: u32, within: Option<Range<u64>>) -> Result<Option<ServedChunk>> {
        let Some(s) = self.remote.open_object(seg)? else { return Ok(None) };
        let i = index as usize;
        if i >= s.footer.crcs.len() {
            return Ok(None);
        }
        let (start, end) = s.footer.chunk_range(i);
        let within = within.unwrap_or(0..end - start);
        if within.start >= within.end || within.end > end - start {
            return Ok(None);
        }
        // A miss is the one request that went to the bucket for the
        // chunk; those that waited for it meanwhile count as hits.
        if let Some(mut bytes) = s.fetch(i)? {
            if within.end - within.start < bytes.len() as u64 {
                bytes = bytes[within.start as usize..within.end as usize].to_vec();
            }
            return Ok(Some(ServedChunk { bytes, hit: false }));
        }
        let mut bytes = vec![0u8; (within.end - within.start) as usize];
        // Many clients' requests interleave here: none of them streams.
        crate::device::SegmentFile::read_unstreamed(&*s, &mut bytes, start + within.start)?;
        Ok(Some(ServedChunk { bytes, hit: true }))
    }

    /// Bytes `leaves` of chunk `index` of `seg` with the hashes of all the
    /// chunk's leaves, which a reader checks against the chunk's digest
    /// ([`crate::tier::object::prove_part`]); the whole chunk is read (and
    /// cached) for its hashes.
    /// A range not starting on a leaf is refused (`None`).
    pub fn proved_part(&self, seg: SegId, index: u32, leaves: Range<u64>) -> Result<Option<ServedChunk>> {
        use super::object::{leaf_hashes, LEAF};
        if !leaves.start.is_multiple_of(LEAF) || leaves.start >= leaves.end {
            return Ok(None);
        }
        let hashes = match self.leaves.get(&(seg, index)) {
            Some(h) => h,
            None => {
                let whole = match self.cached_part(seg, index, None) {
                    Some(c) => c,
                    None => match self.chunk_part(seg, index, None)? {
                        Some(c) => c,
                        None => return Ok(None),
                    },
                };
                let h = Arc::new(leaf_hashes(&whole.bytes));
                self.leaves.insert((seg, index), h.clone());
                h
            }
        };
        let part = match self.cached_part(seg, index, Some(leaves.clone())) {
            Some(c) => c,
            None => match self.chunk_part(seg, index, Some(leaves))? {
                Some(c) => c,
                None => return Ok(None),
            },
        };
        let mut bytes = part.bytes;
        bytes.extend_from_slice(&hashes);
        Ok(Some(ServedChunk { bytes, hit: part.hit }))
    }

    /// Bytes `within` (all of it when `None`) of chunk `index` of `seg` if
    /// they are cached and checked now: answered without blocking on anything but a read of
    /// the cache (`None`: ask [`SegmentCache::chunk_part`]).
    pub fn cached_part(&self, seg: SegId, index: u32, within: Option<Range<u64>>) -> Option<ServedChunk> {
        self.remote.cached_range(seg, index, within).map(|bytes| ServedChunk { bytes, hit: true })
    }

    /// Like [`SegmentCache::cached_part`], but hands `send` the cache file
    /// and where the bytes lie in it (offset, length) instead of reading
    /// them, for a server that sends them on with `sendfile`; no eviction
    /// punches them out while `send` runs. `None` when they are not cached
    /// and checked now, or `send` gave `None`.
    pub fn send_cached_part<T>(
        &self,
        seg: SegId,
        index: u32,
        within: Option<Range<u64>>,
        send: impl FnOnce(&std::fs::File, u64, usize) -> Option<T>,
    ) -> Option<T> {
        self.remote.send_cached(seg, index, within, send)
    }

    /// Whether chunk `index` of `seg` is cached (reading it needs no
    /// bucket; it may still need its check).
    pub fn holds(&self, seg: SegId, index: u32) -> bool {
        self.remote.holds(seg, index)
    }

    /// The cache's clock: it advances with every use of a chunk.
    pub fn clock(&self) -> u64 {
        self.remote.tick()
    }

    /// Evicts every chunk not used since the clock read `tick`.
    pub fn evict_unused_since(&self, tick: u64) {
        self.remote.evict_unused_since(tick + 1);
    }

    /// The chunk store this cache keeps its chunks in (of `capacity`
    /// bytes): a server's chunk files of imported objects go in it too.
    pub fn chunk_store(&self) -> Arc<ChunkStore> {
        self.remote.chunk_store().clone()
    }

    /// Counters: bytes cached, fetched from the bucket, evicted, hits.
    pub fn stats(&self) -> CacheStats {
        self.remote.stats()
    }
}

impl Drop for SegmentCache {
    fn drop(&mut self) {
        self.remote.shutdown();
    }
}
