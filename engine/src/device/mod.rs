//! Where segment files and the superblock live. [`FileDevice`] is a local
//! directory (the cache directory of a mount); [`SimDevice`] keeps durable
//! and volatile bytes apart and can crash at any point, for the crash tests.
//!
//! Every durable step of the engine calls [`Device::failpoint`] with its
//! name first, so a test can crash exactly there.

mod file;
mod sim;

use crate::error::Result;
use crate::format::SegId;
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

pub trait SegmentFile: Send + Sync {
    /// Writes all of `buf` at `off`; not durable until [`SegmentFile::sync`].
    fn write_at(&self, buf: &[u8], off: u64) -> Result<()>;
    /// Fills `buf` from `off`; an error if the file is shorter.
    fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()>;
    fn sync(&self) -> Result<()>;
    fn size(&self) -> Result<u64>;
    /// Cuts a torn tail off; durable once it returns.
    fn truncate(&self, len: u64) -> Result<()>;
    /// Starts writing the file's dirty bytes back without waiting, so a
    /// later sync finds little left to do. A hint: durability still needs
    /// [`SegmentFile::sync`].
    fn start_writeback(&self) {}
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
    fn write_superblock(&self, bytes: &[u8]) -> Result<()>;
    /// Called before each durable step; a test device may crash here.
    fn failpoint(&self, _name: &'static str) -> Result<()> {
        Ok(())
    }
    /// Which I/O path writes use, for status and tests.
    fn io_name(&self) -> &'static str;
    /// When a segment was last written, where the device knows; GC leaves
    /// recently written segments alone.
    fn segment_modified(&self, _id: SegId) -> Result<Option<std::time::SystemTime>> {
        Ok(None)
    }
}
