//! One file operation at a time through a client of `arbor serve --branch`
//! (`BranchClient` over 127.0.0.1, no FUSE, no added delay) beside the same
//! operation on the owner's volume in this process: what the transport and
//! the owner's dispatch cost per operation.
//!
//! `cargo run --release -p arbor-benches --bin remote_ops [DIR]`
//! (`ARBOR_BENCH_REPS`, default 2000: operations per row;
//! `ARBOR_BENCH_ROWS=write` runs only the rows naming it). Prints a
//! markdown table of medians and p99s.

use arbor_benches::{env_usize, percentile_us, print_table, Row};
use arbor_engine::device::FileDevice;
use arbor_engine::files::Files;
use arbor_engine::io::IoMode;
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_net::{BranchClient, BranchClientOptions, CacheServer, ServerOptions, SharedBranch};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN: &str = "bench-token";
const MIB: usize = 1 << 20;

/// Times `reps` calls of `op`, sorted.
fn timed(reps: usize, mut op: impl FnMut(usize)) -> Vec<Duration> {
    let mut d: Vec<Duration> = (0..reps)
        .map(|i| {
            let t = Instant::now();
            op(i);
            t.elapsed()
        })
        .collect();
    d.sort();
    d
}

/// The operations of one row, run on `f`.
fn run(f: &dyn Files, row: &str, reps: usize) -> Vec<Duration> {
    let name = |i: usize| format!("{row}-{i}").into_bytes();
    match row {
        "getattr" => {
            let a = f.create(ROOT_INO, b"stat-me", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
            timed(reps, |_| {
                f.getattr(a.ino).expect("getattr");
            })
        }
        "lookup (missing name)" => timed(reps, |i| {
            assert!(f.lookup(ROOT_INO, &name(i)).is_err());
        }),
        "create + unlink" => timed(reps, |i| {
            f.create(ROOT_INO, &name(i), libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
            f.unlink(ROOT_INO, &name(i)).expect("unlink");
        }),
        "write 4 KiB" | "write 1 MiB" => {
            let len = if row.ends_with("4 KiB") { 4096 } else { MIB };
            let a = f.create_open(ROOT_INO, row.as_bytes(), libc::S_IFREG | 0o644, 0, 0).expect("create");
            let data = vec![0x5a; len];
            let reps = if len == MIB { reps / 4 } else { reps };
            let d = timed(reps, |i| {
                // Within 64 MiB, so the file stays a bounded size.
                let off = ((i * len) % (64 * MIB)) as u64;
                assert_eq!(f.write(a.ino, off, &data).expect("write"), len);
            });
            f.fsync(a.ino).expect("fsync");
            f.release(a.ino).expect("release");
            d
        }
        "read 1 MiB" => {
            let a = f.create_open(ROOT_INO, b"to-read", libc::S_IFREG | 0o644, 0, 0).expect("create");
            let data = vec![0xa5; MIB];
            for i in 0..64 {
                f.write(a.ino, (i * MIB) as u64, &data).expect("write");
            }
            f.fsync(a.ino).expect("fsync");
            let d = timed(reps / 4, |i| {
                let got = f.read(a.ino, ((i % 64) * MIB) as u64, MIB).expect("read");
                assert_eq!(got.len(), MIB);
            });
            f.release(a.ino).expect("release");
            d
        }
        _ => unreachable!("no such row"),
    }
}

fn volume(dir: &std::path::Path) -> Arc<Volume> {
    std::fs::create_dir_all(dir).expect("mkdir");
    let dev = FileDevice::open(dir, IoMode::Auto).expect("device");
    Volume::open(dev, Config { commit_interval: None, ..Config::default() }).expect("volume")
}

fn main() {
    let base = std::env::args().nth(1).map(std::path::PathBuf::from);
    let base = base.unwrap_or_else(|| std::path::PathBuf::from("/var/tmp"));
    std::fs::create_dir_all(&base).expect("the folder to work in");
    let tmp = tempfile::tempdir_in(&base).expect("tempdir");
    let reps = env_usize("ARBOR_BENCH_REPS", 2000);

    let local = volume(&tmp.path().join("local"));
    let owned = volume(&tmp.path().join("owned"));
    let branch = SharedBranch::new("main", owned, None, arbor_net::Policy::default());
    let server = CacheServer::owner(None, vec![branch], ServerOptions { token: TOKEN.into(), ..Default::default() })
        .spawn("127.0.0.1:0")
        .expect("serve");
    let addr = server.addr.to_string();
    let remote = BranchClient::connect(BranchClientOptions {
        branch: "main".into(),
        token: TOKEN.into(),
        locate: Arc::new(move || Some(addr.clone())),
        timeout: Some(Duration::from_secs(30)),
        segments: None,
        tls: None,
    })
    .expect("connect");

    let rows = ["getattr", "lookup (missing name)", "create + unlink", "write 4 KiB", "write 1 MiB", "read 1 MiB"];
    // ARBOR_BENCH_ROWS=write: only the rows whose name contains it.
    let only = std::env::var("ARBOR_BENCH_ROWS").unwrap_or_default();
    let mut out = Vec::new();
    for row in rows.into_iter().filter(|r| r.contains(only.as_str())) {
        let base = run(local.as_ref(), row, reps);
        let client = run(&remote, row, reps);
        let (b50, c50) = (percentile_us(&base, 50.0), percentile_us(&client, 50.0));
        out.push(Row {
            name: row.into(),
            baseline: format!("p50 {b50:.1} µs, p99 {:.1} µs", percentile_us(&base, 99.0)),
            arbor: format!("p50 {c50:.1} µs, p99 {:.1} µs", percentile_us(&client, 99.0)),
            ratio: c50 / b50,
            target: "report".into(),
        });
    }
    print_table("one operation: the owner's volume in-process (baseline) vs a client over 127.0.0.1", &out);
    drop(remote);
    drop(server);
}
