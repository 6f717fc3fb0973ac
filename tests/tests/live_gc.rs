//! gc and compaction against a live mount of an s3:// disk: a client
//! writes, overwrites and deletes files (tmp + fsync + rename + directory
//! fsync) and takes and deletes checkpoints, while gc and compact run in a
//! loop (from the CLI, or the mount's own `--maintain-every`). The writer
//! seals small segments all the time, so gc keeps meeting WAL pieces that
//! their writer retires while gc reads them. Every gc run must succeed, and
//! afterwards the branch and every checkpoint read back whole from the
//! bucket alone, and fsck is clean.

use arbor_engine::testkit::S3_BUCKET;
use arbor_tests::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The files a root should hold: name -> (length, seed of its bytes).
type Model = BTreeMap<String, (usize, u32)>;

/// How long the client churns, and the most operations it makes.
const CHURN: Duration = Duration::from_secs(10);
const MAX_OPS: usize = 2_000;
/// Checkpoints kept while churning (older ones are deleted).
const KEEP: usize = 4;

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn sync_dir(dir: &Path) {
    std::fs::File::open(dir).expect("open dir").sync_all().expect("fsync dir");
}

/// Writes `name` the way careful programs save: a temporary name, fsync,
/// rename over the old file, fsync of the directory.
fn save(dir: &Path, name: &str, len: usize, seed: u32) {
    let tmp = dir.join(format!("{name}.tmp"));
    write_synced(&tmp, &pattern(len, seed));
    std::fs::rename(&tmp, dir.join(name)).expect("rename");
    sync_dir(dir);
}

/// Every regular file under `root` (one level) with its bytes checked
/// against the model, and nothing else there.
fn check_root(root: &Path, model: &Model, what: &str) {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
        .collect();
    names.sort();
    let want: Vec<String> = model.keys().cloned().collect();
    assert_eq!(names, want, "{what}: names differ");
    for (name, &(len, seed)) in model {
        let got = std::fs::read(root.join(name)).unwrap_or_else(|e| panic!("{what}/{name}: {e}"));
        assert!(got.len() == len && got == pattern(len, seed), "{what}/{name}: bytes differ");
    }
}

/// Runs `arbor compact MNT` and `arbor gc MNT --grace 0` in a loop until
/// told to stop; returns how many gc runs there were and every failure.
fn maintenance_loop(mnt: String, env: Vec<(&'static str, String)>, stop: Arc<AtomicBool>) -> (usize, Vec<String>) {
    let (mut runs, mut failures) = (0, Vec::new());
    // Bounded twice: by the stop flag and by a count.
    for _ in 0..1_000 {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        for args in [vec!["compact", mnt.as_str()], vec!["gc", mnt.as_str(), "--grace", "0"]] {
            let out = arbor_env(&args, &env);
            if !out.status.success() {
                failures.push(format!("arbor {}: {}", args[0], String::from_utf8_lossy(&out.stderr).trim()));
            }
        }
        runs += 1;
    }
    (runs, failures)
}

fn churn_under_maintenance(durability: &str, by_cli: bool) {
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{S3_BUCKET}/disks/live-gc");
    arbor_env_ok(&["init", &disk], &w.env);
    let main = w.mnt("main");
    let mp = main.to_str().expect("utf8").to_string();
    let mut opts = vec!["--durability", durability, "--segment-size", "1M"];
    if !by_cli {
        opts.extend(["--maintain-every", "1"]);
    }
    let m = Mount::start_env(&disk, &main, &opts, &w.env);
    let stop = Arc::new(AtomicBool::new(false));
    let maintainer = by_cli.then(|| {
        let (mp, env, stop) = (mp.clone(), w.env.clone(), stop.clone());
        std::thread::spawn(move || maintenance_loop(mp, env, stop))
    });

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ durability.len() as u64);
    let mut model = Model::new();
    let mut checkpoints: Vec<(String, Model)> = Vec::new();
    let mut taken = 0;
    let started = Instant::now();
    for op in 0..MAX_OPS {
        if started.elapsed() > CHURN {
            break;
        }
        let name = format!("f{:02}", rng.below(40));
        if model.contains_key(&name) && rng.below(4) == 0 {
            std::fs::remove_file(main.join(&name)).expect("unlink");
            sync_dir(&main);
            model.remove(&name);
        } else {
            let len = 100 + rng.below(2 << 20) as usize;
            let seed = op as u32;
            save(&main, &name, len, seed);
            model.insert(name, (len, seed));
        }
        if op % 25 == 24 {
            let c = format!("c{taken}");
            taken += 1;
            arbor_env_ok(&["checkpoints", "create", &mp, &c], &w.env);
            checkpoints.push((c, model.clone()));
            if checkpoints.len() > KEEP {
                let (old, _) = checkpoints.remove(0);
                arbor_env_ok(&["checkpoints", "delete", &mp, &old], &w.env);
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    if let Some(t) = maintainer {
        let (runs, failures) = t.join().expect("maintenance thread");
        assert!(failures.is_empty(), "{} of {runs} maintenance runs failed:\n{}", failures.len(), failures.join("\n"));
        assert!(runs >= 2, "only {runs} maintenance runs");
    }
    assert!(taken >= 2, "only {taken} checkpoints taken");
    let log = m.log.clone();
    m.unmount_env(&w.env);
    if !by_cli {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(!log.contains("maintenance failed"), "the mount's maintenance failed:\n{log}");
        let runs = log.matches("background maintenance").count();
        assert!(runs >= 2, "only {runs} background maintenance runs:\n{log}");
    }
    // Once more now that nothing writes, then from the bucket alone.
    arbor_env_ok(&["gc", &disk, "--grace", "0"], &w.env);
    w.lose_the_cache();
    let m = Mount::start_env(&disk, &main, &[], &w.env);
    check_root(&main, &model, "branch main");
    m.unmount_env(&w.env);
    for (c, want) in &checkpoints {
        w.lose_the_cache();
        let at = w.mnt(c);
        let m = Mount::start_env(&disk, &at, &["--checkpoint", c], &w.env);
        check_root(&at, want, &format!("checkpoint {c}"));
        m.unmount_env(&w.env);
    }
    let fsck = arbor_env_ok(&["fsck", &disk, "--json"], &w.env);
    assert!(fsck.contains("\"problems\":[]"), "{fsck}");
}

#[test]
fn gc_and_compact_from_the_cli_beside_a_live_writer_with_local_durability() {
    churn_under_maintenance("local", true);
}

#[test]
fn gc_and_compact_from_the_cli_beside_a_live_writer_with_bucket_durability() {
    churn_under_maintenance("bucket", true);
}

#[test]
fn a_mount_maintaining_itself_every_second_while_it_writes() {
    churn_under_maintenance("bucket", false);
}
