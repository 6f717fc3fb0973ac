//! Branches and checkpoints against a model: several branches written
//! independently, checkpoints taken and forked, GC run with operations
//! between its mark and sweep, crashes at any durable step. After every
//! step each root must hold exactly its model; a checkpoint or branch that
//! `create` returned must survive any later crash.
//!
//! `PROPTEST_CASES=20000 cargo test --release -p arbor-snapshot --test isolation_model`

use arbor_engine::bucket::{MemObjectStore, ObjectStore};
use arbor_engine::device::{CrashMode, Device, SimDevice};
use arbor_engine::env::TestEnv;
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_snapshot::{Catalog, Error};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

type Files = BTreeMap<String, Vec<u8>>;

#[derive(Clone, Debug)]
enum Op {
    /// Write file `file` on branch `b` with `len` bytes of `seed`.
    Write {
        b: usize,
        file: u8,
        len: u16,
        seed: u8,
    },
    Remove {
        b: usize,
        file: u8,
    },
    Fsync {
        b: usize,
    },
    Checkpoint {
        b: usize,
    },
    /// Fork a new branch from checkpoint `c` (by index).
    Fork {
        c: usize,
    },
    Reset {
        b: usize,
        c: usize,
    },
    /// Compaction of branch `b`: moves its live bytes out of mostly dead
    /// segments and commits (so, durably, like a sync).
    Compact {
        b: usize,
    },
    GcMark,
    GcSweep,
    Crash {
        seed: Option<u64>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0usize..4, 0u8..4, 1u16..12000, any::<u8>()).prop_map(|(b, file, len, seed)| Op::Write { b, file, len, seed }),
        2 => (0usize..4, 0u8..4).prop_map(|(b, file)| Op::Remove { b, file }),
        2 => (0usize..4).prop_map(|b| Op::Fsync { b }),
        3 => (0usize..4).prop_map(|b| Op::Checkpoint { b }),
        2 => (0usize..8).prop_map(|c| Op::Fork { c }),
        1 => (0usize..4, 0usize..8).prop_map(|(b, c)| Op::Reset { b, c }),
        2 => (0usize..4).prop_map(|b| Op::Compact { b }),
        2 => Just(Op::GcMark),
        2 => Just(Op::GcSweep),
        2 => proptest::option::of(any::<u64>()).prop_map(|seed| Op::Crash { seed }),
    ]
}

/// One clock and random source for every volume of a case, so writer ids
/// differ between volumes yet the case replays exactly.
fn cfg(env: &Arc<TestEnv>) -> Config {
    Config {
        segment_size: 32 << 10,
        commit_every_ops: 25,
        commit_interval: None,
        env: env.clone(),
        ..Config::default()
    }
}

fn body(len: u16, seed: u8) -> Vec<u8> {
    (0..len as usize).map(|i| (i as u8).wrapping_add(seed)).collect()
}

fn read_all(vol: &Volume) -> Files {
    let mut out = Files::new();
    for e in vol.list_dir(ROOT_INO).expect("list") {
        let size = vol.getattr(e.ino).expect("attr").size as usize;
        out.insert(String::from_utf8(e.name).expect("utf8"), vol.read(e.ino, 0, size).expect("read"));
    }
    out
}

struct Branch {
    name: String,
    vol: Option<Arc<Volume>>,
    /// Its states since the last fsync: after a crash it must be in one of
    /// them (the first is durable, the last is live).
    history: Vec<Files>,
}

impl Branch {
    fn new(name: String, files: Files) -> Branch {
        Branch { name, vol: None, history: vec![files] }
    }
    fn live(&self) -> &Files {
        self.history.last().expect("history is never empty")
    }
    fn change(&mut self, f: impl FnOnce(&mut Files)) {
        let mut next = self.live().clone();
        f(&mut next);
        self.history.push(next);
    }
    fn settle(&mut self) {
        self.history = vec![self.live().clone()];
    }
}

struct World {
    dev: SimDevice,
    catalog: Catalog,
    branches: Vec<Branch>,
    checkpoints: Vec<(String, Files)>,
    plan: Option<arbor_snapshot::GcPlan>,
    env: Arc<TestEnv>,
}

impl World {
    fn vol(&mut self, b: usize) -> Arc<Volume> {
        let br = &mut self.branches[b];
        if br.vol.is_none() {
            let (v, lock) = self.catalog.open_branch(&br.name, cfg(&self.env)).expect("open branch");
            std::mem::forget(lock);
            br.vol = Some(v);
        }
        br.vol.clone().expect("open")
    }
}

