//! The owner record (`owners/<branch>`) as owners start and stop: two
//! owners starting at once after a crashed one leave the winner's record
//! (not the crashed owner's, which the loser read before it recorded
//! itself), and a client mount started while its owner restarts cleanly
//! waits for it instead of becoming the branch's writer.

use arbor_tests::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn owner_record(disk: &Path) -> String {
    fn find(dir: &Path) -> Option<PathBuf> {
        for e in std::fs::read_dir(dir).ok()?.flatten() {
            let p = e.path();
            if p.is_dir() {
                if let Some(f) = find(&p) {
                    return Some(f);
                }
            } else if p.ends_with("owners/main") {
                return Some(p);
            }
        }
        None
    }
    find(disk).and_then(|p| std::fs::read_to_string(p).ok()).unwrap_or_default()
}

fn spawn_owner(disk: &str, port: u16, token: &Path, log: &Path) -> Child {
    let log_file = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("log");
    Command::new(arbor_bin())
        .args(["serve", disk, "--listen", &format!("127.0.0.1:{port}"), "--branch", "main"])
        .args(["--token-file", token.to_str().expect("utf8"), "--foreground"])
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("log"))
        .stderr(log_file)
        .spawn()
        .expect("spawn")
}

#[test]
fn an_owner_that_loses_the_race_does_not_clobber_the_winners_record() {
    let s = Scratch::new();
    let token = s.dir.path().join("token");
    std::fs::write(&token, "t0k\n").expect("token");
    let port = free_port();
    let log = s.dir.path().join("first.log");
    let mut dead =
        Serve::start(s.disk_str(), port, &["--branch", "main", "--token-file", token.to_str().unwrap()], &[], &log);
    dead.kill9_only();
    for round in 0..5 {
        let (pa, pb) = (free_port(), free_port());
        let (la, lb) = (s.dir.path().join(format!("a{round}.log")), s.dir.path().join(format!("b{round}.log")));
        let mut a = spawn_owner(s.disk_str(), pa, &token, &la);
        let mut b = spawn_owner(s.disk_str(), pb, &token, &lb);
        // One of them wins; the other exits.
        let started = Instant::now();
        let (mut winner, port, loser) = loop {
            assert!(started.elapsed() < Duration::from_secs(60), "neither owner exited");
            if a.try_wait().expect("wait").is_some() {
                break (b, pb, "a");
            }
            if b.try_wait().expect("wait").is_some() {
                break (a, pa, "b");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let wlog = if loser == "a" { &lb } else { &la };
        wait_until("the winner to serve", Duration::from_secs(30), || {
            std::fs::read_to_string(wlog).unwrap_or_default().contains(" serving disk=")
        });
        // Within a few seconds, the record names the owner that serves.
        let want = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut record = owner_record(&s.disk);
        while !record.contains(&want) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
            record = owner_record(&s.disk);
        }
        let ok = record.contains(&want);
        if !ok {
            for l in [&la, &lb] {
                eprintln!("LOG {}:\n{}", l.display(), std::fs::read_to_string(l).unwrap_or_default());
            }
        }
        let _ = winner.kill();
        let _ = winner.wait();
        assert!(ok, "round {round}: the branch is served at {want} but its owner record says {record:?}");
    }
}

/// An owner's clean restart (a stop, then a start: an upgrade) removes its
/// record for a moment. A client mount (given --token-file: it means to go
/// through the owner) started in that moment becomes the branch's writer
/// instead, and the owner cannot come back.
#[test]
fn a_client_mount_started_while_its_owner_restarts_cleanly_never_becomes_the_writer() {
    let Some(w) = SharedWorld::start() else { return };
    let SharedWorld { s, token, owner } = w;
    let port: u16 = owner.addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    // (It logs that it serves a moment before it handles SIGTERM.)
    std::thread::sleep(Duration::from_millis(500));
    owner.stop();
    // The client mount, as a pod restarted during the owner's upgrade.
    let mnt = s.dir.path().join("c");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let (disk, tok) = (s.disk_str().to_string(), token.to_str().expect("utf8").to_string());
    let mounting = std::thread::spawn(move || Mount::start(&disk, &mnt, &["--branch", "main", "--token-file", &tok]));
    // The owner comes back two seconds later.
    std::thread::sleep(Duration::from_secs(2));
    let log = s.dir.path().join("again.log");
    let mut again = spawn_owner(s.disk_str(), port, &token, &log);
    let started = Instant::now();
    let served = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains(" serving disk=") {
            break Ok(());
        }
        if again.try_wait().expect("wait").is_some() || started.elapsed() > Duration::from_secs(30) {
            break Err(text);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if served.is_ok() {
        mounting.join().expect("the client mount").unmount();
    }
    let _ = again.kill();
    let _ = again.wait();
    assert!(served.is_ok(), "the owner could not come back: {}", served.unwrap_err());
}
