//! This process's settings that every front end shares: how segment
//! writes reach the kernel, tries per bucket call, how long a cache server
//! may take and over which wire, and whether a mount through a branch's
//! owner reads every byte through it.
//!
//! The front end sets them once ([`set`]), before it opens a disk; until
//! then, and in a process that never sets them, the defaults hold. This
//! crate reads no environment: the `arbor` command reads these from its
//! `ARBOR_*` variables (docs/configuration.md).

use crate::error::{Error, Result};
use arbor_engine::io::IoMode;
use std::sync::OnceLock;
use std::time::Duration;

#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// How segment writes reach the kernel.
    pub io: IoMode,
    /// Tries per bucket call; `None`: the default.
    pub s3_retries: Option<u32>,
    /// How long a chunk request to a cache server may take before the
    /// reader goes to the bucket.
    pub cache_timeout: Duration,
    /// Segment chunks over the cache servers' chunk connections (`true`)
    /// or over HTTP/2, for comparing the two.
    pub cache_framed: bool,
    /// A mount through a branch's owner reads every byte through it, not
    /// the bytes already in the bucket from the bucket.
    pub read_through_owner: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            io: IoMode::default(),
            s3_retries: None,
            cache_timeout: arbor_net::cache::client::TIMEOUT,
            cache_framed: true,
            read_through_owner: false,
        }
    }
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

/// Sets this process's settings; an error once they are set or read.
pub fn set(s: Settings) -> Result<()> {
    SETTINGS.set(s).map_err(|_| Error::Invalid("the node's settings are set once, before a disk opens".into()))
}

/// This process's settings.
pub fn get() -> &'static Settings {
    SETTINGS.get_or_init(Settings::default)
}
