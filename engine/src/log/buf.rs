//! The log's write buffer, laid out so that every byte sits at the same
//! offset within a memory page as it will within a page of the file. A
//! page-aligned run of the file — a large record's data, which the record
//! format aligns to a block — is then page-aligned in memory too, and the
//! segment file can hand it to the disk with O_DIRECT straight from here,
//! without a copy into the page cache (see `FileSegment::write_at`).

/// The alignment kept: a page, which covers every block device's DMA and
/// logical block alignment that O_DIRECT asks for in practice.
pub const PAGE: usize = 4096;

/// Bytes bound for one file position, aligned as the module says.
#[derive(Default)]
pub struct LogBuf {
    /// `lead` bytes of padding, then the bytes.
    raw: Vec<u8>,
    lead: usize,
}

/// The padding that puts a byte bound for file offset `at` at the same
/// offset within its memory page when the buffer starts at `base`.
fn lead_for(base: *const u8, at: u64) -> usize {
    let want = (at % PAGE as u64) as usize;
    (want + PAGE - base as usize % PAGE) % PAGE
}

impl LogBuf {
    /// Empties the buffer for bytes that go to the file from `at` on.
    pub fn start(&mut self, at: u64) {
        self.raw.clear();
        // The padding must not move the allocation it was measured in.
        self.raw.reserve(PAGE);
        self.lead = lead_for(self.raw.as_ptr(), at);
        self.raw.resize(self.lead, 0);
    }

    /// Appends `bytes`. Growing moves the bytes to an allocation laid out
    /// the same way (a plain `Vec` growth would lose the alignment).
    pub fn extend(&mut self, bytes: &[u8]) {
        if self.raw.len() + bytes.len() > self.raw.capacity() {
            let at = ((self.raw.as_ptr() as usize + self.lead) % PAGE) as u64;
            let want = (self.len() + bytes.len() + PAGE).max(2 * self.raw.capacity());
            let mut raw = Vec::with_capacity(want);
            let lead = lead_for(raw.as_ptr(), at);
            raw.resize(lead, 0);
            raw.extend_from_slice(self.bytes());
            self.raw = raw;
            self.lead = lead;
        }
        self.raw.extend_from_slice(bytes);
    }

    pub fn bytes(&self) -> &[u8] {
        &self.raw[self.lead..]
    }

    pub fn len(&self) -> usize {
        self.raw.len() - self.lead
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Empties the buffer and keeps its allocation.
    pub fn clear(&mut self) {
        self.raw.clear();
        self.lead = 0;
    }

    /// Gives back an allocation grown past `4 * max` by one outsized write.
    pub fn shrink(&mut self, max: usize) {
        if self.raw.capacity() > 4 * max {
            *self = LogBuf { raw: Vec::with_capacity(max), lead: 0 };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_page(b: &LogBuf, i: usize) -> usize {
        (b.bytes()[i..].as_ptr() as usize) % PAGE
    }

    #[test]
    fn every_byte_sits_where_it_will_in_a_file_page_across_starts_and_growth() {
        let mut b = LogBuf::default();
        for (round, at) in [0u64, 1, 4095, 4096, 12_345, (7 << 20) + 100].into_iter().enumerate() {
            b.start(at);
            let mut written = Vec::new();
            // Small pieces force several regrowths of a fresh buffer.
            for n in 0..200usize {
                let piece: Vec<u8> = (0..(n * 97 % 9000)).map(|i| (i + n + round) as u8).collect();
                b.extend(&piece);
                written.extend_from_slice(&piece);
            }
            assert_eq!(b.bytes(), &written[..], "bytes after start at {at}");
            for i in [0, 1, 4095, 4096, written.len() / 2, written.len() - 1] {
                assert_eq!(in_page(&b, i), ((at + i as u64) % PAGE as u64) as usize, "byte {i} of a buffer at {at}");
            }
            b.clear();
            assert!(b.is_empty());
        }
    }

    #[test]
    fn an_outsized_buffer_is_given_back() {
        let mut b = LogBuf::default();
        b.start(3);
        b.extend(&vec![1; 8 << 20]);
        b.clear();
        assert!(b.raw.capacity() > 4 << 20);
        b.shrink(1 << 20);
        assert!(b.raw.capacity() < 2 << 20, "kept {} bytes", b.raw.capacity());
        b.start(5);
        b.extend(b"x");
        assert_eq!(b.bytes(), b"x");
        assert_eq!(in_page(&b, 0), 5);
    }
}
