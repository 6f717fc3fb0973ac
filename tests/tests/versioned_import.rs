//! `arbor import` from a bucket that keeps versions (moto on 127.0.0.1;
//! s3s-fs keeps none): each file records its object's version id, so a
//! checkpoint reads exactly the version it recorded after the key was
//! overwritten or deleted, and only a refresh moves the branch on.

use arbor_tests::*;
use std::path::Path;

const BUCKET: &str = "team-corpus";

fn read_all(p: &Path) -> std::io::Result<Vec<u8>> {
    std::fs::read(p)
}

#[test]
fn a_checkpoint_keeps_reading_the_versions_it_recorded() {
    if !fuse_available() {
        return;
    }
    let Some(s3) = VersionedS3::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let env = vec![
        ("AWS_ACCESS_KEY_ID", "arbor-test-key".to_string()),
        ("AWS_SECRET_ACCESS_KEY", "arbor-test-secret".to_string()),
        ("AWS_ENDPOINT_URL", s3.endpoint()),
        ("AWS_REGION", "us-east-1".to_string()),
        ("XDG_CACHE_HOME", dir.path().join("cache").display().to_string()),
    ];
    s3.client(&["make", BUCKET]);
    let put = |key: &str, body: &[u8]| -> String {
        let f = dir.path().join("body");
        std::fs::write(&f, body).expect("write body");
        s3.client(&["put", BUCKET, key, f.to_str().expect("utf8")])
    };
    let (a_v1, b_v1, c) = (pattern(3 << 20, 1), pattern(100_000, 2), b"tokenizer\n".to_vec());
    let a_first = put("data/a.bin", &a_v1);
    put("data/b.bin", &b_v1);
    put("data/sub/c.txt", &c);
    assert!(!a_first.is_empty(), "the bucket keeps versions");

    let disk = dir.path().join("disk").display().to_string();
    arbor_env_ok(&["init", &disk], &env);
    let source = format!("s3://{BUCKET}/data");
    let out = arbor_env_ok(&["import", &disk, &source, "--at", "/data"], &env);
    assert!(out.contains("imported 3 files"), "{out}");
    // Nothing moved: a second run and a refresh find every file as it is.
    let again = arbor_env_ok(&["import", &disk, &source, "--at", "/data", "--refresh"], &env);
    assert!(again.contains("imported 0 files") && again.contains("3 already there"), "{again}");
    assert!(again.contains("0 changed, 0 deleted"), "{again}");

    let mnt = dir.path().join("m");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let cache = dir.path().join("cache").display().to_string();
    let m = Mount::start_env(&disk, &mnt, &["--cache-dir", &cache], &env);
    let mp = mnt.to_str().expect("utf8");
    let data = mnt.join("data");
    assert!(read_all(&data.join("a.bin")).expect("a") == a_v1);
    assert_eq!(read_all(&data.join("sub/c.txt")).expect("c"), c);
    arbor_env_ok(&["checkpoints", "create", mp, "v1"], &env);

    // The team overwrites one object and deletes another. The files name
    // the versions they were imported at: the branch still reads those
    // bytes (not EIO, not the new object) until it is refreshed.
    let a_v2 = pattern(2 << 20, 3);
    let a_second = put("data/a.bin", &a_v2);
    assert_ne!(a_first, a_second);
    s3.client(&["delete", BUCKET, "data/b.bin"]);
    let b = read_all(&data.join("b.bin"));
    assert!(
        b.as_ref().is_ok_and(|b| *b == b_v1),
        "b reads its recorded version: {:?}; log: {}",
        b.map(|b| b.len()),
        std::fs::read_to_string(&m.log).unwrap_or_default()
    );

    let out = arbor_env(&["import", mp, &source, "--at", "/data", "--refresh"], &env);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("1 changed, 1 deleted") && stdout.contains("0 conflicts"), "{stdout}");
    assert!(read_all(&data.join("a.bin")).expect("a after refresh") == a_v2, "the new version");
    assert!(!data.join("b.bin").exists());
    let diff = arbor_env_ok(&["diff", mp, "v1", "branch:main"], &env);
    for line in ["M data/a.bin", "D data/b.bin"] {
        assert!(diff.contains(line), "{line} in diff: {diff}");
    }
    m.unmount();

    // The checkpoint reads exactly what it recorded, on a node whose
    // caches are gone (every byte from the bucket, by version id).
    assert!(bytes_under(&Path::new(&cache).join("objects")) > 0, "the mount kept the chunks it read");
    std::fs::remove_dir_all(&cache).expect("rm cache");
    let m = Mount::start_env(&disk, &mnt, &["--checkpoint", "v1", "--cache-dir", &cache], &env);
    assert!(read_all(&data.join("a.bin")).expect("a in v1") == a_v1, "v1 reads the first version");
    assert!(read_all(&data.join("b.bin")).expect("b in v1") == b_v1, "v1 reads the deleted key's version");
    m.unmount();
    let out = arbor_env(&["fsck", &disk], &env);
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));

    // A version deleted for good is reported by fsck and fails the
    // checkpoint's reads with EIO, never other bytes.
    s3.client(&["purge", BUCKET, "data/a.bin", &a_first]);
    let out = arbor_env(&["fsck", &disk], &env);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("data/a.bin (deleted since import)"), "{text}");
    std::fs::remove_dir_all(&cache).expect("rm cache");
    let m = Mount::start_env(&disk, &mnt, &["--checkpoint", "v1", "--cache-dir", &cache], &env);
    match read_all(&data.join("a.bin")) {
        Ok(b) => panic!("read {} bytes of a version deleted for good", b.len()),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}"),
    }
    let log = std::fs::read_to_string(&m.log).unwrap_or_default();
    assert!(log.contains(&format!("s3://{BUCKET}/data/a.bin")) && log.contains(&a_first), "{log}");
    m.unmount();
}
