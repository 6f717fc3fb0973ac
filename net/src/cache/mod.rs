//! The shared chunk cache's client: [`CacheClient`], the engine's
//! `ChunkSource` for mounts ([`client`]); the server's counters
//! (`metrics`); which imported objects a server may fetch ([`scope`]).
//! The server itself ([`crate::server`]) also accepts a branch's framed
//! connections, so it sits above this room. This room imports only
//! [`crate::wire`]: nothing of [`crate::branch`] or the server.

pub mod client;
pub(crate) mod metrics;
pub mod scope;

pub use client::{CacheClient, ClientOptions, ServerStats};
