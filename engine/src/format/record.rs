//! The record header: the first 32 bytes of every record in a segment.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const MAGIC: u32 = u32::from_le_bytes(*b"ARBR");
pub const FORMAT_VERSION: u16 = 1;
pub const HEADER_LEN: usize = 32;
/// Data bytes are checksummed per block of this size, so a small random read
/// verifies only the blocks it touches.
pub const BLOCK_SIZE: usize = 4096;
/// No record payload is larger than this; a header claiming more is garbage.
pub const MAX_PAYLOAD: u32 = 64 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordKind {
    /// A logical operation; a write carries its data bytes after the metadata.
    Intent = 1,
    /// One tree node.
    Node = 2,
    /// A new durable root of the branch.
    Commit = 3,
}

impl RecordKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(RecordKind::Intent),
            2 => Some(RecordKind::Node),
            3 => Some(RecordKind::Commit),
            _ => None,
        }
    }
}

/// Little-endian, unaligned, fixed 32 bytes.
///
/// `crc` is the crc32c of the header (with `crc` zero) followed by the first
/// `meta_len` bytes of the payload. Payload bytes past `meta_len` are data
/// blocks, each covered by a crc32c stored in the metadata.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RecordHeader {
    pub magic: U32,
    pub version: U16,
    pub kind: u8,
    pub flags: u8,
    pub payload_len: U32,
    pub meta_len: U32,
    pub seq: U64,
    pub crc: U32,
    /// Zero bytes between the metadata and the crc table, so that a large
    /// write's data starts on a 4 KiB boundary of the segment file.
    pub pad: U32,
}

const _: () = assert!(std::mem::size_of::<RecordHeader>() == HEADER_LEN);

impl RecordHeader {
    pub fn new(kind: RecordKind, seq: u64, meta: &[u8], data_len: usize) -> Self {
        Self::with_pad(kind, seq, meta, data_len, 0)
    }

    /// `meta` here is the whole metadata region, padding included.
    pub fn with_pad(kind: RecordKind, seq: u64, meta: &[u8], data_len: usize, pad: u32) -> Self {
        let mut h = RecordHeader {
            magic: MAGIC.into(),
            version: FORMAT_VERSION.into(),
            kind: kind as u8,
            flags: 0,
            payload_len: ((meta.len() + data_len) as u32).into(),
            meta_len: (meta.len() as u32).into(),
            seq: seq.into(),
            crc: 0.into(),
            pad: pad.into(),
        };
        h.crc = h.compute_crc(meta).into();
        h
    }

    pub fn compute_crc(&self, meta: &[u8]) -> u32 {
        let mut zeroed = *self;
        zeroed.crc = 0.into();
        crate::crc::crc32c_append(crate::crc::crc32c(zeroed.as_bytes()), meta)
    }

    /// Parses and sanity-checks a header; the checksum is checked later,
    /// once the metadata it covers has been read.
    pub fn parse(bytes: &[u8]) -> Option<RecordHeader> {
        let h = RecordHeader::read_from_prefix(bytes).ok()?.0;
        let sane = h.magic.get() == MAGIC
            && h.version.get() == FORMAT_VERSION
            && RecordKind::from_u8(h.kind).is_some()
            && h.flags == 0
            && h.payload_len.get() <= MAX_PAYLOAD
            && h.meta_len.get() <= h.payload_len.get();
        sane.then_some(h)
    }

    pub fn kind(&self) -> Option<RecordKind> {
        RecordKind::from_u8(self.kind)
    }

    pub fn total_len(&self) -> u64 {
        HEADER_LEN as u64 + self.payload_len.get() as u64
    }

    pub fn data_len(&self) -> usize {
        (self.payload_len.get() - self.meta_len.get()) as usize
    }
}

/// Data writes at least this large get their data block-aligned in the segment.
pub const ALIGN_DATA_MIN: usize = 32 << 10;

/// The crc32c of each `BLOCK_SIZE` block of `data` (the last may be short).
pub fn block_crcs(data: &[u8]) -> Vec<u32> {
    data.chunks(BLOCK_SIZE).map(crate::crc::crc32c).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_checks_its_crc() {
        let meta = b"metadata";
        let h = RecordHeader::new(RecordKind::Intent, 7, meta, 100);
        let parsed = RecordHeader::parse(h.as_bytes()).expect("parses");
        assert_eq!(parsed.seq.get(), 7);
        assert_eq!(parsed.data_len(), 100);
        assert_eq!(parsed.compute_crc(meta), parsed.crc.get());
        assert_ne!(parsed.compute_crc(b"metadatA"), parsed.crc.get());
    }

    #[test]
    fn parse_rejects_bad_magic_kind_and_lengths() {
        let good = RecordHeader::new(RecordKind::Node, 1, b"x", 0);
        let mut bytes = good.as_bytes().to_vec();
        bytes[0] ^= 1;
        assert!(RecordHeader::parse(&bytes).is_none());
        let mut bad_kind = good;
        bad_kind.kind = 9;
        assert!(RecordHeader::parse(bad_kind.as_bytes()).is_none());
        let mut bad_len = good;
        bad_len.meta_len = 5.into();
        bad_len.payload_len = 4.into();
        assert!(RecordHeader::parse(bad_len.as_bytes()).is_none());
        assert!(RecordHeader::parse(&bytes[..10]).is_none());
    }

    #[test]
    fn block_crcs_cover_every_block_including_a_short_tail() {
        let data = vec![7u8; BLOCK_SIZE * 2 + 10];
        let crcs = block_crcs(&data);
        assert_eq!(crcs.len(), 3);
        assert_eq!(crcs[2], crate::crc::crc32c(&data[BLOCK_SIZE * 2..]));
    }
}
