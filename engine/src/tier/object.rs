//! How segments are laid out as objects: their keys, and the footer of
//! chunk checksums every segment object and WAL piece carries.
//!
//! ```text
//! segments/<xx>/seg-<writer>-<seq>        a sealed segment, uploaded once
//! wal/<xx>/seg-<writer>-<seq>/<offset>    bytes [offset, …) of an open segment
//! ```
//!
//! `<xx>` is two hex digits of crc32c(segment name): keys spread over 256
//! prefixes instead of piling onto one monotonic range, so a bucket can
//! split its index. Every object is the segment bytes followed by:
//!
//! ```text
//! per chunk of the bytes (chunk = chunk_size bytes, the last may be shorter):
//!   crc32c of the chunk                u32
//!   digest of the chunk                [u8; 32]
//! chunk_size                           u32
//! n                                    u32
//! data_len                             u64
//! magic "ARSH"                         u32
//! crc32c of the footer before this     u32
//! ```
//!
//! A chunk's digest is BLAKE3 over the BLAKE3 hashes of its 16 KiB leaves
//! (the last may be shorter), in order: a whole chunk is checked by
//! hashing it, and a leaf-aligned part of one by its leaves and the
//! chunk's leaf hashes, which a cache server sends with the part. crc32c
//! catches damage; the digest also catches a cache server that means harm
//! (crc32c is linear: a chunk can be rewritten keeping it). Objects of
//! earlier builds end in magic "ARSO" with the crc32c table only: read as
//! before, their chunks from cache servers checked by crc32c alone.

use crate::error::{Error, Result};

pub const FOOTER_MAGIC: u32 = u32::from_le_bytes(*b"ARSH");
/// The footer of earlier builds: crc32c per chunk, no digest.
pub const CRC_ONLY_MAGIC: u32 = u32::from_le_bytes(*b"ARSO");
/// Bytes a leaf of a chunk's digest covers.
pub const LEAF: u64 = 16 << 10;
/// A chunk's entry in a footer with digests.
const HASHED_ENTRY: usize = 4 + 32;
/// Bytes after the crc table.
pub const TRAILER_LEN: usize = 24;

pub use crate::layout::{segment_key, segment_of_key, wal_key, wal_offset, wal_prefix};

/// Checksums of each chunk, and the layout they describe.
#[derive(Clone, Debug, PartialEq)]
pub struct Footer {
    pub chunk_size: u32,
    pub data_len: u64,
    pub crcs: Vec<u32>,
    /// The digest of each chunk; empty in a footer of an earlier build.
    pub hashes: Vec<[u8; 32]>,
}

impl Footer {
    pub fn of(data: &[u8], chunk_size: u32) -> Footer {
        Footer {
            chunk_size,
            data_len: data.len() as u64,
            crcs: data.chunks(chunk_size as usize).map(crate::crc::crc32c).collect(),
            hashes: data.chunks(chunk_size as usize).map(chunk_digest).collect(),
        }
    }

    /// Whether chunks carry digests (a footer of this build).
    pub fn hashed(&self) -> bool {
        !self.hashes.is_empty()
    }

    fn entry_len(&self) -> usize {
        if self.hashed() {
            HASHED_ENTRY
        } else {
            4
        }
    }

