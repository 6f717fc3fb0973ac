//! The shared chunk cache: its service ([`server`]: chunk connections,
//! the HTTP routes, `sendfile`, `/metrics`, the fault switch), its client
//! ([`CacheClient`], the engine's `ChunkSource` for mounts, [`client`]),
//! the server's counters (`metrics`) and which imported objects a server
//! may fetch ([`scope`]). The listener (`server`, above) hands the
//! service its connections; it also accepts a branch's, so it sits above
//! this room. This room imports only [`crate::wire`]: nothing of
//! `branch` or the listener.

pub mod client;
pub(crate) mod metrics;
pub mod scope;
pub mod server;

pub use client::{CacheClient, ClientOptions, ServerStats};
