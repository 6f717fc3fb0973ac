//! Comparing two committed trees in time proportional to what differs,
//! and walking everything a tree reaches.
//!
//! Two trees that share history share nodes: a copy-on-write change copies
//! only the path from the root to what changed. The diff walks two nodes'
//! children side by side, skips every child both share (equal subtrees)
//! and follows only the paths that differ; where a split or merge left the
//! two sides cut differently, it compares that run level by level.

use super::{load, Branch, Child, Node, NodeStore};
use crate::error::{Error, Result};
use crate::format::Addr;
use std::collections::HashSet;
use std::sync::Arc;
/// The nodes of one side at one tree level, by address, in key order.
struct Level {
    level: u8,
    addrs: Vec<Addr>,
}

impl Level {
    /// Loads each node (all of which differ from the other side) and lists
    /// its children: only nodes that differ are ever loaded.
    fn expand(self, store: &dyn NodeStore) -> Result<Level> {
        let mut addrs = Vec::new();
        for a in self.addrs {
            if let Node::Branch(b) = &*load(store, &Child::Disk(a), Some(self.level))? {
                addrs.extend(b.children.iter().filter_map(|c| match c {
                    Child::Disk(a) => Some(*a),
                    Child::Mem(_) => None,
                }));
            }
        }
        Ok(Level { level: self.level.saturating_sub(1), addrs })
    }

    /// The leaves of this level, in key order.
    fn leaves(&self, store: &dyn NodeStore) -> Result<Vec<Arc<Node>>> {
        self.addrs.iter().map(|a| load(store, &Child::Disk(*a), Some(0))).collect()
    }

    /// Drops the addresses both levels hold (their subtrees are equal).
    fn drop_shared(&mut self, other: &mut Level) {
        let mut mine = self.addrs.clone();
        mine.sort_unstable();
        let mut theirs = other.addrs.clone();
        theirs.sort_unstable();
        let shared: Vec<Addr> = intersect(&mine, &theirs);
        if !shared.is_empty() {
            self.addrs.retain(|a| shared.binary_search(a).is_err());
            other.addrs.retain(|a| shared.binary_search(a).is_err());
        }
    }
}

/// The addresses in both sorted lists.
fn intersect(a: &[Addr], b: &[Addr]) -> Vec<Addr> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out
}

/// One entry that differs: its key, and its value on each side.
pub type Difference<'a> = (&'a [u8], Option<&'a [u8]>, Option<&'a [u8]>);

/// Calls `f` for every key whose value differs between the trees rooted at
/// `a` and `b` (both written), in key order.
pub fn diff(store: &dyn NodeStore, a: Addr, b: Addr, f: &mut dyn FnMut(Difference) -> Result<()>) -> Result<()> {
    if a == b {
        return Ok(());
    }
    let (na, nb) = (load(store, &Child::Disk(a), None)?, load(store, &Child::Disk(b), None)?);
    if na.level() == nb.level() {
        return diff_nodes(store, &na, &nb, f);
    }
    diff_levels(store, Level { level: na.level(), addrs: vec![a] }, Level { level: nb.level(), addrs: vec![b] }, f)
}

