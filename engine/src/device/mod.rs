//! Where segment files and the superblock live. [`FileDevice`] is a local
//! directory (the cache directory of a mount); [`SimDevice`] keeps durable
//! and volatile bytes apart and can crash at any point, for the crash tests.
//!
//! Every durable step of the engine calls [`Device::failpoint`] with its
//! name first, so a test can crash exactly there.

mod file;
mod sim;

use crate::error::Result;
use crate::format::{Addr, SegId, Superblock};
use std::sync::Arc;

pub use file::FileDevice;
pub use sim::{CrashMode, SimDevice};

/// Names of the engine's durable steps, in the order a commit reaches them.
pub mod failpoints {
    pub const INTENT_APPEND: &str = "intent_append";
    pub const SEGMENT_SEAL: &str = "segment_seal";
    pub const FSYNC: &str = "fsync";
    pub const NODE_WRITE: &str = "node_write";
    pub const COMMIT_RECORD: &str = "commit_record";
    pub const SUPERBLOCK: &str = "superblock";
    pub const ALL: [&str; 6] = [INTENT_APPEND, SEGMENT_SEAL, FSYNC, NODE_WRITE, COMMIT_RECORD, SUPERBLOCK];
}

/// Keeps a map of open segment handles under `max` entries by dropping a
/// quarter of them when it is full. Dropping a handle never closes a file
/// in use: its users hold their own `Arc`.
pub(crate) fn bound_handles<V>(map: &mut std::collections::HashMap<SegId, V>, max: usize) {
    if map.len() >= max {
        let victims: Vec<SegId> = map.keys().take(max / 4).copied().collect();
        for v in victims {
            map.remove(&v);
        }
    }
}

/// Who checked the bytes a [`SegmentFile::read_for_check`] gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checked {
    /// The file (a chunk against its object's footer, or a local file).
    Here,
    /// Nobody yet: the caller's own checksum is the only check.
    Unchecked,
}

pub trait SegmentFile: Send + Sync {
    /// Writes all of `buf` at `off`; not durable until [`SegmentFile::sync`].
    fn write_at(&self, buf: &[u8], off: u64) -> Result<()>;
    /// Fills `buf` from `off`; an error if the file is shorter.
    fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()>;
    /// Fills `buf` from `off` for a reader of metadata (a tree node, a
    /// commit record): not part of a stream, so it starts no read-ahead
    /// and does not make the file's next read look sequential.
    fn read_unstreamed(&self, buf: &mut [u8], off: u64) -> Result<()> {
        self.read_at(buf, off)
    }
    /// Fills `buf` from `off` for a caller that checks every byte itself
    /// (file data against its blocks' crc32c). The bytes may come from a
    /// copy this file did not check — a cache server's part of a chunk,
    /// a fraction of a millisecond instead of a whole chunk's transfer —
    /// and then the answer is `Unchecked`: a caller whose check fails
    /// calls [`SegmentFile::unchecked_failed`] and reads with `read_at`.
    fn read_for_check(&self, buf: &mut [u8], off: u64) -> Result<Checked> {
        self.read_at(buf, off).map(|()| Checked::Here)
    }
    /// Bytes `read_for_check` gave at `off` as `Unchecked` failed the
    /// caller's check.
    fn unchecked_failed(&self, _off: u64) {}
    fn sync(&self) -> Result<()>;
    fn size(&self) -> Result<u64>;
    /// Cuts a torn tail off; durable once it returns.
    fn truncate(&self, len: u64) -> Result<()>;
    /// Starts writing the file's dirty bytes back without waiting, so a
    /// later sync finds little left to do. A hint: durability still needs
    /// [`SegmentFile::sync`].
    fn start_writeback(&self) {}
    /// The log will not write this file again (it was sealed): what only
    /// writing needed can go.
    fn sealed(&self) {}
}

