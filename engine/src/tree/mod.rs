//! A copy-on-write B+tree of byte keys and values.
//!
//! Nodes are immutable values behind `Arc`; a change path-copies from the
//! root with `Arc::make_mut`, in place when nobody else holds a node. A clean
//! node is known by its address and loaded through a [`NodeStore`] (which
//! verifies and caches it); a dirty one lives only in memory until
//! [`Tree::flush`] writes it, children first. Cloning a [`Tree`] is O(1).

mod cache;
mod diff;
mod node;
mod packed;

pub use diff::{diff, walk, Difference};

pub use cache::NodeCache;
pub use node::{Branch, Child, Entry, Leaf, Node, MAX_LEVEL};
pub use packed::Packed;

use crate::error::{Error, Result};
use crate::format::Addr;
use std::sync::Arc;

/// A leaf is split once its encoded entries pass this many bytes.
pub const LEAF_MAX: usize = 16 << 10;
/// A branch is split past this many children.
pub const BRANCH_MAX: usize = 128;

/// Loads clean nodes and writes dirty ones.
pub trait NodeStore {
    /// The node at `addr`, verified; cached by the store as it sees fit.
    fn load(&self, addr: Addr) -> Result<Arc<Node>>;
    /// Appends a node (all of whose children are on disk) and returns its address.
    fn write(&self, node: &Node) -> Result<Addr>;
    /// Offers a just-written node to the cache.
    fn cache(&self, _addr: Addr, _node: Arc<Node>) {}
    /// A written node is no longer part of this tree (it was copied for a
    /// change, or merged away): for live-bytes accounting.
    fn released(&self, _addr: Addr) {}
    /// File data bytes in segment `seg` were added to (or, negative, dropped
    /// from) this tree.
    fn account_data(&self, _seg: crate::format::SegId, _delta: i64) {}
}

#[derive(Clone, Debug)]
pub struct Tree {
    root: Child,
}

impl Default for Tree {
    fn default() -> Self {
        Self::new()
    }
}

fn corrupt_level(addr: Addr) -> Error {
    Error::corrupted("tree node (wrong level)", addr)
}

/// Loads a child, checking that its level is the one its parent implies;
/// that check is what makes a cycle of corrupt pointers impossible.
fn load(store: &dyn NodeStore, child: &Child, level: Option<u8>) -> Result<Arc<Node>> {
    match child {
        Child::Mem(n) => Ok(n.clone()),
        Child::Disk(a) => {
            let n = store.load(*a)?;
            match level {
                Some(l) if n.level() != l => Err(corrupt_level(*a)),
                _ => Ok(n),
            }
        }
    }
}

fn make_mut<'a>(store: &dyn NodeStore, child: &'a mut Child, level: Option<u8>) -> Result<&'a mut Node> {
    if let Child::Disk(a) = *child {
        let n = load(store, child, level)?;
        *child = Child::Mem(Arc::new((*n).clone()));
        store.released(a);
    }
    match child {
        Child::Mem(arc) => Ok(Arc::make_mut(arc)),
        Child::Disk(a) => Err(corrupt_level(*a)),
    }
}

fn child_level(b: &Branch) -> Option<u8> {
    Some(b.level.saturating_sub(1))
}

fn child_index(b: &Branch, key: &[u8]) -> usize {
    b.keys.partition_point(|k| k <= key)
}

type Split = Option<(Vec<u8>, Child)>;

/// Called on each entry of a scan; returns whether to go on.
pub type Visitor<'a> = &'a mut dyn FnMut(&[u8], &[u8]) -> Result<bool>;

impl Tree {
    pub fn new() -> Tree {
        Tree { root: Child::Mem(Arc::new(Node::Leaf(Leaf::default()))) }
    }

    pub fn from_root(addr: Addr) -> Tree {
        Tree { root: Child::Disk(addr) }
    }

    /// The root's address, if nothing has changed since the last flush.
    pub fn root_addr(&self) -> Option<Addr> {
        match self.root {
            Child::Disk(a) => Some(a),
            Child::Mem(_) => None,
        }
    }

    pub fn get(&self, store: &dyn NodeStore, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let mut node = load(store, &self.root, None)?;
        loop {
            let next = match &*node {
                Node::Leaf(l) => return Ok(l.get(key).map(<[u8]>::to_vec)),
                Node::Branch(b) => load(store, &b.children[child_index(b, key)], child_level(b))?,
            };
            node = next;
        }
    }

