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
//! crc32c of each chunk of the bytes    u32 × n   (chunk = chunk_size bytes, the last may be shorter)
//! chunk_size                           u32
//! n                                    u32
//! data_len                             u64
//! magic "ARSO"                         u32
//! crc32c of the footer before this     u32
//! ```

use crate::error::{Error, Result};

pub const FOOTER_MAGIC: u32 = u32::from_le_bytes(*b"ARSO");
/// Bytes after the crc table.
pub const TRAILER_LEN: usize = 24;

pub use crate::layout::{segment_key, segment_of_key, wal_key, wal_offset, wal_prefix};

/// Checksums of each chunk, and the layout they describe.
#[derive(Clone, Debug, PartialEq)]
pub struct Footer {
    pub chunk_size: u32,
    pub data_len: u64,
    pub crcs: Vec<u32>,
}

impl Footer {
    pub fn of(data: &[u8], chunk_size: u32) -> Footer {
        Footer {
            chunk_size,
            data_len: data.len() as u64,
            crcs: data.chunks(chunk_size as usize).map(crate::crc::crc32c).collect(),
        }
    }

    pub fn encoded_len(&self) -> usize {
        self.crcs.len() * 4 + TRAILER_LEN
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        for c in &self.crcs {
            out.extend_from_slice(&c.to_le_bytes());
        }
        out.extend_from_slice(&self.chunk_size.to_le_bytes());
        out.extend_from_slice(&(self.crcs.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.data_len.to_le_bytes());
        out.extend_from_slice(&FOOTER_MAGIC.to_le_bytes());
        let crc = crate::crc::crc32c(&out[start..]);
        out.extend_from_slice(&crc.to_le_bytes());
    }

    /// How many crc-table bytes precede the trailer `tail` (the last
    /// `TRAILER_LEN` bytes of an object of `object_len` bytes).
    pub fn table_len(tail: &[u8], object_len: u64, what: &str) -> Result<usize> {
        let bad = || Error::corrupted("segment object footer", what);
        if tail.len() != TRAILER_LEN || u32_at(tail, 16) != FOOTER_MAGIC {
            return Err(bad());
        }
        let n = u32_at(tail, 4) as u64;
        let data_len = u64::from_le_bytes(tail[8..16].try_into().map_err(|_| bad())?);
        if data_len.checked_add(n * 4 + TRAILER_LEN as u64) != Some(object_len) {
            return Err(bad());
        }
        Ok(n as usize * 4)
    }

    /// Decodes the footer from the object's last `table_len + TRAILER_LEN` bytes.
    pub fn decode(bytes: &[u8], what: &str) -> Result<Footer> {
        let bad = || Error::corrupted("segment object footer", what);
        let split = bytes.len().checked_sub(TRAILER_LEN).ok_or_else(bad)?;
        let trailer = &bytes[split..];
        if u32_at(trailer, 16) != FOOTER_MAGIC || crate::crc::crc32c(&bytes[..bytes.len() - 4]) != u32_at(trailer, 20) {
            return Err(bad());
        }
        let chunk_size = u32_at(trailer, 0);
        let n = u32_at(trailer, 4) as usize;
        let data_len = u64::from_le_bytes(trailer[8..16].try_into().map_err(|_| bad())?);
        if split != n * 4 || chunk_size == 0 || data_len.div_ceil(chunk_size as u64) != n as u64 {
            return Err(bad());
        }
        let crcs = bytes[..split].chunks_exact(4).map(|c| u32_at(c, 0)).collect();
        Ok(Footer { chunk_size, data_len, crcs })
    }

    /// Bytes `[start, end)` of chunk `i`.
    pub fn chunk_range(&self, i: usize) -> (u64, u64) {
        let start = i as u64 * self.chunk_size as u64;
        (start, (start + self.chunk_size as u64).min(self.data_len))
    }

    /// Checks one chunk's bytes.
    pub fn verify(&self, i: usize, bytes: &[u8]) -> bool {
        let (s, e) = self.chunk_range(i);
        bytes.len() as u64 == e - s && self.crcs.get(i) == Some(&crate::crc::crc32c(bytes))
    }
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
}
