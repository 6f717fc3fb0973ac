//! CRC-32C as the log and the chunk checks use it — a record header, one
//! 4 KiB block, and 1 MiB in 4 KiB blocks (a large write's block crcs) —
//! through `arbor_engine::crc`, against the `crc32c` crate on the same
//! bytes in the same run.
//!
//! `cargo bench -p arbor-engine --bench crc`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;

fn crc(c: &mut Criterion) {
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    let mut g = c.benchmark_group("crc32c");
    for (name, len) in [("header 80 B", 80usize), ("block 4 KiB", 4096), ("1 MiB in blocks", 1 << 20)] {
        let bytes = &data[..len];
        g.throughput(Throughput::Bytes(len as u64));
        let blocks = |f: fn(&[u8]) -> u32| bytes.chunks(4096).map(f).fold(0u32, |a, c| a ^ c);
        g.bench_with_input(BenchmarkId::new("arbor", name), &len, |b, _| {
            b.iter(|| black_box(blocks(arbor_engine::crc::crc32c)))
        });
        g.bench_with_input(BenchmarkId::new("crc32c crate", name), &len, |b, _| {
            b.iter(|| black_box(blocks(crc32c::crc32c)))
        });
    }
    g.finish();
}

criterion_group!(benches, crc);
criterion_main!(benches);