    /// Calls `f` on every entry with key `>= from`, in order, until it returns false.
    pub fn scan(&self, store: &dyn NodeStore, from: &[u8], f: Visitor) -> Result<()> {
        let root = load(store, &self.root, None)?;
        scan_node(store, &root, from, f).map(|_| ())
    }

    /// The first entry with key `>= from`.
    pub fn first_from(&self, store: &dyn NodeStore, from: &[u8]) -> Result<Option<Entry>> {
        let mut found = None;
        self.scan(store, from, &mut |k, v| {
            found = Some((k.to_vec(), v.to_vec()));
            Ok(false)
        })?;
        Ok(found)
    }

    pub fn insert(&mut self, store: &dyn NodeStore, key: Vec<u8>, val: Vec<u8>) -> Result<Option<Vec<u8>>> {
        if key.len() > u16::MAX as usize {
            return Err(Error::Invalid("tree key too long"));
        }
        let (old, split) = insert_rec(store, &mut self.root, None, key, val)?;
        if let Some((k, right)) = split {
            let left = std::mem::replace(&mut self.root, Child::Disk(Addr::default()));
            let level = load(store, &left, None)?.level() + 1;
            let keys = Packed::from_iter([k]);
            self.root = Child::Mem(Arc::new(Node::Branch(Branch { level, keys, children: vec![left, right] })));
        }
        Ok(old)
    }

    pub fn remove(&mut self, store: &dyn NodeStore, key: &[u8]) -> Result<Option<Vec<u8>>> {
        if self.get(store, key)?.is_none() {
            return Ok(None);
        }
        let old = remove_rec(store, &mut self.root, None, key)?;
        loop {
            let root = load(store, &self.root, None)?;
            match &*root {
                Node::Branch(b) if b.children.len() == 1 => self.root = b.children[0].clone(),
                _ => break,
            }
        }
        Ok(old)
    }

    /// Copies into memory (as any change does, with the path above it)
    /// every written node that `pick` chooses, so the next flush writes it
    /// afresh. Walks only into chosen nodes and nodes already in memory.
    pub fn rewrite_where(&mut self, store: &dyn NodeStore, pick: &dyn Fn(Addr) -> bool) -> Result<()> {
        rewrite_rec(store, &mut self.root, None, pick)
    }

    /// Writes every dirty node, children before parents, and returns the
    /// root's address.
    pub fn flush(&mut self, store: &dyn NodeStore) -> Result<Addr> {
        flush_rec(store, &mut self.root)
    }
}

fn scan_node(store: &dyn NodeStore, node: &Node, from: &[u8], f: Visitor) -> Result<bool> {
    match node {
        Node::Leaf(l) => {
            for (k, v) in l.entries_from(l.lower_bound(from)) {
                if !f(k, v)? {
                    return Ok(false);
                }
            }
            Ok(true)
        }
        Node::Branch(b) => {
            for c in &b.children[child_index(b, from)..] {
                let child = load(store, c, child_level(b))?;
                if !scan_node(store, &child, from, f)? {
                    return Ok(false);
                }
            }
            Ok(true)
        }
    }
}

fn insert_rec(
    store: &dyn NodeStore,
    child: &mut Child,
    level: Option<u8>,
    key: Vec<u8>,
    val: Vec<u8>,
) -> Result<(Option<Vec<u8>>, Split)> {
    match make_mut(store, child, level)? {
        Node::Leaf(l) => {
            let old = l.put(&key, &val);
            Ok((old, split_leaf(l)))
        }
        Node::Branch(b) => {
            let idx = child_index(b, &key);
            let lvl = child_level(b);
            let (old, split) = insert_rec(store, &mut b.children[idx], lvl, key, val)?;
            if let Some((k, c)) = split {
                b.keys.insert(idx, &k);
                b.children.insert(idx + 1, c);
            }
            Ok((old, split_branch(b)))
        }
    }
}

fn split_leaf(l: &mut Leaf) -> Split {
    let bytes = l.bytes();
    if bytes <= LEAF_MAX || l.len() < 2 {
        return None;
    }
    let mut acc = 0;
    let mut mid = l.len() - 1;
    for (i, (k, v)) in l.entries().enumerate() {
        acc += node::entry_size(k, v);
        if acc > bytes / 2 {
            mid = i.clamp(1, l.len() - 1);
            break;
        }
    }
    let right = l.split_off(mid);
    let key = right.key(0).to_vec();
    Some((key, Child::Mem(Arc::new(Node::Leaf(right)))))
}

