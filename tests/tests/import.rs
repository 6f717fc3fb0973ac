//! `arbor import`: a prefix of plain objects in a real S3 server (s3s-fs)
//! becomes files of a branch without copying; reads go to the objects,
//! writes land on top, changed objects fail loudly, gc and compaction
//! never touch them.

use arbor_engine::bucket::ObjectStore;
use arbor_engine::testkit::S3_BUCKET;
use arbor_tests::*;
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

/// Objects under `corpus/raw/`: nested folders, sizes 0 B – 9 MiB, read
/// one at a time. (A small GET from s3s-fs often takes ~40 ms, a
/// Nagle/delayed-ACK stall on its side; the 10,000-object test below reads
/// many at once.)
fn corpus() -> BTreeMap<String, Vec<u8>> {
    let mut objects = BTreeMap::new();
    for i in 0..120u32 {
        let size = match i % 10 {
            0 => 0,
            1 => 1,
            2 => 4096,
            3 => (1 << 20) + 17,
            _ => (i as usize * 7919) % 300_000,
        };
        let key = format!("corpus/raw/shard-{:02}/part-{}/item-{i:04}.bin", i % 7, i % 3);
        objects.insert(key, pattern(size, i));
    }
    objects.insert("corpus/raw/big/tokens.bin".into(), pattern(9 << 20, 99));
    objects.insert("corpus/raw/README".into(), b"a corpus\n".to_vec());
    // Changed and deleted behind arbor's back before anything reads them.
    objects.insert("corpus/raw/later/changed.bin".into(), pattern(3 << 20, 5));
    objects.insert("corpus/raw/later/deleted.bin".into(), pattern(100_000, 6));
    objects
}

fn read_all(p: &Path) -> std::io::Result<Vec<u8>> {
    std::fs::read(p)
}

