//! Named roots: the catalog of checkpoints and branches of one disk, and
//! what users do with them — fork a branch per run, mount any root, diff
//! two roots, collect garbage.
//!
//! A checkpoint is one object naming a commit (created once, never
//! replaced); a branch is one head object naming its newest commit
//! (replaced only by compare-and-swap). So creating either is O(1): one
//! small object, whatever the disk holds.

mod catalog;
pub mod disk;
mod error;
mod gc;

pub use catalog::{check_name, BranchInfo, BranchLock, Catalog, CheckpointInfo, Owner, Root};
pub use disk::{Disk, DiskOptions};
pub use error::{Error, Result};
pub use gc::{GcPlan, GcReport, GC_GRACE};
