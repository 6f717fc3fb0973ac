//! A mount survives the death of the process that serves it: `arbor mount`
//! is a keeper that holds the FUSE connection, and a new serving process
//! takes it over (FUSE_NOTIFY_RESEND). A process holding a file open on the
//! mount sees a stall, never an error, and every byte it fsynced is there.

use arbor_tests::*;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Kills of the serving process per test.
const KILLS: usize = 3;
/// How long the loop on the mount runs (the kills fall inside it).
const LOOP_SECONDS: &str = "8";

fn status(mnt: &Path) -> serde_json::Value {
    serde_json::from_str(&arbor_ok(&["status", mnt.to_str().expect("utf8"), "--json"])).expect("status json")
}

/// The pid of the process serving `mnt`, once `arbor status` answers and it
/// is not `not`.
fn serving_pid(mnt: &Path, not: Option<i64>) -> i64 {
    let mut pid = None;
    wait_until("a serving process", Duration::from_secs(30), || {
        let out = arbor(&["status", mnt.to_str().expect("utf8"), "--json"]);
        let p = serde_json::from_slice::<serde_json::Value>(&out.stdout).ok().and_then(|s| s["pid"].as_i64());
        pid = p.filter(|p| Some(*p) != not);
        pid.is_some()
    });
    pid.expect("pid")
}

/// Records the first errno a `statfs` of the mount point gives while it
/// runs (a statfs stalls while nobody serves; it must never fail).
struct Watcher {
    stop: Arc<AtomicBool>,
    errno: Arc<AtomicI32>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watcher {
    fn start(mnt: &Path) -> Watcher {
        let (stop, errno) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicI32::new(0)));
        let (s, e, mnt) = (stop.clone(), errno.clone(), mnt.to_path_buf());
        let thread = std::thread::spawn(move || {
            // Bounded: the loop stops with the test, at most ten minutes.
            let deadline = Instant::now() + Duration::from_secs(600);
            while !s.load(Ordering::SeqCst) && Instant::now() < deadline {
                if !statfs_ok(&mnt) {
                    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(-1);
                    let _ = e.compare_exchange(0, errno, Ordering::SeqCst, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Watcher { stop, errno, thread: Some(thread) }
    }

    /// The first errno seen (0: none).
    fn finish(mut self) -> i32 {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.errno.load(Ordering::SeqCst)
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The loop script on `file`, once it said "ready"; killed on drop.
struct Loop(Child);

impl Loop {
    fn start(file: &Path) -> (Loop, BufReader<std::process::ChildStdout>) {
        let script = manifest_dir().join("clients/hold_open_loop.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args([file.to_str().expect("utf8"), LOOP_SECONDS, "1000000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("read");
        assert_eq!(line.trim(), "ready", "the loop did not start");
        (Loop(child), out)
    }

    fn running(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }

    /// Waits for the end (bounded: two minutes) and returns (rounds, worst
    /// round in ms); fails on any error the loop saw.
    fn finish(mut self, mut out: BufReader<std::process::ChildStdout>) -> (u64, u64) {
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(s) = self.0.try_wait().expect("wait") {
                break s;
            }
            assert!(Instant::now() < deadline, "the loop on the mount hangs");
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut err = String::new();
        if let Some(mut e) = self.0.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        assert!(status.success(), "the loop on the mount saw an error ({status}):\n{err}");
        let mut line = String::new();
        out.read_line(&mut line).expect("read");
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.first(), Some(&"ok"), "{line}");
        (f[1].parse().expect("rounds"), f[2].parse().expect("ms"))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What `hold_open_loop.py` leaves in its file after `rounds` rounds.
fn expected(rounds: u64) -> Vec<u8> {
    const SLOTS: u64 = 1024;
    let slots = rounds.min(SLOTS);
    let mut v = vec![0u8; (slots * 4096) as usize];
    for s in 0..slots {
        // The last round that wrote slot s.
        let i = s + (rounds - 1 - s) / SLOTS * SLOTS;
        let at = (s * 4096) as usize;
        v[at..at + 8].copy_from_slice(&i.to_le_bytes());
        v[at + 8..at + 4096].fill((i % 251) as u8);
    }
    v
}

/// Kills the process serving `mnt` `KILLS` times while a loop holds
/// `file` open there; returns the loop's rounds and its worst round (ms).
fn kill_under_a_loop(mnt: &Path, file: &Path) -> (u64, u64) {
    let watcher = Watcher::start(mnt);
    let (mut lp, out) = Loop::start(file);
    let mut pid = serving_pid(mnt, None);
    for k in 0..KILLS {
        std::thread::sleep(Duration::from_millis(1200));
        assert!(lp.running(), "the loop ended before kill {k}");
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
    assert!(back == expected(rounds), "bytes differ after {rounds} rounds and {KILLS} kills");
    // New opens, stats and listings.
    let new = mnt.join("after.txt");
    std::fs::write(&new, b"written after the restarts").expect("create after the restarts");
    assert_eq!(std::fs::read(&new).expect("read"), b"written after the restarts");
    assert_eq!(std::fs::metadata(&new).expect("stat").len(), 26);
    let names: Vec<PathBuf> = std::fs::read_dir(mnt).expect("ls").map(|e| e.expect("entry").path()).collect();
    assert!(names.contains(&new) && names.contains(&file.to_path_buf()), "{names:?}");
}

#[test]
fn a_local_mount_survives_kill_9_of_its_serving_process() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let st = status(&s.mnt);
    assert_eq!(st["keeper_pid"].as_i64(), Some(i64::from(m.child.id())), "arbor mount keeps its serving child");
    let file = s.mnt.join("held-open.bin");
    let started = Instant::now();
    let (rounds, worst) = kill_under_a_loop(&s.mnt, &file);
    eprintln!("{rounds} rounds in {:?}, {KILLS} kills, worst round {worst} ms", started.elapsed());
    check_after(&s.mnt, &file, rounds);
    // A taken-over mount unmounts cleanly, and what was fsynced is durable.
    m.unmount();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    assert!(std::fs::read(&file).expect("read after remount") == expected(rounds), "bytes differ after a remount");
    m.unmount();
}