    pub fn encoded_len(&self) -> usize {
        self.crcs.len() * self.entry_len() + TRAILER_LEN
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        for (i, c) in self.crcs.iter().enumerate() {
            out.extend_from_slice(&c.to_le_bytes());
            if let Some(h) = self.hashes.get(i) {
                out.extend_from_slice(h);
            }
        }
        out.extend_from_slice(&self.chunk_size.to_le_bytes());
        out.extend_from_slice(&(self.crcs.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.data_len.to_le_bytes());
        let magic = if self.hashed() { FOOTER_MAGIC } else { CRC_ONLY_MAGIC };
        out.extend_from_slice(&magic.to_le_bytes());
        let crc = crate::crc::crc32c(&out[start..]);
        out.extend_from_slice(&crc.to_le_bytes());
    }

    /// How many crc-table bytes precede the trailer `tail` (the last
    /// `TRAILER_LEN` bytes of an object of `object_len` bytes).
    pub fn table_len(tail: &[u8], object_len: u64, what: &str) -> Result<usize> {
        let bad = || Error::corrupted("segment object footer", what);
        if tail.len() != TRAILER_LEN {
            return Err(bad());
        }
        let entry = match u32_at(tail, 16) {
            FOOTER_MAGIC => HASHED_ENTRY as u64,
            CRC_ONLY_MAGIC => 4,
            _ => return Err(bad()),
        };
        let n = u32_at(tail, 4) as u64;
        let data_len = u64::from_le_bytes(tail[8..16].try_into().map_err(|_| bad())?);
        if data_len.checked_add(n * entry + TRAILER_LEN as u64) != Some(object_len) {
            return Err(bad());
        }
        Ok((n * entry) as usize)
    }

    /// Decodes the footer from the object's last `table_len + TRAILER_LEN` bytes.
    pub fn decode(bytes: &[u8], what: &str) -> Result<Footer> {
        let bad = || Error::corrupted("segment object footer", what);
        let split = bytes.len().checked_sub(TRAILER_LEN).ok_or_else(bad)?;
        let trailer = &bytes[split..];
        let entry = match u32_at(trailer, 16) {
            FOOTER_MAGIC => HASHED_ENTRY,
            CRC_ONLY_MAGIC => 4,
            _ => return Err(bad()),
        };
        if crate::crc::crc32c(&bytes[..bytes.len() - 4]) != u32_at(trailer, 20) {
            return Err(bad());
        }
        let chunk_size = u32_at(trailer, 0);
        let n = u32_at(trailer, 4) as usize;
        let data_len = u64::from_le_bytes(trailer[8..16].try_into().map_err(|_| bad())?);
        if Some(split) != n.checked_mul(entry) || chunk_size == 0 || data_len.div_ceil(chunk_size as u64) != n as u64 {
            return Err(bad());
        }
        let entries = bytes[..split].chunks_exact(entry);
        let crcs = entries.clone().map(|c| u32_at(c, 0)).collect();
        let hashes = if entry == HASHED_ENTRY {
            entries.map(|c| c[4..].try_into().unwrap_or([0; 32])).collect()
        } else {
            Vec::new()
        };
        Ok(Footer { chunk_size, data_len, crcs, hashes })
    }

    /// Bytes `[start, end)` of chunk `i`.
    pub fn chunk_range(&self, i: usize) -> (u64, u64) {
        let start = i as u64 * self.chunk_size as u64;
        (start, (start + self.chunk_size as u64).min(self.data_len))
    }

    /// Checks one chunk's bytes: its length, crc32c and (in a footer of
    /// this build) digest.
    pub fn verify(&self, i: usize, bytes: &[u8]) -> bool {
        let (s, e) = self.chunk_range(i);
        bytes.len() as u64 == e - s
            && self.crcs.get(i) == Some(&crate::crc::crc32c(bytes))
            && (!self.hashed() || self.hashes.get(i) == Some(&chunk_digest(bytes)))
    }

    /// Offsets `within` chunk `i` widened to whole leaves (clipped to the
    /// chunk): what a part checked against the digest covers.
    pub fn leaf_range(&self, i: usize, within: std::ops::Range<u64>) -> std::ops::Range<u64> {
        let (s, e) = self.chunk_range(i);
        let start = within.start / LEAF * LEAF;
        let end = within.end.div_ceil(LEAF).saturating_mul(LEAF).min(e - s);
        start..end
    }

    /// Checks a part of chunk `i` as a cache server proves it: `payload` is
    /// the bytes of `leaves` (a [`Footer::leaf_range`]) followed by the
    /// hash of every leaf of the chunk ([`prove_part`]). The leaves' bytes
    /// if they hash to their leaf hashes and those to the chunk's digest.
    pub fn check_proved_part(&self, i: usize, leaves: std::ops::Range<u64>, payload: &[u8]) -> Option<Vec<u8>> {
        let want = self.hashes.get(i)?;
        let (s, e) = self.chunk_range(i);
        let n = (e - s).div_ceil(LEAF).max(1) as usize;
        let data_len = payload.len().checked_sub(n * 32)?;
        if !leaves.start.is_multiple_of(LEAF) || leaves.end > e - s || leaves.end < leaves.start {
            return None;
        }
        if data_len as u64 != leaves.end - leaves.start {
            return None;
        }
        let (data, hashes) = payload.split_at(data_len);
        if &blake3::hash(hashes).as_bytes()[..] != want {
            return None;
        }
        let first = (leaves.start / LEAF) as usize;
        for (k, leaf) in data.chunks(LEAF as usize).enumerate() {
            let h = hashes.get((first + k) * 32..(first + k + 1) * 32)?;
            if blake3::hash(leaf).as_bytes()[..] != *h {
                return None;
            }
        }
        Some(data.to_vec())
    }
}

/// The BLAKE3 hash of each 16 KiB leaf of `chunk`, one after another (one
/// leaf, empty, for an empty chunk).
pub fn leaf_hashes(chunk: &[u8]) -> Vec<u8> {
    if chunk.is_empty() {
        return blake3::hash(&[]).as_bytes().to_vec();
    }
    let mut out = Vec::with_capacity(chunk.len().div_ceil(LEAF as usize) * 32);
    for leaf in chunk.chunks(LEAF as usize) {
        out.extend_from_slice(blake3::hash(leaf).as_bytes());
    }
    out
}

/// A chunk's digest: BLAKE3 over its [`leaf_hashes`].
pub fn chunk_digest(chunk: &[u8]) -> [u8; 32] {
    *blake3::hash(&leaf_hashes(chunk)).as_bytes()
}

/// What a cache server sends for a proved part: bytes `leaves` of `chunk`
/// and the hash of each of its leaves (see [`Footer::check_proved_part`]).
pub fn prove_part(chunk: &[u8], leaves: std::ops::Range<u64>) -> Option<Vec<u8>> {
    let part = chunk.get(leaves.start as usize..leaves.end as usize)?;
    let mut out = part.to_vec();
    out.extend_from_slice(&leaf_hashes(chunk));
    Some(out)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// `data` with its footer appended: the body of a segment object or WAL piece.
pub fn with_footer(mut data: Vec<u8>, chunk_size: u32) -> (Vec<u8>, Footer) {
    let footer = Footer::of(&data, chunk_size);
    data.reserve_exact(footer.encoded_len());
    footer.encode(&mut data);
    (data, footer)
}

/// Splits a whole object into its data and verified footer, checking every chunk.
pub fn split_verified(body: &[u8], what: &str) -> Result<(Vec<u8>, Footer)> {
    let bad = || Error::corrupted("segment object", what);
    let tail_at = body.len().checked_sub(TRAILER_LEN).ok_or_else(bad)?;
    let table = Footer::table_len(&body[tail_at..], body.len() as u64, what)?;
    let data_len = tail_at.checked_sub(table).ok_or_else(bad)?;
    let footer = Footer::decode(&body[data_len..], what)?;
    let data = &body[..data_len];
    for (i, chunk) in data.chunks(footer.chunk_size as usize).enumerate() {
        if !footer.verify(i, chunk) {
            return Err(bad());
        }
    }
    Ok((data.to_vec(), footer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::SegId;

    #[test]
    fn keys_round_trip_and_spread() {
        let id = SegId { writer: 0xabc, seq: 7 };
        assert_eq!(segment_of_key(&segment_key(id)), Some(id));
        assert_eq!(segment_of_key(&wal_key(id, 4096)), Some(id));
        assert_eq!(wal_offset(&wal_key(id, 4096)), Some(4096));
        let prefixes: std::collections::HashSet<String> =
            (0..64).map(|seq| segment_key(SegId { writer: 1, seq })[..12].to_string()).collect();
        assert!(prefixes.len() > 16, "consecutive segments of one writer share few prefixes: {prefixes:?}");
    }

    #[test]
    fn footer_round_trips_and_catches_any_flipped_byte() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let (body, footer) = with_footer(data.clone(), 4096);
        assert_eq!(footer.crcs.len(), 3);
        let (back, f2) = split_verified(&body, "test").expect("valid");
        assert_eq!(back, data);
        assert_eq!(f2, footer);
        for i in (0..body.len()).step_by(97) {
            let mut b = body.clone();
            b[i] ^= 0x40;
            assert!(split_verified(&b, "test").is_err(), "flip at {i} went unnoticed");
        }
        assert!(split_verified(&body[..body.len() - 1], "test").is_err());
        assert!(split_verified(&[], "test").is_err());
    }

    #[test]
    fn a_footer_of_an_earlier_build_still_reads() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 5) as u8).collect();
        let mut old = Footer::of(&data, 4096);
        old.hashes.clear();
        let mut body = data.clone();
        old.encode(&mut body);
        assert_eq!(&body[body.len() - 8..body.len() - 4], b"ARSO");
        let (back, f) = split_verified(&body, "old").expect("an ARSO footer reads");
        assert_eq!(back, data);
        assert!(!f.hashed());
        assert!(f.verify(1, &data[4096..8192]));
    }

