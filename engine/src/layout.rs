//! Where everything of a disk lives: the objects in its bucket (or the
//! local folder standing in for one) and the folders on each node. Every
//! key and folder name arbor uses is made here and nowhere else.
//!
//! ```text
//! <bucket>/<prefix>/
//!   disk                         identity, written once by `arbor init`
//!   probe/conditional-writes     written and removed by `arbor init`
//!   segments/<xx>/seg-…          sealed segments (names are never reused)
//!   wal/<xx>/seg-…/<offset>      log tails of writers with bucket durability
//!   branches/<name>              branch heads (superblock + writer lease)
//!   checkpoints/<name>           checkpoints (created once, never replaced)
//!   owners/<name>                where `arbor serve --branch` serves a branch
//!   clock                        rewritten by gc to read the bucket's clock
//!
//! <node folder>/                 a local disk's own folder, or
//!                                $XDG_CACHE_HOME/arbor/<disk-id>/ for s3
//!   locks/                       writer locks of this node
//!   logs/<name>.log              logs of background mounts
//!   mounts/<branch|checkpoint>/  one cache per mount (s3 disks)
//!   cmd-<pid>/                   a command's own cache, removed after it
//! ```
//!
//! `<xx>` spreads segments over 256 prefixes (a byte of the name's crc32c),
//! so a bucket's per-prefix request rate is never the limit.

use crate::format::SegId;

/// The identity object.
pub const IDENTITY: &str = "disk";
/// What the identity object starts with.
pub const FORMAT: &str = "arbor-disk v1";
/// The start of the objects `arbor init` and a branch's owner use to check
/// that the bucket honours conditional writes (this, `-<pid>-<time>`;
/// removed after the check).
pub const PROBE: &str = "probe/conditional-writes";
pub const BRANCHES: &str = "branches/";
pub const CHECKPOINTS: &str = "checkpoints/";
pub const SEGMENTS: &str = "segments/";
pub const WAL: &str = "wal/";
pub const OWNERS: &str = "owners/";
/// An empty object gc writes to learn the time by the bucket's own clock
/// (its `LastModified`), against which it ages segments in the bucket.
pub const CLOCK: &str = "clock";

/// A local disk's segment folder (inside the disk's folder).
pub const SEGMENT_DIR: &str = "segments";
/// Writer locks, in the node folder.
pub const LOCK_DIR: &str = "locks";
/// Logs of background mounts, in the node folder.
pub const LOG_DIR: &str = "logs";

pub fn branch_key(name: &str) -> String {
    format!("{BRANCHES}{name}")
}

pub fn checkpoint_key(name: &str) -> String {
    format!("{CHECKPOINTS}{name}")
}

pub fn owner_key(name: &str) -> String {
    format!("{OWNERS}{name}")
}

fn spread(id: SegId) -> String {
    format!("{:02x}", crate::crc::crc32c(id.file_name().as_bytes()) & 0xff)
}

pub fn segment_key(id: SegId) -> String {
    format!("{SEGMENTS}{}/{}", spread(id), id.file_name())
}

pub fn wal_prefix(id: SegId) -> String {
    format!("{WAL}{}/{}/", spread(id), id.file_name())
}

pub fn wal_key(id: SegId, offset: u64) -> String {
    format!("{}{offset:016x}", wal_prefix(id))
}

/// The segment a `segments/` or `wal/` key belongs to.
pub fn segment_of_key(key: &str) -> Option<SegId> {
    let mut parts = key.split('/');
    match parts.next()? {
        "segments" | "wal" => {
            parts.next()?;
            SegId::parse_file_name(parts.next()?)
        }
        _ => None,
    }
}

/// The offset a WAL piece starts at.
pub fn wal_offset(key: &str) -> Option<u64> {
    let last = key.rsplit('/').next()?;
    (last.len() == 16).then(|| u64::from_str_radix(last, 16).ok()).flatten()
}

/// A mount's cache folder name inside the node folder.
pub fn mount_cache(name: &str) -> String {
    format!("mounts/{name}")
}

/// A command's own cache folder name inside the node folder.
pub fn command_cache(pid: u32) -> String {
    format!("cmd-{pid}")
}
