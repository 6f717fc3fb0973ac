//! The shared object-store suite; every backend runs it.

use super::*;
use std::sync::Arc;

/// Checks the semantics every backend must share.
pub fn conformance(store: &dyn ObjectStore) {
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
    // Bad keys change nothing.
    for bad in ["", "/abs", "a//b", "../x", "a/./b", "dir/", ".arbor-locks/x"] {
        assert!(store.put(bad, b"x").is_err(), "{bad:?}");
    }
}

#[test]
fn local_folder_passes_the_conformance_suite() {
    let dir = tempfile::tempdir().expect("tempdir");
    conformance(&LocalFolderStore::open(dir.path()).expect("open"));
}

#[test]
fn the_in_memory_store_passes_the_conformance_suite() {
    conformance(&MemObjectStore::new());
}

#[test]
fn concurrent_compare_and_replace_never_loses_an_update() {
    let dir = tempfile::tempdir().expect("tempdir");
    LocalFolderStore::open(dir.path()).expect("open").put("counter", b"0").expect("put");
    let wins = Arc::new(std::sync::atomic::AtomicU64::new(0));
    std::thread::scope(|s| {
        for _ in 0..4 {
            let wins = wins.clone();
            let root = dir.path().to_path_buf();
            s.spawn(move || {
                // A store per thread: separate lock descriptors, as two processes would have.
                let store = LocalFolderStore::open(root).expect("open");
                for _ in 0..50 {
                    let (body, tag) = store.get("counter").expect("get");
                    let n: u64 = String::from_utf8(body).expect("utf8").parse().expect("number");
                    if store.put_if_match("counter", (n + 1).to_string().as_bytes(), &tag).is_ok() {
                        wins.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let store = LocalFolderStore::open(dir.path()).expect("open");
    let n: u64 = String::from_utf8(store.get("counter").expect("get").0).expect("utf8").parse().expect("number");
    assert_eq!(n, wins.load(std::sync::atomic::Ordering::Relaxed));
    assert!(n > 0);
}

#[test]
fn exactly_one_of_many_concurrent_creators_wins() {
    let dir = tempfile::tempdir().expect("tempdir");
    let winners: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let root = dir.path().to_path_buf();
                s.spawn(move || {
                    LocalFolderStore::open(root)
                        .expect("open")
                        .put_if_absent("checkpoints/c", format!("{i}").as_bytes())
                        .is_ok()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("join") as usize).sum()
    });
    assert_eq!(winners, 1);
}
