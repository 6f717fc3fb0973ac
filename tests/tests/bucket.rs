//! An s3:// disk end to end: the real binary, real FUSE mounts, and a real
//! S3-compatible server (s3s-fs) on 127.0.0.1. A node that dies and loses
//! its whole cache directory comes back with every fsynced byte, every
//! checkpoint and every branch.

use arbor_engine::testkit::S3_BUCKET;
use arbor_tests::*;
use std::path::Path;
use std::process::Command;

#[test]
fn bucket_durability_survives_kill_9_and_losing_the_whole_cache() {
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{S3_BUCKET}/disks/one");
    arbor_env_ok(&["init", &disk], &w.env);
    let mnt = w.mnt("m1");
    let m = Mount::start_env(&disk, &mnt, &["--durability", "bucket"], &w.env);
    let files: Vec<(String, Vec<u8>)> =
        (0..5).map(|i| (format!("shard-{i}.bin"), pattern(300_000 + i * 9_000_000, i as u32))).collect();
    std::fs::create_dir_all(mnt.join("data")).expect("mkdir");
    for (name, bytes) in &files {
        write_synced(&mnt.join("data").join(name), bytes);
    }
    let status = arbor_env_ok(&["status", mnt.to_str().expect("utf8"), "--json"], &w.env);
    assert!(status.contains("\"durability\":\"bucket\""), "{status}");
    m.kill9();
    w.lose_the_cache();
    // A new node: an empty cache, the same bucket.
    let m = Mount::start_env(&disk, &mnt, &[], &w.env);
    for (name, bytes) in &files {
        let got = std::fs::read(mnt.join("data").join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(got == *bytes, "{name}: bytes differ after losing the node");
    }
    m.unmount_env(&w.env);
}

#[test]
fn checkpoints_and_branches_open_from_the_bucket_alone() {
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{S3_BUCKET}/disks/two");
    arbor_env_ok(&["init", &disk], &w.env);
    let main = w.mnt("main");
    let m = Mount::start_env(&disk, &main, &[], &w.env);
    let dataset = pattern(70 << 20, 7);
    write_synced(&main.join("dataset.bin"), &dataset);
    let mp = main.to_str().expect("utf8");
    arbor_env_ok(&["checkpoints", "create", mp, "v1"], &w.env);
    arbor_env_ok(&["branches", "create", mp, "run-a", "--from-checkpoint", "v1"], &w.env);
    let status = arbor_env_ok(&["status", mp, "--json"], &w.env);
    assert!(status.contains("\"pending_upload_bytes\""), "{status}");
    // Local durability: unmount waits until the bucket has everything.
    m.unmount_env(&w.env);
    w.lose_the_cache();
    let run_a = w.mnt("run-a");
    let m = Mount::start_env(&disk, &run_a, &["--branch", "run-a"], &w.env);
    write_synced(&run_a.join("model.ckpt"), b"weights of run a");
    m.unmount_env(&w.env);
    w.lose_the_cache();
    let v1 = w.mnt("v1");
    let m = Mount::start_env(&disk, &v1, &["--checkpoint", "v1"], &w.env);
    assert!(std::fs::read(v1.join("dataset.bin")).expect("read") == dataset, "checkpoint bytes differ");
    assert!(!v1.join("model.ckpt").exists());
    m.unmount_env(&w.env);
    let m = Mount::start_env(
        &disk,
        &run_a,
        &["--branch", "run-a", "--cache-dir", &w.dir.path().join("c2").display().to_string()],
        &w.env,
    );
    assert_eq!(std::fs::read(run_a.join("model.ckpt")).expect("read"), b"weights of run a");
    assert!(std::fs::read(run_a.join("dataset.bin")).expect("read") == dataset);
    m.unmount_env(&w.env);
    let list = arbor_env_ok(&["branches", "list", &disk], &w.env);
    assert!(list.contains("run-a") && list.contains("main"), "{list}");
    let diff = arbor_env_ok(&["diff", &disk, "v1", "branch:run-a"], &w.env);
    assert!(diff.contains("model.ckpt"), "{diff}");
    // Commands on the unmounted disk read segments through a cache of their own.
    let gc = arbor_env_ok(&["gc", &disk], &w.env);
    assert!(gc.contains("reachable") && gc.contains("deleted"), "{gc}");
    let fsck = arbor_env_ok(&["fsck", &disk, "--json"], &w.env);
    assert!(fsck.contains("\"problems\":[]"), "{fsck}");
    // Nothing gc deleted was needed: every root still reads whole.
    let m = Mount::start_env(&disk, &v1, &["--checkpoint", "v1"], &w.env);
    assert!(std::fs::read(v1.join("dataset.bin")).expect("read") == dataset, "checkpoint bytes differ after gc");
    m.unmount_env(&w.env);
    // Compacting run-a copies what it still holds of mostly dead segments
    // (the dataset's tail, shared with v1) through the bucket; gc then keeps
    // what v1 needs, and both read whole from the bucket alone.
    let out = arbor_env_ok(&["compact", &disk, "--branch", "run-a"], &w.env);
    assert!(out.contains("branch run-a: moved"), "{out}");
    arbor_env_ok(&["gc", &disk], &w.env);
    w.lose_the_cache();
    let m = Mount::start_env(&disk, &run_a, &["--branch", "run-a"], &w.env);
    assert_eq!(std::fs::read(run_a.join("model.ckpt")).expect("read"), b"weights of run a");
    assert!(std::fs::read(run_a.join("dataset.bin")).expect("read") == dataset, "branch bytes differ after compact");
    m.unmount_env(&w.env);
    let m = Mount::start_env(&disk, &v1, &["--checkpoint", "v1"], &w.env);
    assert!(std::fs::read(v1.join("dataset.bin")).expect("read") == dataset, "checkpoint bytes differ after compact");
    m.unmount_env(&w.env);
}

#[test]
fn an_unreachable_bucket_and_bad_credentials_are_one_clear_line() {
    let Some(w) = S3World::start() else { return };
    let closed = free_port();
    let mut env = w.env.clone();
    env.retain(|(k, _)| *k != "AWS_ENDPOINT_URL");
    env.push(("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{closed}")));
    env.push(("ARBOR_S3_RETRIES", "2".into()));
    let out = arbor_env(&["init", &format!("s3://{S3_BUCKET}/x")], &env);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unreachable"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let mut env = w.env.clone();
    env.retain(|(k, _)| *k != "AWS_SECRET_ACCESS_KEY");
    env.push(("AWS_SECRET_ACCESS_KEY", "wrong".into()));
    let out = arbor_env(&["init", &format!("s3://{S3_BUCKET}/y")], &env);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("access denied"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    let out = arbor_env(&["status", "/nonexistent"], &env);
    assert!(!out.status.success());
}

/// Appends `n` records of `len` bytes to `path`, fsyncing each.
fn append_synced(path: &Path, n: usize, len: usize, seed: u32) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).expect("open");
    for i in 0..n {
        f.write_all(&pattern(len, seed + i as u32)).expect("append");
        f.sync_data().expect("fsync");
    }
}

