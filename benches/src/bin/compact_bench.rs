//! Compaction against copying the same bytes with `std::fs`, same run.
//!
//! Builds a disk as a training loop leaves it: small files written once,
//! and shards each written beside a big checkpoint file that is deleted
//! again, so every segment is mostly dead but for a few live bytes. Then
//! times `compact` (moving those bytes and the tree nodes), and as the
//! baseline, copying the same number of bytes from one file to another and
//! syncing, in the same directory.
//!
//! `cargo run --release -p arbor-benches --bin compact_bench -- [DIR]`
//! Env: ARBOR_BENCH_ROUNDS (shards, default 8), ARBOR_BENCH_RUNS (3).

use arbor_benches::*;
use arbor_engine::volume::{Config, ROOT_INO};
use arbor_snapshot::{Disk, DiskOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

const SHARD: usize = 4 << 20;
const CHECKPOINT: usize = 60 << 20;

/// Segment bytes on disk.
fn segment_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir.join("segments"))
        .map_or(0, |d| d.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
}

struct Run {
    compact_s: f64,
    copy_s: f64,
    moved: u64,
    before: u64,
    after_gc: u64,
}

fn run(dir: &Path, rounds: usize, seed: u64) -> Run {
    let _ = std::fs::remove_dir_all(dir);
    let disk = Disk::init(&dir.display().to_string(), DiskOptions::default()).expect("disk");
    let cat = disk.catalog().expect("catalog");
    let cfg = Config { commit_interval: None, ..Config::default() };
    let (vol, _lock) = cat.open_branch("main", cfg).expect("main");
    let keep = vol.mkdir(ROOT_INO, b"keep", 0o755, 0, 0).expect("mkdir").ino;
    for i in 0..2000 {
        let f = vol.create(keep, format!("f{i}").as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        vol.write(f, 0, format!("config {i}").as_bytes()).expect("write");
    }
    let mut rng = Rng::new(seed);
    let mut bytes = |n: usize| (0..n / 8).flat_map(|_| rng.next_u64().to_le_bytes()).collect::<Vec<u8>>();
    for r in 0..rounds {
        let shard =
            vol.create(keep, format!("shard{r}").as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        vol.write(shard, 0, &bytes(SHARD)).expect("write");
        let ckpt = vol.create(ROOT_INO, b"ckpt.pt", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        vol.write(ckpt, 0, &bytes(CHECKPOINT)).expect("write");
        vol.commit().expect("commit");
        vol.unlink(ROOT_INO, b"ckpt.pt").expect("unlink");
    }
    vol.commit().expect("commit");
    cat.gc(Duration::ZERO).expect("gc");
    let before = segment_bytes(dir);
    let (report, t) = time(|| vol.compact(0.25).expect("compact"));
    let moved = report.data_bytes + report.bytes;
    cat.gc(Duration::ZERO).expect("gc");
    let after_gc = segment_bytes(dir);
    drop(vol);
    // Baseline: the same bytes read from one file, written to another, synced.
    let src = dir.join("copy-src");
    std::fs::write(&src, bytes(moved as usize)).expect("write");
    let (_, copy) = time(|| {
        let data = std::fs::read(&src).expect("read");
        let mut f = std::fs::File::create(dir.join("copy-dst")).expect("create");
        f.write_all(&data).expect("write");
        f.sync_all().expect("sync");
    });
    Run { compact_s: t.as_secs_f64(), copy_s: copy.as_secs_f64(), moved, before, after_gc }
}

fn main() {
    let base = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/bench-compact"));
    let rounds = env_usize("ARBOR_BENCH_ROUNDS", 8);
    let runs: Vec<Run> = (0..env_usize("ARBOR_BENCH_RUNS", 3)).map(|i| run(&base, rounds, i as u64 + 1)).collect();
    let _ = std::fs::remove_dir_all(&base);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let rate = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(|r| mib(r.moved) / f(r)).collect());
    let (arbor, copy) = (rate(&|r| r.compact_s), rate(&|r| r.copy_s));
    let last = runs.last().expect("a run");
    println!("\n### compaction (medians of {} runs)\n", runs.len());
    println!("| moved | compact | copy + fsync, std::fs | ratio | segments before → after compact + gc |");
    println!("| ---: | ---: | ---: | ---: | ---: |");
    println!(
        "| {:.1} MiB | {arbor:.0} MiB/s | {copy:.0} MiB/s | {:.2}× | {:.0} MiB → {:.0} MiB |",
        mib(last.moved),
        arbor / copy,
        mib(last.before),
        mib(last.after_gc)
    );
}
