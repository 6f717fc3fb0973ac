//! Imported files against plain S3 on the same machine, in the same run,
//! from a real S3-compatible server (`s3s-fs` on 127.0.0.1):
//!
//! - **cold read**: a 1 GiB object imported as a file and read
//!   sequentially (1 MiB reads) through a fresh volume that keeps chunk
//!   files as a mount does, against the baseline: the same object fetched
//!   by a plain parallel ranged download with aws-sdk-s3 (8 MiB ranges, 8
//!   in flight);
//! - the same **cold read keeping no chunk files** (a volume with memory
//!   only, as a command's), to show what writing them costs;
//! - **warm read from the chunk files**: the same read by a new volume
//!   (empty memory, the chunk files of the cold read, page cache dropped),
//!   against reading a plain local file of the same size the same way;
//! - **export**: 16 files of 64 MiB on a local-folder disk, exported by the
//!   `arbor` release binary beside this bench (`cargo build --release -p
//!   arbor-cli` first; four files at once, each streamed into multipart
//!   uploads of 8 MiB parts, four in flight), against a plain parallel
//!   upload of the same bytes with aws-sdk-s3 (whole-object PUTs, four in
//!   flight);
//! - **import rate**: objects per second listed (with their ETags) and
//!   added as files, for a prefix of many small objects in nested folders.
//!   The objects are written as s3s-fs keeps them (one file each under its
//!   data folder), which is how a team's existing bucket looks to arbor.
//!
//! Usage: `import_bench [DIR]` (default `target/bench-data`); env
//! `ARBOR_BENCH_MIB` (1024), `ARBOR_BENCH_OBJECTS` (20000),
//! `ARBOR_BENCH_RUNS` (3). Medians are printed.

