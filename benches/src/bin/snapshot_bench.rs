//! Checkpoint create, branch create and the diff of a 10-file change, on
//! disks of growing size: the medians should stay flat.
//!
//! `cargo run --release -p arbor-benches --bin snapshot_bench -- [DIR]`
//! Env: ARBOR_BENCH_SIZES (default "1000,100000,1000000"), ARBOR_BENCH_REPS (30),
//! ARBOR_BENCH_COLD_REPS (cold diffs, 300), ARBOR_BENCH_DIFF_REPS (warm diffs, REPS).
//!
//! A cold diff is what one `arbor diff` command does: a new process with a
//! fresh catalog and no node cached. The bench runs them in a child process
//! of its own, each with a fresh catalog, so that the heap and caches of
//! the process that built the disk do not weigh on them; the time is the
//! diff alone, without process start. Each phase starts after `sync(2)`, so
//! the kernel's writeback of the disk just built does not run under it.

use arbor_benches::*;
use arbor_engine::bucket::{LocalFolderStore, ObjectStore};
use arbor_engine::device::{Device, FileDevice};
use arbor_engine::io::IoMode;
use arbor_engine::volume::{Config, ROOT_INO};
use arbor_snapshot::Catalog;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn open_catalog(dir: &Path, locks: Option<PathBuf>) -> Catalog {
    let store: Arc<dyn ObjectStore> = Arc::new(LocalFolderStore::open(dir).expect("store"));
    let segs: Arc<dyn Device> = FileDevice::open(dir.join("segments"), IoMode::Auto).expect("segments");
    Catalog::new(store, segs, locks)
}

/// `--cold-diffs DIR CHECKPOINT BRANCH REPS CHANGES`: the child process.
/// Prints the time of each diff from the checkpoint to the branch's head,
/// each through a fresh catalog, in ms, one per line.
fn cold_diffs(args: &[String]) {
    let [dir, checkpoint, branch, reps, changes] = args else { panic!("usage: --cold-diffs DIR CP BRANCH REPS N") };
    let dir = Path::new(dir);
    let cat = open_catalog(dir, None);
    let (from, to) =
        (cat.checkpoint(checkpoint).expect("checkpoint").commit, cat.branch_head(branch).expect("head").commit);
    drop(cat);
    for _ in 0..reps.parse::<usize>().expect("reps") {
        let fresh = open_catalog(dir, None);
        let (found, t) = time(|| fresh.diff_between(from, to).expect("diff"));
        assert_eq!(found.len().to_string(), *changes, "diff must find the changed files");
        println!("{}", t.as_secs_f64() * 1e3);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--cold-diffs") {
        return cold_diffs(&args[2..]);
    }
    let base = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/bench-snapshot"));
    let sizes: Vec<usize> = std::env::var("ARBOR_BENCH_SIZES")
        .unwrap_or_else(|_| "1000,100000,1000000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let reps = env_usize("ARBOR_BENCH_REPS", 30);
    let cold_reps = env_usize("ARBOR_BENCH_COLD_REPS", 300);
    let diff_reps = env_usize("ARBOR_BENCH_DIFF_REPS", reps);
    let mut rows: Vec<(usize, f64, f64, f64, f64)> = Vec::new();
    for &n in &sizes {
        let dir = base.join(format!("disk-{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        let cat = open_catalog(&dir, Some(dir.join("locks")));
        let cfg = Config { commit_interval: None, ..Config::default() };
        let (vol, _lock) = cat.open_branch("main", cfg.clone()).expect("main");
        eprintln!("building a disk of {n} files");
        // 100 directories at every size, so the 10 changed files (spread
        // evenly over the disk) sit in 10 directories at every size too:
        // the same change on a bigger disk.
        let per_dir = (n / 100).max(1);
        let mut dirs = Vec::new();
        let mut files = Vec::new();
        for i in 0..n {
            if i % per_dir == 0 {
                dirs.push(vol.mkdir(ROOT_INO, format!("d{}", i / per_dir).as_bytes(), 0o755, 0, 0).expect("mkdir").ino);
            }
            let d = *dirs.last().expect("dir");
            let f = vol.create(d, format!("f{i}").as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
            vol.write(f, 0, b"sample").expect("write");
            if i % (n / 10).max(1) == 0 {
                files.push(f);
            }
        }
        vol.commit().expect("commit");
        settle();
        // Checkpoint create, each after a small change, as in a training loop.
        let mut cp_times = Vec::new();
        let mut last = None;
        for r in 0..reps {
            vol.write(files[r % files.len()], 0, format!("step {r}").as_bytes()).expect("write");
            let (cp, t) = time(|| cat.checkpoint_volume(&format!("cp-{r}"), "main", &vol).expect("checkpoint"));
            cp_times.push(t.as_secs_f64() * 1e3);
            last = Some(cp);
        }
        let cp = last.expect("a checkpoint");
        let mut br_times = Vec::new();
        for r in 0..reps {
            let (_, t) = time(|| cat.create_branch(&format!("run-{r}"), cp.commit).expect("branch"));
            br_times.push(t.as_secs_f64() * 1e3);
        }
        // A branch with 10 changed files.
        let (run, _l2) = cat.open_branch("run-0", cfg.clone()).expect("open run");
        for f in files.iter().take(10) {
            run.write(*f, 0, b"changed by run-0").expect("write");
        }
        run.commit().expect("commit");
        let head = run.last_commit().expect("commit");
        settle();
        let child = std::process::Command::new(std::env::current_exe().expect("this program"))
            .arg("--cold-diffs")
            .arg(&dir)
            .arg(&cp.name)
            .arg("run-0")
            .arg(cold_reps.to_string())
            .arg(files.len().min(10).to_string())
            .output()
            .expect("cold diffs");
        assert!(child.status.success(), "cold diffs: {}", String::from_utf8_lossy(&child.stderr));
        let cold: Vec<f64> =
            String::from_utf8_lossy(&child.stdout).lines().map(|l| l.parse().expect("a time")).collect();
        let mut diff_times = Vec::new();
        for _ in 0..diff_reps {
            let (changes, t) = time(|| cat.diff_between(cp.commit, head).expect("diff"));
            assert_eq!(changes.len(), files.len().min(10), "diff must find the changed files");
            diff_times.push(t.as_secs_f64() * 1e3);
        }
        rows.push((n, median(cp_times), median(br_times), median(cold), median(diff_times)));
        drop(run);
        drop(vol);
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!("\n### checkpoints, branches and diff (medians of {reps}, ms)\n");
    println!(
        "| files on disk | checkpoint create | branch create | diff of a 10-file change, cold | same, warm catalog |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for (n, c, b, d, w) in &rows {
        println!("| {n} | {c:.3} | {b:.3} | {d:.3} | {w:.3} |");
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        println!(
            "| largest ÷ smallest | {:.2}× | {:.2}× | {:.2}× | {:.2}× |",
            last.1 / first.1,
            last.2 / first.2,
            last.3 / first.3,
            last.4 / first.4
        );
    }
}