#[test]
fn an_s3_prefix_becomes_files_read_in_place_with_writes_on_top() {
    let Some(w) = S3World::start() else { return };
    let bucket = w.bucket();
    let mut objects = corpus();
    for (k, v) in &objects {
        bucket.put(k, v).expect("put");
    }
    // Keys that cannot be paths (`a//b`, `./c`, a key that is also a
    // prefix) cannot be stored by s3s-fs, which keeps objects as files;
    // the unit tests of `arbor_cli::import::plan` cover them.
    if numpy_available() {
        let made = tempfile::tempdir().expect("tempdir");
        let out = python("read_in_place.py", &["make", made.path().to_str().expect("utf8")]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        for e in std::fs::read_dir(made.path()).expect("readdir").flatten() {
            let key = format!("corpus/raw/webdataset/{}", e.file_name().to_string_lossy());
            let body = std::fs::read(e.path()).expect("read");
            bucket.put(&key, &body).expect("put");
            objects.insert(key, body);
        }
    }
    let disk = format!("s3://{S3_BUCKET}/disks/imp");
    arbor_env_ok(&["init", &disk], &w.env);
    let source = format!("s3://{S3_BUCKET}/corpus/raw");
    let out = arbor_env(&["import", &disk, &source, "--at", "/data"], &w.env);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains(&format!("imported {} files", objects.len())), "{stdout}");
    assert!(stdout.contains("0 skipped, 0 conflicts"), "{stdout}");
    // Nothing was copied: the disk's own prefix holds only heads and small segments.
    let store = w.bucket();
    let disk_bytes: u64 = store.list("disks/imp/").expect("list").iter().map(|k| store.size(k).expect("size")).sum();
    let corpus_bytes: u64 = objects.values().map(|v| v.len() as u64).sum();
    assert!(disk_bytes < corpus_bytes / 10, "disk {disk_bytes} B for a {corpus_bytes} B corpus");

    // A second run adds nothing.
    let again = arbor_env_ok(&["import", &disk, &source, "--at", "/data"], &w.env);
    assert!(again.contains("imported 0 files"), "{again}");
    assert!(again.contains(&format!("{} already there", objects.len())), "{again}");

    let mnt = w.mnt("m");
    let m = Mount::start_env(&disk, &mnt, &[], &w.env);
    let data = mnt.join("data");
    let mut files = 0;
    let mut stack = vec![data.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("readdir").flatten() {
            if e.file_type().expect("type").is_dir() {
                stack.push(e.path());
            } else {
                files += 1;
            }
        }
    }
    assert_eq!(files, objects.len(), "one file per object");
    for (k, v) in &objects {
        let p = data.join(k.strip_prefix("corpus/raw/").expect("prefix"));
        assert_eq!(std::fs::metadata(&p).expect("stat").len(), v.len() as u64, "{k}");
        if !k.contains("/later/") {
            assert!(read_all(&p).expect("read") == *v, "{k} reads its object");
        }
    }
    // WebDataset shards and a token file, read in place by Python.
    if numpy_available() {
        let out = python("read_in_place.py", &["check", data.join("webdataset").to_str().expect("utf8")]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    }
    // Windows of a token file, as numpy.memmap reads it.
    let tokens = &objects["corpus/raw/big/tokens.bin"];
    {
        let mut f = std::fs::File::open(data.join("big/tokens.bin")).expect("open");
        for off in [0u64, 4093, (5 << 20) + 1, (9 << 20) - 8] {
            let mut buf = [0u8; 8];
            f.seek(SeekFrom::Start(off)).expect("seek");
            f.read_exact(&mut buf).expect("read");
            assert_eq!(&buf[..], &tokens[off as usize..off as usize + 8], "at {off}");
        }
    }

    // Writes on top: only the written range changes.
    let target = data.join("big/tokens.bin");
    let mut expect = tokens.clone();
    {
        let mut f = std::fs::OpenOptions::new().write(true).open(&target).expect("open rw");
        f.seek(SeekFrom::Start(3 << 20)).expect("seek");
        f.write_all(b"written by arbor").expect("write");
        f.sync_all().expect("fsync");
    }
    expect[3 << 20..(3 << 20) + 16].copy_from_slice(b"written by arbor");
    assert!(read_all(&target).expect("read") == expect);
    let mp = mnt.to_str().expect("utf8");
    arbor_env_ok(&["checkpoints", "create", mp, "v1"], &w.env);

    // Changed and deleted outside arbor: their reads fail, never other
    // bytes (of the new object, or zeros).
    let changed = "corpus/raw/later/changed.bin";
    let deleted = "corpus/raw/later/deleted.bin";
    bucket.put(changed, &pattern(3 << 20, 12345)).expect("overwrite");
    bucket.delete(deleted).expect("delete");
    for k in [changed, deleted] {
        let p = data.join(k.strip_prefix("corpus/raw/").expect("prefix"));
        match read_all(&p) {
            Ok(b) => panic!("{k}: read {} bytes of an object changed since import", b.len()),
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{k}: {e}"),
        }
    }

    // Status counts the GETs, the bytes, and the refused reads.
    let status: serde_json::Value =
        serde_json::from_str(&arbor_env_ok(&["status", mp, "--json"], &w.env)).expect("status json");
    let imported = &status["imported"];
    // Every file read above came from its object (later/ was never read).
    let read_bytes: u64 = objects.iter().filter(|(k, _)| !k.contains("/later/")).map(|(_, v)| v.len() as u64).sum();
    assert!(imported["fetched_bytes"].as_u64().unwrap_or(0) >= read_bytes, "{imported} < {read_bytes}");
    assert!(imported["changed"].as_u64().unwrap_or(0) >= 2, "{imported}");
    let human = arbor_env_ok(&["status", mp], &w.env);
    assert!(human.contains("imported ") && human.contains("refused (object changed or gone)"), "{human}");
    // A refresh follows the bucket, as ordinary operations on the branch;
    // the file the branch wrote on is left alone and reported.
    bucket.put("corpus/raw/big/tokens.bin", &pattern(1000, 1)).expect("overwrite");
    bucket.put("corpus/raw/later/new.bin", &pattern(5000, 7)).expect("put");
    // README was read through the mount above: the kernel holds its pages.
    bucket.put("corpus/raw/README", b"A CORPUS\n").expect("overwrite");
    let out = arbor_env(&["import", mp, &source, "--at", "/data", "--refresh"], &w.env);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("imported 1 files") && stdout.contains("2 changed, 1 deleted"), "{stdout}{stderr}");
    assert!(stdout.contains("1 conflicts"), "{stdout}");
    assert!(stderr.contains("/data/big/tokens.bin (changed in the branch and in the bucket)"), "{stderr}");
    assert!(read_all(&data.join("later/changed.bin")).expect("changed") == pattern(3 << 20, 12345));
    assert!(read_all(&data.join("later/new.bin")).expect("new") == pattern(5000, 7));
    assert!(!data.join("later/deleted.bin").exists());
    assert_eq!(read_all(&data.join("README")).expect("README"), b"A CORPUS\n", "not the cached pages");
    // Left alone: the same size and extents (its unwritten part names the
    // old object, so a read of it fails now unless the kernel still holds
    // its pages; diff below shows it unchanged).
    assert_eq!(std::fs::metadata(&target).expect("kept").len(), expect.len() as u64);
    let diff = arbor_env_ok(&["diff", mp, "v1", "branch:main"], &w.env);
    for line in ["M data/later/changed.bin", "D data/later/deleted.bin", "A data/later/new.bin"] {
        assert!(diff.contains(line), "{line} in diff: {diff}");
    }
    assert!(!diff.contains("tokens.bin"), "{diff}");
    m.unmount();

    // fsck asks the bucket about every imported file: checkpoint v1 still
    // names the old versions. Offline it checks only what the disk holds.
    let out = arbor_env(&["fsck", &disk], &w.env);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    for k in ["later/changed.bin (changed since import)", "later/deleted.bin (deleted since import)"] {
        assert!(text.contains(k), "{k}: {text}");
    }
    let out = arbor_env(&["fsck", &disk, "--offline"], &w.env);
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));

    // Files deleted in the branch, then compaction and gc: every source
    // object is still there, byte for byte.
    let m = Mount::start_env(&disk, &mnt, &[], &w.env);
    std::fs::remove_dir_all(data.join("shard-00")).expect("rm");
    std::fs::remove_file(data.join("README")).expect("rm");
    m.unmount();
    arbor_env_ok(&["checkpoints", "delete", &disk, "v1"], &w.env);
    arbor_env_ok(&["compact", &disk, "--max-live", "1"], &w.env);
    arbor_env_ok(&["gc", &disk, "--grace", "0"], &w.env);
    objects.insert(changed.into(), pattern(3 << 20, 12345));
    objects.insert("corpus/raw/big/tokens.bin".into(), pattern(1000, 1));
    objects.insert("corpus/raw/later/new.bin".into(), pattern(5000, 7));
    objects.insert("corpus/raw/README".into(), b"A CORPUS\n".to_vec());
    objects.remove(deleted);
    for (k, v) in &objects {
        assert!(bucket.get(k).expect("source object kept").0 == *v, "{k} unchanged");
    }
}

