//! A crash at every durable step of an `s3://` disk: segment upload, WAL
//! piece, branch head (commit published, lease taken or released),
//! checkpoint created, gc delete, WAL pieces retired; the write that makes
//! the step landing or not. The process dies there (its bucket calls stop;
//! its cache is lost), and a new one opens the disk from the bucket alone
//! with an empty cache: every fsynced byte is there (bucket durability),
//! every checkpoint whose creation returned is there and whole, one whose
//! deletion returned is gone, and fsck finds nothing wrong.

use arbor_engine::bucket::{CrashStore, MemObjectStore, ObjectStore, Step};
use arbor_engine::device::Device;
use arbor_engine::env::TestEnv;
use arbor_engine::head::FixedRootDevice;
use arbor_engine::tier::{BucketDevice, Durability, TierConfig};
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_snapshot::Catalog;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The most times one step is crashed at (its 1st, 2nd, … occurrence).
const MAX_NTH: u64 = 8;

type Files = BTreeMap<String, Vec<u8>>;

/// What the dead process was told is durable.
#[derive(Default)]
struct Promised {
    /// Files whose last fsync returned, with their bytes.
    files: Files,
    /// Files whose removal was fsynced.
    removed: Vec<String>,
    /// Checkpoints whose creation returned, with the files they froze.
    checkpoints: Vec<(String, Files)>,
    /// Checkpoints whose deletion returned.
    deleted: Vec<String>,
}

fn cfg(seed: u64) -> Config {
    Config { commit_interval: None, segment_size: 64 << 10, env: TestEnv::new(seed), ..Config::default() }
}

fn tier() -> TierConfig {
    TierConfig {
        durability: Durability::Bucket,
        chunk_size: 16 << 10,
        read_ahead: 0,
        drain_timeout: Some(Duration::from_secs(2)),
        ..TierConfig::default()
    }
}

fn catalog(store: Arc<dyn ObjectStore>, cache: &Path) -> Catalog {
    let dev: Arc<dyn Device> = BucketDevice::open(store.clone(), cache, tier()).expect("bucket device");
    Catalog::new(store, dev, None)
}

fn bytes(i: usize) -> Vec<u8> {
    (0..20_000 + i * 23_000).map(|n| (n.wrapping_mul(31) ^ (i * 7)) as u8).collect()
}

/// The workload; stops at the first error (the process died there).
fn workload(cat: &Catalog, p: &mut Promised) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let (vol, _lock) = cat.open_branch("main", cfg(3)).map_err(|x| e(&x))?;
    for i in 0..6 {
        let name = format!("f{i}");
        let ino = vol.create(ROOT_INO, name.as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).map_err(|x| e(&x))?.ino;
        let data = bytes(i);
        vol.write(ino, 0, &data).map_err(|x| e(&x))?;
        vol.fsync(ino).map_err(|x| e(&x))?;
        p.files.insert(name, data);
        if i == 2 || i == 4 {
            let c = format!("c{i}");
            cat.checkpoint_volume(&c, "main", &vol).map_err(|x| e(&x))?;
            p.checkpoints.push((c, p.files.clone()));
        }
        if i == 3 {
            // Once the unlink is issued, either state may come back.
            p.files.remove("f0");
            vol.unlink(ROOT_INO, b"f0").map_err(|x| e(&x))?;
            vol.fsync(ROOT_INO).map_err(|x| e(&x))?;
            p.removed.push("f0".into());
        }
    }
    // A file no root keeps: its segments are gc's to delete.
    let big = vol.create(ROOT_INO, b"big", libc::S_IFREG | 0o644, 0, 0, 0).map_err(|x| e(&x))?.ino;
    vol.write(big, 0, &bytes(12)).map_err(|x| e(&x))?;
    vol.fsync(big).map_err(|x| e(&x))?;
    vol.unlink(ROOT_INO, b"big").map_err(|x| e(&x))?;
    cat.delete_checkpoint("c2").map_err(|x| e(&x))?;
    p.deleted.push("c2".into());
    // Closed, the branch's head names its last commit, so what the file
    // no root keeps used is unreachable.
    vol.close().map_err(|x| e(&x))?;
    cat.gc(Duration::ZERO).map_err(|x| e(&x))?;
    Ok(())
}

