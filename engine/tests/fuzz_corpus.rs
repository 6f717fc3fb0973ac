//! Replays every committed fuzz corpus input through its target, and (when
//! asked) writes fresh seed inputs made by the real encoders.
//!
//! Seeds: `ARBOR_WRITE_SEEDS=1 cargo test -p arbor-engine --test fuzz_corpus`.

use arbor_engine::device::{Device, SimDevice};
use arbor_engine::format::{encode_value, Addr, RecordKind, SegId};
use arbor_engine::log::Log;
use arbor_engine::tree::{Branch, Child, Leaf, Node};
use arbor_engine::volume::{CommitRecord, Superblock};
use std::path::PathBuf;
use std::sync::Arc;

#[path = "../../fuzz/targets.rs"]
mod targets;
use targets::TARGETS;

fn corpus_dir() -> PathBuf {
    manifest_dir().join("../fuzz/corpus")
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let addr = Addr { seg: SegId { writer: 7, seq: 1 }, off: 64, len: 99 };
    let leaf = Node::Leaf(Leaf::from_entries(vec![
        (b"I\0\0\0\0\0\0\0\x01".to_vec(), vec![1, 2, 3]),
        (b"k2".to_vec(), vec![]),
    ]));
    let branch = Node::Branch(Branch {
        level: 1,
        keys: [b"m"].into_iter().collect(),
        children: vec![Child::Disk(addr), Child::Disk(addr)],
    });
    let commit = CommitRecord {
        root: addr,
        next_ino: 5,
        covers_seq: 9,
        prev: Some(addr),
        time: Default::default(),
        live: vec![(addr.seg, 4096)],
    };
    let dev = SimDevice::new();
    let shared: Arc<dyn Device> = Arc::new(dev.clone());
    let log = Log::create(shared.clone(), 1, 1, 1 << 20).expect("log");
    log.append(RecordKind::Node, &leaf.encode().expect("encode"), &[], "seed").expect("append");
    log.append(RecordKind::Intent, b"meta", &vec![9u8; 5000], "seed").expect("append");
    log.append(RecordKind::Commit, &encode_value(&commit), &[], "seed").expect("append");
    let seg = SegId { writer: 1, seq: 0 };
    let file = shared.open_segment(seg).expect("open").expect("exists");
    let mut segment = vec![0u8; dev.segment_len(seg)];
    file.read_at(&mut segment, 0).expect("read");
    vec![
        ("segment", segment.clone()),
        ("segment", segment[..40].to_vec()),
        ("node", leaf.encode().expect("encode")),
        ("node", branch.encode().expect("encode")),
        ("values", encode_value(&commit)),
        ("values", Superblock::new(addr).encode()),
        ("tree_vs_btreemap", (0..600u32).map(|i| (i * 7919 % 251) as u8).collect()),
        ("footer", footer_of(&segment, 4096, true)),
        ("footer", footer_of(&segment, 1 << 20, false)),
    ]
}

/// The footer a segment object of `data` ends in (`hashed`: with digests,
/// as written now; else crc32c only, as earlier builds wrote).
fn footer_of(data: &[u8], chunk_size: u32, hashed: bool) -> Vec<u8> {
    let mut f = arbor_engine::tier::Footer::of(data, chunk_size);
    if !hashed {
        f.hashes.clear();
    }
    let mut out = Vec::new();
    f.encode(&mut out);
    out
}

#[test]
fn every_corpus_input_runs_clean() {
    if std::env::var_os("ARBOR_WRITE_SEEDS").is_some() {
        for (i, (target, bytes)) in seeds().into_iter().enumerate() {
            let dir = corpus_dir().join(target);
            std::fs::create_dir_all(&dir).expect("mkdir");
            std::fs::write(dir.join(format!("seed-{i}")), bytes).expect("write seed");
        }
    }
    let mut ran = 0;
    for (name, target) in TARGETS {
        let dir = corpus_dir().join(name);
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("corpus {dir:?}: {e}"));
        for entry in entries {
            let path = entry.expect("entry").path();
            target(&std::fs::read(&path).expect("read input"));
            ran += 1;
        }
    }
    assert!(ran >= TARGETS.len(), "every target needs a corpus");
}

#[test]
fn seeds_exercise_the_decoders_successfully() {
    // The seeds are valid encodings: the targets must accept them whole.
    for (target, bytes) in seeds() {
        let f = TARGETS.iter().find(|(n, _)| *n == target).expect("target").1;
        f(&bytes);
    }
    assert!(Node::decode(&seeds()[2].1).is_ok());
}

/// This package's folder: where cargo says when it runs the test (the
/// build may have been made in another clone of the repository).
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}
