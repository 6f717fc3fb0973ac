//! Tools of fault-schedule tests: a TCP proxy that can partition or eat
//! replies, a launcher that starts processes from a process with no FUSE
//! files open, and a small seeded random number generator.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the proxy does with traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Bytes pass both ways.
    Pass = 0,
    /// New connections are closed at once (existing ones were shut).
    Partition = 1,
    /// Requests reach the upstream; its answers are dropped.
    EatReplies = 2,
}

/// A TCP proxy on 127.0.0.1 in front of one upstream address, with faults.
/// Stops (and shuts every connection) when dropped.
pub struct FaultProxy {
    pub addr: SocketAddr,
    mode: Arc<AtomicU8>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    stop: Arc<AtomicBool>,
}

impl FaultProxy {
    pub fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        listener.set_nonblocking(true).expect("nonblocking");
        let mode = Arc::new(AtomicU8::new(Mode::Pass as u8));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (m, c, s) = (mode.clone(), conns.clone(), stop.clone());
        std::thread::spawn(move || {
            // Ends when the proxy is dropped.
            while !s.load(Ordering::Relaxed) {
                let Ok((down, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                if m.load(Ordering::Relaxed) == Mode::Partition as u8 {
                    let _ = down.shutdown(Shutdown::Both);
                    continue;
                }
                let _ = down.set_nonblocking(false);
                let Ok(up) = TcpStream::connect_timeout(&upstream, Duration::from_secs(2)) else {
                    let _ = down.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = (down.set_nodelay(true), up.set_nodelay(true));
                {
                    let mut all = c.lock().expect("conns");
                    all.retain(|s| s.peer_addr().is_ok());
                    all.extend([down.try_clone(), up.try_clone()].into_iter().flatten());
                }
                pump(down.try_clone(), up.try_clone(), None);
                pump(up.try_clone(), down.try_clone(), Some(m.clone()));
            }
        });
        FaultProxy { addr, mode, conns, stop }
    }

    pub fn set(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::Relaxed);
    }

    /// Shuts every connection now open (their ends see EOF).
    pub fn cut_all(&self) {
        for s in self.conns.lock().expect("conns").drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.cut_all();
    }
}

/// Copies `from` to `to` on a thread until either closes; with `mode`, bytes
/// are dropped while it says [`Mode::EatReplies`].
fn pump(from: std::io::Result<TcpStream>, to: std::io::Result<TcpStream>, mode: Option<Arc<AtomicU8>>) {
    let (Ok(mut from), Ok(mut to)) = (from, to) else { return };
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 256 << 10];
        // Ends when either side closes (the proxy's drop shuts both).
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if mode.as_ref().is_some_and(|m| m.load(Ordering::Relaxed) == Mode::EatReplies as u8) {
                continue;
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

/// Starts processes from a shell started before any FUSE file is open: a
/// process forked from a test whose threads hold files of a client mount
/// would close them at exec, and such a close (a FUSE flush) may wait for
/// the very owner being started.
pub struct Launcher {
    child: Child,
    stdin: ChildStdin,
    dir: PathBuf,
    next: u64,
}

impl Launcher {
    pub fn start(dir: &Path) -> Launcher {
        let mut child = Command::new("sh")
            .args(["-c", "while IFS= read -r line; do sh -c \"$line\" </dev/null >/dev/null 2>&1 & done"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("launcher shell");
        let stdin = child.stdin.take().expect("stdin");
        Launcher { child, stdin, dir: dir.to_path_buf(), next: 0 }
    }

    /// Runs `argv` (shell-quoted here) in a process group of its own,
    /// output appended to `log`; returns the group's id (its leader's pid).
    pub fn spawn(&mut self, argv: &[String], log: &Path) -> i32 {
        self.next += 1;
        let pidfile = self.dir.join(format!("launched-{}.pid", self.next));
        let cmd: Vec<String> = argv.iter().map(|a| quote(a)).collect();
        let inner = format!("echo $$ > {}; exec {} >> {} 2>&1", quote_path(&pidfile), cmd.join(" "), quote_path(log));
        let line = format!("exec setsid sh -c {}\n", quote(&inner));
        self.stdin.write_all(line.as_bytes()).expect("launch");
        self.stdin.flush().expect("launch");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(pid) = std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse::<i32>().ok()) {
                return pid;
            }
            assert!(Instant::now() < deadline, "the launcher did not start {argv:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn quote_path(p: &Path) -> String {
    quote(p.to_str().expect("utf8 path"))
}

/// Sends `sig` to process group `pgid`.
pub fn signal_group(pgid: i32, sig: i32) {
    // SAFETY: a signal to a process group this test started.
    unsafe { libc::kill(-pgid, sig) };
}

/// Whether any process of group `pgid` is left that has not exited (a
/// zombie waiting for the launcher to collect it holds nothing).
pub fn group_alive(pgid: i32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else { return false };
    dir.flatten().any(|e| {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { return false };
        // After the parenthesised name: state, ppid, pgrp, …
        let Some((_, rest)) = stat.rsplit_once(')') else { return false };
        let f: Vec<&str> = rest.split_whitespace().collect();
        f.len() > 2 && f[2] == pgid.to_string() && !matches!(f[0], "Z" | "X")
    })
}

/// splitmix64: a seeded generator, so a schedule can be run again.
pub struct Rng(pub u64);

impl Rng {
    pub fn draw(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.draw() % (hi - lo).max(1)
    }
}
