//! A mount survives the death of the process that serves it: `arbor mount`
//! is a keeper that holds the FUSE connection, and a new serving process
//! takes it over (FUSE_NOTIFY_RESEND). A process holding a file open on the
//! mount sees a stall, never an error, and every byte it fsynced is there.

use arbor_tests::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Kills of the serving process per test.
const KILLS: usize = 3;
/// How long the loop on the mount runs, in seconds (the kills fall inside it).
const LOOP_SECONDS: u32 = 8;

/// The environment of a mount that can be restarted: `ARBOR_FUSE=ring`
/// (one of the two CI runs) insists on the ring, whose requests in flight
/// die with its process.
fn restartable() -> Vec<(&'static str, String)> {
    vec![("ARBOR_FUSE", "auto".to_string())]
}

fn status(mnt: &Path) -> serde_json::Value {
    serde_json::from_str(&arbor_ok(&["status", mnt.to_str().expect("utf8"), "--json"])).expect("status json")
}

/// Kills the process serving `mnt` `KILLS` times while a loop holds
/// `file` open there; returns the loop's rounds and its worst round (ms).
fn kill_under_a_loop(mnt: &Path, file: &Path) -> (u64, u64) {
    let watcher = Watcher::start(mnt);
    let (mut lp, out) = HoldOpenLoop::start(file, LOOP_SECONDS);
    let mut pid = serving_pid(mnt, None);
    for k in 0..KILLS {
        std::thread::sleep(Duration::from_millis(1200));
        if !lp.running() {
            // Says what the loop saw, if it failed.
            lp.finish(out);
            panic!("the loop ended before kill {k}");
        }
        // SAFETY: a signal to the serving process this test's mount started.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0, "kill -9 {pid}");
        pid = serving_pid(mnt, Some(pid));
    }
    assert!(lp.running(), "the loop ended before the last kill was survived");
    let (rounds, worst) = lp.finish(out);
    assert_eq!(watcher.finish(), 0, "statfs of the mount point failed while its server was restarted");
    (rounds, worst)
}

fn check_after(mnt: &Path, file: &Path, rounds: u64) {
    let back = std::fs::read(file).expect("read the looped file");
    assert!(back == hold_open_expected(rounds), "bytes differ after {rounds} rounds and {KILLS} kills");
    check_hold_open_files(file, rounds);
    // New opens, stats and listings.
    let new = mnt.join("after.txt");
    std::fs::write(&new, b"written after the restarts").expect("create after the restarts");
    assert_eq!(std::fs::read(&new).expect("read"), b"written after the restarts");
    assert_eq!(std::fs::metadata(&new).expect("stat").len(), 26);
    let names: Vec<PathBuf> = std::fs::read_dir(mnt).expect("ls").map(|e| e.expect("entry").path()).collect();
    assert!(names.contains(&new) && names.contains(&file.to_path_buf()), "{} names", names.len());
}

#[test]
fn a_local_mount_survives_kill_9_of_its_serving_process() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start_env(s.disk_str(), &s.mnt, &["--restartable"], &restartable());
    let st = status(&s.mnt);
    assert_eq!(st["keeper_pid"].as_i64(), Some(i64::from(m.child.id())), "arbor mount keeps its serving child");
    let file = s.mnt.join("held-open.bin");
    let started = Instant::now();
    let (rounds, worst) = kill_under_a_loop(&s.mnt, &file);
    eprintln!("{rounds} rounds in {:?}, {KILLS} kills, worst round {worst} ms", started.elapsed());
    check_after(&s.mnt, &file, rounds);
    let st = status(&s.mnt);
    assert_eq!(st["keeper_pid"].as_i64(), Some(i64::from(m.child.id())), "the same keeper");
    assert!(st["fuse_transport"].as_str().is_some_and(|t| t.contains("taken over")), "{st}");
    // A taken-over mount unmounts cleanly, and what was fsynced is durable.
    m.unmount();
    let m = Mount::start_env(s.disk_str(), &s.mnt, &["--restartable"], &restartable());
    assert!(
        std::fs::read(&file).expect("read after remount") == hold_open_expected(rounds),
        "bytes differ after a remount"
    );
    m.unmount();
}

#[test]
fn a_client_mount_of_a_shared_branch_survives_kill_9_of_its_serving_process() {
    let Some(w) = SharedWorld::start() else { return };
    let mnt = w.s.dir.path().join("client");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let c = Mount::start_env(
        w.s.disk_str(),
        &mnt,
        &["--token-file", w.token.to_str().expect("utf8"), "--restartable"],
        &restartable(),
    );
    let st = status(&c.mnt);
    assert!(st["owner"].as_str().is_some(), "mounted through the owner: {st}");
    assert_eq!(st["keeper_pid"].as_i64(), Some(i64::from(c.child.id())));
    let file = c.mnt.join("held-open.bin");
    let started = Instant::now();
    let (rounds, worst) = kill_under_a_loop(&c.mnt, &file);
    eprintln!("{rounds} rounds in {:?}, {KILLS} kills, worst round {worst} ms", started.elapsed());
    check_after(&c.mnt, &file, rounds);
    assert_eq!(status(&c.mnt)["keeper_pid"].as_i64(), Some(i64::from(c.child.id())), "the same keeper");
    c.unmount();
    // The owner has every byte: another client reads them.
    let other = w.client("other");
    assert!(std::fs::read(other.mnt.join("held-open.bin")).expect("read") == hold_open_expected(rounds));
    other.unmount();
}
