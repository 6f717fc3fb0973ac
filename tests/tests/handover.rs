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

// ---- `arbor keeper`: the connection held outside the mount's process tree. ----

/// Kills the mount's whole process group `KILLS` times while a loop holds
/// `file` open there (kill -9, except the second time: SIGTERM, as
/// `systemctl restart` stops a unit), starting `arbor mount --keeper` again
/// with the same arguments after each kill; returns the mount left
/// running, the loop's rounds and its worst round (ms).
fn restart_under_a_loop(m: Mount, disk: &str, args: &[&str], file: &Path) -> (Mount, u64, u64) {
    let mnt = m.mnt.clone();
    let watcher = Watcher::start(&mnt);
    let (mut lp, out) = HoldOpenLoop::start(file, LOOP_SECONDS);
    let mut m = m;
    for k in 0..KILLS {
        std::thread::sleep(Duration::from_millis(1200));
        if !lp.running() {
            lp.finish(out);
            panic!("the loop ended before kill {k}");
        }
        let old = m.child.id();
        let t = Instant::now();
        if k == 1 {
            let log = m.log.clone();
            let status = m.signal_group(libc::SIGTERM);
            let log = std::fs::read_to_string(log).unwrap_or_default();
            assert!(status.success(), "SIGTERM: {status}; log: {log}");
            assert!(log.contains("the keeper keeps the mount"), "{log}");
        } else {
            m.kill_group();
        }
        assert!(is_mounted(&mnt), "the kernel mount died with its process");
        m = Mount::start_in_group(disk, &mnt, args, &restartable());
        assert_ne!(m.child.id(), old);
        eprintln!("kill {k}: served again {} ms after the kill", t.elapsed().as_millis());
    }
    assert!(lp.running(), "the loop ended before the last restart was survived");
    let (rounds, worst) = lp.finish(out);
    assert_eq!(watcher.finish(), 0, "statfs of the mount point failed while its process was restarted");
    (m, rounds, worst)
}

#[test]
fn a_mount_killed_with_its_whole_process_group_comes_back_on_the_same_kernel_mount() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let keeper = Keeper::start(s.dir.path());
    let args = ["--keeper", keeper.socket_str()];
    let m = Mount::start_in_group(s.disk_str(), &s.mnt, &args, &restartable());
    let mnt = s.mnt.to_str().expect("utf8").to_string();
    assert_eq!(keeper.held(), vec![mnt.clone()], "the keeper holds the new mount's connection");
    let st = status(&s.mnt);
    assert!(st["keeper_pid"].is_null(), "no in-process keeper: {st}");
    assert_eq!(st["keeper_socket"].as_str(), Some(keeper.socket_str()), "{st}");
    let text = arbor_ok(&["status", &mnt]);
    assert!(text.contains(&format!("`arbor keeper` at {}", keeper.socket_str())), "{text}");
    let fresh = status(&s.mnt)["fuse_transport"].as_str().unwrap_or_default().to_string();
    assert!(!fresh.contains("taken over"), "{fresh}");

    // A second mount process while one serves is refused, and changes nothing.
    let out =
        arbor_env(&["mount", s.disk_str(), &mnt, "--foreground", "--keeper", keeper.socket_str()], &restartable());
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("already served"));

    let file = s.mnt.join("held-open.bin");
    let started = Instant::now();
    let (m, rounds, worst) = restart_under_a_loop(m, s.disk_str(), &args, &file);
    eprintln!("{rounds} rounds in {:?}, {KILLS} restarts, worst round {worst} ms", started.elapsed());
    check_after(&s.mnt, &file, rounds);
    let st = status(&s.mnt);
    assert!(st["fuse_transport"].as_str().is_some_and(|t| t.contains("taken over")), "{st}");
    assert_eq!(keeper.held(), vec![mnt.clone()], "the keeper still holds the connection");

    // A clean unmount: the keeper lets the connection go, and the bytes
    // are durable.
    m.unmount();
    assert!(!is_mounted(&s.mnt));
    assert!(keeper.held().is_empty(), "the keeper holds an unmounted connection");
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    assert!(std::fs::read(&file).expect("read after remount") == hold_open_expected(rounds), "bytes differ");
    m.unmount();
}