#[test]
fn an_import_into_a_mounted_branch_shows_in_the_mount() {
    let Some(w) = S3World::start() else { return };
    let bucket = w.bucket();
    for i in 0..20u32 {
        bucket.put(&format!("eval/set-{}/q{i}.json", i % 2), &pattern(1000 + i as usize, i)).expect("put");
    }
    let disk = w.dir.path().join("local-disk").display().to_string();
    arbor_env_ok(&["init", &disk], &w.env);
    let mnt = w.mnt("m");
    let m = Mount::start_env(&disk, &mnt, &["--refresh-source", "1"], &w.env);
    let mp = mnt.to_str().expect("utf8");
    let out = arbor_env_ok(&["import", mp, &format!("s3://{S3_BUCKET}/eval"), "--at", "/evals/v1"], &w.env);
    assert!(out.contains("imported 20 files"), "{out}");
    for i in 0..20u32 {
        let p = mnt.join(format!("evals/v1/set-{}/q{i}.json", i % 2));
        assert_eq!(std::fs::read(&p).expect("read"), pattern(1000 + i as usize, i), "{}", p.display());
    }
    // The mount refreshes the recorded import on its own: a new object
    // appears, a changed one (same size, pages cached) reads anew, a
    // deleted one goes.
    bucket.put("eval/set-0/q20.json", b"new question").expect("put");
    bucket.put("eval/set-1/q1.json", &pattern(1001, 99)).expect("overwrite");
    bucket.delete("eval/set-0/q0.json").expect("delete");
    let dir = mnt.join("evals/v1");
    wait_until("the refresh", std::time::Duration::from_secs(30), || {
        std::fs::read(dir.join("set-0/q20.json")).is_ok_and(|b| b == b"new question")
            && std::fs::read(dir.join("set-1/q1.json")).is_ok_and(|b| b == pattern(1001, 99))
            && !dir.join("set-0/q0.json").exists()
    });
    // A folder where the import needs one is a file: the import says so
    // (one line, non-zero) or, below its folder, leaves it and reports it.
    std::fs::write(mnt.join("evals/v2"), b"a file").expect("write");
    let out = arbor_env(&["import", mp, &format!("s3://{S3_BUCKET}/eval"), "--at", "/evals/v2"], &w.env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is not a folder"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    std::fs::create_dir(mnt.join("evals/v3")).expect("mkdir");
    std::fs::write(mnt.join("evals/v3/set-0"), b"a file").expect("write");
    let out = arbor_env(&["import", mp, &format!("s3://{S3_BUCKET}/eval"), "--at", "/evals/v3"], &w.env);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("imported 10 files") && stdout.contains("1 conflicts"), "{stdout}");
    assert!(stderr.contains("/evals/v3/set-0 (exists and is not a folder)"), "{stderr}");
    // A bad source is one line and changes nothing.
    let out = arbor_env(&["import", mp, "gs://x/y"], &w.env);
    assert!(!out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim_end().lines().count(), 1);
    m.unmount();
}

