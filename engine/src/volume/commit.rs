//! The commit record and the superblock that names the newest one.

use crate::env::Timestamp;
use crate::error::{Error, Result};
use crate::format::{decode_value, encode_value, Addr};

const SUPERBLOCK_MAGIC: u32 = u32::from_le_bytes(*b"ARSB");
const SUPERBLOCK_VERSION: u16 = 1;

#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct CommitRecord {
    /// The tree root as of this commit.
    pub root: Addr,
    pub next_ino: u64,
    /// Every intent with a sequence number up to this one is in `root`.
    pub covers_seq: u64,
    /// The commit before this one, in any writer's log.
    pub prev: Option<Addr>,
    pub time: Timestamp,
    /// Bytes of tree nodes and file data `root` references, per segment.
    pub live: Vec<(crate::format::SegId, u64)>,
}

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
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(bytes: &[u8]) -> Result<Superblock> {
        let bad = || Error::corrupted("superblock", "local cache directory");
        let split = bytes.len().checked_sub(4).ok_or_else(bad)?;
        let (body, crc) = bytes.split_at(split);
        if crc32c::crc32c(body).to_le_bytes() != crc {
            return Err(bad());
        }
        let sb: Superblock = decode_value(body, "superblock").map_err(|_| bad())?;
        if sb.magic != SUPERBLOCK_MAGIC || sb.version != SUPERBLOCK_VERSION {
            return Err(bad());
        }
        Ok(sb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::SegId;

    #[test]
    fn superblock_round_trips_and_rejects_any_flipped_byte() {
        let sb = Superblock::new(Addr { seg: SegId { writer: 3, seq: 4 }, off: 5, len: 6 });
        let bytes = sb.encode();
        assert_eq!(Superblock::decode(&bytes).ok(), Some(sb));
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 1;
            assert!(Superblock::decode(&b).is_err(), "flip at {i}");
        }
        assert!(Superblock::decode(&[]).is_err());
    }
}