    #[test]
    fn a_chunk_rewritten_keeping_its_crc32c_fails_its_digest() {
        let data: Vec<u8> = (0..(64u32 << 10)).map(|i| (i * 13 + 1) as u8).collect();
        let footer = Footer::of(&data, 64 << 10);
        let mut forged = data.clone();
        crate::testkit::forge_keeping_crc(&mut forged[1000..1000 + 4096], b"EVIL BYTES");
        assert_eq!(crate::crc::crc32c(&forged), footer.crcs[0], "the forgery keeps the crc32c");
        assert_ne!(forged, data);
        assert!(footer.verify(0, &data));
        assert!(!footer.verify(0, &forged), "a forged chunk passed its digest");
    }

    #[test]
    fn a_proved_part_passes_and_any_flipped_byte_fails() {
        let data: Vec<u8> = (0..(100u32 << 10)).map(|i| (i * 31 + 7) as u8).collect();
        let footer = Footer::of(&data, 64 << 10);
        // A small read inside chunk 1, widened to its leaves.
        let leaves = footer.leaf_range(1, 5000..9000);
        assert_eq!(leaves, 0..16384);
        let chunk = &data[64 << 10..];
        let payload = prove_part(chunk, leaves.clone()).expect("prove");
        let got = footer.check_proved_part(1, leaves.clone(), &payload).expect("an honest part passes");
        assert_eq!(got, chunk[..16384]);
        // The short last leaf of a short last chunk.
        let tail = footer.leaf_range(1, 30_000..36_000);
        assert_eq!(tail, 16384..36864);
        let p2 = prove_part(chunk, tail.clone()).expect("prove");
        assert_eq!(footer.check_proved_part(1, tail, &p2).expect("passes"), chunk[16384..]);
        for at in (0..payload.len()).step_by(211) {
            let mut bad = payload.clone();
            bad[at] ^= 1;
            assert!(footer.check_proved_part(1, leaves.clone(), &bad).is_none(), "a flip at {at} passed");
        }
        assert!(
            footer.check_proved_part(0, leaves.clone(), &payload).is_none(),
            "chunk 0's digest took chunk 1's part"
        );
        assert!(footer.check_proved_part(1, leaves, &payload[1..]).is_none());
    }
}
