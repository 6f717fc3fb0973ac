//! The engine against plain `std::fs` on the same directory, same run.
//!
//! `cargo run --release -p arbor-benches --bin engine_compare -- [DIR]`
//! Env: ARBOR_BENCH_MIB (default 1024), ARBOR_BENCH_FILES (10000),
//! ARBOR_BENCH_READS (100000), ARBOR_BENCH_RUNS (5).

use arbor_benches::*;
use arbor_engine::device::FileDevice;
use arbor_engine::io::IoMode;
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1 << 20;

fn fresh(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    let _ = fs::remove_dir_all(&p);
    fs::create_dir_all(&p).expect("mkdir");
    p
}

fn open_volume(dir: &Path) -> Arc<Volume> {
    Volume::open(FileDevice::open(dir, IoMode::Auto).expect("device"), Config::default()).expect("volume")
}

fn chunk(seed: u8) -> Vec<u8> {
    (0..MIB).map(|i| (i as u8).wrapping_mul(seed | 1)).collect()
}

/// MiB/s writing `mib` MiB in 1 MiB writes, then one fsync.
fn seq_write_std(dir: &Path, mib: usize) -> f64 {
    let buf = chunk(3);
    let (_, t) = time(|| {
        let mut f = File::create(dir.join("big")).expect("create");
        for _ in 0..mib {
            f.write_all(&buf).expect("write");
        }
        f.sync_all().expect("fsync");
    });
    mib as f64 / t.as_secs_f64()
}

fn seq_write_arbor(dir: &Path, mib: usize) -> (f64, Arc<Volume>, u64) {
    let buf = chunk(3);
    let vol = open_volume(dir);
    let ino = vol.create(ROOT_INO, b"big", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    let (_, t) = time(|| {
        for i in 0..mib {
            vol.write(ino, (i * MIB) as u64, &buf).expect("write");
        }
        vol.fsync(ino).expect("fsync");
    });
    (mib as f64 / t.as_secs_f64(), vol, ino)
}

fn latencies(n: usize, size: u64, mut read: impl FnMut(u64)) -> Vec<Duration> {
    let mut rng = Rng::new(42);
    let blocks = size / 4096;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let off = (rng.next_u64() % blocks) * 4096;
        let (_, t) = time(|| read(off));
        out.push(t);
    }
    out.sort();
    out
}

fn files_std(dir: &Path, n: usize) -> f64 {
    let body = vec![7u8; 4096];
    let (_, t) = time(|| {
        for i in 0..n {
            let mut f = File::create(dir.join(format!("f{i}"))).expect("create");
            f.write_all(&body).expect("write");
            f.sync_all().expect("fsync");
        }
    });
    n as f64 / t.as_secs_f64()
}

