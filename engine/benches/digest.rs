//! What a segment footer costs per chunk: crc32c (the footer of earlier
//! builds) against crc32c + the BLAKE3 chunk digest (leaves of 16 KiB),
//! over one 1 MiB chunk, in the same run; and what proving a small part
//! costs a cache server (the chunk's leaf hashes).
//!
//! `cargo bench -p arbor-engine --bench digest`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

fn digest(c: &mut Criterion) {
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    let mut g = c.benchmark_group("footer entry, 1 MiB chunk");
    g.throughput(Throughput::Bytes(chunk.len() as u64));
    g.bench_function("crc32c (ARSO)", |b| b.iter(|| black_box(arbor_engine::crc::crc32c(&chunk))));
    g.bench_function("crc32c + digest (ARSH)", |b| {
        b.iter(|| {
            let crc = arbor_engine::crc::crc32c(&chunk);
            black_box((crc, arbor_engine::tier::chunk_digest(&chunk)))
        })
    });
    g.bench_function("prove a 16 KiB part", |b| {
        b.iter(|| black_box(arbor_engine::tier::prove_part(&chunk, 0..16 << 10)))
    });
    g.finish();
}

criterion_group!(benches, digest);
criterion_main!(benches);
