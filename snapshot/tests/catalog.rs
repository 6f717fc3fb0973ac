//! The catalog's rules, one by one.

use arbor_engine::bucket::{LocalFolderStore, MemObjectStore, ObjectStore};
use arbor_engine::device::{Device, FileDevice, SimDevice};
use arbor_engine::env::TestEnv;
use arbor_engine::io::IoMode;
use arbor_engine::volume::{ChangeKind, Config, ROOT_INO};
use arbor_snapshot::{check_name, Catalog, Error, Root};
use std::sync::Arc;
use std::time::Duration;

fn cfg() -> Config {
    Config { commit_interval: None, segment_size: 64 << 10, env: TestEnv::new(11), ..Config::default() }
}

fn mem_catalog() -> (SimDevice, Catalog) {
    let dev = SimDevice::new();
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let segs: Arc<dyn Device> = Arc::new(dev.clone());
    (dev, Catalog::new(store, segs, None))
}

#[test]
fn names_follow_the_rule() {
    for good in ["main", "run-1", "sweep_2.b", &"a".repeat(128)] {
        assert!(check_name(good).is_ok(), "{good}");
    }
    for bad in ["", ".", "..", "a/b", "sp ace", &"a".repeat(129), "é", "x\0"] {
        assert!(matches!(check_name(bad), Err(Error::InvalidName(_))), "{bad:?}");
    }
}

#[test]
fn checkpoints_and_branches_are_taken_once_and_bad_requests_change_nothing() {
    let (_, cat) = mem_catalog();
    let (main, _lock) = cat.open_branch("main", cfg()).expect("main");
    main.create(ROOT_INO, b"data", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    let cp = cat.checkpoint_volume("v1", "main", &main).expect("checkpoint");
    assert!(matches!(cat.checkpoint_volume("v1", "main", &main), Err(Error::Exists(..))));
    assert!(matches!(cat.checkpoint_volume("bad/name", "main", &main), Err(Error::InvalidName(_))));
    cat.create_branch("run-a", cp.commit).expect("branch");
    assert!(matches!(cat.create_branch("run-a", cp.commit), Err(Error::Exists(..))));
    assert!(matches!(cat.delete_branch("main"), Err(Error::Refused(_))));
    assert!(matches!(cat.rename_branch("main", "x"), Err(Error::Refused(_))));
    assert!(matches!(cat.delete_checkpoint("nope"), Err(Error::NotFound(..))));
    assert!(matches!(cat.open_branch("nope", cfg()), Err(Error::NotFound(..))));
    let names: Vec<String> = cat.list_branches().expect("list").into_iter().map(|b| b.name).collect();
    assert_eq!(names, ["main", "run-a"]);
    assert_eq!(cat.list_checkpoints().expect("list").len(), 1);
    cat.rename_branch("run-a", "run-b").expect("rename");
    assert!(matches!(cat.branch_head("run-a"), Err(Error::NotFound(..))));
    cat.delete_branch("run-b").expect("delete");
    cat.delete_checkpoint("v1").expect("delete");
    assert!(cat.list_checkpoints().expect("list").is_empty());
}

#[test]
fn an_open_branch_cannot_be_reset_deleted_or_opened_twice() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<dyn ObjectStore> = Arc::new(LocalFolderStore::open(dir.path().join("disk")).expect("store"));
    let segs: Arc<dyn Device> = FileDevice::open(dir.path().join("disk/segments"), IoMode::Syscall).expect("segments");
    let cat = Catalog::new(store, segs, Some(dir.path().join("locks")));
    let (main, lock) = cat.open_branch("main", cfg()).expect("main");
    let cp = cat.checkpoint_volume("c", "main", &main).expect("checkpoint");
    cat.create_branch("run", cp.commit).expect("branch");
    let (_run, run_lock) = cat.open_branch("run", cfg()).expect("open run");
    assert!(matches!(cat.open_branch("run", cfg()), Err(Error::Open(_))));
    assert!(matches!(cat.reset_branch("run", cp.commit), Err(Error::Open(_))));
    assert!(matches!(cat.delete_branch("run"), Err(Error::Open(_))));
    drop(run_lock);
    cat.reset_branch("run", cp.commit).expect("reset once closed");
    drop(lock);
}

#[test]
fn diff_between_a_checkpoint_and_a_branch_names_the_changed_files() {
    let (_, cat) = mem_catalog();
    let (main, _l) = cat.open_branch("main", cfg()).expect("main");
    for i in 0..300 {
        let f =
            main.create(ROOT_INO, format!("shard-{i}").as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        main.write(f, 0, &[1; 100]).expect("write");
    }
    let cp = cat.checkpoint_volume("dataset", "main", &main).expect("checkpoint");
    cat.create_branch("run", cp.commit).expect("branch");
    let (run, _l2) = cat.open_branch("run", cfg()).expect("run");
    let w = run.create(ROOT_INO, b"model.pt", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    run.write(w, 0, &[9; 5000]).expect("write");
    run.commit().expect("commit");
    let d = cat.diff(&Root::Checkpoint("dataset".into()), &Root::Branch("run".into())).expect("diff");
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].path.as_str(), d[0].kind, d[0].size_after), ("model.pt", ChangeKind::Added, Some(5000)));
    // main is untouched by run's write.
    assert!(main.lookup(ROOT_INO, b"model.pt").is_err());
}

#[test]
fn gc_reclaims_overwritten_data_and_keeps_every_root_readable() {
    let (dev, cat) = mem_catalog();
    let (main, _l) = cat.open_branch("main", cfg()).expect("main");
    let f = main.create(ROOT_INO, b"big", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    for round in 0..20u8 {
        main.write(f, 0, &vec![round; 50_000]).expect("overwrite");
        main.commit().expect("commit");
    }
    cat.checkpoint_volume("last", "main", &main).expect("checkpoint");
    let before = dev.list_segments().expect("list").len();
    let report = cat.gc(Duration::ZERO).expect("gc");
    assert!(!report.deleted.is_empty(), "overwritten data must be reclaimed: {report:?}");
    assert_eq!(dev.list_segments().expect("list").len(), before - report.deleted.len());
    assert_eq!(main.read(f, 0, 50_000).expect("read"), vec![19u8; 50_000]);
    let cp = cat.open_checkpoint("last", cfg()).expect("checkpoint");
    assert_eq!(cp.read(f, 0, 50_000).expect("read"), vec![19u8; 50_000]);
}