/// Two nodes of one level covering the same key range. Both lists of
/// children are walked in key order and cut wherever the two sides agree on
/// a boundary: at a child both share (its address on both sides: equal
/// subtrees, skipped; every entry before it on either side is smaller than
/// its keys) or at a separator key both hold. The children between two cuts
/// cover the same keys on both sides: a single pair is compared on its own,
/// and only a run whose cuts differ (a child split or merged) is left to the
/// level-by-level comparison. Mostly this compares addresses, not keys.
fn diff_nodes(store: &dyn NodeStore, a: &Node, b: &Node, f: &mut dyn FnMut(Difference) -> Result<()>) -> Result<()> {
    let (x, y) = match (a, b) {
        (Node::Leaf(x), Node::Leaf(y)) => return merge(x.entries(), y.entries(), f),
        (Node::Branch(x), Node::Branch(y)) => (x, y),
        _ => return Err(Error::corrupted("tree node (mixed levels)", "diff")),
    };
    let level = x.level - 1;
    let mut run = |left: &[Child], right: &[Child]| -> Result<()> {
        match (left, right) {
            ([], []) => Ok(()),
            ([Child::Disk(l)], [Child::Disk(r)]) if l == r => Ok(()),
            ([l], [r]) => diff_nodes(store, &*load(store, l, Some(level))?, &*load(store, r, Some(level))?, f),
            _ => {
                let (left, right) = (disk_addrs(left)?, disk_addrs(right)?);
                diff_levels(store, Level { level, addrs: left }, Level { level, addrs: right }, f)
            }
        }
    };
    let (xs, ys) = (&x.children, &y.children);
    // Child k covers [keys[k-1], keys[k]); the last one has no upper key.
    let (mut i, mut j, mut from_l, mut from_r) = (0, 0, 0, 0);
    while i < xs.len() && j < ys.len() {
        if let (Child::Disk(l), Child::Disk(r)) = (&xs[i], &ys[j]) {
            if l == r {
                run(&xs[from_l..i], &ys[from_r..j])?;
                (i, j) = (i + 1, j + 1);
                (from_l, from_r) = (i, j);
                continue;
            }
        }
        match (upper(x, i), upper(y, j)) {
            (None, None) => break,
            (Some(_), None) => i += 1,
            (None, Some(_)) => j += 1,
            (Some(p), Some(q)) => match p.cmp(q) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal => {
                    run(&xs[from_l..=i], &ys[from_r..=j])?;
                    (i, j) = (i + 1, j + 1);
                    (from_l, from_r) = (i, j);
                }
            },
        }
    }
    run(&xs[from_l..], &ys[from_r..])
}

/// The smallest key past child `k`; none for the last child.
fn upper(b: &Branch, k: usize) -> Option<&[u8]> {
    (k + 1 < b.children.len()).then(|| b.keys.get(k))
}

/// The addresses of written children (a committed tree has no others).
fn disk_addrs(children: &[Child]) -> Result<Vec<Addr>> {
    children
        .iter()
        .map(|c| match c {
            Child::Disk(a) => Ok(*a),
            Child::Mem(_) => Err(Error::Invalid("diff of a tree with unwritten nodes")),
        })
        .collect()
}

/// Compares two lists of subtrees covering the same key range, level by
/// level: at each level the nodes whose address appears on both sides are
/// dropped (their subtrees are equal) and only the rest are expanded.
fn diff_levels(
    store: &dyn NodeStore,
    mut left: Level,
    mut right: Level,
    f: &mut dyn FnMut(Difference) -> Result<()>,
) -> Result<()> {
    loop {
        // Bring both sides to the same level.
        while left.level > right.level && !left.addrs.is_empty() {
            left = left.expand(store)?;
        }
        while right.level > left.level && !right.addrs.is_empty() {
            right = right.expand(store)?;
        }
        left.drop_shared(&mut right);
        let bottom = |l: &Level| l.level == 0 || l.addrs.is_empty();
        if bottom(&left) && bottom(&right) {
            let (l, r) = (left.leaves(store)?, right.leaves(store)?);
            return merge(entries_of(&l), entries_of(&r), f);
        }
        if !bottom(&left) {
            left = left.expand(store)?;
        }
        if !bottom(&right) {
            right = right.expand(store)?;
        }
    }
}

/// The entries of `leaves`, in key order, without copying them.
fn entries_of(leaves: &[Arc<Node>]) -> impl Iterator<Item = (&[u8], &[u8])> {
    leaves
        .iter()
        .flat_map(|n| match &**n {
            Node::Leaf(l) => Some(l.entries()),
            Node::Branch(_) => None,
        })
        .flatten()
}

/// Merges two sorted entry sequences, reporting the keys whose values differ.
fn merge<'a>(
    mut l: impl Iterator<Item = (&'a [u8], &'a [u8])>,
    mut r: impl Iterator<Item = (&'a [u8], &'a [u8])>,
    f: &mut dyn FnMut(Difference) -> Result<()>,
) -> Result<()> {
    let (mut x, mut y) = (l.next(), r.next());
    loop {
        match (x, y) {
            (None, None) => return Ok(()),
            (Some((lk, lv)), Some((rk, rv))) if lk == rk => {
                if lv != rv {
                    f((lk, Some(lv), Some(rv)))?;
                }
                (x, y) = (l.next(), r.next());
            }
            (Some((lk, lv)), Some((rk, _))) if lk < rk => {
                f((lk, Some(lv), None))?;
                x = l.next();
            }
            (Some((lk, lv)), None) => {
                f((lk, Some(lv), None))?;
                x = l.next();
            }
            (_, Some((rk, rv))) => {
                f((rk, None, Some(rv)))?;
                y = r.next();
            }
        }
    }
}

