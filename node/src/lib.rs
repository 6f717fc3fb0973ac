//! A node of an arbor disk: what every front end (the `arbor` command's
//! FUSE mount, a CSI plugin, an S3 endpoint) does before it serves files.
//!
//! It opens a disk (an `s3://` bucket prefix or a local folder) with this
//! process's writer lease and the cache servers it reads through, then
//! opens a branch (read-write) or a checkpoint (read-only): here, as a
//! `Volume` this process writes, or through the process that owns the
//! branch (`arbor serve --branch`). Either way the front end gets one
//! [`Files`] handle to mount or serve.
//!
//! ```no_run
//! use arbor_node::{cache_client, disk::CacheOptions, Node, OpenOptions, OwnerOptions, Root};
//!
//! # fn main() -> arbor_node::Result<()> {
//! let auth = cache_client::ClientAuth::default();
//! let servers = cache_client::client(&["cache1:7070".to_string()], &auth)?;
//! let root = Root::Branch("main".into());
//! let node = Node::open("s3://my-bucket/disk1", &root, CacheOptions::default(), servers)?;
//! node.find(&root)?;
//! let opts = OpenOptions {
//!     segment_size: arbor_engine::volume::SEGMENT_SIZE,
//!     owner: OwnerOptions { auth, ..OwnerOptions::default() },
//!     holder: "my front end".into(),
//! };
//! let opened = node.open_root(&root, &opts)?;
//! let files = opened.files(); // what a front end mounts or serves
//! let _free = files.statfs()?;
//! files.close()?; // the last commit
//! # Ok(())
//! # }
//! ```
//!
//! Nothing here prints, exits the process or reads argv: a front end
//! passes options in and gets a [`Result`] back.

pub mod cache_client;
pub mod disk;
mod error;
pub mod identity;
mod open;
pub mod through_owner;

/// The transport-neutral file handle every front end mounts or serves.
pub use arbor_engine::Files;

pub use error::{Context, Error, Result};
pub use open::{check_segment_size, open_branch, Local, Node, OpenOptions, Opened, Root, MEMORY_ONLY_BRANCH};
pub use through_owner::OwnerOptions;
