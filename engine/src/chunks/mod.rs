//! Caches of immutable chunks: every chunk this node keeps of a sealed
//! segment object or of an imported (source) object, and where a chunk may
//! come from before the bucket. An immutable chunk needs no invalidation,
//! only to be the bytes that were put: what every cache here keeps is
//! checked by its reader (a segment chunk against its object's footer, an
//! object chunk file against its own crc32c).
//!
//! - `store.rs`: [`ChunkStore`], **the node's one budget of chunks on
//!   disk**: one capacity, one ledger over segment chunks and imported
//!   objects' chunk files alike (an insert of either kind may evict the
//!   other), one eviction path and its count of evicted bytes, and the
//!   lock that keeps a reader's pread and a hole punch apart. A mount's
//!   segment tier (`tier/remote`) and its chunk files share one store
//!   ([`ChunkStore`] says how, and the lock order); a memory-only mount's
//!   store holds segment chunks alone.
//! - `sparse.rs`: where a segment chunk's bytes are, a sparse file per
//!   segment object (on the cache folder's disk or in memory files), holes
//!   punched on eviction; the files are the segment tier's, which punches
//!   for the store.
//! - `object_files.rs`: [`ChunkFiles`], where an imported object's chunk's
//!   bytes are: one file each, checked on read, kept across restarts.
//! - `memory.rs`: `MemoryChunks`, imported objects' chunks in memory: one
//!   source reader's working set (a staging area before the chunk files,
//!   bounded by a count of chunks), not the node's disk budget, so it keeps
//!   a ledger of its own.
//! - `peers.rs`: [`ChunkSource`], chunks from cache servers (`arbor serve`)
//!   or another cache of this process, asked before the bucket.
//! - `fetch.rs`: fetches in flight (`InFlight`): each chunk
//!   fetched at most once however many readers ask, its waiters woken
//!   when it lands or fails (a failed fetch is claimed again by the next
//!   reader), and read-ahead's runs of chunks, one GET each
//!   (`runs`); used by the segment reader (`tier/remote`) and
//!   `SourceReader` (`source`), which keep what a fetch is (a ranged GET
//!   of a segment object checked against its footer, a conditional GET of
//!   a source object checked against its ETag).
//! - `ahead.rs`: read-ahead, the same for both readers: `Window` and
//!   `Stream`, what a sequential read is and how far ahead of it to fetch
//!   (each reader passes its sizes: the segment reader's window grows
//!   fourfold per read to a cap, the source reader's stays at 64 chunks),
//!   and `Workers`, the lazily started pool of fetch worker threads its
//!   runs go to (one job a run, a panicking job caught, `drain` to wait
//!   for every job submitted before it, `stop` to let the workers end). A reader's own misses
//!   never queue there: each reader fetches them itself, on the caller's
//!   thread.
//! - `policy.rs`: **the eviction policy of every cache here**, the one
//!   place to change it: each cache keeps its chunks in a
//!   [`policy::Ledger`], which ranks them and picks the victims as the
//!   cache's [`policy::Policy`] says (the two policies, the store's and
//!   the memory chunks', are constants there).
//!
//! This room imports nothing from the modules that use it (`tier`,
//! `source`, `volume`): only the format, the error type, checksums,
//! private files and the metrics module's counters (what a cache here
//! counts, evicted bytes, hits, damaged files, is a `metrics::Counter`; a
//! cache with a `*Stats` of its own declares both with `counters!`).
//!
//! Not here: which chunks a window covers and how a reader fetches them
//! (`tier/remote/prefetch.rs` queues whole aligned runs and carries a
//! window into a writer's next segments; `source/mod.rs` queues a window's
//! chunks under its cap of fetches in flight or queued; both claim a
//! queued run's chunks when a worker takes it, so a read that needs one
//! first fetches it itself), and what a fetch is.

pub(crate) mod ahead;
pub(crate) mod fetch;
mod memory;
mod object_files;
mod peers;
pub mod policy;
mod sparse;
mod store;

pub(crate) use memory::MemoryChunks;
pub use object_files::{ChunkFiles, ChunkFilesStats, FileChunk};
pub use peers::{ChunkRequest, ChunkSource, LateSources};
pub(crate) use sparse::{is_data, punch_hole};
pub use store::ChunkStore;
pub(crate) use store::{PlacedChunk, SegChunk, SegmentFiles};

/// FNV-1a, 64 bits: how chunk files are named and cache servers weighed
/// (the same on every host and build).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}
