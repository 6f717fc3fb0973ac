//! A bounds-checked little-endian cursor, and bincode with a size limit.
//! Nothing here trusts a length before checking it against what is there.

use crate::error::{Error, Result};
use crate::format::Addr;

/// Decode limit for any bincode value read from disk: a garbage length
/// prefix can never make us allocate more than this.
pub(crate) const DECODE_LIMIT: usize = 16 << 20;

pub fn encode_value<T: bincode::Encode>(value: &T) -> Vec<u8> {
    // Encoding into a Vec cannot fail for our plain-data types.
    bincode::encode_to_vec(value, bincode::config::standard()).unwrap_or_default()
}

pub fn decode_value<T: bincode::Decode<()>>(bytes: &[u8], what: &'static str) -> Result<T> {
    let cfg = bincode::config::standard().with_limit::<DECODE_LIMIT>();
    match bincode::decode_from_slice(bytes, cfg) {
        Ok((v, used)) if used == bytes.len() => Ok(v),
        _ => Err(Error::Corrupted { what, addr: "value".into() }),
    }
}

pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Writer { buf: Vec::new() }
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bytes(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }
    pub fn addr(&mut self, a: &Addr) {
        self.u64(a.seg.writer);
        self.u32(a.seg.seq);
        self.u32(a.off);
        self.u32(a.len);
    }
}

impl Default for Writer {
    fn default() -> Self {
        Self::new()
    }
}

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, pos: 0, what }
    }

    fn bad(&self) -> Error {
        Error::Corrupted { what: self.what, addr: format!("byte {}", self.pos) }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Bytes read so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.bad());
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub fn addr(&mut self) -> Result<Addr> {
        Ok(Addr::from_encoded(&self.array()?))
    }

    pub fn finish(&self) -> Result<()> {
        if self.remaining() == 0 {
            Ok(())
        } else {
            Err(self.bad())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_refuses_to_read_past_the_end() {
        let mut r = Reader::new(&[1, 2, 3], "t");
        assert_eq!(r.u16().ok(), Some(0x0201));
        assert!(r.u16().is_err());
        assert!(r.take(usize::MAX).is_err());
        assert_eq!(r.u8().ok(), Some(3));
        assert!(r.finish().is_ok());
    }

    #[test]
    fn bincode_decode_rejects_trailing_bytes_and_huge_lengths() {
        let v: Vec<u8> = vec![1, 2, 3];
        let mut enc = encode_value(&v);
        assert_eq!(decode_value::<Vec<u8>>(&enc, "t").ok(), Some(v));
        enc.push(0);
        assert!(decode_value::<Vec<u8>>(&enc, "t").is_err());
        // A length prefix claiming 2^60 elements.
        let huge = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0x10];
        assert!(decode_value::<Vec<u64>>(&huge, "t").is_err());
    }
}
