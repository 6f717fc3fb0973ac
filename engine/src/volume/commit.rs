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

/// A tree's feature bits, kept in its commit record's data section
/// (FORMAT.md, "1 (commit features)"). Bits 0–31 are promises beyond format
/// 1: a commit passes on only the promises its build knows, and only those
/// its tree had, so a build that does not keep one ends it. Bits 32–63 are
/// requirements: the tree holds something a build must understand to read
/// it, and a build that does not know one refuses the tree.
pub mod features {
    /// Every inode's recorded name (`parent`, `name`) is one of its links:
    /// the tree was built from empty by builds that keep link names.
    pub const NAMES_EXACT: u64 = 1;
    /// The tree may hold external extents (imported files' objects).
    pub const EXTERNAL_EXTENTS: u64 = 1 << 32;
    /// The tree records which client requests it includes (`Q` keys) and
    /// the log's intents may carry a request tag after the operation.
    pub const REQUEST_SLOTS: u64 = 1 << 33;
    /// The promise bits.
    pub const PROMISES: u64 = NAMES_EXACT;
    /// The requirement bits, known or not.
    pub const REQUIREMENTS: u64 = 0xffff_ffff_0000_0000;
    /// The bits this build keeps.
    pub const KNOWN: u64 = NAMES_EXACT | EXTERNAL_EXTENTS | REQUEST_SLOTS;
}

/// A commit record's data section: its feature bits, little-endian. Later
/// formats may append; a record written before the bits has none.
pub fn encode_features(bits: u64) -> [u8; 8] {
    bits.to_le_bytes()
}

/// The known bits of a data section; `Err` with the unknown requirement
/// bits if it has any; `Ok(None)` if it is malformed.
fn decode_features(data: &[u8]) -> std::result::Result<Option<u64>, u64> {
    let bits = match data.len() {
        0 => 0,
        n if n >= 8 => data[..8].try_into().map(u64::from_le_bytes).unwrap_or_default(),
        _ => return Ok(None),
    };
    match bits & features::REQUIREMENTS & !features::KNOWN {
        0 => Ok(Some(bits & features::KNOWN)),
        unknown => Err(unknown),
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
    let features = decode_features(&rec.data)
        .map_err(|unknown| {
            Error::NeedsNewer(format!("its tree at {addr} uses features this build does not know (bits {unknown:#x})"))
        })?
        .ok_or_else(bad)?;
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
        assert_eq!(decode_features(&[]), Ok(Some(0)));
        assert_eq!(decode_features(&encode_features(features::NAMES_EXACT)), Ok(Some(features::NAMES_EXACT)));
        // Promises of a later build are not passed on by this one.
        assert_eq!(decode_features(&encode_features(features::NAMES_EXACT | 1 << 20)), Ok(Some(features::NAMES_EXACT)));
        let mut longer = encode_features(features::NAMES_EXACT).to_vec();
        longer.extend_from_slice(b"later");
        assert_eq!(decode_features(&longer), Ok(Some(features::NAMES_EXACT)));
        assert_eq!(decode_features(&[1, 0, 0]), Ok(None));
        // Requirements it knows are kept; one it does not know refuses the tree.
        let external = features::NAMES_EXACT | features::EXTERNAL_EXTENTS;
        assert_eq!(decode_features(&encode_features(external)), Ok(Some(external)));
        assert_eq!(decode_features(&encode_features(external | 1 << 40)), Err(1 << 40));
    }
}
