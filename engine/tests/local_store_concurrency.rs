//! Concurrency of the local-folder store; the shared conformance suite is
//! `engine/tests/object_stores.rs`.

use arbor_engine::bucket::{LocalFolderStore, ObjectStore};
use std::sync::Arc;

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
