//! The commit record and the superblock that names the newest one.

use crate::device::Device;
use crate::env::Timestamp;
use crate::error::{Error, Result};
use crate::format::{decode_value, Addr, RecordKind};

pub use crate::format::Superblock;

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

/// Promises a tree keeps beyond format 1, as bits in its commit record's
/// data section (FORMAT.md, "1 (commit features)"). A commit passes on only
/// the bits its build knows, and only those its tree had: a build that does
/// not keep a promise writes no bits, so the promise ends with it.
pub mod features {
    /// Every inode's recorded name (`parent`, `name`) is one of its links:
    /// the tree was built from empty by builds that keep link names.
    pub const NAMES_EXACT: u64 = 1;
    /// The bits this build keeps.
    pub const KNOWN: u64 = NAMES_EXACT;
}

/// A commit record's data section: its feature bits, little-endian. Later
/// formats may append; a record written before the bits has none.
pub fn encode_features(bits: u64) -> [u8; 8] {
    bits.to_le_bytes()
}

fn decode_features(data: &[u8]) -> Option<u64> {
    match data.len() {
        0 => Some(0),
        n if n >= 8 => Some(u64::from_le_bytes(data[..8].try_into().ok()?) & features::KNOWN),
        _ => None,
    }
}

/// A commit record as read back, with its tree's feature bits.
pub struct Commit {
    pub record: CommitRecord,
    pub features: u64,
    pub seq: u64,
}

/// Reads and verifies the commit record at `addr`.
pub fn read_commit(device: &dyn Device, addr: Addr) -> Result<Commit> {
    let rec = super::nodes::load_record(device, addr, RecordKind::Commit)?;
    let bad = || Error::corrupted("commit record", addr);
    let record: CommitRecord = decode_value(&rec.meta, "commit record").map_err(|_| bad())?;
    let features = decode_features(&rec.data).ok_or_else(bad)?;
    Ok(Commit { record, features, seq: rec.seq })
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

    #[test]
    fn feature_bits_keep_known_bits_and_refuse_a_short_section() {
        assert_eq!(decode_features(&[]), Some(0));
        assert_eq!(decode_features(&encode_features(features::NAMES_EXACT)), Some(features::NAMES_EXACT));
        // Bits of a later build are not passed on by this one.
        assert_eq!(decode_features(&encode_features(features::NAMES_EXACT | 1 << 40)), Some(features::NAMES_EXACT));
        let mut longer = encode_features(features::NAMES_EXACT).to_vec();
        longer.extend_from_slice(b"later");
        assert_eq!(decode_features(&longer), Some(features::NAMES_EXACT));
        assert_eq!(decode_features(&[1, 0, 0]), None);
    }
}
