//! The crash promise, checked against an in-memory model.
//!
//! Each case runs random operations on a volume over a [`SimDevice`], then
//! crashes it — at a random failpoint (any durable step) or between two
//! operations — with unsynced writes dropped, kept or torn at random. After
//! reopening, the disk must equal the model after some prefix of the issued
//! operations, and that prefix must include every operation that finished
//! before the last `fsync` (or commit) that returned. Sometimes recovery
//! itself is crashed too, and must still come back right.
//!
//! `PROPTEST_CASES=100000 cargo test --release -p arbor-engine --test crash_model`
//! runs a long soak; the normal run does 256 cases.

use arbor_engine::device::{CrashMode, SimDevice};
use arbor_engine::env::TestEnv;
use arbor_engine::volume::{Config, FileKind, RenameMode, SetAttr, Volume, ROOT_INO};
use arbor_engine::Error;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use std::collections::BTreeMap;
use std::sync::Arc;

const DIRS: [&str; 4] = ["", "d0", "d1", "d0/d2"];
const NAMES: [&str; 6] = ["a", "b", "c", "d0", "d1", "d2"];

#[derive(Clone, Debug)]
enum Op {
    Create(usize, usize),
    Mkdir(usize, usize),
    Symlink(usize, usize),
    Write(usize, usize, u32, u32, u8),
    Truncate(usize, usize, u32),
    Rename(usize, usize, usize, usize),
    Unlink(usize, usize),
    Rmdir(usize, usize),
    Fsync,
    Commit,
    /// Moves live tree nodes out of mostly dead segments: changes nothing
    /// a reader sees, and commits.
    Compact,
}

#[derive(Clone, Debug, PartialEq)]
enum Entry {
    Dir,
    File(Vec<u8>),
    Symlink(String),
}

type Model = BTreeMap<String, Entry>;

fn path(d: usize, n: usize) -> String {
    match DIRS[d] {
        "" => NAMES[n].to_string(),
        dir => format!("{dir}/{}", NAMES[n]),
    }
}

fn is_dir(m: &Model, p: &str) -> bool {
    p.is_empty() || m.get(p) == Some(&Entry::Dir)
}

fn has_children(m: &Model, p: &str) -> bool {
    let prefix = format!("{p}/");
    m.keys().any(|k| k.starts_with(&prefix))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8 ^ seed).wrapping_add((i >> 8) as u8)).collect()
}

/// Applies `op` to the model; `false` if POSIX says it must fail.
fn model_apply(m: &mut Model, op: &Op) -> bool {
    match op {
        Op::Create(d, n) | Op::Mkdir(d, n) | Op::Symlink(d, n) => {
            let p = path(*d, *n);
            if !is_dir(m, DIRS[*d]) || m.contains_key(&p) {
                return false;
            }
            let e = match op {
                Op::Create(..) => Entry::File(Vec::new()),
                Op::Mkdir(..) => Entry::Dir,
                _ => Entry::Symlink(format!("target-{p}")),
            };
            m.insert(p, e);
            true
        }
        Op::Write(d, n, off, len, seed) => match m.get_mut(&path(*d, *n)) {
            Some(Entry::File(data)) => {
                let (off, len) = (*off as usize, *len as usize);
                if data.len() < off + len {
                    data.resize(off + len, 0);
                }
                data[off..off + len].copy_from_slice(&pattern(len, *seed));
                true
            }
            _ => false,
        },
        Op::Truncate(d, n, size) => match m.get_mut(&path(*d, *n)) {
            Some(Entry::File(data)) => {
                data.resize(*size as usize, 0);
                true
            }
            _ => false,
        },
        Op::Rename(d1, n1, d2, n2) => {
            let (src, dst) = (path(*d1, *n1), path(*d2, *n2));
            let Some(se) = m.get(&src).cloned() else {
                return false;
            };
            if !is_dir(m, DIRS[*d2]) {
                return false;
            }
            if src == dst {
                return true;
            }
            if se == Entry::Dir && dst.starts_with(&format!("{src}/")) {
                return false;
            }
            match (m.get(&dst), &se) {
                (Some(Entry::Dir), Entry::Dir) if has_children(m, &dst) => return false,
                (Some(Entry::Dir), Entry::Dir) | (None, _) => {}
                (Some(Entry::Dir), _) | (Some(_), Entry::Dir) => return false,
                _ => {}
            }
            let moved: Vec<(String, Entry)> = m
                .iter()
                .filter(|(k, _)| **k == src || k.starts_with(&format!("{src}/")))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            m.remove(&dst);
            for (k, v) in moved {
                m.remove(&k);
                m.insert(format!("{dst}{}", &k[src.len()..]), v);
            }
            true
        }
        Op::Unlink(d, n) => match m.get(&path(*d, *n)) {
            Some(Entry::File(_)) | Some(Entry::Symlink(_)) => {
                m.remove(&path(*d, *n));
                true
            }
            _ => false,
        },
        Op::Rmdir(d, n) => {
            let p = path(*d, *n);
            if m.get(&p) != Some(&Entry::Dir) || has_children(m, &p) {
                return false;
            }
            m.remove(&p);
            true
        }
        Op::Fsync | Op::Commit | Op::Compact => true,
    }
}