fn split_branch(b: &mut Branch) -> Split {
    if b.children.len() <= BRANCH_MAX {
        return None;
    }
    let mid = b.children.len() / 2;
    let children = b.children.split_off(mid);
    let keys = b.keys.split_off(mid);
    let sep = b.keys.pop()?;
    Some((sep, Child::Mem(Arc::new(Node::Branch(Branch { level: b.level, keys, children })))))
}

fn remove_rec(store: &dyn NodeStore, child: &mut Child, level: Option<u8>, key: &[u8]) -> Result<Option<Vec<u8>>> {
    match make_mut(store, child, level)? {
        Node::Leaf(l) => Ok(l.remove(key)),
        Node::Branch(b) => {
            let idx = child_index(b, key);
            let lvl = child_level(b);
            let old = remove_rec(store, &mut b.children[idx], lvl, key)?;
            rebalance(store, b, idx)?;
            Ok(old)
        }
    }
}

fn fill(node: &Node) -> (usize, usize) {
    match node {
        Node::Leaf(l) => (l.bytes(), LEAF_MAX),
        Node::Branch(b) => (b.children.len(), BRANCH_MAX),
    }
}

/// After a removal below `b.children[idx]`: drop the child if it is empty,
/// or merge it with a neighbour if both fit in one node.
fn rebalance(store: &dyn NodeStore, b: &mut Branch, idx: usize) -> Result<()> {
    let lvl = child_level(b);
    let node = load(store, &b.children[idx], lvl)?;
    let (used, max) = fill(&node);
    if used == 0 && b.children.len() > 1 {
        if let Child::Disk(a) = b.children.remove(idx) {
            store.released(a);
        }
        b.keys.remove(idx.saturating_sub(1));
        return Ok(());
    }
    if used >= max / 4 || b.children.len() < 2 {
        return Ok(());
    }
    let left = if idx + 1 < b.children.len() { idx } else { idx - 1 };
    let right = load(store, &b.children[left + 1], lvl)?;
    let left_node = load(store, &b.children[left], lvl)?;
    if fill(&left_node).0 + fill(&right).0 > max {
        return Ok(());
    }
    let sep = b.keys.remove(left);
    if let Child::Disk(a) = b.children.remove(left + 1) {
        store.released(a);
    }
    match (make_mut(store, &mut b.children[left], lvl)?, &*right) {
        (Node::Leaf(l), Node::Leaf(r)) => l.append(r),
        (Node::Branch(l), Node::Branch(r)) => {
            l.keys.push(&sep);
            l.keys.extend_from(&r.keys);
            l.children.extend(r.children.iter().cloned());
        }
        _ => return Err(Error::corrupted("tree node (mixed levels)", "merge")),
    }
    Ok(())
}

fn rewrite_rec(store: &dyn NodeStore, child: &mut Child, level: Option<u8>, pick: &dyn Fn(Addr) -> bool) -> Result<()> {
    if let Child::Disk(a) = child {
        if !pick(*a) {
            return Ok(());
        }
    }
    if let Node::Branch(b) = make_mut(store, child, level)? {
        let lvl = child_level(b);
        for c in b.children.iter_mut() {
            rewrite_rec(store, c, lvl, pick)?;
        }
    }
    Ok(())
}

fn flush_rec(store: &dyn NodeStore, child: &mut Child) -> Result<Addr> {
    let arc = match child {
        Child::Disk(a) => return Ok(*a),
        Child::Mem(arc) => arc,
    };
    if let Node::Branch(b) = Arc::make_mut(arc) {
        for c in b.children.iter_mut() {
            flush_rec(store, c)?;
        }
    }
    let addr = store.write(arc)?;
    if let Child::Mem(arc) = std::mem::replace(child, Child::Disk(addr)) {
        store.cache(addr, arc);
    }
    Ok(addr)
}

/// An in-memory node store that keeps encoded nodes, so tests and fuzzing
/// run the real encoder and decoder.
#[derive(Default)]
pub struct MemNodeStore {
    nodes: parking_lot::Mutex<Vec<Vec<u8>>>,
}

impl NodeStore for MemNodeStore {
    fn load(&self, addr: Addr) -> Result<Arc<Node>> {
        let nodes = self.nodes.lock();
        let bytes = nodes.get(addr.off as usize).ok_or_else(|| Error::corrupted("tree node (bad address)", addr))?;
        Ok(Arc::new(Node::decode(bytes)?))
    }

    fn write(&self, node: &Node) -> Result<Addr> {
        let bytes = node.encode()?;
        let mut nodes = self.nodes.lock();
        nodes.push(bytes);
        Ok(Addr { off: (nodes.len() - 1) as u32, ..Addr::default() })
    }
}