/// Every object under `prefix` of the test bucket, by path below it.
fn objects_below(bucket: &dyn ObjectStore, prefix: &str) -> BTreeMap<String, Vec<u8>> {
    let keys = bucket.list(prefix).expect("list");
    keys.into_iter().map(|k| (k[prefix.len()..].to_string(), bucket.get(&k).expect("get").0)).collect()
}

/// Every regular file under `root`, by path below it.
fn files_below(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("readdir").flatten() {
            let t = e.file_type().expect("type");
            let rel = e.path().strip_prefix(root).expect("below").display().to_string();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                out.insert(rel, std::fs::read(e.path()).expect("read"));
            }
        }
    }
    out
}

#[test]
fn export_writes_plain_objects_once_and_then_only_what_changed() {
    let Some(w) = S3World::start() else { return };
    let bucket = w.bucket();
    bucket.put("in/tokens.bin", &pattern(3 << 20, 4)).expect("put");
    let disk = w.dir.path().join("disk").display().to_string();
    arbor_env_ok(&["init", &disk], &w.env);
    let mnt = w.mnt("m");
    let m = Mount::start_env(&disk, &mnt, &[], &w.env);
    let mp = mnt.to_str().expect("utf8");
    arbor_env_ok(&["import", mp, &format!("s3://{S3_BUCKET}/in"), "--at", "/imported"], &w.env);
    // Written on top of an imported file: the export has both parts.
    let mut f = std::fs::OpenOptions::new().write(true).open(mnt.join("imported/tokens.bin")).expect("open");
    f.seek(SeekFrom::Start(1 << 20)).expect("seek");
    f.write_all(b"patched").expect("write");
    drop(f);
    for i in 0..150u32 {
        std::fs::create_dir_all(mnt.join(format!("ckpt/shard-{}", i % 5))).expect("mkdir");
        write_synced(&mnt.join(format!("ckpt/shard-{}/r{i}.bin", i % 5)), &pattern(1000 + i as usize * 37, i));
    }
    write_synced(&mnt.join("ckpt/big.bin"), &pattern(21 << 20, 77));
    std::os::unix::fs::symlink("big.bin", mnt.join("ckpt/latest")).expect("symlink");
    arbor_env_ok(&["checkpoints", "create", mp, "c1"], &w.env);
    let dest = format!("s3://{S3_BUCKET}/out/run-a");

    // Killed once its first manifest is saved; the next run finishes the job.
    let mut child = std::process::Command::new(arbor_bin())
        .args(["export", mp, "--checkpoint", "c1", &dest])
        .envs(w.env.iter().map(|(k, v)| (*k, v)))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn export");
    let manifests = std::path::Path::new(&disk).join("exports");
    wait_until("a saved export manifest", std::time::Duration::from_secs(60), || {
        manifests.read_dir().is_ok_and(|mut d| d.next().is_some()) || child.try_wait().ok().flatten().is_some()
    });
    let _ = child.kill();
    let _ = child.wait();
    let out = arbor_env_ok(&["export", mp, "--checkpoint", "c1", &dest], &w.env);
    assert!(out.contains("not regular files skipped") && out.contains("1 not regular"), "{out}");
    let exported = objects_below(&bucket, "out/run-a/");
    assert_eq!(exported.len(), 152, "every regular file, no symlink");
    assert!(exported == files_below(&mnt), "objects equal files");

    let again = arbor_env_ok(&["export", mp, "--checkpoint", "c1", &dest], &w.env);
    assert!(again.contains("exported 0 files") && again.contains("152 unchanged"), "{again}");

    // Change, add and remove; export with --since uploads only those.
    write_synced(&mnt.join("ckpt/shard-0/r0.bin"), b"changed");
    write_synced(&mnt.join("ckpt/new.bin"), b"new");
    std::fs::remove_file(mnt.join("ckpt/shard-1/r1.bin")).expect("rm");
    std::fs::remove_dir_all(mnt.join("ckpt/shard-2")).expect("rm dir");
    arbor_env_ok(&["checkpoints", "create", mp, "c2"], &w.env);
    let out = arbor_env_ok(&["export", mp, "--checkpoint", "c2", &dest, "--since", "c1"], &w.env);
    assert!(out.contains("exported 2 files") && out.contains("31 deleted"), "{out}");
    assert!(objects_below(&bucket, "out/run-a/") == files_below(&mnt), "objects equal files after --since");
    let again = arbor_env_ok(&["export", mp, "--checkpoint", "c2", &dest], &w.env);
    assert!(again.contains("exported 0 files"), "{again}");
    // A bad destination is one line and uploads nothing.
    let out = arbor_env(&["export", mp, &format!("s3://{S3_BUCKET}")], &w.env);
    assert!(!out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim_end().lines().count(), 1);
    m.unmount();
}

