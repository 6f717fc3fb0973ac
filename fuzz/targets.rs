//! The bodies of the fuzz targets, shared by the cargo-fuzz binaries in
//! `fuzz_targets/` and by `engine/tests/fuzz_corpus.rs`, which replays the
//! committed corpora in the normal test run. Each must return (never hang)
//! on any input; it panics only to report a bug, which is how a fuzzer
//! learns of one. Test code: nothing here ships in the engine library.

use arbor_engine::device::{Device, SimDevice};
use arbor_engine::format::{decode_value, SegId};
use arbor_engine::log::{Cursor, Next};
use arbor_engine::tree::{MemNodeStore, Node, Tree};
use arbor_engine::volume::{CommitRecord, Op, Superblock};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Reads `data` as a segment: every record the cursor returns verified.
pub fn segment(data: &[u8]) {
    let dev = SimDevice::new();
    let seg = SegId { writer: 1, seq: 0 };
    let Ok(file) = dev.create_segment(seg) else {
        return;
    };
    if file.write_at(data, 0).is_err() {
        return;
    }
    let Ok(mut cursor) = Cursor::new(Arc::new(dev), seg, 0) else {
        return;
    };
    // Every record is at least a header long, so this bounds the walk.
    for _ in 0..=data.len() / arbor_engine::format::HEADER_LEN {
        match cursor.next_record() {
            Ok(Next::Record(r)) => assert!(r.addr.end() as usize <= data.len()),
            _ => return,
        }
    }
    panic!("cursor did not stop");
}

/// Decodes a tree node; whatever decodes must re-encode to the same bytes.
pub fn node(data: &[u8]) {
    if let Ok(n) = Node::decode(data) {
        let again = n.encode().expect("decoded nodes have on-disk children");
        assert_eq!(again, data, "node re-encoding differs");
    }
}

/// Decodes the small bincode values: commit records, superblocks, intents.
pub fn values(data: &[u8]) {
    let _ = decode_value::<CommitRecord>(data, "commit");
    let _ = decode_value::<Op>(data, "intent");
    let _ = Superblock::decode(data);
}

/// Runs byte-coded operations on the tree and a `BTreeMap`, comparing them.
pub fn tree_vs_btreemap(data: &[u8]) {
    let store = MemNodeStore::default();
    let mut tree = Tree::new();
    let mut model = BTreeMap::new();
    for chunk in data.chunks(3) {
        let [op, k, v] = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let key = vec![k; 1 + (k as usize % 5)];
        match op % 4 {
            0 | 1 => {
                let val = vec![v; v as usize * 3];
                assert_eq!(tree.insert(&store, key.clone(), val.clone()).expect("insert"), model.insert(key, val));
            }
            2 => assert_eq!(tree.remove(&store, &key).expect("remove"), model.remove(&key)),
            _ => {
                tree.flush(&store).expect("flush");
            }
        }
    }
    let mut got = Vec::new();
    tree.scan(&store, b"", &mut |k, v| {
        got.push((k.to_vec(), v.to_vec()));
        Ok(true)
    })
    .expect("scan");
    assert_eq!(got, model.into_iter().collect::<Vec<_>>());
}

/// Decodes the end of `data` as a segment object's footer (as a reader
/// does with a footer from the bucket or its cache folder): whatever
/// decodes re-encodes to the same bytes, and a proved part of any range,
/// made of the rest of the input, is checked without a panic.
pub fn footer(data: &[u8]) {
    use arbor_engine::tier::Footer;
    let Ok(f) = Footer::decode(data, "fuzz") else { return };
    let mut again = Vec::new();
    f.encode(&mut again);
    assert_eq!(again, data, "a footer that decodes re-encodes to its bytes");
    let (a, b) = (data.first().copied().unwrap_or(0) as u64, data.last().copied().unwrap_or(0) as u64);
    for i in 0..f.crcs.len().min(4) {
        let leaves = f.leaf_range(i, (a << 10)..(a << 10) + b + 1);
        let _ = f.check_proved_part(i, leaves, data);
        let _ = f.verify(i, data);
    }
}

/// The fuzz targets by name, as the corpus folders are named.
/// A fuzz target's name (its corpus folder) and body.
pub type Target = (&'static str, fn(&[u8]));

pub const TARGETS: [Target; 5] = [
    ("segment", segment),
    ("node", node),
    ("values", values),
    ("tree_vs_btreemap", tree_vs_btreemap),
    ("footer", footer),
];
