//! The bucket tier against plain S3 on the same machine, in the same run:
//!
//! - **cold read**: a 1 GiB file read sequentially (1 MiB reads) through a
//!   volume with an empty cache, from a real S3-compatible server
//!   (`s3s-fs` on 127.0.0.1), against the baseline: the same bytes fetched
//!   by a plain parallel ranged download with aws-sdk-s3 (8 MiB ranges,
//!   8 in flight);
//! - **warm re-read**: the same file again, now from the local cache,
//!   against the engine alone (the same file in a volume on a local
//!   directory, read the same way).
//!
//! Usage: `bucket_bench [DIR]` (default `target/bench-data`); env
//! `ARBOR_BENCH_MIB` (1024), `ARBOR_BENCH_RUNS` (3). Medians are printed.

use arbor_benches::{env_usize, median, print_table, Row};
use arbor_engine::device::FileDevice;
use arbor_engine::io::IoMode;
use arbor_engine::testkit::{S3Server, S3_BUCKET};
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_snapshot::disk::{CacheOptions, Disk, DiskOptions, S3Overrides};
use std::path::{Path, PathBuf};
use std::time::Instant;

const MIB: usize = 1 << 20;

fn cfg() -> Config {
    Config { commit_interval: None, ..Config::default() }
}

fn write_file(vol: &Volume, mib: usize) -> u64 {
    let ino = vol.create(ROOT_INO, b"data.bin", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    let mut block = vec![0u8; MIB];
    for i in 0..mib {
        for (j, b) in block.iter_mut().enumerate().step_by(4096) {
            *b = (i + j) as u8;
        }
        vol.write(ino, (i * MIB) as u64, &block).expect("write");
    }
    vol.fsync(ino).expect("fsync");
    ino
}

/// Reads the whole file in 1 MiB reads; MiB/s.
fn read_all(vol: &Volume, ino: u64, mib: usize) -> f64 {
    let t = Instant::now();
    let mut total = 0;
    for i in 0..mib {
        let got = vol.read(ino, (i * MIB) as u64, MIB).expect("read");
        assert_eq!(got.len(), MIB, "short read");
        total += got.len();
    }
    total as f64 / MIB as f64 / t.elapsed().as_secs_f64()
}

/// The baseline: every segment object downloaded by ranged GETs, 8 in
/// flight; MiB/s of bytes received.
fn parallel_download(server: &S3Server, prefix: &str, keys: &[(String, u64)]) -> f64 {
    let full: Vec<(String, u64)> = keys.iter().map(|(k, n)| (format!("{prefix}/{k}"), *n)).collect();
    arbor_benches::parallel_download(&server.endpoint(), S3_BUCKET, &full)
}

fn fresh(base: &Path, name: &str) -> PathBuf {
    let p = base.join(name);
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("mkdir");
    p
}

fn main() {
    let base = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/bench-data"));
    let (mib, runs) = (env_usize("ARBOR_BENCH_MIB", 1024), env_usize("ARBOR_BENCH_RUNS", 3));
    println!("bucket_bench: dir {}, {mib} MiB, {runs} runs (medians)", base.display());
    let data = fresh(&base, "s3");
    let Some(server) = S3Server::start(&data).expect("s3s-fs") else {
        eprintln!("bucket_bench needs s3s-fs");
        std::process::exit(2);
    };
    let (mut cold, mut baseline, mut warm, mut engine) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for run in 0..runs {
        eprintln!("run {}/{runs}", run + 1);
        let prefix = format!("bench{run}");
        let url = format!("s3://{S3_BUCKET}/{prefix}");
        let opts = |cache: CacheOptions| DiskOptions {
            cache,
            s3: Some(S3Overrides::from(&server.config(&prefix))),
            ..DiskOptions::default()
        };
        // Write and upload.
        let store = {
            let cache = CacheOptions { dir: Some(fresh(&base, "cache-w")), ..CacheOptions::default() };
            let disk = Disk::init(&url, opts(cache)).expect("disk");
            let (vol, _lock) = disk.catalog().expect("catalog").open_branch("main", cfg()).expect("vol");
            write_file(&vol, mib);
            vol.close().expect("close");
            disk.store().clone()
        };
        // The baseline first, then the engine cold, on the same objects.
        let keys: Vec<(String, u64)> = store
            .list("segments/")
            .expect("list")
            .into_iter()
            .map(|k| {
                let size = store.size(&k).expect("size");
                (k, size)
            })
            .collect();
        arbor_benches::drop_page_cache();
        baseline.push(parallel_download(&server, &prefix, &keys));
        arbor_benches::drop_page_cache();
        let mut cache = CacheOptions { dir: Some(fresh(&base, "cache-r")), ..CacheOptions::default() };
        if let Ok(ra) = std::env::var("ARBOR_BENCH_READ_AHEAD_MIB") {
            cache.read_ahead = ra.parse::<u64>().expect("read-ahead MiB") << 20;
        }
        let disk = Disk::open(&url, opts(cache)).expect("disk");
        let (vol, lock) = disk.catalog().expect("catalog").open_branch("main", cfg()).expect("vol");
        let ino = vol.lookup(ROOT_INO, b"data.bin").expect("lookup").ino;
        cold.push(read_all(&vol, ino, mib));
        warm.push(read_all(&vol, ino, mib));
        vol.close().expect("close");
        drop((vol, lock, disk));
        // The engine alone on a local directory.
        let local = fresh(&base, "local");
        let vol = Volume::open(FileDevice::open(&local, IoMode::Auto).expect("dev"), cfg()).expect("vol");
        let ino = write_file(&vol, mib);
        read_all(&vol, ino, mib);
        engine.push(read_all(&vol, ino, mib));
        // Each run leaves the machine as it found it: later runs must not
        // pay for earlier runs' objects and files in memory.
        for key in store.list("").expect("list") {
            store.delete(&key).expect("delete");
        }
        drop(vol);
        let _ = std::fs::remove_dir_all(&local);
        arbor_benches::drop_page_cache();
    }
    let rows = vec![
        Row {
            name: format!("cold sequential read, {mib} MiB from the bucket"),
            baseline: format!("{:.0} MiB/s (parallel ranged GETs)", median(baseline.clone())),
            arbor: format!("{:.0} MiB/s", median(cold.clone())),
            ratio: median(cold) / median(baseline),
            target: "≥ 0.8".into(),
        },
        Row {
            name: format!("warm re-read, {mib} MiB from the cache"),
            baseline: format!("{:.0} MiB/s (engine on a local dir)", median(engine.clone())),
            arbor: format!("{:.0} MiB/s", median(warm.clone())),
            ratio: median(warm) / median(engine),
            target: "report".into(),
        },
    ];
    print_table("bucket tier vs plain S3 and the engine alone", &rows);
}
