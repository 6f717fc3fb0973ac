//! Decoding a tree node, against copying its bytes (a decode takes the
//! record's buffer as its own, so a copy is the floor): what every cold
//! node read pays after its pread and checksum. Decode alone is the
//! difference of the two.
//!
//! `cargo bench -p arbor-engine --bench nodes`

use arbor_engine::format::{Addr, SegId};
use arbor_engine::tree::{Branch, Child, Leaf, Node, Packed};
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

/// An inode key, as the volume writes them: a tag, then a big-endian number.
fn key(ino: u64) -> Vec<u8> {
    let mut k = vec![b'I'];
    k.extend_from_slice(&ino.to_be_bytes());
    k
}

/// A full leaf of small-file inodes (~16 KiB, 170 entries).
fn leaf() -> Vec<u8> {
    let leaf = Leaf::from_entries((0..170u64).map(|i| (key(1_000_000 + 3 * i), vec![(i % 251) as u8; 80])));
    Node::Leaf(leaf).encode().expect("encode")
}

/// A full branch node (128 children, ~4 KiB).
fn branch() -> Vec<u8> {
    let mut keys = Packed::default();
    for i in 1..128u64 {
        keys.push(&key(1_000_000 + 500 * i));
    }
    let children = (0..128u32)
        .map(|i| Child::Disk(Addr { seg: SegId { writer: 0xabcdef, seq: 7 }, off: i * 9000, len: 16_000 }))
        .collect();
    Node::Branch(Branch { level: 1, keys, children }).encode().expect("encode")
}

fn decode(c: &mut Criterion) {
    for (name, bytes) in [("leaf", leaf()), ("branch", branch())] {
        let mut g = c.benchmark_group(format!("node/{name}"));
        // Each iteration copies the bytes (a decode takes ownership) and
        // drops what it made, so the allocator reuses warm memory as a
        // reader's loop does.
        g.bench_function("copy bytes (baseline)", |b| b.iter(|| black_box(black_box(&bytes).clone())));
        g.bench_function("copy and decode", |b| {
            b.iter(|| black_box(Node::decode_owned(black_box(&bytes).clone()).expect("decode")))
        });
        g.finish();
    }
}

criterion_group!(benches, decode);
criterion_main!(benches);