#[test]
fn repeated_kill_9_on_a_bucket_durable_disk_loses_nothing_and_leaves_no_wal_behind() {
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{S3_BUCKET}/disks/spot");
    arbor_env_ok(&["init", &disk], &w.env);
    let mnt = w.mnt("m");
    // What every round fsynced: (file, records, record length, seed).
    let mut logs: Vec<(String, usize, usize, u32)> = Vec::new();
    let mut mount_times = Vec::new();
    const ROUNDS: u32 = 4;
    for round in 0..ROUNDS {
        // A preempted node: its replacement starts with an empty cache.
        let _ = std::fs::remove_dir_all(w.dir.path().join("cache"));
        let started = std::time::Instant::now();
        let m = Mount::start_env(&disk, &mnt, &["--durability", "bucket", "--segment-size", "4M"], &w.env);
        mount_times.push(started.elapsed());
        for (name, n, len, seed) in &logs {
            let got = std::fs::read(mnt.join(name)).unwrap_or_else(|e| panic!("round {round}: {name}: {e}"));
            let want: Vec<u8> = (0..*n).flat_map(|i| pattern(*len, seed + i as u32)).collect();
            assert!(got == want, "round {round}: {name} differs after kill -9 and a new node");
        }
        let name = format!("log-{round}");
        append_synced(&mnt.join(&name), 150, 40_000, round * 1000);
        logs.push((name, 150, 40_000, round * 1000));
        // And a tail nobody fsynced, cut off by the kill.
        std::fs::write(mnt.join("unsynced"), pattern(3 << 20, round)).expect("write");
        if round == ROUNDS - 1 {
            // The tail may fill the open segment, which is then sealed and
            // uploaded, its WAL pieces left for recovery to delete. One more
            // fsync leaves the dead writer an open segment whose bytes only
            // WAL pieces hold, for the last recovery to seal.
            append_synced(&mnt.join("last"), 1, 4096, 7);
        }
        m.kill9();
        let _ = Command::new("fusermount3").args(["-u", "-z"]).arg(&mnt).status();
    }
    let _ = std::fs::remove_dir_all(w.dir.path().join("cache"));
    let started = std::time::Instant::now();
    let m = Mount::start_env(&disk, &mnt, &["--durability", "bucket"], &w.env);
    mount_times.push(started.elapsed());
    let status = arbor_env_ok(&["status", mnt.to_str().expect("utf8"), "--json"], &w.env);
    let human = arbor_env_ok(&["status", mnt.to_str().expect("utf8")], &w.env);
    m.unmount_env(&w.env);
    // The dead writer's open segment was WAL pieces only: recovery sealed it.
    assert!(status.contains("\"recovery\"") && !status.contains("\"sealed\":0"), "{status}");
    assert!(human.contains("recovery") && human.contains("sealed"), "{human}");
    // The same disk after a clean unmount, for comparison.
    let _ = std::fs::remove_dir_all(w.dir.path().join("cache"));
    let started = std::time::Instant::now();
    let m = Mount::start_env(&disk, &mnt, &["--durability", "bucket"], &w.env);
    let clean = started.elapsed();
    m.unmount_env(&w.env);
    let ms: Vec<String> = mount_times.iter().map(|t| format!("{:.0}", t.as_secs_f64() * 1e3)).collect();
    eprintln!(
        "mount with an empty cache after each kill -9, ms: {} (after a clean unmount: {:.0})",
        ms.join(", "),
        clean.as_secs_f64() * 1e3
    );
    eprintln!("{human}");
    // Recovery left a head that needs no old WAL piece, and deleted them.
    let wal = w.objects_under("disks/spot/wal");
    assert_eq!(wal, 0, "{wal} WAL pieces of dead writers are still in the bucket after a clean unmount");
    let fsck = arbor_env_ok(&["fsck", &disk, "--json"], &w.env);
    assert!(fsck.contains("\"problems\":[]"), "{fsck}");
}

/// gc on a node that never held a segment judges its age by the bucket:
/// a segment another node's writer uploaded a moment ago (not in any head
/// yet) is kept for the grace period, and deleted once past it.
#[test]
fn gc_elsewhere_keeps_a_segment_just_uploaded_by_another_node() {
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{S3_BUCKET}/disks/gc-age");
    arbor_env_ok(&["init", &disk], &w.env);
    // What another node's writer just uploaded: a segment no head reaches.
    let seg = arbor_engine::format::SegId { writer: 0xdead_beef, seq: 3 };
    let key = format!("disks/gc-age/{}", arbor_engine::layout::segment_key(seg));
    let segments = "disks/gc-age/segments";
    let before = w.objects_under(segments);
    w.put_as_file(&key, &pattern(1 << 20, 5));
    w.lose_the_cache();
    let out = arbor_env_ok(&["gc", &disk], &w.env);
    assert_eq!(w.objects_under(segments), before + 1, "gc deleted a segment uploaded a moment ago: {out}");
    let out = arbor_env_ok(&["gc", &disk, "--grace", "0"], &w.env);
    assert_eq!(w.objects_under(segments), before, "past its grace period it goes: {out}");
}