/// Visits every node reachable from `root` that is not in `seen` (and adds
/// it there), so walking many roots that share subtrees visits each once.
pub fn walk(
    store: &dyn NodeStore,
    root: Addr,
    seen: &mut HashSet<Addr>,
    f: &mut dyn FnMut(Addr, &Node) -> Result<()>,
) -> Result<()> {
    let mut stack = vec![(root, None)];
    while let Some((addr, level)) = stack.pop() {
        if !seen.insert(addr) {
            continue;
        }
        let node = load(store, &Child::Disk(addr), level)?;
        f(addr, &node)?;
        if let Node::Branch(b) = &*node {
            for c in &b.children {
                if let Child::Disk(a) = c {
                    stack.push((*a, Some(b.level - 1)));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{MemNodeStore, Tree};
    use std::collections::BTreeMap;
    use std::sync::Arc;

    fn key(i: u32) -> Vec<u8> {
        format!("k{i:07}").into_bytes()
    }

    /// Counts node loads, to show the diff touches little of a big tree.
    struct Counting<'a>(&'a MemNodeStore, std::cell::Cell<u64>);

    impl NodeStore for Counting<'_> {
        fn load(&self, addr: Addr) -> Result<Arc<Node>> {
            self.1.set(self.1.get() + 1);
            self.0.load(addr)
        }
        fn write(&self, node: &Node) -> Result<Addr> {
            self.0.write(node)
        }
    }

    #[test]
    fn diff_finds_exactly_the_changes_and_skips_shared_subtrees() {
        let s = MemNodeStore::default();
        let mut t = Tree::new();
        for i in 0..50_000 {
            t.insert(&s, key(i), vec![1; 20]).expect("insert");
        }
        let a = t.flush(&s).expect("flush");
        t.insert(&s, key(10), vec![2; 20]).expect("modify");
        t.remove(&s, &key(20_000)).expect("remove");
        t.insert(&s, b"k9999999x".to_vec(), vec![3]).expect("add");
        let b = t.flush(&s).expect("flush");
        let counting = Counting(&s, Default::default());
        let mut got = BTreeMap::new();
        diff(&counting, a, b, &mut |(k, l, r)| {
            got.insert(k.to_vec(), (l.map(<[u8]>::to_vec), r.map(<[u8]>::to_vec)));
            Ok(())
        })
        .expect("diff");
        assert_eq!(got.len(), 3);
        assert_eq!(got[&key(10)], (Some(vec![1; 20]), Some(vec![2; 20])));
        assert_eq!(got[&key(20_000)], (Some(vec![1; 20]), None));
        assert_eq!(got[&b"k9999999x".to_vec()], (None, Some(vec![3])));
        let mut all = HashSet::new();
        walk(&s, b, &mut all, &mut |_, _| Ok(())).expect("walk");
        assert!(
            counting.1.get() < all.len() as u64 / 4,
            "{} loads for a tree of {} nodes",
            counting.1.get(),
            all.len()
        );
    }

    #[test]
    fn diff_of_unrelated_trees_equals_a_full_comparison() {
        let s = MemNodeStore::default();
        let (mut x, mut y) = (Tree::new(), Tree::new());
        for i in 0..3000 {
            x.insert(&s, key(i), vec![(i % 7) as u8]).expect("insert");
            y.insert(&s, key(i * 2), vec![(i % 5) as u8]).expect("insert");
        }
        let (a, b) = (x.flush(&s).expect("flush"), y.flush(&s).expect("flush"));
        let mut count = 0;
        diff(&s, a, b, &mut |_| {
            count += 1;
            Ok(())
        })
        .expect("diff");
        let collect = |t: &Tree| {
            let mut m = BTreeMap::new();
            t.scan(&s, b"", &mut |k, v| {
                m.insert(k.to_vec(), v.to_vec());
                Ok(true)
            })
            .expect("scan");
            m
        };
        let (mx, my) = (collect(&x), collect(&y));
        let expected =
            mx.keys().chain(my.keys()).collect::<HashSet<_>>().into_iter().filter(|k| mx.get(*k) != my.get(*k)).count();
        assert_eq!(count, expected);
    }
}
