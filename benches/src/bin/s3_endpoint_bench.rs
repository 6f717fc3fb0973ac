//! The S3 endpoint of `arbor serve --s3` against `s3s-fs` (a plain S3
//! server over a local folder, built on the same `s3s` crate) on the same
//! machine, in the same run, and against a FUSE mount of the same branch:
//!
//! - PUT and GET of one 1 GiB object (one request each; the PUT's body
//!   read from a file on the same disk);
//! - PUT and GET of 10,000 objects of 64 KiB, 32 in flight;
//! - the GET of the 1 GiB object against a sequential read of the same
//!   file on a FUSE mount of the branch (a client mount through the owner,
//!   mounted fresh).
//!
//! The arbor side is a local-folder disk whose branch `main` the server
//! owns (every PUT answered after a sync of the branch's log); s3s-fs
//! writes a file and renames it (no fsync). Both keep their data under
//! DIR, on the same disk.
//!
//! Usage: `s3_endpoint_bench [DIR]` (default `target/bench-data`); env
//! `ARBOR` (the arbor binary; default beside this one), `ARBOR_BENCH_MIB`
//! (1024), `ARBOR_BENCH_SMALL` (10000), `ARBOR_BENCH_RUNS` (1). Needs root
//! and /dev/fuse for the mount row, and s3s-fs on the PATH. Medians are
//! printed as a markdown table.

use arbor_benches::{env_usize, print_table, s3_client, Row};
use arbor_engine::testkit::{free_port, S3Server, S3_BUCKET, S3_KEY, S3_SECRET};
use aws_sdk_s3::primitives::ByteStream;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const SMALL: usize = 64 << 10;

fn arbor_bin() -> PathBuf {
    std::env::var_os("ARBOR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::current_exe().expect("exe").parent().expect("dir").join("arbor"))
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(60), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

/// `arbor serve` owning `main` of a fresh local-folder disk under `dir`,
/// with --s3: (the server, the S3 endpoint, the token file).
fn start_arbor(dir: &Path) -> (Killed, String, PathBuf) {
    let disk = dir.join("arbor-disk");
    let ok = Command::new(arbor_bin()).args(["init", disk.to_str().expect("utf8")]).status().expect("arbor init");
    assert!(ok.success());
    let token = dir.join("token");
    std::fs::write(&token, "bench-token\n").expect("token");
    let keys = dir.join("s3-keys");
    std::fs::write(&keys, format!("{S3_KEY} {S3_SECRET}\n")).expect("keys");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let s3 = format!("127.0.0.1:{}", free_port().expect("port"));
    let listen = format!("127.0.0.1:{}", free_port().expect("port"));
    let log = dir.join("serve.log");
    let child = Command::new(arbor_bin())
        .args(["serve", disk.to_str().expect("utf8"), "--listen", &listen, "--branch", "main", "--foreground"])
        .args(["--token-file", token.to_str().expect("utf8"), "--s3", &s3, "--s3-keys", keys.to_str().expect("utf8")])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).expect("log"))
        .stderr(std::fs::File::options().append(true).open(&log).expect("log"))
        .spawn()
        .expect("arbor serve");
    wait_for("arbor serve", || std::fs::read_to_string(&log).unwrap_or_default().contains(" serving disk="));
    (Killed(child), format!("http://{s3}"), token)
}

fn put_big(c: &aws_sdk_s3::Client, rt: &tokio::runtime::Runtime, bucket: &str, file: &Path, bytes: usize) -> f64 {
    rt.block_on(async {
        let t = Instant::now();
        let body = ByteStream::from_path(file).await.expect("body");
        c.put_object().bucket(bucket).key("big/data.bin").body(body).send().await.expect("put");
        bytes as f64 / MIB as f64 / t.elapsed().as_secs_f64()
    })
}

fn get_big(c: &aws_sdk_s3::Client, rt: &tokio::runtime::Runtime, bucket: &str, bytes: usize) -> f64 {
    rt.block_on(async {
        let t = Instant::now();
        let mut r = c.get_object().bucket(bucket).key("big/data.bin").send().await.expect("get");
        let mut got = 0;
        while let Some(chunk) = r.body.try_next().await.expect("body") {
            got += chunk.len();
        }
        assert_eq!(got, bytes);
        bytes as f64 / MIB as f64 / t.elapsed().as_secs_f64()
    })
}

fn small_key(i: usize) -> String {
    format!("small/{:02}/obj-{i:05}", i % 100)
}

