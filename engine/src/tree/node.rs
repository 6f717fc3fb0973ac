//! Tree nodes and their on-disk encoding.

use super::packed::{Packed, Span};
use crate::error::{Error, Result};
use crate::format::{Addr, Reader, Writer};
use std::sync::Arc;

/// Deeper trees than this are corrupt: with a fan-out of at least two it
/// would take more than 2^24 entries per level... far past any disk.
pub const MAX_LEVEL: u8 = 24;

pub type Entry = (Vec<u8>, Vec<u8>);

#[derive(Clone, Debug)]
pub enum Node {
    Leaf(Leaf),
    Branch(Branch),
}

/// Entries in strictly increasing key order. Key `i` is string `2i` of one
/// packed list and its value string `2i + 1`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Leaf {
    strings: Packed,
}

/// `keys[i]` is the smallest key in `children[i + 1]`.
#[derive(Clone, Debug)]
pub struct Branch {
    pub level: u8,
    pub keys: Packed,
    pub children: Vec<Child>,
}

/// A pointer to a child: in memory while dirty, an address once written.
#[derive(Clone, Debug)]
pub enum Child {
    Mem(Arc<Node>),
    Disk(Addr),
}

/// Whether `a` sorts strictly before `b`, as `a < b` does. Keys start with
/// a tag and big-endian numbers, so neighbours share long prefixes: eight
/// bytes at a time is several times faster than a call to memcmp per key.
#[inline]
pub fn sorts_before(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().min(b.len());
    let (mut ca, mut cb) = (a[..n].chunks_exact(8), b[..n].chunks_exact(8));
    for (x, y) in (&mut ca).zip(&mut cb) {
        let word = |c: &[u8]| c.try_into().map_or(0, u64::from_be_bytes);
        let (x, y) = (word(x), word(y));
        if x != y {
            return x < y;
        }
    }
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        if x != y {
            return x < y;
        }
    }
    a.len() < b.len()
}

pub fn entry_size(k: &[u8], v: &[u8]) -> usize {
    k.len() + v.len() + 6
}

impl Leaf {
    pub fn from_entries<K: AsRef<[u8]>, V: AsRef<[u8]>>(entries: impl IntoIterator<Item = (K, V)>) -> Leaf {
        let mut strings = Packed::default();
        for (k, v) in entries {
            strings.push(k.as_ref());
            strings.push(v.as_ref());
        }
        Leaf { strings }
    }

    pub fn len(&self) -> usize {
        self.strings.len() / 2
    }

    pub fn is_empty(&self) -> bool {
        self.strings.is_empty()
    }

    /// Encoded size of the entries.
    pub fn bytes(&self) -> usize {
        self.strings.live_bytes() + 6 * self.len()
    }

    pub fn key(&self, i: usize) -> &[u8] {
        self.strings.get(2 * i)
    }

    pub fn value(&self, i: usize) -> &[u8] {
        self.strings.get(2 * i + 1)
    }

    pub fn entries(&self) -> impl DoubleEndedIterator<Item = (&[u8], &[u8])> + ExactSizeIterator + '_ {
        self.entries_from(0)
    }

    /// The entries from index `start` on.
    pub fn entries_from(
        &self,
        start: usize,
    ) -> impl DoubleEndedIterator<Item = (&[u8], &[u8])> + ExactSizeIterator + '_ {
        (start.min(self.len())..self.len()).map(|i| (self.key(i), self.value(i)))
    }

    /// Where `key` is (`Ok`), or where it would go (`Err`).
    pub fn search(&self, key: &[u8]) -> std::result::Result<usize, usize> {
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.key(mid).cmp(key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Ok(mid),
            }
        }
        Err(lo)
    }

    /// The index of the first key `>= key`.
    pub fn lower_bound(&self, key: &[u8]) -> usize {
        self.search(key).unwrap_or_else(|i| i)
    }

    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.search(key).ok().map(|i| self.value(i))
    }

    /// Inserts or replaces; returns the value replaced.
    pub fn put(&mut self, key: &[u8], val: &[u8]) -> Option<Vec<u8>> {
        match self.search(key) {
            Ok(i) => Some(self.strings.set(2 * i + 1, val)),
            Err(i) => {
                self.strings.insert(2 * i, key);
                self.strings.insert(2 * i + 1, val);
                None
            }
        }
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: &[u8]) -> Option<Vec<u8>> {
        let i = self.search(key).ok()?;
        let v = self.strings.remove(2 * i + 1);
        self.strings.remove(2 * i);
        Some(v)
    }

    /// Moves the entries `at..` into a new leaf.
    pub fn split_off(&mut self, at: usize) -> Leaf {
        Leaf { strings: self.strings.split_off(2 * at) }
    }

    /// Appends the entries of `other`, all of whose keys are greater.
    pub fn append(&mut self, other: &Leaf) {
        self.strings.extend_from(&other.strings);
    }
}

impl Node {
    pub fn level(&self) -> u8 {
        match self {
            Node::Leaf(_) => 0,
            Node::Branch(b) => b.level,
        }
    }

    /// Approximate in-memory weight, for the node cache.
    pub fn weight(&self) -> u64 {
        64 + match self {
            Node::Leaf(l) => l.strings.heap_bytes(),
            Node::Branch(b) => b.keys.heap_bytes() + b.children.capacity() * std::mem::size_of::<Child>(),
        } as u64
    }

