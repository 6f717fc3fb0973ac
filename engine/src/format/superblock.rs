//! The superblock: which commit a branch's newest durable state is, and
//! whether the log after it is the branch's own. A device stores it; a
//! branch head in the bucket carries it.

use crate::error::{Error, Result};
use crate::format::{decode_value, encode_value, Addr};

const SUPERBLOCK_MAGIC: u32 = u32::from_le_bytes(*b"ARSB");
const SUPERBLOCK_VERSION: u16 = 1;

#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct Superblock {
    pub magic: u32,
    pub version: u16,
    /// The newest durable commit of this branch.
    pub commit: Addr,
    /// Whether intents after `commit` in its writer's log belong to this
    /// branch. False for a branch just forked from a checkpoint: the log
    /// after that commit is its parent's.
    pub replay: bool,
}

impl Superblock {
    pub fn new(commit: Addr) -> Self {
        Superblock { magic: SUPERBLOCK_MAGIC, version: SUPERBLOCK_VERSION, commit, replay: true }
    }

    /// A root to open without replaying anything after it.
    pub fn frozen(commit: Addr) -> Self {
        Superblock { replay: false, ..Self::new(commit) }
    }

    /// The encoding followed by its crc32c.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = encode_value(self);
        let crc = crate::crc::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(bytes: &[u8]) -> Result<Superblock> {
        let bad = || Error::corrupted("superblock", "local cache directory");
        let split = bytes.len().checked_sub(4).ok_or_else(bad)?;
        let (body, crc) = bytes.split_at(split);
        if crate::crc::crc32c(body).to_le_bytes() != crc {
            return Err(bad());
        }
        let sb: Superblock = decode_value(body, "superblock").map_err(|_| bad())?;
        if sb.magic != SUPERBLOCK_MAGIC || sb.version != SUPERBLOCK_VERSION {
            return Err(bad());
        }
        Ok(sb)
    }
}
