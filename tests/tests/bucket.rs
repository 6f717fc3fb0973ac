//! An s3:// disk end to end: the real binary, real FUSE mounts, and a real
//! S3-compatible server (s3s-fs) on 127.0.0.1. A node that dies and loses
//! its whole cache directory comes back with every fsynced byte, every
//! checkpoint and every branch.

use arbor_engine::testkit::S3_BUCKET;
use arbor_tests::*;

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
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
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
