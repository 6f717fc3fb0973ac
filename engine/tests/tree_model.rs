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
    let looped =
        Node::Branch(Branch { level: 1, keys: Packed::default(), children: vec![Child::Disk(Addr::default())] });
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

type Model = BTreeMap<Vec<u8>, Vec<u8>>;

/// A three-level tree shared by the diff cases (the store only grows, so
/// every case's new nodes sit beside it).
fn diff_base() -> &'static (MemNodeStore, Addr, Model) {
    static BASE: std::sync::OnceLock<(MemNodeStore, Addr, Model)> = std::sync::OnceLock::new();
    BASE.get_or_init(|| {
        let s = MemNodeStore::default();
        let (mut t, mut m) = (Tree::new(), Model::new());
        for i in 0..6000u32 {
            let v = vec![(i % 251) as u8; 600];
            t.insert(&s, key(i * 2), v.clone()).expect("insert");
            m.insert(key(i * 2), v);
        }
        let root = t.flush(&s).expect("flush");
        assert!(s.load(root).expect("root").level() >= 2, "the base must have three levels");
        (s, root, m)
    })
}

/// A key whose value differs, with its value on each side.
type Change = (Vec<u8>, Option<Vec<u8>>, Option<Vec<u8>>);

/// What a diff must report: every key whose value differs, in key order.
fn model_diff(a: &Model, b: &Model) -> Vec<Change> {
    let keys: std::collections::BTreeSet<&Vec<u8>> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| (k.clone(), a.get(k).cloned(), b.get(k).cloned()))
        .collect()
}

fn tree_diff(s: &MemNodeStore, a: Addr, b: Addr) -> Vec<Change> {
    let mut out = Vec::new();
    diff(s, a, b, &mut |(k, l, r)| {
        out.push((k.to_vec(), l.map(<[u8]>::to_vec), r.map(<[u8]>::to_vec)));
        Ok(())
    })
    .expect("diff");
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Versions of one tree, changed by runs of inserts (of all sizes, so
    /// leaves split), removals (so nodes merge and the root may shrink)
    /// and growth past the base: the diff of any two equals the models'.
    #[test]
    fn diff_of_any_two_versions_matches_the_models(
        runs in proptest::collection::vec(proptest::collection::vec((0u32..16_000, 0u16..1500, any::<bool>()), 0..120), 1..5)
    ) {
        let (s, base_root, base_model) = diff_base();
        let mut t = Tree::from_root(*base_root);
        let mut m = base_model.clone();
        let mut versions = vec![(*base_root, m.clone())];
        for run in runs {
            for (k, size, remove) in run {
                if remove {
                    prop_assert_eq!(t.remove(s, &key(k)).expect("remove"), m.remove(&key(k)));
                } else {
                    let v = vec![(k % 7) as u8; size as usize];
                    prop_assert_eq!(t.insert(s, key(k), v.clone()).expect("insert"), m.insert(key(k), v));
                }
            }
            versions.push((t.flush(s).expect("flush"), m.clone()));
        }
        for (a, ma) in &versions {
            for (b, mb) in &versions {
                prop_assert_eq!(tree_diff(s, *a, *b), model_diff(ma, mb));
            }
        }
    }
}

#[test]
fn diff_finds_changes_across_split_and_merged_nodes_and_a_new_root_level() {
    let (s, base_root, base_model) = diff_base();
    let mut t = Tree::from_root(*base_root);
    let mut m = base_model.clone();
    // Splits: many new keys between existing ones in one region.
    for i in 1000..1400u32 {
        t.insert(s, key(i * 2 + 1), vec![9; 900]).expect("insert");
        m.insert(key(i * 2 + 1), vec![9; 900]);
    }
    // Merges: a whole region removed.
    for i in 4000..4600u32 {
        t.remove(s, &key(i * 2)).expect("remove");
        m.remove(&key(i * 2));
    }
    let mid = t.flush(s).expect("flush");
    assert_eq!(tree_diff(s, *base_root, mid), model_diff(base_model, &m));
    // A root that gains levels, and loses them again.
    let small = MemNodeStore::default();
    let (mut t, mut m) = (Tree::new(), Model::new());
    for i in 0..20u32 {
        t.insert(&small, key(i), vec![1; 100]).expect("insert");
        m.insert(key(i), vec![1; 100]);
    }
    let leaf = t.flush(&small).expect("flush");
    let mut grown = m.clone();
    for i in 0..30_000u32 {
        t.insert(&small, key(i * 3), vec![2; 300]).expect("insert");
        grown.insert(key(i * 3), vec![2; 300]);
    }
    let big = t.flush(&small).expect("flush");
    assert_eq!(small.load(leaf).expect("root").level(), 0);
    assert!(small.load(big).expect("root").level() >= 2, "the root must gain levels");
    assert_eq!(tree_diff(&small, leaf, big), model_diff(&m, &grown));
    assert_eq!(tree_diff(&small, big, leaf), model_diff(&grown, &m));
}
