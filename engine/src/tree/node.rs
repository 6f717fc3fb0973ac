//! Tree nodes and their on-disk encoding.

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

#[derive(Clone, Debug, Default)]
pub struct Leaf {
    pub entries: Vec<Entry>,
    /// Encoded size of the entries, kept up to date so splits are O(1) to decide.
    pub bytes: usize,
}

/// `keys[i]` is the smallest key in `children[i + 1]`.
#[derive(Clone, Debug)]
pub struct Branch {
    pub level: u8,
    pub keys: Vec<Vec<u8>>,
    pub children: Vec<Child>,
}

/// A pointer to a child: in memory while dirty, an address once written.
#[derive(Clone, Debug)]
pub enum Child {
    Mem(Arc<Node>),
    Disk(Addr),
}

pub fn entry_size(k: &[u8], v: &[u8]) -> usize {
    k.len() + v.len() + 6
}

impl Leaf {
    pub fn from_entries(entries: Vec<Entry>) -> Leaf {
        let bytes = entries.iter().map(|(k, v)| entry_size(k, v)).sum();
        Leaf { entries, bytes }
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
            Node::Leaf(l) => l.bytes + l.entries.len() * 48,
            Node::Branch(b) => b.keys.iter().map(|k| k.len() + 24).sum::<usize>() + b.children.len() * 32,
        } as u64
    }

    /// Encodes a node whose children are all on disk.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut w = Writer::new();
        match self {
            Node::Leaf(l) => {
                w.u8(0);
                w.u32(l.entries.len() as u32);
                for (k, v) in &l.entries {
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
                for k in &b.keys {
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
        let mut r = Reader::new(bytes, "tree node");
        let level = r.u8()?;
        let count = r.u32()? as usize;
        let bad = || Error::Corrupted { what: "tree node", addr: "layout".into() };
        if level > MAX_LEVEL {
            return Err(bad());
        }
        let node = if level == 0 {
            if count > r.remaining() / 6 {
                return Err(bad());
            }
            let mut entries: Vec<Entry> = Vec::with_capacity(count);
            for _ in 0..count {
                let klen = r.u16()? as usize;
                let k = r.take(klen)?.to_vec();
                let vlen = r.u32()? as usize;
                let v = r.take(vlen)?.to_vec();
                if entries.last().is_some_and(|(prev, _)| *prev >= k) {
                    return Err(bad());
                }
                entries.push((k, v));
            }
            Node::Leaf(Leaf::from_entries(entries))
        } else {
            if count == 0 || count > r.remaining() / crate::format::Addr::ENCODED_LEN {
                return Err(bad());
            }
            let mut children = Vec::with_capacity(count);
            for _ in 0..count {
                children.push(Child::Disk(r.addr()?));
            }
            let mut keys: Vec<Vec<u8>> = Vec::with_capacity(count - 1);
            for _ in 1..count {
                let klen = r.u16()? as usize;
                let k = r.take(klen)?.to_vec();
                if keys.last().is_some_and(|prev| *prev >= k) {
                    return Err(bad());
                }
                keys.push(k);
            }
            Node::Branch(Branch { level, keys, children })
        };
        r.finish()?;
        Ok(node)
    }
}