pub trait Device: Send + Sync {
    /// Creates a new, empty segment; its existence is durable on return.
    fn create_segment(&self, id: SegId) -> Result<Arc<dyn SegmentFile>>;
    /// Opens an existing segment, or `None` if there is none by that name.
    fn open_segment(&self, id: SegId) -> Result<Option<Arc<dyn SegmentFile>>>;
    fn list_segments(&self) -> Result<Vec<SegId>>;
    fn remove_segment(&self, id: SegId) -> Result<()>;
    fn read_superblock(&self) -> Result<Option<Vec<u8>>>;
    /// Replaces the superblock atomically and durably.
    fn write_superblock(&self, sb: &Superblock) -> Result<()>;
    /// Refuses every durable step once this device must not write any
    /// more: a writer fenced off its branch.
    fn check_writable(&self) -> Result<()> {
        Ok(())
    }
    /// Called before each durable step with its name; a test device may
    /// crash here. Never a production check (that is `check_writable`).
    fn failpoint(&self, _name: &'static str) -> Result<()> {
        Ok(())
    }
    /// Which I/O path writes use, for status and tests.
    fn io_name(&self) -> &'static str;
    /// Bytes of the log written past the page cache (`O_DIRECT`) so far.
    fn direct_bytes(&self) -> u64 {
        0
    }
    /// When a segment was last written, where the device knows; GC leaves
    /// recently written segments alone.
    fn segment_modified(&self, _id: SegId) -> Result<Option<std::time::SystemTime>> {
        Ok(None)
    }
    /// Now, by this node's clock and by the clock of the store segments
    /// are kept in (a bucket's own), where that is another.
    fn clocks(&self) -> Result<Clocks> {
        Ok(Clocks { here: std::time::SystemTime::now(), store: None })
    }
    /// How long before `at` segment `id` was last written, each time read
    /// on the clock that stamped it: a node whose clock is off does not
    /// take a segment another node just wrote to the bucket for an old one.
    fn segment_age(&self, id: SegId, at: Clocks) -> Result<Option<std::time::Duration>> {
        Ok(self.segment_modified(id)?.map(|m| at.here.duration_since(m).unwrap_or_default()))
    }
    /// Bytes free for new segments, where the device can tell.
    fn free_bytes(&self) -> Option<u64> {
        None
    }

    /// Who watches this device's log to copy it to a bucket and publish
    /// its heads; `None` where the device is its own durable copy.
    fn replica(&self) -> Option<&dyn Replica> {
        None
    }
}

/// The bucket tier's side of a device: what the log tells it at each
/// durable step, and what waits for it. Kept apart from [`Device`], which
/// only stores.
pub trait Replica: Send + Sync {
    /// The log wrote its last byte to `id` (`len` bytes): the segment is
    /// final and may be uploaded.
    fn segment_sealed(&self, _id: SegId, _len: u64) {}
    /// Whether an fsync means "in the bucket" ([`Replica::log_synced`]).
    fn fsync_reaches_bucket(&self) -> bool {
        false
    }
    /// The log made every record through byte `len` of its open segment
    /// `id` durable locally. Where fsync means "in the bucket", this returns
    /// once those bytes (and every sealed segment) are there.
    fn log_synced(&self, _id: SegId, _len: u64) -> Result<()> {
        Ok(())
    }
    /// Runs `publish` (a branch-head update) once every byte through
    /// `upto` is in the bucket: at once where the device is the durable copy.
    fn publish_when_stored(&self, _upto: Addr, publish: Box<dyn Fn() -> Result<()> + Send>) -> Result<()> {
        publish()
    }
    /// Returns once every sealed segment, and segment `upto.seg` through
    /// `upto.end()`, is in the bucket.
    fn flush_to_bucket(&self, _upto: Addr) -> Result<()> {
        Ok(())
    }
    /// Returns once every upload and deferred publish has finished.
    fn drain(&self) -> Result<()> {
        Ok(())
    }
    /// Recovery replayed these segments of a writer that is gone (this
    /// volume holds its branch now). Where they live in the bucket only as
    /// WAL pieces, each becomes one segment object and its pieces go, so
    /// no later head needs a WAL piece and the next open reads chunks, not
    /// one object per fsync. Returns how many segments it sealed and how
    /// many pieces it deleted.
    fn seal_recovered(&self, _segments: &[SegId]) -> Result<(u64, u64)> {
        Ok((0, 0))
    }
    /// Bytes written here and not yet in the bucket.
    fn pending_upload_bytes(&self) -> u64 {
        0
    }
    /// Whether another node can read segment `id` where the disk keeps its
    /// segments (the bucket, or the folder that is the disk): not while it
    /// is only in this node's cache, waiting for its upload.
    fn segment_shared(&self, _id: SegId) -> bool {
        true
    }
}

/// A durable step named `name` on `dev`: refused if the device may not
/// write, and a place where a test device may crash.
pub fn durable_step(dev: &dyn Device, name: &'static str) -> Result<()> {
    dev.check_writable()?;
    dev.failpoint(name)
}

/// Runs `publish` once every byte through `upto` is in the bucket, or at
/// once where the device is its own durable copy.
/// The time now on two clocks: this node's, and the segment store's.
#[derive(Clone, Copy, Debug)]
pub struct Clocks {
    pub here: std::time::SystemTime,
    /// `None`: the store's clock is this node's (a local folder), or the
    /// store does not say.
    pub store: Option<std::time::SystemTime>,
}

pub fn publish_when_stored(dev: &dyn Device, upto: Addr, publish: Box<dyn Fn() -> Result<()> + Send>) -> Result<()> {
    match dev.replica() {
        Some(r) => r.publish_when_stored(upto, publish),
        None => publish(),
    }
}
