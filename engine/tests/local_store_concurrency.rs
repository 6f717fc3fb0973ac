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
    let winners: Vec<u32> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8u32)
            .map(|i| {
                let root = dir.path().to_path_buf();
                s.spawn(move || {
                    let won = LocalFolderStore::open(root)
                        .expect("open")
                        .put_if_absent("checkpoints/c", format!("{i}").as_bytes())
                        .is_ok();
                    won.then_some(i)
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().expect("join")).collect::<Vec<_>>()
    });
    assert_eq!(winners.len(), 1, "{winners:?}");
    let store = LocalFolderStore::open(dir.path()).expect("open");
    assert_eq!(store.get("checkpoints/c").expect("get").0, format!("{}", winners[0]).into_bytes());
    // The losers' temporary files are gone, and a create-once leaves no lock file.
    let count = |d: &str| std::fs::read_dir(dir.path().join(d)).expect("read_dir").count();
    assert_eq!((count(".arbor-tmp"), count(".arbor-locks")), (0, 0));
    assert!(store.list("").expect("list").iter().all(|k| !k.starts_with(".arbor")));
}
