//! One conformance suite for every ObjectStore: the local folder, the
//! in-memory store, and S3 through aws-sdk-s3 against a real S3-compatible
//! server (`s3s-fs` 0.14.1, started here on 127.0.0.1 with its own data
//! folder). Outside CI the S3 case is skipped, loudly, when `s3s-fs` is not
//! installed; in CI it must run (`.ci/run` installs it).

use arbor_engine::bucket::{LocalFolderStore, MemObjectStore, ObjectStore, S3Config, S3Store};
use arbor_engine::testkit::{S3Server, S3_KEY};
use arbor_engine::Error;

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
    // A shorter body replaces a longer one whole.
    let t3 = store.put_if_match("branches/main", &[7u8; 100], &t2).expect("long");
    store.put_if_match("branches/main", b"short", &t3).expect("short");
    assert_eq!(store.get("branches/main").expect("get").0, b"short");
    store.put("branches/other", &[1u8; 100]).expect("long");
    store.put("branches/other", b"tiny").expect("short");
    assert_eq!(store.get("branches/other").expect("get").0, b"tiny");
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
    assert_eq!(store.size("segments/ef/big").expect("size"), big.len() as u64);
    assert!(store.get_range("segments/ef/big", 100_000..2_900_000).expect("range") == big[100_000..2_900_000]);
    assert!(store.get_range("segments/ef/big", 3_000_000..3_000_001).is_err());
    assert!(matches!(store.size("segments/none"), Err(Error::NoSuchObject(_))));
    // The tail of an object and its length, in one request where it can.
    assert_eq!(store.get_tail("segments/ef/big", 10).expect("tail"), (big[big.len() - 10..].to_vec(), 3_000_000));
    assert_eq!(store.get_tail("segments/cd/seg-2", 16 << 10).expect("whole"), (b"x".to_vec(), 1));
    assert!(matches!(store.get_tail("segments/none", 10), Err(Error::NoSuchObject(_))));
    // A body past the multipart threshold (16 MiB) arrives whole.
    let large: Vec<u8> = (0..(20u32 << 20) + 12_345).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    store.put_large("segments/ef/large", &large).expect("put large");
    assert_eq!(store.size("segments/ef/large").expect("size"), large.len() as u64);
    assert!(store.get("segments/ef/large").expect("get large").0 == large);
    assert_eq!(
        store.get_range("segments/ef/large", 17 << 20..(17 << 20) + 9).expect("range"),
        large[17 << 20..(17 << 20) + 9]
    );
    // A body given piece by piece (multipart on S3: 20 MiB is three parts).
    let streamed: Vec<u8> = (0..20u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let mut asked = 0u64;
    store
        .put_from("segments/ef/streamed", streamed.len() as u64, &mut |off, buf| {
            assert_eq!(off, asked, "pieces in order");
            buf.copy_from_slice(&streamed[off as usize..off as usize + buf.len()]);
            asked += buf.len() as u64;
            Ok(())
        })
        .expect("put from");
    assert_eq!(asked, streamed.len() as u64);
    assert!(store.get("segments/ef/streamed").expect("get streamed").0 == streamed);
    // Bad keys change nothing.
    for bad in ["", "/abs", "a//b", "../x", "a/./b", "dir/", ".arbor-locks/x"] {
        assert!(store.put(bad, b"x").is_err(), "{bad:?}");
    }
    // Reads conditional on a tag, and listings with sizes and tags.
    let old = store.put("src/nested/a", b"hello world").expect("put");
    let new = store.put("src/nested/a", b"HELLO WORLD").expect("put");
    store.put("src/b", b"xyz").expect("put");
    assert_ne!(old, new, "a new body has a new tag");
    assert_eq!(store.get_range_if("src/nested/a", 6..11, &new, None).expect("current tag"), b"WORLD");
    assert!(matches!(store.get_range_if("src/nested/a", 0..5, &old, None), Err(Error::PreconditionFailed(_))));
    assert!(matches!(store.get_range_if("src/gone", 0..5, &old, None), Err(Error::NoSuchObject(_))));
    let listed = store.list_objects("src/").expect("list objects");
    let got: Vec<(&str, u64, &str)> = listed.iter().map(|o| (o.key.as_str(), o.size, o.etag.as_str())).collect();
    let b_tag = store.get("src/b").expect("get").1;
    assert_eq!(got, [("src/b", 3, b_tag.as_str()), ("src/nested/a", 11, new.as_str())]);
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

#[test]
fn s3_through_aws_sdk_against_a_real_server_passes() {
    let data = tempfile::tempdir().expect("tempdir");
    let Some(server) = S3Server::start(data.path()).expect("s3s-fs") else { return };
    let cfg = server.config("disks/one");
    let store = S3Store::open(&cfg).expect("open");
    conformance(&store);
    // Wrong credentials are refused with a clear error, not a panic.
    let bad = S3Store::open(&S3Config { credentials: Some((S3_KEY.into(), "wrong".into())), ..cfg }).expect("open");
    let err = bad.get("branches/main").expect_err("bad secret");
    assert!(err.to_string().contains("S3 get"), "{err}");
}
