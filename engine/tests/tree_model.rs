//! The copy-on-write B+tree against a BTreeMap, and its corner cases.

use arbor_engine::format::Addr;
use arbor_engine::tree::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

fn key(i: u32) -> Vec<u8> {
    format!("key-{i:08}").into_bytes()
}

fn contents(t: &Tree, s: &dyn NodeStore) -> Vec<Entry> {
    let mut out = Vec::new();
    t.scan(s, b"", &mut |k, v| {
        out.push((k.to_vec(), v.to_vec()));
        Ok(true)
    })
    .expect("scan");
    out
}

#[test]
fn many_inserts_split_and_stay_ordered_through_flush_and_reload() {
    let s = MemNodeStore::default();
    let mut t = Tree::new();
    for i in (0..20_000u32).rev() {
        t.insert(&s, key(i), vec![i as u8; 40]).expect("insert");
    }
    let root = t.flush(&s).expect("flush");
    let reloaded = Tree::from_root(root);
    assert_eq!(reloaded.get(&s, &key(12_345)).expect("get"), Some(vec![(12_345u32) as u8; 40]));
    let all = contents(&reloaded, &s);
    assert_eq!(all.len(), 20_000);
    assert!(all.windows(2).all(|w| w[0].0 < w[1].0));
    assert!(s.load(root).expect("root").level() >= 2, "20k entries must make a deep tree");
}

#[test]
fn a_clone_is_a_frozen_copy() {
    let s = MemNodeStore::default();
    let mut t = Tree::new();
    for i in 0..5000 {
        t.insert(&s, key(i), b"old".to_vec()).expect("insert");
    }
    t.flush(&s).expect("flush");
    let frozen = t.clone();
    for i in 0..5000 {
        t.insert(&s, key(i), b"new".to_vec()).expect("insert");
    }
    t.remove(&s, &key(7)).expect("remove");
    assert_eq!(frozen.get(&s, &key(7)).expect("get"), Some(b"old".to_vec()));
    assert_eq!(t.get(&s, &key(8)).expect("get"), Some(b"new".to_vec()));
    assert_eq!(t.get(&s, &key(7)).expect("get"), None);
}

#[test]
fn removing_everything_collapses_the_tree() {
    let s = MemNodeStore::default();
    let mut t = Tree::new();
    for i in 0..10_000 {
        t.insert(&s, key(i), vec![1; 30]).expect("insert");
    }
    for i in 0..10_000 {
        assert!(t.remove(&s, &key(i)).expect("remove").is_some());
    }
    assert!(contents(&t, &s).is_empty());
    let root = t.flush(&s).expect("flush");
    assert_eq!(s.load(root).expect("root").level(), 0);
}

#[test]
fn a_pointer_cycle_in_corrupt_nodes_is_an_error_not_a_hang() {
    let s = MemNodeStore::default();
    // A branch at level 1 whose only child is itself (address 0).
    let looped = Node::Branch(Branch { level: 1, keys: vec![], children: vec![Child::Disk(Addr::default())] });
    let addr = s.write(&looped).expect("write");
    let t = Tree::from_root(addr);
    assert!(t.get(&s, b"x").is_err());
    assert!(t.scan(&s, b"", &mut |_, _| Ok(true)).is_err());
}

#[derive(Debug, Clone)]
enum TreeOp {
    Insert(u16, u8),
    Remove(u16),
    Flush,
    Snapshot,
}

fn op() -> impl Strategy<Value = TreeOp> {
    prop_oneof![
        6 => (0u16..2000, any::<u8>()).prop_map(|(k, v)| TreeOp::Insert(k, v)),
        3 => (0u16..2000).prop_map(TreeOp::Remove),
        1 => Just(TreeOp::Flush),
        1 => Just(TreeOp::Snapshot),
    ]
}

proptest! {
    #[test]
    fn tree_matches_a_btreemap(ops in proptest::collection::vec(op(), 1..600)) {
        let s = MemNodeStore::default();
        let mut t = Tree::new();
        let mut model = BTreeMap::new();
        type Model = BTreeMap<Vec<u8>, Vec<u8>>;
        let mut snaps: Vec<(Tree, Model)> = Vec::new();
        for op in ops {
            match op {
                TreeOp::Insert(k, v) => {
                    let val = vec![v; (v as usize % 7) * 50 + 1];
                    prop_assert_eq!(t.insert(&s, key(k as u32), val.clone()).expect("insert"), model.insert(key(k as u32), val));
                }
                TreeOp::Remove(k) => {
                    prop_assert_eq!(t.remove(&s, &key(k as u32)).expect("remove"), model.remove(&key(k as u32)));
                }
                TreeOp::Flush => { t.flush(&s).expect("flush"); }
                TreeOp::Snapshot => snaps.push((t.clone(), model.clone())),
            }
        }
        let got = contents(&t, &s);
        let want: Vec<Entry> = model.into_iter().collect();
        prop_assert_eq!(got, want);
        for (snap, m) in snaps {
            prop_assert_eq!(contents(&snap, &s), m.into_iter().collect::<Vec<_>>());
        }
    }
}