fn file_ino(vol: &Volume, name: &str) -> Option<u64> {
    vol.lookup(ROOT_INO, name.as_bytes()).ok().map(|a| a.ino)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_root_keeps_exactly_its_own_state(ops in proptest::collection::vec(op(), 1..60)) {
        let dev = SimDevice::new();
        let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
        let segs: Arc<dyn Device> = Arc::new(dev.clone());
        let catalog = Catalog::new(store, segs, None).with_env(TestEnv::new(4));
        let mut w = World { dev, catalog, branches: Vec::new(), checkpoints: Vec::new(), plan: None, env: TestEnv::new(9) };
        w.branches.push(Branch::new("main".into(), Files::new()));
        let main = w.vol(0);
        main.commit().expect("first commit");
        for op in ops {
            match op {
                Op::Write { b, file, len, seed } => {
                    let b = b % w.branches.len();
                    let vol = w.vol(b);
                    let name = format!("f{file}");
                    // Three operations (create, truncate, write): a crash may
                    // land between any two, so each state goes in the history.
                    let ino = match file_ino(&vol, &name) {
                        Some(i) => i,
                        None => vol.create(ROOT_INO, name.as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino,
                    };
                    w.branches[b].change(|f| {
                        f.insert(name.clone(), Vec::new());
                    });
                    vol.setattr(ino, arbor_engine::SetAttr { size: Some(0), ..Default::default() }).expect("truncate");
                    vol.write(ino, 0, &body(len, seed)).expect("write");
                    w.branches[b].change(|f| {
                        f.insert(name, body(len, seed));
                    });
                }
                Op::Remove { b, file } => {
                    let b = b % w.branches.len();
                    let vol = w.vol(b);
                    let name = format!("f{file}");
                    if file_ino(&vol, &name).is_some() {
                        vol.unlink(ROOT_INO, name.as_bytes()).expect("unlink");
                        w.branches[b].change(|f| {
                            f.remove(&name);
                        });
                    }
                }
                Op::Fsync { b } => {
                    let b = b % w.branches.len();
                    w.vol(b).sync_all().expect("fsync");
                    w.branches[b].settle();
                }
                Op::Checkpoint { b } => {
                    let b = b % w.branches.len();
                    let vol = w.vol(b);
                    let name = format!("cp{}", w.checkpoints.len());
                    let branch = w.branches[b].name.clone();
                    w.catalog.checkpoint_volume(&name, &branch, &vol).expect("checkpoint");
                    // A checkpoint commits the branch: everything so far is durable.
                    w.branches[b].settle();
                    w.checkpoints.push((name, w.branches[b].live().clone()));
                }
                Op::Fork { c } => {
                    if w.checkpoints.is_empty() { continue; }
                    let (cp, files) = w.checkpoints[c % w.checkpoints.len()].clone();
                    let name = format!("br{}", w.branches.len());
                    let at = w.catalog.checkpoint(&cp).expect("checkpoint").commit;
                    w.catalog.create_branch(&name, at).expect("fork");
                    prop_assert!(matches!(w.catalog.create_branch(&name, at), Err(Error::Exists(..))));
                    w.branches.push(Branch::new(name, files));
                }
                Op::Reset { b, c } => {
                    if w.checkpoints.is_empty() { continue; }
                    let b = b % w.branches.len();
                    let (cp, files) = w.checkpoints[c % w.checkpoints.len()].clone();
                    // Resetting needs the branch closed.
                    if let Some(v) = w.branches[b].vol.take() {
                        v.close().expect("close");
                    }
                    let at = w.catalog.checkpoint(&cp).expect("checkpoint").commit;
                    w.catalog.reset_branch(&w.branches[b].name.clone(), at).expect("reset");
                    w.branches[b].history = vec![files];
                }
                Op::Compact { b } => {
                    let b = b % w.branches.len();
                    // Compaction commits only when it has something to move.
                    let commits = !w.vol(b).compactable(1.0).expect("compactable").is_empty();
                    w.vol(b).compact(1.0).expect("compact");
                    if commits {
                        w.branches[b].settle();
                    }
                }
                Op::GcMark => w.plan = Some(w.catalog.gc_plan().expect("gc plan")),
                Op::GcSweep => {
                    if let Some(plan) = w.plan.take() {
                        w.catalog.gc_sweep(plan, Duration::ZERO).expect("gc sweep");
                    }
                }
                Op::Crash { seed } => {
                    for br in &mut w.branches {
                        br.vol = None;
                    }
                    w.plan = None;
                    w.dev.crash(match seed { Some(seed) => CrashMode::Scramble { seed }, None => CrashMode::DropUnsynced });
                    for b in 0..w.branches.len() {
                        let got = read_all(&w.vol(b));
                        let br = &mut w.branches[b];
                        let at = br.history.iter().position(|h| *h == got);
                        prop_assert!(at.is_some(), "branch {} recovered to no state since its last fsync: {:?}", br.name, got.keys().collect::<Vec<_>>());
                        br.history = vec![got];
                    }
                }
            }
            // Every root holds exactly its model.
            for b in 0..w.branches.len() {
                let vol = w.vol(b);
                prop_assert_eq!(&read_all(&vol), w.branches[b].live(), "branch {}", w.branches[b].name);
            }
            for (cp, files) in &w.checkpoints {
                let vol = w.catalog.open_checkpoint(cp, cfg(&w.env)).expect("open checkpoint");
                prop_assert_eq!(&read_all(&vol), files, "checkpoint {}", cp);
                prop_assert_eq!(vol.create(ROOT_INO, b"x", libc::S_IFREG, 0, 0, 0).expect_err("read-only").errno(), libc::EROFS);
            }
        }
    }
}
