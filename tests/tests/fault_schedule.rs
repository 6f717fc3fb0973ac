//! One shared branch, concurrent writers on two client mounts, and the
//! faults clusters have, on a seeded schedule: the owner killed -9 and
//! restarted, stopped cleanly and restarted, paused (SIGSTOP) and resumed,
//! a partition between clients and owner, replies lost on the way back,
//! and owners restarted with a clock 40 s ahead or in a PID namespace of
//! their own. Every writer keeps a history of what was acknowledged; a
//! checker then reads the branch from a fresh mount and finds nothing
//! acknowledged missing and nothing overwritten come back.
//!
//! `ARBOR_FAULT_SEED` and `ARBOR_FAULT_SECS` (default 30) choose the
//! schedule and its length, `ARBOR_FAULT_ONLY=N` keeps one kind of fault;
//! a longer soak: `ARBOR_FAULT_SECS=600`.

use arbor_tests::faults::{group_alive, signal_group, FaultProxy, Launcher, Mode, Rng};
use arbor_tests::*;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TOKEN: &str = "fault-schedule-token";
const WRITERS_PER_MOUNT: usize = 2;
/// How long the writers go on after the last fault, each to succeed again.
const QUIET: Duration = Duration::from_secs(12);

/// What one writer did: saves it made durable (written, fsynced, renamed,
/// folder fsynced), saves it removed durably, and the versions of its
/// rewritten file.
#[derive(Default)]
struct History {
    saved: BTreeSet<u64>,
    removed: BTreeSet<u64>,
    /// Removals that failed: done or not.
    maybe_removed: BTreeSet<u64>,
    errors: u64,
    /// Increments of the shared counter under `flock` that returned (its
    /// fsync and unlock too), and those tried that did not.
    increments: u64,
    increments_failed: u64,
    /// Each acknowledged increment: the value it read, and when (seconds
    /// into the run) it held the lock and when it let go.
    counted: Vec<(u64, f64, f64)>,
    /// When an operation of this writer last succeeded.
    last_ok: Option<Instant>,
}

/// One try at a version of a rewritten file: when its rewrite began, when
/// it ended, and whether its fsync returned.
#[derive(Clone, Copy)]
struct Try {
    id: u64,
    start: Instant,
    end: Instant,
    acked: bool,
}

/// The tries at each rewritten file, by every writer: `rw-<w>` by its own
/// writer, `shared` by all of them (on both mounts).
type Rewrites = Arc<Mutex<BTreeMap<String, Vec<Try>>>>;

fn save_body(w: usize, i: u64) -> Vec<u8> {
    pattern(48 << 10, (w as u32) << 20 | i as u32)
}

fn version_body(id: u64) -> Vec<u8> {
    // Versions differ in length too, so a stale tail shows.
    let len = 4096 + ((id * 7919) % 64) as usize * 1024;
    pattern(len, 0x4000_0000 | id as u32)
}

