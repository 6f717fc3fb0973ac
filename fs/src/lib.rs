//! arbor's FUSE adapter: one kernel request in, one [`Volume`] call, an
//! errno or a reply out. No storage logic lives here; kernel options and
//! the mount itself are in [`mount`].

mod adapter;
pub mod mount;

pub use adapter::{to_errno, ArborFs};
pub use mount::{mount, recover_stale_mount, server_is_gone, MountHandle, MountOptions};