#[test]
fn a_keeper_never_hands_out_a_connection_whose_mount_is_gone_and_refuses_bad_requests() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let mut keeper = Keeper::start(s.dir.path());
    let args = ["--keeper", keeper.socket_str()];
    let mnt = s.mnt.to_str().expect("utf8").to_string();

    // A mount point the keeper does not hold mounts fresh.
    let m = Mount::start_in_group(s.disk_str(), &s.mnt, &args, &restartable());
    std::fs::write(s.mnt.join("kept.txt"), b"synced before the kill").expect("write");
    arbor_ok(&["checkpoints", "create", &mnt, "before-kill"]);
    assert_eq!(keeper.held(), vec![mnt.clone()]);

    // The mount's process is killed, and its mount detached behind the
    // keeper's back: the connection it holds is dead. A new mount must
    // not take it over (it would serve nobody): it mounts fresh.
    m.kill_group();
    let out = std::process::Command::new("umount").arg("-l").arg(&s.mnt).output().expect("umount");
    assert!(out.status.success(), "umount -l: {}", String::from_utf8_lossy(&out.stderr));
    let m = Mount::start_in_group(s.disk_str(), &s.mnt, &args, &restartable());
    let st = status(&s.mnt);
    assert!(!st["fuse_transport"].as_str().unwrap_or_default().contains("taken over"), "took a dead connection: {st}");
    assert_eq!(std::fs::read(s.mnt.join("kept.txt")).expect("read"), b"synced before the kill");
    assert_eq!(keeper.held(), vec![mnt.clone()], "the keeper holds the new mount's connection");

    // Requests that are not the protocol get an error answer, and the
    // keeper goes on serving.
    let script = r#"
import json, os, socket, sys
def call(msgs):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sys.argv[1])
    out = []
    for m in msgs:
        s.send(m)
        r = s.recv(4096)
        out.append(json.loads(r) if r else None)
    return out
hello = json.dumps({"hello": "arbor-keeper", "version": 1}).encode()
def two_fds():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sys.argv[1])
    s.send(hello)
    s.recv(4096)
    r, w = os.pipe()
    socket.send_fds(s, [json.dumps({"op": "deposit", "mountpoint": "/x"}).encode()], [r, w])
    first = json.loads(s.recv(4096))
    s.send(json.dumps({"op": "list"}).encode())
    return [first, json.loads(s.recv(4096))]
print(json.dumps([
    two_fds(),
    call([b"\xff not json"]),
    call([json.dumps({"hello": "arbor-keeper", "version": 99}).encode()]),
    call([json.dumps({"op": "list"}).encode()]),
    call([hello, json.dumps({"op": "get"}).encode(), json.dumps({"op": "deposit", "mountpoint": "/x"}).encode(),
          json.dumps({"op": "fly"}).encode(), json.dumps({"op": "get", "mountpoint": "/nowhere"}).encode()]),
]))
"#;
    let out =
        std::process::Command::new("python3").args(["-c", script, keeper.socket_str()]).output().expect("python3");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let answers: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let error = |a: &serde_json::Value| a["ok"] == false && a["error"].is_string();
    assert!(error(&answers[0][0]), "two descriptors: {answers}");
    assert_eq!(answers[0][1]["ok"], true, "the connection goes on after a bad request: {answers}");
    assert!(error(&answers[1][0]), "not JSON: {answers}");
    assert!(error(&answers[2][0]) && answers[2][0]["error"].as_str().is_some_and(|e| e.contains("version")));
    assert!(error(&answers[3][0]), "a request before the hello: {answers}");
    let after_hello = &answers[4];
    assert_eq!(after_hello[0]["version"], 1);
    assert!(error(&after_hello[1]) && error(&after_hello[2]) && error(&after_hello[3]), "{answers}");
    assert_eq!(after_hello[4], serde_json::json!({"ok": true, "held": false}));
    assert!(keeper.running(), "a bad request ended the keeper");
    assert_eq!(keeper.held(), vec![mnt.clone()]);

    // Its process killed, `arbor unmount --keeper` has the keeper let the
    // connection go, and the dead mount is detached (a held one would wait
    // for a server instead of failing).
    m.kill_group();
    // Without the keeper's socket, `arbor unmount` says why it can do
    // nothing (the held mount would wait for a server forever).
    let t = Instant::now();
    let out = arbor(&["unmount", &mnt]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--keeper"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(30) && is_mounted(&s.mnt));
    arbor_ok(&["unmount", &mnt, "--keeper", keeper.socket_str()]);
    assert!(!is_mounted(&s.mnt));
    assert!(keeper.held().is_empty());
}