fn files_arbor(dir: &Path, n: usize) -> f64 {
    let body = vec![7u8; 4096];
    let vol = open_volume(dir);
    let (_, t) = time(|| {
        for i in 0..n {
            let ino =
                vol.create(ROOT_INO, format!("f{i}").as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
            vol.write(ino, 0, &body).expect("write");
            vol.fsync(ino).expect("fsync");
        }
    });
    vol.close().expect("close");
    n as f64 / t.as_secs_f64()
}

fn main() {
    let base = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/bench-data"));
    let (mib, nfiles, nreads, runs) = (
        env_usize("ARBOR_BENCH_MIB", 1024),
        env_usize("ARBOR_BENCH_FILES", 10_000),
        env_usize("ARBOR_BENCH_READS", 100_000),
        env_usize("ARBOR_BENCH_RUNS", 5),
    );
    println!(
        "engine_compare: dir {}, {mib} MiB, {nfiles} files, {nreads} reads, {runs} runs (medians)",
        base.display()
    );
    let size = (mib * MIB) as u64;

    let (mut w_std, mut w_arbor) = (Vec::new(), Vec::new());
    let (mut r_std, mut r_arbor, mut rc_std, mut rc_arbor) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut f_std, mut f_arbor) = (Vec::new(), Vec::new());
    let mut cold = std::env::var("ARBOR_BENCH_COLD").map_or(true, |v| v != "0");
    for run in 0..runs {
        eprintln!("run {}/{runs}", run + 1);
        let sd = fresh(&base, "std");
        let ad = fresh(&base, "arbor");
        // Alternate which side goes first, so neither always inherits the
        // other's writeback.
        let (tput, vol, ino) = if run % 2 == 0 {
            w_std.push(seq_write_std(&sd, mib));
            seq_write_arbor(&ad, mib)
        } else {
            let r = seq_write_arbor(&ad, mib);
            w_std.push(seq_write_std(&sd, mib));
            r
        };
        w_arbor.push(tput);

        let f = File::open(sd.join("big")).expect("open");
        let mut buf = vec![0u8; 4096];
        let mut std_read = |off| f.read_exact_at(&mut buf, off).expect("pread");
        let arbor_read = |off| {
            let b = vol.read(ino, off, 4096).expect("read");
            assert_eq!(b.len(), 4096);
        };
        let lat_s = latencies(nreads, size, &mut std_read);
        let lat_a = latencies(nreads, size, arbor_read);
        r_std.push((percentile_us(&lat_s, 50.0), percentile_us(&lat_s, 99.0)));
        r_arbor.push((percentile_us(&lat_a, 50.0), percentile_us(&lat_a, 99.0)));
        if cold && drop_page_cache() {
            let lat_s = latencies(nreads / 10, size, &mut std_read);
            drop_page_cache();
            let lat_a = latencies(nreads / 10, size, arbor_read);
            rc_std.push((percentile_us(&lat_s, 50.0), percentile_us(&lat_s, 99.0)));
            rc_arbor.push((percentile_us(&lat_a, 50.0), percentile_us(&lat_a, 99.0)));
        } else {
            cold = false;
        }
        vol.close().expect("close");
        drop(vol);
        let _ = fs::remove_dir_all(&sd);
        let _ = fs::remove_dir_all(&ad);

        let sd = fresh(&base, "std-files");
        let ad = fresh(&base, "arbor-files");
        if run % 2 == 0 {
            f_std.push(files_std(&sd, nfiles));
            f_arbor.push(files_arbor(&ad, nfiles));
        } else {
            f_arbor.push(files_arbor(&ad, nfiles));
            f_std.push(files_std(&sd, nfiles));
        }
        let _ = fs::remove_dir_all(&sd);
        let _ = fs::remove_dir_all(&ad);
    }
    let _ = fs::remove_dir_all(&base);

    let (ws, wa) = (median(w_std), median(w_arbor));
    let p = |v: &Vec<(f64, f64)>, i: usize| median(v.iter().map(|x| if i == 0 { x.0 } else { x.1 }).collect());
    let (fs_, fa) = (median(f_std), median(f_arbor));
    let mut rows = vec![
        Row {
            name: format!("sequential write {mib} MiB + fsync"),
            baseline: format!("{ws:.0} MiB/s"),
            arbor: format!("{wa:.0} MiB/s"),
            ratio: wa / ws,
            target: "≥ 0.8×".into(),
        },
        Row {
            name: "random 4 KiB read p50 (page cache)".into(),
            baseline: format!("{:.1} µs", p(&r_std, 0)),
            arbor: format!("{:.1} µs", p(&r_arbor, 0)),
            ratio: p(&r_arbor, 0) / p(&r_std, 0),
            target: "≤ 1.5× (lower is better)".into(),
        },
        Row {
            name: "random 4 KiB read p99 (page cache)".into(),
            baseline: format!("{:.1} µs", p(&r_std, 1)),
            arbor: format!("{:.1} µs", p(&r_arbor, 1)),
            ratio: p(&r_arbor, 1) / p(&r_std, 1),
            target: "(lower is better)".into(),
        },
    ];
    if !rc_std.is_empty() {
        rows.push(Row {
            name: "random 4 KiB read p50 (cold cache)".into(),
            baseline: format!("{:.1} µs", p(&rc_std, 0)),
            arbor: format!("{:.1} µs", p(&rc_arbor, 0)),
            ratio: p(&rc_arbor, 0) / p(&rc_std, 0),
            target: "≤ 1.5× (lower is better)".into(),
        });
        rows.push(Row {
            name: "random 4 KiB read p99 (cold cache)".into(),
            baseline: format!("{:.1} µs", p(&rc_std, 1)),
            arbor: format!("{:.1} µs", p(&rc_arbor, 1)),
            ratio: p(&rc_arbor, 1) / p(&rc_std, 1),
            target: "(lower is better)".into(),
        });
    }
    rows.push(Row {
        name: format!("create + write 4 KiB + fsync × {nfiles}"),
        baseline: format!("{fs_:.0} files/s"),
        arbor: format!("{fa:.0} files/s"),
        ratio: fa / fs_,
        target: "≥ 1.0×".into(),
    });
    print_table("engine vs std::fs (same directory, same run)", &rows);
}