/// PUTs (or GETs) `n` objects of 64 KiB, 32 in flight; MiB/s.
fn many(c: &aws_sdk_s3::Client, rt: &tokio::runtime::Runtime, bucket: &str, n: usize, put: bool) -> f64 {
    let body = bytes::Bytes::from(vec![7u8; SMALL]);
    rt.block_on(async {
        let sem = Arc::new(tokio::sync::Semaphore::new(32));
        let t = Instant::now();
        let mut tasks = Vec::with_capacity(n);
        for i in 0..n {
            let (c, sem, body, bucket) = (c.clone(), sem.clone(), body.clone(), bucket.to_string());
            tasks.push(tokio::spawn(async move {
                let _permit = sem.acquire().await.expect("permit");
                if put {
                    c.put_object()
                        .bucket(bucket)
                        .key(small_key(i))
                        .body(ByteStream::from(body))
                        .send()
                        .await
                        .expect("put");
                } else {
                    let r = c.get_object().bucket(bucket).key(small_key(i)).send().await.expect("get");
                    let got = r.body.collect().await.expect("body").into_bytes();
                    assert_eq!(got.len(), SMALL);
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
        (n * SMALL) as f64 / MIB as f64 / t.elapsed().as_secs_f64()
    })
}

/// Reads a file sequentially in 1 MiB reads; MiB/s.
fn read_file(path: &Path) -> f64 {
    let t = Instant::now();
    let mut f = std::fs::File::open(path).expect("open");
    let mut buf = vec![0u8; MIB];
    let mut got = 0;
    loop {
        let n = f.read(&mut buf).expect("read");
        if n == 0 {
            break;
        }
        got += n;
    }
    got as f64 / MIB as f64 / t.elapsed().as_secs_f64()
}

fn main() {
    let root = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/bench-data"));
    std::fs::create_dir_all(&root).expect("mkdir");
    let dir = tempfile::Builder::new().prefix("s3-endpoint").tempdir_in(&root).expect("tempdir");
    let mib = env_usize("ARBOR_BENCH_MIB", 1024);
    let n = env_usize("ARBOR_BENCH_SMALL", 10_000);
    let runs = env_usize("ARBOR_BENCH_RUNS", 1);
    let bytes = mib * MIB;
    // The big body, on the same disk.
    let file = dir.path().join("body.bin");
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&file).expect("create"));
        let mut block = vec![0u8; MIB];
        for i in 0..mib {
            for (j, b) in block.iter_mut().enumerate().step_by(512) {
                *b = (i * 31 + j) as u8;
            }
            f.write_all(&block).expect("write");
        }
    }

    let s3s_data = dir.path().join("s3s-fs");
    std::fs::create_dir_all(&s3s_data).expect("mkdir");
    let s3s = S3Server::start(&s3s_data).expect("s3s-fs").expect("s3s-fs on the PATH");
    let (server, endpoint, token) = start_arbor(dir.path());
    let (rt, base) = s3_client(&s3s.endpoint());
    let (_rt2, arb) = s3_client(&endpoint);

    let mut rows = [(); 4].map(|_| (Vec::new(), Vec::new()));
    let mut fuse_rows = (Vec::new(), Vec::new());
    for run in 0..runs {
        rows[0].0.push(put_big(&base, &rt, S3_BUCKET, &file, bytes));
        rows[0].1.push(put_big(&arb, &rt, "main", &file, bytes));
        rows[1].0.push(get_big(&base, &rt, S3_BUCKET, bytes));
        rows[1].1.push(get_big(&arb, &rt, "main", bytes));
        rows[2].0.push(many(&base, &rt, S3_BUCKET, n, true));
        rows[2].1.push(many(&arb, &rt, "main", n, true));
        rows[3].0.push(many(&base, &rt, S3_BUCKET, n, false));
        rows[3].1.push(many(&arb, &rt, "main", n, false));
        // A fresh client mount of the branch, through the owner.
        let mnt = dir.path().join(format!("mnt-{run}"));
        std::fs::create_dir_all(&mnt).expect("mkdir");
        let mounted = Command::new(arbor_bin())
            .args(["mount", dir.path().join("arbor-disk").to_str().expect("utf8"), mnt.to_str().expect("utf8")])
            .args(["--token-file", token.to_str().expect("utf8")])
            .status()
            .is_ok_and(|s| s.success());
        if mounted {
            fuse_rows.0.push(read_file(&mnt.join("big/data.bin")));
            fuse_rows.1.push(get_big(&arb, &rt, "main", bytes));
            let _ = Command::new(arbor_bin()).args(["unmount", mnt.to_str().expect("utf8")]).status();
        } else {
            eprintln!("no FUSE mount here: the mount row is left out");
        }
        println!(
            "run {run}: put {:.0}/{:.0}, get {:.0}/{:.0}, small put {:.0}/{:.0}, small get {:.0}/{:.0} MiB/s (s3s-fs/arbor)",
            rows[0].0[run], rows[0].1[run], rows[1].0[run], rows[1].1[run], rows[2].0[run], rows[2].1[run], rows[3].0[run], rows[3].1[run]
        );
    }
    let how = "s3s-fs";
    let mut table = vec![
        Row::mib_per_s(format!("PUT one {mib} MiB object"), how, &rows[0].0, &rows[0].1, "report"),
        Row::mib_per_s(format!("GET one {mib} MiB object"), how, &rows[1].0, &rows[1].1, "report"),
        Row::mib_per_s(format!("PUT {n} × 64 KiB, 32 in flight"), how, &rows[2].0, &rows[2].1, "report"),
        Row::mib_per_s(format!("GET {n} × 64 KiB, 32 in flight"), how, &rows[3].0, &rows[3].1, "report"),
    ];
    if !fuse_rows.0.is_empty() {
        table.push(Row::mib_per_s(
            format!("GET one {mib} MiB object vs the mount"),
            "a FUSE mount's sequential read",
            &fuse_rows.0,
            &fuse_rows.1,
            "report",
        ));
    }
    print_table("The S3 endpoint against s3s-fs and a FUSE mount (arbor serve --s3)", &table);
    drop(server);
}