fn resolve(vol: &Volume, p: &str) -> Result<u64, Error> {
    let mut ino = ROOT_INO;
    for part in p.split('/').filter(|s| !s.is_empty()) {
        ino = vol.lookup(ino, part.as_bytes())?.ino;
    }
    Ok(ino)
}

fn volume_apply(vol: &Volume, op: &Op) -> Result<(), Error> {
    match op {
        Op::Create(d, n) => {
            vol.create(resolve(vol, DIRS[*d])?, NAMES[*n].as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).map(drop)
        }
        Op::Mkdir(d, n) => vol.mkdir(resolve(vol, DIRS[*d])?, NAMES[*n].as_bytes(), 0o755, 0, 0).map(drop),
        Op::Symlink(d, n) => {
            let target = format!("target-{}", path(*d, *n));
            vol.symlink(resolve(vol, DIRS[*d])?, NAMES[*n].as_bytes(), target.as_bytes(), 0, 0).map(drop)
        }
        Op::Write(d, n, off, len, seed) => {
            let ino = resolve(vol, &path(*d, *n))?;
            vol.write(ino, *off as u64, &pattern(*len as usize, *seed)).map(drop)
        }
        Op::Truncate(d, n, size) => {
            let ino = resolve(vol, &path(*d, *n))?;
            vol.setattr(ino, SetAttr { size: Some(*size as u64), ..Default::default() }).map(drop)
        }
        Op::Rename(d1, n1, d2, n2) => {
            let (p1, p2) = (resolve(vol, DIRS[*d1])?, resolve(vol, DIRS[*d2])?);
            vol.rename(p1, NAMES[*n1].as_bytes(), p2, NAMES[*n2].as_bytes(), RenameMode::Plain)
        }
        Op::Unlink(d, n) => vol.unlink(resolve(vol, DIRS[*d])?, NAMES[*n].as_bytes()),
        Op::Rmdir(d, n) => vol.rmdir(resolve(vol, DIRS[*d])?, NAMES[*n].as_bytes()),
        Op::Fsync => vol.fsync(ROOT_INO),
        Op::Commit => vol.commit(),
        Op::Compact => vol.compact(1.0).map(drop),
    }
}

/// The whole visible state of a volume, as the model sees it.
fn snapshot(vol: &Volume) -> Model {
    let mut out = Model::new();
    let mut stack = vec![(ROOT_INO, String::new())];
    while let Some((dir, prefix)) = stack.pop() {
        for e in vol.list_dir(dir).expect("list") {
            let name = String::from_utf8(e.name).expect("utf8");
            let p = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
            let entry = match e.kind {
                FileKind::Directory => {
                    stack.push((e.ino, p.clone()));
                    Entry::Dir
                }
                FileKind::Symlink => {
                    Entry::Symlink(String::from_utf8(vol.readlink(e.ino).expect("readlink")).expect("utf8"))
                }
                _ => {
                    let size = vol.getattr(e.ino).expect("attr").size as usize;
                    Entry::File(vol.read(e.ino, 0, size).expect("read"))
                }
            };
            out.insert(p, entry);
        }
    }
    out
}

fn op_strategy() -> impl Strategy<Value = Op> {
    // Mostly the root, so that most operations find their parent.
    let d = prop_oneof![5 => Just(0usize), 1 => Just(1usize), 1 => Just(2usize), 1 => Just(3usize)];
    let n = 0..NAMES.len();
    prop_oneof![
        4 => (d.clone(), n.clone()).prop_map(|(d, n)| Op::Create(d, n)),
        3 => (d.clone(), 3..NAMES.len()).prop_map(|(d, n)| Op::Mkdir(d, n)),
        1 => (d.clone(), n.clone()).prop_map(|(d, n)| Op::Symlink(d, n)),
        5 => (d.clone(), 0..3usize, 0u32..200_000, 1u32..70_000, any::<u8>()).prop_map(|(d, n, o, l, s)| Op::Write(d, n, o, l, s)),
        // Larger than one record holds with the models' segment sizes: logged in pieces.
        1 => (d.clone(), 0..3usize, 0u32..200_000, 70_000u32..300_000, any::<u8>()).prop_map(|(d, n, o, l, s)| Op::Write(d, n, o, l, s)),
        2 => (d.clone(), 0..3usize, 0u32..250_000).prop_map(|(d, n, s)| Op::Truncate(d, n, s)),
        3 => (d.clone(), n.clone(), d.clone(), n.clone()).prop_map(|(a, b, c, e)| Op::Rename(a, b, c, e)),
        2 => (d.clone(), n.clone()).prop_map(|(d, n)| Op::Unlink(d, n)),
        1 => (d.clone(), 3..NAMES.len()).prop_map(|(d, n)| Op::Rmdir(d, n)),
        2 => Just(Op::Fsync),
        1 => Just(Op::Commit),
        1 => Just(Op::Compact),
    ]
}

