//! Checkpoint create, branch create and the diff of a 10-file change, on
//! disks of growing size: the medians should stay flat.
//!
//! `cargo run --release -p arbor-benches --bin snapshot_bench -- [DIR]`
//! Env: ARBOR_BENCH_SIZES (default "1000,100000,1000000"), ARBOR_BENCH_REPS (30),
//! ARBOR_BENCH_COLD_REPS (cold diffs, 300), ARBOR_BENCH_DIFF_REPS (warm diffs, 300).
//!
//! Every disk is built first and then measured in turn, one repetition on
//! each before the next (this VM has slow spells lasting seconds; taken
//! one disk after another, a spell lands on one size and looks like
//! growth).
//!
//! A cold diff is what one `arbor diff` command does: a fresh catalog, no
//! node cached; a warm diff reuses one catalog that has diffed the same
//! roots before (a long-lived process). Both run in a child process that
//! holds nothing else, so the heap and caches of the process that built the
//! disks do not weigh on them; the time is the diff alone, without process
//! start. Each phase starts after `sync(2)`, so the kernel's writeback of
//! what was just written does not run under it.

use arbor_benches::*;
use arbor_engine::format::Addr;
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_snapshot::{BranchLock, Catalog, Disk, DiskOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The catalog of the local disk at `dir`, created first if `create`.
fn open_catalog(dir: &Path, create: bool) -> Arc<Catalog> {
    let arg = dir.display().to_string();
    let disk = if create { Disk::init(&arg, DiskOptions::default()) } else { Disk::open(&arg, DiskOptions::default()) };
    disk.expect("disk").catalog().expect("catalog")
}

/// `--diffs COLD WARM CHANGES CHECKPOINT BRANCH DIR...`: the child
/// process. Times diffs from the checkpoint to the branch's head on each
/// disk, a repetition on every disk before the next: `COLD` through a fresh
/// catalog each, then `WARM` through one catalog per disk after a first
/// diff. Prints `cold I MS` and `warm I MS` lines, `I` the disk's index.
fn diffs(args: &[String]) {
    let [cold, warm, changes, checkpoint, branch, dirs @ ..] = args else {
        panic!("usage: --diffs COLD WARM CHANGES CHECKPOINT BRANCH DIR...")
    };
    let reps = |s: &String| s.parse::<usize>().expect("repetitions");
    let check = |found: Vec<_>| assert_eq!(found.len().to_string(), *changes, "diff must find the changed files");
    let disks: Vec<(&Path, Arc<Catalog>, Addr, Addr)> = dirs
        .iter()
        .map(|d| {
            let cat = open_catalog(Path::new(d), false);
            let from = cat.checkpoint(checkpoint).expect("checkpoint").commit;
            let to = cat.branch_head(branch).expect("head").commit;
            (Path::new(d), cat, from, to)
        })
        .collect();
    for _ in 0..reps(cold) {
        for (i, (dir, _, from, to)) in disks.iter().enumerate() {
            let fresh = open_catalog(dir, false);
            let (found, t) = time(|| fresh.diff_between(*from, *to).expect("diff"));
            check(found);
            println!("cold {i} {}", t.as_secs_f64() * 1e3);
        }
    }
    for (_, cat, from, to) in &disks {
        check(cat.diff_between(*from, *to).expect("diff"));
    }
    for _ in 0..reps(warm) {
        for (i, (_, cat, from, to)) in disks.iter().enumerate() {
            let (found, t) = time(|| cat.diff_between(*from, *to).expect("diff"));
            check(found);
            println!("warm {i} {}", t.as_secs_f64() * 1e3);
        }
    }
}

/// A disk being measured, with its main branch open.
struct Measured {
    n: usize,
    dir: PathBuf,
    cat: Arc<Catalog>,
    vol: Arc<Volume>,
    _lock: BranchLock,
    /// Ten files spread evenly over the disk.
    files: Vec<u64>,
}

fn build(base: &Path, n: usize, cfg: &Config) -> Measured {
    let dir = base.join(format!("disk-{n}"));
    let _ = std::fs::remove_dir_all(&dir);
    let cat = open_catalog(&dir, true);
    let (vol, lock) = cat.open_branch("main", cfg.clone()).expect("main");
    eprintln!("building a disk of {n} files");
    // 100 directories at every size, so the 10 changed files (spread
    // evenly over the disk) sit in 10 directories at every size too: the
    // same change on a bigger disk.
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
    Measured { n, dir, cat, vol, _lock: lock, files }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--diffs") {
        return diffs(&args[2..]);
    }
    let base = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/bench-snapshot"));
    let sizes: Vec<usize> = std::env::var("ARBOR_BENCH_SIZES")
        .unwrap_or_else(|_| "1000,100000,1000000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let reps = env_usize("ARBOR_BENCH_REPS", 30);
    let cold_reps = env_usize("ARBOR_BENCH_COLD_REPS", 300);
    let diff_reps = env_usize("ARBOR_BENCH_DIFF_REPS", 300);
    let cfg = Config { commit_interval: None, ..Config::default() };
    let disks: Vec<Measured> = sizes.iter().map(|&n| build(&base, n, &cfg)).collect();
    let mut times = vec![[Vec::new(), Vec::new(), Vec::new(), Vec::new()]; disks.len()];
    settle();
    // Checkpoint create, each after a small change, as in a training loop.
    for r in 0..reps {
        for (d, t) in disks.iter().zip(&mut times) {
            d.vol.write(d.files[r % d.files.len()], 0, format!("step {r}").as_bytes()).expect("write");
            let (_, took) = time(|| d.cat.checkpoint_volume(&format!("cp-{r}"), "main", &d.vol).expect("checkpoint"));
            t[0].push(took.as_secs_f64() * 1e3);
        }
    }
    let last = format!("cp-{}", reps - 1);
    for r in 0..reps {
        for (d, t) in disks.iter().zip(&mut times) {
            let cp = d.cat.checkpoint(&last).expect("checkpoint").commit;
            let (_, took) = time(|| d.cat.create_branch(&format!("run-{r}"), cp).expect("branch"));
            t[1].push(took.as_secs_f64() * 1e3);
        }
    }
    // On each disk a branch with 10 changed files.
    for d in &disks {
        let (run, _lock) = d.cat.open_branch("run-0", cfg.clone()).expect("open run");
        for f in d.files.iter().take(10) {
            run.write(*f, 0, b"changed by run-0").expect("write");
        }
        run.close().expect("close");
    }
    settle();
    let changes = disks.iter().map(|d| d.files.len().min(10)).min().unwrap_or(0);
    let child = std::process::Command::new(std::env::current_exe().expect("this program"))
        .args(["--diffs", &cold_reps.to_string(), &diff_reps.to_string(), &changes.to_string(), &last, "run-0"])
        .args(disks.iter().map(|d| &d.dir))
        .output()
        .expect("diffs");
    assert!(child.status.success(), "diffs: {}", String::from_utf8_lossy(&child.stderr));
    for line in String::from_utf8_lossy(&child.stdout).lines() {
        let mut words = line.split(' ');
        let (kind, i, ms) = (words.next(), words.next().and_then(|i| i.parse::<usize>().ok()), words.next());
        let col = match kind {
            Some("cold") => 2,
            Some("warm") => 3,
            _ => panic!("unexpected line from the child: {line}"),
        };
        times[i.expect("a disk index")][col].push(ms.and_then(|m| m.parse().ok()).expect("a time"));
    }
    let rows: Vec<(usize, f64, f64, f64, f64)> = disks
        .iter()
        .zip(times)
        .map(|(d, [c, b, cold, warm])| (d.n, median(c), median(b), median(cold), median(warm)))
        .collect();
    for d in disks {
        let dir = d.dir.clone();
        drop(d);
        let _ = std::fs::remove_dir_all(dir);
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