    /// Encodes a node whose children are all on disk.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut w = Writer::new();
        match self {
            Node::Leaf(l) => {
                w.u8(0);
                w.u32(l.len() as u32);
                for (k, v) in l.entries() {
                    w.u16(k.len() as u16);
                    w.bytes(k);
                    w.u32(v.len() as u32);
                    w.bytes(v);
                }
            }
            Node::Branch(b) => {
                w.u8(b.level);
                w.u32(b.children.len() as u32);
                for c in &b.children {
                    match c {
                        Child::Disk(a) => w.addr(a),
                        Child::Mem(_) => return Err(Error::Invalid("encoding a node with an unwritten child")),
                    }
                }
                for k in b.keys.iter() {
                    w.u16(k.len() as u16);
                    w.bytes(k);
                }
            }
        }
        Ok(w.buf)
    }

    /// Decodes a node, checking every length and that keys are strictly
    /// increasing. Never panics on garbage.
    pub fn decode(bytes: &[u8]) -> Result<Node> {
        Node::decode_owned(bytes.to_vec())
    }

    /// [`Node::decode`], keeping `bytes` as the node's buffer: a node costs a
    /// few allocations, not one per key and value.
    pub fn decode_owned(bytes: Vec<u8>) -> Result<Node> {
        let bad = || Error::Corrupted { what: "tree node", addr: "layout".into() };
        let mut r = Reader::new(&bytes, "tree node");
        let level = r.u8()?;
        let count = r.u32()? as usize;
        if level > MAX_LEVEL {
            return Err(bad());
        }
        // Takes a string of `len` bytes, checking it sorts after `prev`.
        #[inline(always)]
        fn string<'a>(
            r: &mut Reader<'a>,
            len: usize,
            prev: &mut Option<&'a [u8]>,
            spans: &mut Vec<Span>,
        ) -> Result<()> {
            let at = r.position();
            let s = r.take(len)?;
            if let Some(p) = prev.replace(s) {
                if !sorts_before(p, s) {
                    return Err(Error::Corrupted { what: "tree node", addr: "key order".into() });
                }
            }
            spans.push((at as u32, len as u32));
            Ok(())
        }
        if level == 0 {
            if count > r.remaining() / 6 {
                return Err(bad());
            }
            let mut spans = Vec::with_capacity(2 * count);
            let mut prev = None;
            for _ in 0..count {
                let klen = r.u16()? as usize;
                string(&mut r, klen, &mut prev, &mut spans)?;
                let vlen = r.u32()? as usize;
                let at = r.position();
                r.take(vlen)?;
                spans.push((at as u32, vlen as u32));
            }
            r.finish()?;
            let strings = Packed::from_parts(bytes, spans).ok_or_else(bad)?;
            Ok(Node::Leaf(Leaf { strings }))
        } else {
            if count == 0 || count > r.remaining() / Addr::ENCODED_LEN {
                return Err(bad());
            }
            let mut children = Vec::with_capacity(count);
            for c in r.take(count * Addr::ENCODED_LEN)?.chunks_exact(Addr::ENCODED_LEN) {
                children.push(Child::Disk(Addr::from_encoded(c.try_into().map_err(|_| bad())?)));
            }
            let mut spans = Vec::with_capacity(count - 1);
            let mut prev = None;
            for _ in 1..count {
                let klen = r.u16()? as usize;
                string(&mut r, klen, &mut prev, &mut spans)?;
            }
            r.finish()?;
            let keys = Packed::from_parts(bytes, spans).ok_or_else(bad)?;
            Ok(Node::Branch(Branch { level, keys, children }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Byte strings from a small alphabet, so that pairs share prefixes
    /// of every length, across and within 8-byte words.
    fn key() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(prop_oneof![Just(0u8), Just(1), Just(0x80), Just(0xff)], 0..20)
    }

    proptest! {
        #[test]
        fn sorts_before_is_byte_order(a in key(), b in key(), shared in key()) {
            prop_assert_eq!(sorts_before(&a, &b), a < b);
            prop_assert!(!sorts_before(&a, &a));
            let (x, y) = ([shared.as_slice(), &a].concat(), [shared.as_slice(), &b].concat());
            prop_assert_eq!(sorts_before(&x, &y), x < y);
        }
    }

    #[test]
    fn decode_refuses_keys_out_of_order_in_leaves_and_branches() {
        let keys: [&[u8]; 3] = [b"I\0\0\0\0\0\0\0\x01a", b"I\0\0\0\0\0\0\0\x01b", b"I\0\0\0\0\0\0\0\x01b\0"];
        let leaf =
            |ks: &[&[u8]]| Node::Leaf(Leaf::from_entries(ks.iter().map(|k| (*k, b"v")))).encode().expect("encode");
        let branch = |ks: &[&[u8]]| {
            let mut keys = Packed::default();
            ks.iter().for_each(|k| keys.push(k));
            let addr = Addr { seg: crate::format::SegId { writer: 1, seq: 2 }, off: 3, len: 4 };
            let children = (0..=ks.len()).map(|_| Child::Disk(addr)).collect();
            Node::Branch(Branch { level: 1, keys, children }).encode().expect("encode")
        };
        for encode in [&leaf as &dyn Fn(&[&[u8]]) -> Vec<u8>, &branch] {
            assert!(Node::decode(&encode(&keys)).is_ok());
            // Differing past the first eight bytes, and a key that is a prefix of the next.
            for bad in [[keys[1], keys[0], keys[2]], [keys[0], keys[2], keys[1]], [keys[0], keys[1], keys[1]]] {
                assert!(Node::decode(&encode(&bad)).is_err(), "{bad:?}");
            }
        }
        let node = Node::decode(&branch(&keys)).expect("decode");
        let Node::Branch(b) = node else { panic!("a branch") };
        assert!(matches!(b.children[2], Child::Disk(a) if a.off == 3 && a.len == 4 && a.seg.seq == 2));
    }
}