/// Rewrites `path` in place as version `id` (sometimes 1 MiB first, then
/// truncated), fsyncs it, and notes the try in `rewrites`.
fn rewrite(dir: &Path, name: &str, id: u64, big: bool, rewrites: &Rewrites) -> std::io::Result<()> {
    let start = Instant::now();
    let path = dir.join(name);
    let done = (|| {
        if big {
            std::fs::write(&path, pattern(1 << 20, 99))?;
        }
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(&path)?;
        f.write_all(&version_body(id))?;
        f.sync_all()
    })();
    let t = Try { id, start, end: Instant::now(), acked: done.is_ok() };
    rewrites.lock().expect("rewrites").entry(name.to_string()).or_default().push(t);
    done
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// The counter every writer increments under `flock`.
const COUNTER: &str = "counter";

/// Adds one to the counter in `dir` holding its `flock` (a blocking one:
/// the lock's holder may be on the other mount), fsyncs it, and lets go.
/// When the run began: the times its histories print are from here.
static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn since_start() -> f64 {
    T0.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// [`increment`]'s value read, and when the lock was held and let go.
fn increment(dir: &Path) -> std::io::Result<(u64, f64, f64)> {
    use std::io::{Read, Seek};
    use std::os::fd::AsRawFd;
    let mut f =
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(dir.join(COUNTER))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let locked = since_start();
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    let n: u64 = if text.is_empty() {
        0
    } else {
        text.trim().parse().map_err(|_| std::io::Error::other(format!("the counter holds {text:?}")))?
    };
    f.seek(std::io::SeekFrom::Start(0))?;
    f.write_all(format!("{:020}", n + 1).as_bytes())?;
    f.sync_all()?;
    // SAFETY: as above.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((n, locked, since_start()))
}

/// One writer's loop until `stop`: saves as a training job saves a
/// checkpoint (tmp, fsync, rename, folder fsync), removes old saves, and
/// rewrites one file in place (sometimes 1 MiB first, then truncated).
fn writer(
    dir: PathBuf,
    w: usize,
    seed: u64,
    stop: Arc<AtomicBool>,
    h: Arc<Mutex<History>>,
    rewrites: Rewrites,
    ids: Arc<std::sync::atomic::AtomicU64>,
) {
    let mut rng = Rng(seed);
    let mut i = 0u64;
    // Bounded by `stop`, which the schedule sets; each step's FUSE calls
    // end within the mounts' --timeout.
    while !stop.load(Ordering::Relaxed) {
        match rng.range(0, 12) {
            0..=4 => {
                i += 1;
                let tmp = dir.join(format!("save-{w}-{i}.tmp"));
                let done = (|| {
                    let mut f = std::fs::File::create(&tmp)?;
                    f.write_all(&save_body(w, i))?;
                    f.sync_all()?;
                    std::fs::rename(&tmp, dir.join(format!("save-{w}-{i}")))?;
                    fsync_dir(&dir)
                })();
                let mut h = h.lock().expect("history");
                match done {
                    Ok(()) => {
                        h.saved.insert(i);
                        h.last_ok = Some(Instant::now());
                    }
                    Err(_) => h.errors += 1,
                }
            }
            5..=6 => {
                let old = {
                    let g = h.lock().expect("history");
                    g.saved.iter().find(|s| !g.removed.contains(s) && !g.maybe_removed.contains(s)).copied()
                };
                let Some(old) = old else { continue };
                let done = std::fs::remove_file(dir.join(format!("save-{w}-{old}"))).and_then(|_| fsync_dir(&dir));
                let mut h = h.lock().expect("history");
                match done {
                    Ok(()) => {
                        h.removed.insert(old);
                        h.last_ok = Some(Instant::now());
                    }
                    Err(_) => {
                        h.maybe_removed.insert(old);
                        h.errors += 1;
                    }
                }
            }
            10..=11 => {
                let done = increment(&dir);
                let mut h = h.lock().expect("history");
                match done {
                    Ok(c) => {
                        h.increments += 1;
                        h.counted.push(c);
                        h.last_ok = Some(Instant::now());
                    }
                    Err(_) => {
                        h.increments_failed += 1;
                        h.errors += 1;
                    }
                }
            }
            _ => {
                // Its own file, or the one every writer on both mounts
                // rewrites.
                let name = if rng.range(0, 2) == 0 { format!("rw-{w}") } else { "shared".to_string() };
                let id = ids.fetch_add(1, Ordering::Relaxed);
                let done = rewrite(&dir, &name, id, rng.range(0, 3) == 0, &rewrites);
                let mut h = h.lock().expect("history");
                match done {
                    Ok(()) => h.last_ok = Some(Instant::now()),
                    Err(_) => h.errors += 1,
                }
            }
        }
    }
}

/// The owner: `arbor serve` started through the launcher, clients reaching
/// it through the proxy (its advertised address).
struct Owner {
    pgid: i32,
    argv_tail: Vec<String>,
    log: PathBuf,
    listen: u16,
}

impl Drop for Owner {
    fn drop(&mut self) {
        if self.pgid > 0 {
            signal_group(self.pgid, libc::SIGKILL);
        }
    }
}

impl Owner {
    fn ready_lines(&self) -> usize {
        std::fs::read_to_string(&self.log).unwrap_or_default().matches(" serving disk=").count()
    }

    /// Starts the owner under `wrapper` (a stepped clock, a PID namespace)
    /// and waits until it serves.
    fn start(&mut self, launcher: &mut Launcher, wrapper: &[&str]) {
        let before = self.ready_lines();
        let mut argv: Vec<String> = wrapper.iter().map(|s| s.to_string()).collect();
        argv.push(arbor_bin().to_str().expect("utf8").into());
        argv.extend(self.argv_tail.iter().cloned());
        self.pgid = launcher.spawn(&argv, &self.log);
        let addr = format!("127.0.0.1:{}", self.listen);
        wait_until("the owner to serve", Duration::from_secs(60), || {
            assert!(
                group_alive(self.pgid),
                "the owner exited: {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            self.ready_lines() > before && std::net::TcpStream::connect(&addr).is_ok()
        });
    }

    /// An owner that stepped down exits; its supervisor (here) starts it
    /// again.
    fn supervise(&mut self, launcher: &mut Launcher) -> bool {
        if group_alive(self.pgid) {
            return false;
        }
        self.start(launcher, &[]);
        true
    }

    fn kill9(&self) {
        signal_group(self.pgid, libc::SIGKILL);
        wait_until("the owner to die", Duration::from_secs(10), || !group_alive(self.pgid));
    }

    /// SIGTERM, waiting for a clean exit (or kill -9 after 30 s).
    fn term(&self) {
        signal_group(self.pgid, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while group_alive(self.pgid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill9();
    }
}

#[test]
fn a_shared_branch_under_a_fault_schedule_loses_nothing_acknowledged_and_brings_nothing_back() {
    if !fuse_available() {
        return;
    }
    let seed: u64 = std::env::var("ARBOR_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    // One kind of fault only (its number in the schedule's match), to
    // study it.
    let only: Option<u64> = std::env::var("ARBOR_FAULT_ONLY").ok().and_then(|s| s.parse().ok());
    let secs: u64 = std::env::var("ARBOR_FAULT_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    println!("ARBOR_FAULT_SEED={seed} ARBOR_FAULT_SECS={secs}");
    let have = |cmd: &[&str]| Command::new(cmd[0]).args(&cmd[1..]).status().is_ok_and(|s| s.success());
    let ahead = clock_40s_ahead();
    let faketime = ahead.as_ref().is_some_and(|a| {
        let mut cmd: Vec<&str> = a.iter().map(String::as_str).collect();
        cmd.push("true");
        have(&cmd)
    });
    let pidns = have(&["unshare", "-pf", "true"]);
    if std::env::var_os("CI").is_some() {
        assert!(faketime && pidns, "CI needs faketime and unshare -p");
    }

    since_start();
    let s = Scratch::new();
    let token = s.dir.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("token");
    // SAFETY: plain chmod of a file this test made.
    let _ = std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600));
    let mut launcher = Launcher::start(s.dir.path());
    let listen = free_port();
    let proxy = FaultProxy::start(format!("127.0.0.1:{listen}").parse().expect("addr"));
    let advertise = proxy.addr.to_string();
    let mut owner = Owner {
        pgid: 0,
        argv_tail: [
            "serve",
            s.disk_str(),
            "--listen",
            &format!("127.0.0.1:{listen}"),
            "--advertise",
            &advertise,
            "--branch",
            "main",
            "--token-file",
            token.to_str().expect("utf8"),
            "--lease-ttl",
            "3s",
            // Clients here find a new owner within a second or two.
            "--lock-grace",
            "5s",
            "--foreground",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect(),
        log: s.dir.path().join("owner.log"),
        listen,
    };
    owner.start(&mut launcher, &[]);

    // "a" gives up after 20 s without the owner (EIO); "b" is a hard
    // mount, which waits for as long as it takes.
    let mounts: Vec<Mount> = [("a", Some("20s")), ("b", None)]
        .iter()
        .map(|(name, timeout)| {
            let mnt = s.dir.path().join(name);
            std::fs::create_dir_all(&mnt).expect("mkdir");
            let mut args = vec!["--token-file", token.to_str().expect("utf8")];
            if let Some(t) = timeout {
                args.extend(["--timeout", t]);
            }
            Mount::start(s.disk_str(), &mnt, &args)
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let histories: Vec<Arc<Mutex<History>>> =
        (0..mounts.len() * WRITERS_PER_MOUNT).map(|_| Arc::new(Mutex::new(History::default()))).collect();
    let mut rng = Rng(seed);
    let rewrites: Rewrites = Arc::default();
    let ids = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for (w, h) in histories.iter().enumerate() {
        let dir = mounts[w % mounts.len()].mnt.clone();
        let (stop, h, seed, rewrites, ids) = (stop.clone(), h.clone(), rng.draw(), rewrites.clone(), ids.clone());
        let done = done_tx.clone();
        std::thread::spawn(move || {
            writer(dir, w, seed, stop, h, rewrites, ids);
            let _ = done.send(w);
        });
    }

    // The schedule.
    let end = Instant::now() + Duration::from_secs(secs);
    let mut faults: BTreeMap<&str, u32> = BTreeMap::new();
    // Bounded by `end`: each turn sleeps and injects one fault.
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(rng.range(500, 2000)));
        if owner.supervise(&mut launcher) {
            println!("the owner had stepped down and exited; started again");
        }
        let kind = rng.range(0, 7);
        let kind = only.unwrap_or(kind);
        let fault = match kind {
            0 => {
                owner.kill9();
                std::thread::sleep(Duration::from_millis(rng.range(0, 1000)));
                owner.start(&mut launcher, &[]);
                "kill -9, restart"
            }
            1 => {
                owner.term();
                owner.start(&mut launcher, &[]);
                "clean stop, restart"
            }
            2 if rng.range(0, 3) > 0 => {
                // Well inside four fifths of the 3 s lease (renewed every
                // second): the owner resumes as the owner.
                signal_group(owner.pgid, libc::SIGSTOP);
                std::thread::sleep(Duration::from_millis(rng.range(100, 1200)));
                signal_group(owner.pgid, libc::SIGCONT);
                "pause, resume"
            }
            2 => {
                // Past its lease: on resuming it must acknowledge nothing
                // (it stops itself); a new owner is started in its place.
                signal_group(owner.pgid, libc::SIGSTOP);
                std::thread::sleep(Duration::from_millis(rng.range(2600, 4000)));
                signal_group(owner.pgid, libc::SIGCONT);
                std::thread::sleep(Duration::from_millis(rng.range(0, 500)));
                owner.kill9();
                owner.start(&mut launcher, &[]);
                "pause past the lease, resume, replaced"
            }
            3 => {
                proxy.set(Mode::Partition);
                proxy.cut_all();
                std::thread::sleep(Duration::from_millis(rng.range(200, 3000)));
                proxy.set(Mode::Pass);
                "partition"
            }
            4 => {
                proxy.set(Mode::EatReplies);
                std::thread::sleep(Duration::from_millis(rng.range(50, 500)));
                proxy.set(Mode::Partition);
                proxy.cut_all();
                proxy.set(Mode::Pass);
                "replies lost"
            }
            5 if faketime => {
                owner.kill9();
                let wrapper: Vec<&str> = ahead.iter().flatten().map(String::as_str).collect();
                owner.start(&mut launcher, &wrapper);
                "kill -9, restart with the clock 40 s ahead"
            }
            6 if pidns => {
                owner.kill9();
                owner.start(&mut launcher, &["unshare", "-pf"]);
                "kill -9, restart in a PID namespace of its own"
            }
            _ => "nothing",
        };
        println!(
            "{:>6.1}s {fault} (at {:.3}s of the run)",
            secs as f64 - end.saturating_duration_since(Instant::now()).as_secs_f64(),
            since_start()
        );
        *faults.entry(fault).or_default() += 1;
    }
    // A quiet end: with every fault healed, every writer gets on again.
    let quiet = Instant::now();
    while quiet.elapsed() < QUIET {
        std::thread::sleep(Duration::from_millis(200));
        if owner.supervise(&mut launcher) {
            println!("the owner had stepped down and exited; started again");
        }
    }
    stop.store(true, Ordering::Relaxed);
    for _ in &histories {
        // The hard mount's writers wait as long as the owner does: bounded
        // here so that a writer stuck for good fails the test.
        done_rx.recv_timeout(Duration::from_secs(120)).expect("a writer is stuck after every fault healed");
    }
    println!("faults: {faults:?}");
    for (w, h) in histories.iter().enumerate() {
        let last = h.lock().expect("history").last_ok;
        assert!(last.is_some_and(|t| t > quiet), "writer {w} did nothing in the {QUIET:?} after the last fault");
    }

    // Clean shutdown, then the branch read from a fresh local mount.
    for m in mounts {
        m.unmount();
    }
    owner.term();
    let check = Mount::start(s.disk_str(), &s.mnt, &[]);
    let mut violations = Vec::new();
    let (mut saved, mut removed, mut errors) = (0, 0, 0);
    for (w, h) in histories.iter().enumerate() {
        let h = h.lock().expect("history");
        errors += h.errors;
        for i in &h.saved {
            let p = check.mnt.join(format!("save-{w}-{i}"));
            if h.removed.contains(i) || h.maybe_removed.contains(i) {
                continue;
            }
            saved += 1;
            match std::fs::read(&p) {
                Ok(b) if b == save_body(w, *i) => {}
                Ok(b) => violations.push(format!("save-{w}-{i}: acknowledged, now {} other bytes", b.len())),
                Err(e) => violations.push(format!("save-{w}-{i}: acknowledged, now {e}")),
            }
        }
        for i in &h.removed {
            removed += 1;
            if check.mnt.join(format!("save-{w}-{i}")).exists() {
                violations.push(format!("save-{w}-{i}: its removal was acknowledged, and it came back"));
            }
        }
    }
    // A rewritten file holds a version no acknowledged version overwrote:
    // version X whose fsync returned is overwritten once another version
    // whose rewrite began after that returns too. Between versions it may
    // be empty or the 1 MiB first write of a try that failed.
    let rewrites = rewrites.lock().expect("rewrites");
    for (name, tries) in rewrites.iter() {
        let got = std::fs::read(check.mnt.join(name));
        let overwritten = |x: &Try| x.acked && tries.iter().any(|y| y.acked && y.id != x.id && y.start > x.end);
        match got {
            Err(e) => {
                if tries.iter().any(|t| t.acked) {
                    violations.push(format!("{name}: versions acknowledged, now {e}"));
                }
            }
            Ok(b) => match tries.iter().find(|t| version_body(t.id) == b) {
                Some(x) if overwritten(x) => {
                    violations.push(format!("{name}: version {} came back over a newer acknowledged one", x.id))
                }
                Some(_) => {}
                None => {
                    let between = b.is_empty() || b == pattern(1 << 20, 99);
                    if !(between && tries.iter().any(|t| !t.acked)) {
                        violations.push(format!("{name}: {} bytes that are no version", b.len()));
                    }
                }
            },
        }
    }
    // The counter: every acknowledged increment is in it (two holders of
    // the lock at once would both have added one to the same value), and
    // nothing more than was tried.
    let (acked, tried) = histories.iter().fold((0, 0), |(a, t), h| {
        let h = h.lock().expect("history");
        (a + h.increments, t + h.increments + h.increments_failed)
    });
    let counter = std::fs::read_to_string(check.mnt.join(COUNTER)).unwrap_or_default();
    let counted: u64 = if counter.is_empty() { 0 } else { counter.trim().parse().unwrap_or(u64::MAX) };
    if counted < acked || counted > tried {
        violations.push(format!(
            "counter: {counted:?} ({counter:?}) after {acked} acknowledged increments of {tried} tried under flock"
        ));
        // The history: acknowledged increments that read the same value.
        let mut all: Vec<(u64, f64, f64, usize)> = Vec::new();
        for (w, h) in histories.iter().enumerate() {
            all.extend(h.lock().expect("history").counted.iter().map(|&(v, a, b)| (v, a, b, w)));
        }
        all.sort_by(|x, y| x.0.cmp(&y.0).then(x.1.total_cmp(&y.1)));
        for pair in all.windows(2).filter(|p| p[0].0 == p[1].0) {
            for (v, a, b, w) in pair {
                println!("writer {w} read {v} holding the lock from {a:.3}s to {b:.3}s");
            }
        }
        let read: std::collections::BTreeSet<u64> = all.iter().map(|x| x.0).collect();
        let skipped: Vec<u64> = (0..counted).filter(|v| !read.contains(v)).take(10).collect();
        println!("values no acknowledged increment read: {skipped:?}");
    }
    let acked_rewrites: usize = rewrites.values().map(|t| t.iter().filter(|t| t.acked).count()).sum();
    println!(
        "checked: {saved} saves, {removed} removals, {acked_rewrites} rewrites of {} files, \
         {acked} increments under flock (counter {counted}); {errors} operations failed (not acknowledged)",
        rewrites.len()
    );
    check.unmount();
    assert!(violations.is_empty(), "seed {seed}: {violations:#?}");
    let fsck = arbor(&["fsck", s.disk_str()]);
    let said = format!("{}{}", String::from_utf8_lossy(&fsck.stdout), String::from_utf8_lossy(&fsck.stderr));
    assert!(fsck.status.success(), "fsck: {said}");
    assert!(saved > 0, "no save was acknowledged: the schedule left the writers nothing");
}
