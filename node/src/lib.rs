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
//! A node also serves ([`serve`]): the shared chunk cache of a disk for
//! every node that mounts it, and the branches it owns ([`owner`]: their
//! lease, the owner record in the bucket, the file operations of client
//! mounts), until it is stopped:
//!
//! ```no_run
//! use arbor_node::owner::{OwnOptions, STOP_WAIT};
//! use arbor_node::serve::{self, CacheDir, ServeOptions, ServerAuth};
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! # fn main() -> arbor_node::Result<()> {
//! let opts = ServeOptions {
//!     disk: "s3://my-bucket/disk1".into(),
//!     listen: "0.0.0.0:7070".into(),
//!     cache_dir: CacheDir::Node,
//!     cache_size: arbor_engine::tier::CACHE_SIZE,
//!     object_memory: 0,
//!     auth: ServerAuth { token_file: Some("/etc/arbor/token".into()), tls: None },
//!     fault: None,
//!     keep_for: Some(Duration::from_secs(3600)),
//!     imported_prefixes: |_store| Ok(Vec::new()),
//!     owner: OwnOptions {
//!         branches: vec!["main".into()],
//!         advertise: None,
//!         take_over: false,
//!         lease_ttl: arbor_node::identity::LEASE_TTL,
//!         lock_grace: arbor_net::branch::locks::LOCK_GRACE,
//!         stop_timeout: STOP_WAIT,
//!         durability: arbor_engine::tier::Durability::Bucket,
//!         segment_size: arbor_engine::volume::SEGMENT_SIZE,
//!         policy: arbor_net::Policy { allow_suid_devices: false, root_squash: true },
//!         checkpoint_reply: |made| made.name.clone(),
//!     },
//!     // This process can no longer serve the branch: end it, so that a
//!     // supervisor starts a new owner.
//!     on_step_down: Arc::new(|_branch| std::process::exit(75)),
//! };
//! let server = serve::start(&opts)?; // owning main, serving on its own threads
//! println!("serving on {}, clients told {}", server.addr(), server.advertised());
//! // ... until the front end is told to stop:
//! server.stop()?; // the last commits, waiting up to stop_timeout for the bucket
//! # Ok(())
//! # }
//! ```
//!
//! Nothing here prints, exits the process, reads argv or reads the
//! environment: a front end passes options in (and this process's
//! [`settings`], once) and gets a [`Result`] back. A FUSE mount's control
//! socket (`arbor status`, `arbor unmount`, a checkpoint of a mounted
//! branch) is the `arbor` command's own, beside its mount, not here.

pub mod cache_client;
pub mod disk;
mod error;
pub mod identity;
mod open;
pub mod owner;
pub mod owner_files;
pub mod serve;
pub mod settings;
pub mod through_owner;

/// The transport-neutral file handle every front end mounts or serves.
pub use arbor_engine::Files;

pub use error::{chain, Context, Error, Result};
pub use open::{check_segment_size, open_branch, Local, Node, OpenOptions, Opened, Root, MEMORY_ONLY_BRANCH};
pub use through_owner::OwnerOptions;