#[derive(Clone, Debug)]
enum Crash {
    /// Crash at the n-th failpoint reached after the volume is open.
    AtFailpoint(u64),
    /// Crash after this many operations.
    AfterOps(usize),
}

fn crash_strategy() -> impl Strategy<Value = Crash> {
    prop_oneof![(0u64..200).prop_map(Crash::AtFailpoint), (0usize..80).prop_map(Crash::AfterOps)]
}

fn config(commit_every_ops: u64, seed: u64, segment_size: u64) -> Config {
    Config { segment_size, commit_every_ops, commit_interval: None, env: TestEnv::new(seed), ..Config::default() }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 2000,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn recovered_state_is_a_prefix_that_includes_every_fsynced_op(
        ops in proptest::collection::vec(op_strategy(), 1..80),
        crash in crash_strategy(),
        scramble in proptest::option::of(any::<u64>()),
        commit_every in 2u64..40,
        crash_recovery_at in proptest::option::weighted(0.2, 0u64..6),
    ) {
        run_case(&ops, crash, scramble, commit_every, crash_recovery_at, 256 << 10)?;
    }

    /// The same with smaller segments and compaction often, so that it
    /// finds bytes and nodes to move and crashes land inside it.
    #[test]
    fn compaction_keeps_the_prefix_promise(
        ops in proptest::collection::vec(prop_oneof![4 => op_strategy(), 1 => Just(Op::Compact)], 1..120),
        crash in crash_strategy(),
        scramble in proptest::option::of(any::<u64>()),
        commit_every in 2u64..40,
        crash_recovery_at in proptest::option::weighted(0.2, 0u64..6),
    ) {
        // Small enough that segments fill and large writes go in pieces.
        run_case(&ops, crash, scramble, commit_every, crash_recovery_at, 160 << 10)?;
    }
}

/// Runs `ops`, crashes as told, recovers, and checks the recovered state is
/// the state after a prefix of the operations that includes every one
/// before the last fsync or commit.
fn run_case(
    ops: &[Op],
    crash: Crash,
    scramble: Option<u64>,
    commit_every: u64,
    crash_recovery_at: Option<u64>,
    segment_size: u64,
) -> Result<(), TestCaseError> {
    let dev = SimDevice::new();
    let vol = Volume::open(Arc::new(dev.clone()), config(commit_every, 1, segment_size)).expect("open");
    // models[i] is the state after the first i operations.
    let mut models = vec![Model::new()];
    let mut durable = 0;
    let mut issued = 0;
    if let Crash::AtFailpoint(n) = crash {
        dev.crash_at_failpoint(None, n);
    }
    for (i, op) in ops.iter().enumerate() {
        if matches!(crash, Crash::AfterOps(k) if k == i) {
            break;
        }
        issued = i + 1;
        let mut next = models[i].clone();
        let valid = model_apply(&mut next, op);
        // Compaction commits only when it has something to move.
        let commits = match op {
            Op::Fsync | Op::Commit => true,
            Op::Compact => vol.compactable(1.0).is_ok_and(|c| !c.is_empty()),
            _ => false,
        };
        let got = volume_apply(&vol, op);
        if let Err(Error::Crashed(_)) = got {
            models.push(next);
            break;
        }
        prop_assert_eq!(got.is_ok(), valid, "op {} {:?} gave {:?}", i, op, got.err());
        models.push(next);
        if commits {
            durable = i + 1;
        }
    }
    let mode = match scramble {
        Some(seed) => CrashMode::Scramble { seed },
        None => CrashMode::DropUnsynced,
    };
    dev.crash(mode);
    drop(vol);
    if let Some(n) = crash_recovery_at {
        dev.crash_at_failpoint(None, n);
        let _ = Volume::open(Arc::new(dev.clone()), config(commit_every, 2, segment_size));
        dev.crash(mode);
    }
    let vol =
        Volume::open(Arc::new(dev.clone()), config(commit_every, 3, segment_size)).expect("recovery must succeed");
    let got = snapshot(&vol);
    if std::env::var_os("CRASH_MODEL_TRACE").is_some() {
        eprintln!("TRACE issued={issued} durable={durable} files={} crash={crash:?}", got.len());
    }
    let allowed = durable..=issued;
    let matched = allowed.clone().find(|p| models[*p] == got);
    prop_assert!(
        matched.is_some(),
        "recovered state matches no prefix in {:?}\nrecovered: {:?}\nafter durable prefix: {:?}",
        allowed,
        got.keys().collect::<Vec<_>>(),
        models[durable].keys().collect::<Vec<_>>()
    );
    // Its live-bytes table, as recovery rebuilt it, matches a recount.
    vol.commit().expect("commit");
    let commit = vol.last_commit().expect("commit");
    let recount = arbor_engine::volume::recount_live_bytes(Arc::new(dev.clone()), commit).expect("recount");
    prop_assert_eq!(vol.live_bytes(), recount);
    // The recovered volume keeps working.
    let f = vol.create(ROOT_INO, b"after-recovery", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    vol.write(f.ino, 0, b"ok").expect("write");
    vol.fsync(f.ino).expect("fsync");
    Ok(())
}
