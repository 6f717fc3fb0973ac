//! A list of byte strings in one buffer: how a node holds its keys and
//! values without a heap allocation per string.
//!
//! A node decoded from a record keeps the record's bytes as its buffer,
//! the spans pointing past the length prefixes, so loading a node costs two
//! allocations whatever it holds. A change appends the new bytes (or
//! overwrites in place when they fit) and the buffer is compacted once
//! more than half of it is dead.

use std::ops::Range;

/// Where a string sits in the buffer: offset and length.
pub type Span = (u32, u32);

fn range((off, len): Span) -> Range<usize> {
    off as usize..off as usize + len as usize
}

#[derive(Clone, Default)]
pub struct Packed {
    buf: Vec<u8>,
    spans: Vec<Span>,
    /// Bytes the spans cover; the rest of `buf` is prefixes or dead bytes.
    live: usize,
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq for Packed {
    fn eq(&self, other: &Packed) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl<T: AsRef<[u8]>> FromIterator<T> for Packed {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Packed {
        let mut p = Packed::default();
        for s in iter {
            p.push(s.as_ref());
        }
        p
    }
}

impl Packed {
    /// The strings at `spans` of `buf`; `None` if a span is out of bounds.
    pub fn from_parts(buf: Vec<u8>, spans: Vec<Span>) -> Option<Packed> {
        let mut live = 0;
        for &s in &spans {
            if range(s).end > buf.len() {
                return None;
            }
            live += s.1 as usize;
        }
        Some(Packed { buf, spans, live })
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    pub fn get(&self, i: usize) -> &[u8] {
        &self.buf[range(self.spans[i])]
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &[u8]> + ExactSizeIterator + '_ {
        self.spans.iter().map(|s| &self.buf[range(*s)])
    }

    /// Sum of the strings' lengths.
    pub fn live_bytes(&self) -> usize {
        self.live
    }

    /// Memory held, for cache weights.
    pub fn heap_bytes(&self) -> usize {
        self.buf.capacity() + self.spans.capacity() * std::mem::size_of::<Span>()
    }

    /// The first index whose string does not satisfy `pred` (which must be
    /// true for a prefix of the list).
    pub fn partition_point(&self, mut pred: impl FnMut(&[u8]) -> bool) -> usize {
        self.spans.partition_point(|s| pred(&self.buf[range(*s)]))
    }

    fn append_bytes(&mut self, s: &[u8]) -> Span {
        let span = (self.buf.len() as u32, s.len() as u32);
        self.buf.extend_from_slice(s);
        span
    }

    pub fn push(&mut self, s: &[u8]) {
        let span = self.append_bytes(s);
        self.spans.push(span);
        self.live += s.len();
    }

    pub fn insert(&mut self, i: usize, s: &[u8]) {
        let span = self.append_bytes(s);
        self.spans.insert(i, span);
        self.live += s.len();
    }

    /// Replaces string `i`, returning the old one.
    pub fn set(&mut self, i: usize, s: &[u8]) -> Vec<u8> {
        let old = self.spans[i];
        let out = self.buf[range(old)].to_vec();
        self.spans[i] = if s.len() <= old.1 as usize {
            let span = (old.0, s.len() as u32);
            self.buf[range(span)].copy_from_slice(s);
            span
        } else {
            self.append_bytes(s)
        };
        self.live = self.live - old.1 as usize + s.len();
        self.maybe_compact();
        out
    }

    pub fn remove(&mut self, i: usize) -> Vec<u8> {
        let span = self.spans.remove(i);
        let out = self.buf[range(span)].to_vec();
        self.live -= span.1 as usize;
        self.maybe_compact();
        out
    }

    pub fn pop(&mut self) -> Option<Vec<u8>> {
        let i = self.len().checked_sub(1)?;
        Some(self.remove(i))
    }

    /// Splits off strings `at..` into a new list; both halves are compact.
    pub fn split_off(&mut self, at: usize) -> Packed {
        let right: Packed = self.spans[at..].iter().map(|s| &self.buf[range(*s)]).collect();
        *self = self.spans[..at].iter().map(|s| &self.buf[range(*s)]).collect();
        right
    }

    pub fn extend_from(&mut self, other: &Packed) {
        self.buf.reserve(other.live);
        for s in other.iter() {
            self.push(s);
        }
    }

    fn maybe_compact(&mut self) {
        if self.buf.len() > 2 * self.live + 4096 {
            *self = self.iter().collect();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(p: &Packed) -> Vec<Vec<u8>> {
        p.iter().map(<[u8]>::to_vec).collect()
    }

    #[test]
    fn edits_match_a_vec_of_vecs_and_the_buffer_stays_bounded() {
        let mut p = Packed::default();
        let mut model: Vec<Vec<u8>> = Vec::new();
        let mut x = 12345u64;
        for step in 0..20_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let len = (x >> 40) as usize % 40;
            let s = vec![(step % 251) as u8; len];
            let at = if model.is_empty() { 0 } else { (x >> 20) as usize % model.len() };
            match (x >> 8) % 5 {
                0 | 1 => {
                    p.insert(at, &s);
                    model.insert(at, s);
                }
                2 if !model.is_empty() => {
                    assert_eq!(p.set(at, &s), std::mem::replace(&mut model[at], s));
                }
                3 if !model.is_empty() => assert_eq!(p.remove(at), model.remove(at)),
                _ if model.len() > 300 => {
                    let right = p.split_off(at);
                    let model_right = model.split_off(at);
                    assert_eq!(strings(&right), model_right);
                    p.extend_from(&right);
                    model.extend(model_right);
                }
                _ => {
                    p.push(&s);
                    model.push(s);
                }
            }
            assert_eq!(p.live_bytes(), model.iter().map(Vec::len).sum::<usize>());
            assert!(p.buf.len() <= 2 * p.live_bytes() + 4096 + 64, "buffer {} for {} live", p.buf.len(), p.live);
        }
        assert_eq!(strings(&p), model);
    }

    #[test]
    fn a_list_over_a_buffer_reads_its_ranges() {
        assert!(Packed::from_parts(b"ab".to_vec(), vec![(1, 2)]).is_none());
        let mut p = Packed::from_parts(b"..ab...cde".to_vec(), vec![(2, 2), (7, 3)]).expect("in bounds");
        assert_eq!(strings(&p), vec![b"ab".to_vec(), b"cde".to_vec()]);
        assert_eq!(p.partition_point(|s| s < b"b".as_slice()), 1);
        p.set(0, b"z");
        assert_eq!(strings(&p), vec![b"z".to_vec(), b"cde".to_vec()]);
        assert_eq!(p, [b"z".as_slice(), b"cde"].into_iter().collect());
    }
}
