use std::fmt;

/// A segment's global name: the writer epoch that created it and its
/// sequence number within that writer. Never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, bincode::Encode, bincode::Decode)]
pub struct SegId {
    pub writer: u64,
    pub seq: u32,
}

impl SegId {
    /// The file (and object) name of this segment.
    pub fn file_name(&self) -> String {
        format!("seg-{:016x}-{:08x}", self.writer, self.seq)
    }

    pub fn parse_file_name(name: &str) -> Option<SegId> {
        let rest = name.strip_prefix("seg-")?;
        let (w, s) = rest.split_once('-')?;
        if w.len() != 16 || s.len() != 8 {
            return None;
        }
        Some(SegId { writer: u64::from_str_radix(w, 16).ok()?, seq: u32::from_str_radix(s, 16).ok()? })
    }

    pub fn next(&self) -> SegId {
        SegId { writer: self.writer, seq: self.seq.wrapping_add(1) }
    }
}

impl fmt::Display for SegId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}-{:08x}", self.writer, self.seq)
    }
}

/// A byte range inside one segment: where a record, or the data bytes of a
/// write, live. Stable forever.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default, bincode::Encode, bincode::Decode)]
pub struct Addr {
    pub seg: SegId,
    pub off: u32,
    pub len: u32,
}

impl Addr {
    pub const ENCODED_LEN: usize = 20;

    /// Decodes the 20 bytes [`crate::format::Writer::addr`] wrote.
    pub fn from_encoded(b: &[u8; Self::ENCODED_LEN]) -> Addr {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut writer = [0; 8];
        writer.copy_from_slice(&b[..8]);
        Addr { seg: SegId { writer: u64::from_le_bytes(writer), seq: u32_at(8) }, off: u32_at(12), len: u32_at(16) }
    }

    pub fn end(&self) -> u64 {
        self.off as u64 + self.len as u64
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}+{}", self.seg, self.off, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_file_names_round_trip_and_reject_garbage() {
        let id = SegId { writer: 0xdead_beef_0000_0001, seq: 42 };
        assert_eq!(SegId::parse_file_name(&id.file_name()), Some(id));
        for bad in ["seg-", "seg-12-34", "foo", "seg-zzzzzzzzzzzzzzzz-00000000", "seg-0000000000000001-1"] {
            assert_eq!(SegId::parse_file_name(bad), None, "{bad}");
        }
    }
}