use arbor_benches::{env_usize, median, print_table, Row};
use arbor_engine::bucket::{ObjectStore, S3Store};
use arbor_engine::chunks::{ChunkFiles, ChunkStore};
use arbor_engine::device::FileDevice;
use arbor_engine::env::Timestamp;
use arbor_engine::io::IoMode;
use arbor_engine::source::{FixedSources, Source};
use arbor_engine::testkit::{S3Server, S3_BUCKET};
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_snapshot::disk::{Disk, DiskOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const MIB: usize = 1 << 20;

fn fresh(base: &Path, name: &str) -> PathBuf {
    let p = base.join(name);
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("mkdir");
    p
}

/// A volume in `dir`; with `files`, keeping imported chunks there as a
/// mount does in its cache folder.
fn volume(dir: &Path, store: &Arc<S3Store>, files: Option<&Path>) -> Arc<Volume> {
    let files = files.map(|f| ChunkFiles::open(f, &ChunkStore::new(8 << 30)).expect("chunk files"));
    let cfg = Config {
        commit_interval: None,
        sources: FixedSources::with(S3_BUCKET, store.clone()),
        source_files: files,
        ..Config::default()
    };
    Volume::open(FileDevice::open(dir, IoMode::Auto).expect("dev"), cfg).expect("vol")
}

/// MiB/s of reading `mib` MiB of `ino` sequentially, 1 MiB at a time.
fn read_file(vol: &Volume, ino: u64, mib: usize) -> f64 {
    let t = Instant::now();
    for i in 0..mib {
        let got = vol.read(ino, (i * MIB) as u64, MIB).expect("read");
        assert_eq!(got.len(), MIB, "short read");
    }
    mib as f64 / t.elapsed().as_secs_f64()
}

/// MiB/s of reading a plain local file sequentially, 1 MiB at a time.
fn read_plain(path: &Path) -> f64 {
    use std::io::Read;
    let mut f = std::fs::File::open(path).expect("open");
    let mut buf = vec![0u8; MIB];
    let (t, mut n) = (Instant::now(), 0usize);
    loop {
        let got = f.read(&mut buf).expect("read");
        if got == 0 {
            break;
        }
        n += got;
    }
    n as f64 / MIB as f64 / t.elapsed().as_secs_f64()
}

fn source(info: &arbor_engine::bucket::ObjectInfo) -> Source {
    Source { bucket: S3_BUCKET.into(), key: info.key.clone(), size: info.size, etag: info.etag.clone(), version: None }
}

/// Lists `prefix` and adds every object as a file, one folder level per
/// key part (what `arbor import` does); objects per second.
fn import_all(vol: &Volume, store: &S3Store, prefix: &str) -> (usize, f64) {
    let t = Instant::now();
    let objects = store.list_objects(prefix).expect("list");
    let mut dirs: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    for o in &objects {
        let rel = &o.key[prefix.len()..];
        let (folder, name) = rel.rsplit_once('/').unwrap_or(("", rel));
        let mut parent = ROOT_INO;
        let mut path = String::new();
        for part in folder.split('/').filter(|p| !p.is_empty()) {
            path.push_str(part);
            path.push('/');
            parent = *dirs
                .entry(path.clone())
                .or_insert_with(|| vol.mkdir(parent, part.as_bytes(), 0o755, 0, 0).expect("mkdir").ino);
        }
        vol.import(parent, name.as_bytes(), 0o644, (0, 0), source(o), Timestamp { secs: 0, nanos: 0 }).expect("import");
    }
    vol.commit().expect("commit");
    (objects.len(), objects.len() as f64 / t.elapsed().as_secs_f64())
}

/// The baseline of export: the same bodies PUT whole, four in flight; MiB/s.
fn parallel_upload(endpoint: &str, bodies: &[(String, Vec<u8>)]) -> f64 {
    let (rt, client) = arbor_benches::s3_client(endpoint);
    let total: usize = bodies.iter().map(|(_, b)| b.len()).sum();
    let t = Instant::now();
    rt.block_on(async {
        let sem = Arc::new(tokio::sync::Semaphore::new(4));
        let mut tasks = Vec::new();
        for (key, body) in bodies {
            let (client, sem, key, body) = (client.clone(), sem.clone(), key.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                let _permit = sem.acquire().await.expect("semaphore");
                client
                    .put_object()
                    .bucket(S3_BUCKET)
                    .key(key)
                    .body(aws_sdk_s3::primitives::ByteStream::from(body))
                    .send()
                    .await
                    .expect("put");
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
    });
    total as f64 / MIB as f64 / t.elapsed().as_secs_f64()
}

/// `arbor export` (the release binary beside this bench) of branch main
/// of `disk` to `dest`; MiB/s of `bytes`.
fn export_files(server: &S3Server, disk: &Path, dest: &str, bytes: u64) -> f64 {
    let bin = std::env::current_exe().expect("exe").with_file_name("arbor");
    let t = Instant::now();
    let out = std::process::Command::new(&bin)
        .args(["export", &disk.display().to_string(), "--branch", "main", dest])
        .env("AWS_ACCESS_KEY_ID", arbor_engine::testkit::S3_KEY)
        .env("AWS_SECRET_ACCESS_KEY", arbor_engine::testkit::S3_SECRET)
        .env("AWS_ENDPOINT_URL", server.endpoint())
        .env("AWS_REGION", "us-east-1")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (cargo build --release -p arbor-cli)", bin.display()));
    assert!(out.status.success(), "export: {}", String::from_utf8_lossy(&out.stderr));
    bytes as f64 / MIB as f64 / t.elapsed().as_secs_f64()
}

fn main() {
    let base = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/bench-data"));
    let (mib, runs) = (env_usize("ARBOR_BENCH_MIB", 1024), env_usize("ARBOR_BENCH_RUNS", 3));
    let count = env_usize("ARBOR_BENCH_OBJECTS", 20_000);
    println!("import_bench: dir {}, {mib} MiB, {count} objects, {runs} runs (medians)", base.display());
    let data = fresh(&base, "s3");
    let Some(server) = S3Server::start(&data).expect("s3s-fs") else {
        eprintln!("import_bench needs s3s-fs");
        std::process::exit(2);
    };
    let store = Arc::new(S3Store::open(&server.config("")).expect("store"));
    // The large object, and many small ones in nested folders.
    let big: Vec<u8> = (0..mib * MIB).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    store.put_large("corpus/big.bin", &big).expect("put");
    let plain = base.join("plain.bin");
    std::fs::write(&plain, &big).expect("plain file");
    drop(big);
    for i in 0..count {
        let p = data.join(S3_BUCKET).join(format!("many/d{:02}/e{:02}/o{i}.bin", i % 37, i % 11));
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, format!("object {i}\n")).expect("write");
    }
    let (mut cold, mut baseline, mut rate) = (Vec::new(), Vec::new(), Vec::new());
    let (mut exported, mut uploaded) = (Vec::new(), Vec::new());
    // The files to export, in a local-folder disk, and the same bytes for
    // the baseline.
    let export_disk = base.join("export-disk");
    let _ = std::fs::remove_dir_all(&export_disk);
    let mut bodies = Vec::new();
    {
        let disk = Disk::init(&export_disk.display().to_string(), DiskOptions::default()).expect("disk");
        let cfg = Config { commit_interval: None, ..Config::default() };
        let (vol, _lock) = disk.catalog().expect("catalog").open_branch("main", cfg).expect("branch");
        for f in 0..16u64 {
            let body: Vec<u8> =
                (0..64 * MIB).map(|i| ((i as u64).wrapping_mul(2_654_435_761 + f) >> 17) as u8).collect();
            let name = format!("part-{f:02}.bin");
            let ino = vol.create(ROOT_INO, name.as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
            for (i, piece) in body.chunks(MIB).enumerate() {
                vol.write(ino, (i * MIB) as u64, piece).expect("write");
            }
            bodies.push((format!("plain/{name}"), body));
        }
        vol.close().expect("close");
    }
    let export_bytes: u64 = bodies.iter().map(|(_, b)| b.len() as u64).sum();
    let (mut warm, mut local, mut cold_memory) = (Vec::new(), Vec::new(), Vec::new());
    let mut imported = 0;
    for run in 0..runs {
        eprintln!("run {}/{runs}", run + 1);
        arbor_benches::drop_page_cache();
        baseline.push(arbor_benches::parallel_download(
            &server.endpoint(),
            S3_BUCKET,
            &[("corpus/big.bin".into(), (mib * MIB) as u64)],
        ));
        arbor_benches::drop_page_cache();
        let (vol_dir, files) = (fresh(&base, "vol"), fresh(&base, "files"));
        let vol = volume(&vol_dir, &store, Some(&files));
        let info = store.list_objects("corpus/").expect("list").remove(0);
        let ino = vol.import(ROOT_INO, b"big.bin", 0o644, (0, 0), source(&info), Timestamp { secs: 0, nanos: 0 });
        let ino = ino.expect("import").ino;
        cold.push(read_file(&vol, ino, mib));
        eprintln!("  cold read {:.0} MiB/s, download {:.0} MiB/s", cold[run], baseline[run]);
        vol.close().expect("close");
        drop(vol);
        arbor_benches::drop_page_cache();
        let memory_only = volume(&fresh(&base, "vol-memory"), &store, None);
        let ino_m =
            memory_only.import(ROOT_INO, b"big.bin", 0o644, (0, 0), source(&info), Timestamp { secs: 0, nanos: 0 });
        cold_memory.push(read_file(&memory_only, ino_m.expect("import").ino, mib));
        eprintln!("  cold read keeping no chunk files {:.0} MiB/s", cold_memory[run]);
        drop(memory_only);
        arbor_benches::drop_page_cache();
        local.push(read_plain(&plain));
        arbor_benches::drop_page_cache();
        let vol = volume(&vol_dir, &store, Some(&files));
        warm.push(read_file(&vol, ino, mib));
        assert_eq!(vol.source_stats().gets, 0, "the warm read came from the chunk files");
        eprintln!("  warm read from the chunk files {:.0} MiB/s, a local file {:.0} MiB/s", warm[run], local[run]);
        drop(vol);
        arbor_benches::drop_page_cache();
        uploaded.push(parallel_upload(&server.endpoint(), &bodies));
        arbor_benches::drop_page_cache();
        let dest = format!("s3://{S3_BUCKET}/out{run}");
        exported.push(export_files(&server, &export_disk, &dest, export_bytes));
        eprintln!("  export {:.0} MiB/s, upload {:.0} MiB/s", exported[run], uploaded[run]);
        let vol = volume(&fresh(&base, "vol"), &store, None);
        let (n, r) = import_all(&vol, &store, "many/");
        imported = n;
        rate.push(r);
        eprintln!("  import {r:.0} objects/s");
    }
    assert_eq!(imported, count, "every object imported");
    let ranged = "parallel ranged GETs";
    let rows = vec![
        Row::mib_per_s(
            format!("cold sequential read of an imported {mib} MiB object (chunk files kept, as a mount does)"),
            ranged,
            &baseline,
            &cold,
            "≥ 0.8",
        ),
        Row::mib_per_s(
            format!("the same read keeping no chunk files (memory only, {mib} MiB)"),
            ranged,
            &baseline,
            &cold_memory,
            "≥ 0.8",
        ),
        Row::mib_per_s(
            "warm read of it from the chunk files (new volume, page cache dropped)",
            "a local file, 1 MiB reads",
            &local,
            &warm,
            "report",
        ),
        Row::mib_per_s("export of 16 × 64 MiB files", "parallel PUTs", &uploaded, &exported, "report"),
        Row {
            name: format!("import of {count} objects (list with ETags + one file each)"),
            baseline: "—".into(),
            arbor: format!("{:.0} objects/s", median(rate.clone())),
            ratio: f64::NAN,
            target: "report".into(),
        },
    ];
    print_table("imported files (s3s-fs on 127.0.0.1)", &rows);
    let _ = std::fs::remove_dir_all(base.join("vol"));
    let _ = std::fs::remove_dir_all(base.join("files"));
    let _ = std::fs::remove_dir_all(base.join("vol-memory"));
    let _ = std::fs::remove_file(&plain);
    let _ = std::fs::remove_dir_all(&export_disk);
    let _ = std::fs::remove_dir_all(&data);
}
