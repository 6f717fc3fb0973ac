//! A branch this process owns, served to client mounts on other nodes, and
//! the client such a mount uses.
//!
//! - [`owner`]: the owner's side ([`SharedBranch`]): the wire operations
//!   ([`owner::FileOp`], [`owner::Reply`]), sessions, the lock table, the event
//!   ring; [`requests`] is its reply cache, [`locks`] the locks that
//!   survive an owner's restart, [`policy`] what a client's caller may do.
//! - [`frames`]: the requests and answers a framed connection carries to
//!   and from the owner, a write's and a read's bytes after their frames.
//! - [`client`]: a client mount's [`Files`](arbor_engine::Files)
//!   ([`BranchClient`]): a pool of framed connections, writes in flight,
//!   retries, the [`journal`] of answered requests, following the owner's
//!   events into the kernel; [`reads`] reads located extents from the
//!   client's own segments.
//!
//! This room uses the wire ([`crate::wire`]) and nothing of the chunk
//! cache: the HTTP/2 connection its event polls use is the wire's
//! ([`crate::wire::http`]'s `connect`).

pub mod client;
pub mod frames;
pub mod journal;
pub mod locks;
pub mod owner;
pub mod policy;
pub mod reads;
pub mod requests;

pub use client::{BranchClient, BranchClientOptions, BranchClientStats};
pub use owner::SharedBranch;