#[test]
fn a_restarted_keeper_learns_the_connections_of_running_mounts_again() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let keeper = Keeper::start(s.dir.path());
    let socket = keeper.socket_str().to_string();
    let args = ["--keeper", socket.as_str()];
    let mnt = s.mnt.to_str().expect("utf8").to_string();
    let m = Mount::start_in_group(s.disk_str(), &s.mnt, &args, &restartable());
    std::fs::write(s.mnt.join("before.txt"), b"written before the keeper restarted").expect("write");

    // The keeper dies (kill -9) and starts again, holding nothing: the
    // mount goes on serving, and hands the new keeper its connection.
    drop(keeper);
    assert!(statfs_ok(&s.mnt), "the mount died with its keeper");
    let keeper = Keeper::start(s.dir.path());
    wait_until("the mount to hand the new keeper its connection", Duration::from_secs(20), || {
        keeper.held() == vec![mnt.clone()]
    });

    // So the mount survives its process again.
    m.kill_group();
    let m = Mount::start_in_group(s.disk_str(), &s.mnt, &args, &restartable());
    assert!(status(&s.mnt)["fuse_transport"].as_str().is_some_and(|t| t.contains("taken over")));
    assert_eq!(std::fs::read(s.mnt.join("before.txt")).expect("read"), b"written before the keeper restarted");
    m.unmount();
    assert!(keeper.held().is_empty());
}

/// Sends SIGCONT to a process group on drop, so that a test that stopped
/// it and then failed leaves a process its guards can stop.
struct Resumes(libc::pid_t);

impl Drop for Resumes {
    fn drop(&mut self) {
        // SAFETY: a signal to a process group this test started.
        unsafe { libc::kill(-self.0, libc::SIGCONT) };
    }
}

#[test]
fn a_keeper_refuses_the_connection_while_its_server_lives_whatever_control_socket_the_newcomer_sees() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let keeper = Keeper::start(s.dir.path());
    let args = ["--keeper", keeper.socket_str()];
    let mnt = s.mnt.to_str().expect("utf8").to_string();
    let m = Mount::start_in_group(s.disk_str(), &s.mnt, &args, &restartable());
    let old = m.child.id();
    std::fs::write(s.mnt.join("before.txt"), b"served by the first process").expect("write");

    // The server stopped (as a slow death, a frozen container): a newcomer
    // whose control socket is elsewhere (its own /run/arbor, as in another
    // container) sees no server there, and the keeper must refuse it.
    let pgid = old as libc::pid_t;
    // SAFETY: a signal to the process group this test started.
    assert_eq!(unsafe { libc::kill(-pgid, libc::SIGSTOP) }, 0);
    let resumes = Resumes(pgid);
    let script = "mkdir -p /run/arbor && mount -t tmpfs arbor-test /run/arbor && exec \"$0\" \"$@\"";
    let bin = arbor_bin();
    let out = std::process::Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", script])
        .arg(&bin)
        .args(["mount", s.disk_str(), &mnt, "--foreground", "--keeper", keeper.socket_str()])
        .envs(restartable())
        .output()
        .expect("unshare");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second server started: {err}");
    assert!(err.contains(&format!("still served by pid {old}")), "{err}");
    drop(resumes);

    // The first server goes on, alone.
    assert_eq!(status(&s.mnt)["pid"].as_i64(), Some(i64::from(old)));
    std::fs::write(s.mnt.join("after.txt"), b"still the first process").expect("write");
    assert_eq!(keeper.held(), vec![mnt.clone()]);

    // Once it is dead, a newcomer takes the connection over.
    m.kill_group();
    let m = Mount::start_in_group(s.disk_str(), &s.mnt, &args, &restartable());
    assert!(status(&s.mnt)["fuse_transport"].as_str().is_some_and(|t| t.contains("taken over")));
    assert_eq!(std::fs::read(s.mnt.join("before.txt")).expect("read"), b"served by the first process");
    assert_eq!(std::fs::read(s.mnt.join("after.txt")).expect("read"), b"still the first process");
    m.unmount();
    assert!(keeper.held().is_empty());
}

#[test]
fn sigterm_unmounts_cleanly_when_the_keeper_no_longer_holds_the_connection() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let keeper = Keeper::start(s.dir.path());
    let args = ["--keeper", keeper.socket_str()];
    let m = Mount::start_in_group(s.disk_str(), &s.mnt, &args, &restartable());
    std::fs::write(s.mnt.join("kept.txt"), b"flushed by the unmount").expect("write");
    // The keeper dies (kill -9): it holds nothing now. SIGTERM must not
    // leave a mount nobody serves and nobody holds.
    drop(keeper);
    let log = m.log.clone();
    let status = m.signal_group(libc::SIGTERM);
    let log = std::fs::read_to_string(log).unwrap_or_default();
    assert!(status.success(), "SIGTERM: {status}; log: {log}");
    assert!(log.contains("does not hold the FUSE connection; unmounting"), "{log}");
    assert!(!is_mounted(&s.mnt), "a mount without a server or a keeper was left behind");
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    assert_eq!(std::fs::read(s.mnt.join("kept.txt")).expect("read"), b"flushed by the unmount");
    m.unmount();
}
