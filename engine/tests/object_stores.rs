//! One conformance suite for every ObjectStore: the local folder, the
//! in-memory store, and S3 through aws-sdk-s3 against a real S3-compatible
//! server (`s3s-fs` 0.14.1, started here on 127.0.0.1 with its own data
//! folder). Outside CI the S3 case is skipped, loudly, when `s3s-fs` is not
//! installed; in CI it must run (`.ci/run` installs it).

use arbor_engine::bucket::{LocalFolderStore, MemObjectStore, ObjectStore, S3Config, S3Store};
use arbor_engine::Error;
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn conformance(store: &dyn ObjectStore) {
    // Create-once.
    let t1 = store.put_if_absent("branches/main", b"v1").expect("create");
    assert!(matches!(store.put_if_absent("branches/main", b"v2"), Err(Error::AlreadyExists(_))));
    assert_eq!(store.get("branches/main").expect("get").0, b"v1");
    // Compare-and-replace.
    let t2 = store.put_if_match("branches/main", b"v2", &t1).expect("cas");
    assert!(matches!(store.put_if_match("branches/main", b"v3", &t1), Err(Error::PreconditionFailed(_))));
    assert_eq!(store.get("branches/main").expect("get"), (b"v2".to_vec(), t2.clone()));
    assert!(matches!(store.put_if_match("branches/none", b"x", &t2), Err(Error::NoSuchObject(_))));
    // Ranged reads.
    store.put("segments/ab/seg-1", b"0123456789").expect("put");
    assert_eq!(store.get_range("segments/ab/seg-1", 2..5).expect("range"), b"234");
    assert_eq!(store.get_range("segments/ab/seg-1", 8..100).expect("clipped"), b"89");
    assert!(store.get_range("segments/ab/seg-1", 10..12).is_err());
    assert!(matches!(store.get("nope"), Err(Error::NoSuchObject(_))));
    // Listing by prefix.
    store.put("segments/cd/seg-2", b"x").expect("put");
    store.put("checkpoints/c1", b"x").expect("put");
    assert_eq!(store.list("segments/").expect("list"), vec!["segments/ab/seg-1", "segments/cd/seg-2"]);
    assert_eq!(store.list("segments/c").expect("list"), vec!["segments/cd/seg-2"]);
    assert_eq!(store.list("check").expect("list"), vec!["checkpoints/c1"]);
    // Delete is idempotent.
    store.delete("segments/ab/seg-1").expect("delete");
    store.delete("segments/ab/seg-1").expect("delete again");
    assert_eq!(store.list("segments/").expect("list"), vec!["segments/cd/seg-2"]);
    // A larger object survives the round trip.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    store.put("segments/ef/big", &big).expect("put big");
    assert!(store.get("segments/ef/big").expect("get big").0 == big);
    assert_eq!(store.get_range("segments/ef/big", 2_000_000..2_000_010).expect("range"), big[2_000_000..2_000_010]);
    // Bad keys change nothing.
    for bad in ["", "/abs", "a//b", "../x", "a/./b", "dir/", ".arbor-locks/x"] {
        assert!(store.put(bad, b"x").is_err(), "{bad:?}");
    }
}

#[test]
fn the_local_folder_passes() {
    let dir = tempfile::tempdir().expect("tempdir");
    conformance(&LocalFolderStore::open(dir.path()).expect("open"));
}

#[test]
fn the_in_memory_store_passes() {
    conformance(&MemObjectStore::new());
}

/// An `s3s-fs` server on a free loopback port, stopped on drop.
struct S3Server {
    child: Child,
    port: u16,
    _data: tempfile::TempDir,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const KEY: &str = "arbor-test-key";
const SECRET: &str = "arbor-test-secret";
const BUCKET: &str = "arbor-test";

fn start_s3() -> Option<S3Server> {
    let found = Command::new("s3s-fs").arg("--help").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
    if !found {
        if std::env::var_os("CI").is_some() {
            panic!("s3s-fs must be installed in CI (.ci/run installs it)");
        }
        eprintln!("SKIPPED: S3 conformance needs s3s-fs 0.14.1 (cargo install s3s-fs --version 0.14.1 --features binary --locked)");
        return None;
    }
    let data = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(data.path().join(BUCKET)).expect("bucket folder");
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().expect("addr").port();
    let child = Command::new("s3s-fs")
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--access-key", KEY, "--secret-key", SECRET])
        .arg(data.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start s3s-fs");
    let server = S3Server { child, port, _data: data };
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "s3s-fs did not start listening");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(server)
}

#[test]
fn s3_through_aws_sdk_against_a_real_server_passes() {
    let Some(server) = start_s3() else { return };
    let cfg = S3Config {
        bucket: BUCKET.into(),
        prefix: "disks/one".into(),
        endpoint: Some(format!("http://127.0.0.1:{}", server.port)),
        region: Some("us-east-1".into()),
        path_style: true,
        credentials: Some((KEY.into(), SECRET.into())),
    };
    let store = S3Store::open(&cfg).expect("open");
    conformance(&store);
    // Wrong credentials are refused with a clear error, not a panic.
    let bad = S3Store::open(&S3Config { credentials: Some((KEY.into(), "wrong".into())), ..cfg }).expect("open");
    let err = bad.get("branches/main").expect_err("bad secret");
    assert!(err.to_string().contains("S3 get"), "{err}");
}
