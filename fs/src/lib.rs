//! arbor's FUSE adapter: one kernel request in, one [`Files`] call (a
//! `Volume` on this node, or the node that owns a shared branch), an errno
//! or a reply out. No storage logic lives here; kernel options and the
//! mount itself are in [`mod@mount`].

mod adapter;
mod classic;
mod direct;
pub mod mount;
mod notify;
pub mod ops;
mod resume;
pub mod ring;

pub use adapter::{to_errno, ArborFs, Counters};
pub use arbor_engine::files::{Caller, Files, Lock};
pub use mount::{
    is_mountpoint, mount, mount_path, recover_stale_mount, resume, Invalidator, MountHandle, MountOptions, THREADS,
};
pub use notify::Notify;
pub use ops::{FuseOp, OpMetrics};
pub use ring::{RingChoice, Transport};