fn read_all(vol: &Volume, name: &str) -> Option<Vec<u8>> {
    let attr = vol.lookup(ROOT_INO, name.as_bytes()).ok()?;
    let mut got = Vec::new();
    while (got.len() as u64) < attr.size {
        let part = vol.read(attr.ino, got.len() as u64, 1 << 20).expect("read");
        assert!(!part.is_empty(), "{name}: short");
        got.extend_from_slice(&part);
    }
    Some(got)
}

/// Opens the disk from the bucket alone and checks every promise.
fn verify(inner: Arc<dyn ObjectStore>, cache: &Path, p: &Promised, case: &str) {
    let cat = catalog(inner, cache);
    {
        let (vol, _lock) = cat.open_branch("main", cfg(9)).unwrap_or_else(|e| panic!("{case}: reopen: {e}"));
        for (name, want) in &p.files {
            let got = read_all(&vol, name).unwrap_or_else(|| panic!("{case}: fsynced {name} lost"));
            assert!(got == *want, "{case}: {name} differs");
        }
        for name in &p.removed {
            assert!(vol.lookup(ROOT_INO, name.as_bytes()).is_err(), "{case}: fsynced removal of {name} undone");
        }
        vol.close().unwrap_or_else(|e| panic!("{case}: close: {e}"));
    }
    let present: Vec<String> = cat.list_checkpoints().expect("list").into_iter().map(|c| c.name).collect();
    for (c, files) in &p.checkpoints {
        if p.deleted.contains(c) {
            assert!(!present.contains(c), "{case}: deleted checkpoint {c} is back");
            continue;
        }
        let vol = cat.open_checkpoint(c, cfg(5)).unwrap_or_else(|e| panic!("{case}: checkpoint {c}: {e}"));
        for (name, want) in files {
            let got = read_all(&vol, name).unwrap_or_else(|| panic!("{case}: {c}/{name} missing"));
            assert!(got == *want, "{case}: {c}/{name} differs");
        }
    }
    let mut report = arbor_engine::fsck::check_segments(cat.segments().clone(), &mut |_| {}).expect("fsck");
    let mut roots: Vec<_> = cat.list_branches().expect("branches").into_iter().map(|b| b.commit).collect();
    roots.extend(cat.list_checkpoints().expect("checkpoints").into_iter().map(|c| c.commit));
    for commit in roots {
        let ro = Config { read_only: true, ..cfg(6) };
        let vol = Volume::open(FixedRootDevice::new(cat.segments().clone(), commit), ro).expect("root");
        arbor_engine::fsck::check_files(&vol, &mut report).expect("fsck files");
    }
    assert!(report.problems.is_empty(), "{case}: fsck: {:?}", report.problems);
}

#[test]
fn a_crash_at_every_bucket_tier_step_reopens_from_the_bucket_alone() {
    let mut crashed_at: BTreeMap<String, u64> = BTreeMap::new();
    for step in Step::ALL {
        for lands in [true, false] {
            for nth in 1..=MAX_NTH {
                let dir = tempfile::tempdir().expect("tempdir");
                let inner: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
                let store = CrashStore::new(inner.clone());
                store.crash_at(step, nth, lands);
                let mut promised = Promised::default();
                let outcome = {
                    let cat = catalog(store.clone(), &dir.path().join("dead"));
                    workload(&cat, &mut promised)
                };
                let case = format!("{step:?} #{nth} (landed: {lands})");
                if !store.is_dead() {
                    // The step came fewer than `nth` times: the run was whole.
                    outcome.unwrap_or_else(|e| panic!("{case}: a run that never crashed failed: {e}"));
                    break;
                }
                *crashed_at.entry(format!("{step:?}")).or_default() += 1;
                verify(inner, &dir.path().join("new-node"), &promised, &case);
            }
        }
    }
    // Each step was crashed at, or the test proves nothing about it.
    for step in Step::ALL {
        assert!(
            crashed_at.get(&format!("{step:?}")).is_some_and(|n| *n > 0),
            "never crashed at {step:?}: {crashed_at:?}"
        );
    }
    eprintln!("crashes per step: {crashed_at:?}");
}