/// Object `i` of the large corpus: sizes 0 B – 64 MiB, mostly small.
fn many_size(i: usize) -> usize {
    match i {
        0 => 64 << 20,
        1 => 16 << 20,
        2 => 0,
        _ if i % 1000 == 3 => (1 << 20) + i,
        _ => (i * 7919) % 20_000,
    }
}

fn many_key(i: usize) -> String {
    format!("corpus/many/d{:02}/e{}/o{i:05}.bin", i % 23, i % 7)
}

#[test]
fn ten_thousand_objects_in_nested_folders_import_after_a_kill_and_read_back_whole() {
    const N: usize = 10_000;
    let Some(w) = S3World::start() else { return };
    let t = std::time::Instant::now();
    for i in 0..N {
        w.put_as_file(&many_key(i), &pattern(many_size(i), i as u32));
    }
    let disk = format!("s3://{S3_BUCKET}/disks/many");
    arbor_env_ok(&["init", &disk], &w.env);
    let source = format!("s3://{S3_BUCKET}/corpus/many");

    // kill -9 in the middle of an import, then run it again: complete.
    let mut child = std::process::Command::new(arbor_bin())
        .args(["import", &disk, &source, "--at", "/data"])
        .envs(w.env.iter().map(|(k, v)| (*k, v)))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn arbor import");
    std::thread::sleep(std::time::Duration::from_millis(400));
    let _ = child.kill();
    let _ = child.wait();
    let out = arbor_env_ok(&["import", &disk, &source, "--at", "/data", "--json"], &w.env);
    let report: serde_json::Value = serde_json::from_str(&out).expect("import json");
    let (added, there) = (report["added"].as_u64(), report["already"].as_u64());
    assert_eq!(added.unwrap_or(0) + there.unwrap_or(0), N as u64, "{report}");
    assert_eq!(report["skipped"].as_array().map(Vec::len), Some(0), "{report}");
    eprintln!(
        "after a kill -9: {} added, {} already there ({:?})",
        added.unwrap_or(0),
        there.unwrap_or(0),
        t.elapsed()
    );

    let mnt = w.mnt("m");
    let m = Mount::start_env(&disk, &mnt, &[], &w.env);
    let data = mnt.join("data");
    let found = std::process::Command::new("find").arg(&data).args(["-type", "f"]).output().expect("find");
    assert_eq!(String::from_utf8_lossy(&found.stdout).lines().count(), N, "find | wc -l");
    eprintln!("mounted and found ({:?})", t.elapsed());
    // Every file read whole and compared with its object, 32 readers at
    // once, as a data loader's workers would (a small GET from s3s-fs often
    // waits ~40 ms, a Nagle stall on its side: reads must overlap).
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..32 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= N {
                    break;
                }
                let p = data.join(many_key(i).strip_prefix("corpus/many/").expect("prefix"));
                let got = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                assert!(got == pattern(many_size(i), i as u32), "{}: not its object's bytes", p.display());
            });
        }
    });
    eprintln!("read back ({:?})", t.elapsed());
    m.unmount_env(&w.env);
}
