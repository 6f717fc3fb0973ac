//! Support for tests and benchmarks: a real S3-compatible server
//! (`s3s-fs` 0.14.1) on a free 127.0.0.1 port, with its own data folder,
//! stopped when dropped; a TCP proxy that counts what a server sends and
//! can hold it back like a network path; a plain HTTP GET; disk usage.

use crate::bucket::S3Config;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const S3_KEY: &str = "arbor-test-key";
pub const S3_SECRET: &str = "arbor-test-secret";
pub const S3_BUCKET: &str = "arbor-test";

pub struct S3Server {
    child: Child,
    pub port: u16,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3Server {
    /// Starts `s3s-fs` serving `data` (bucket [`S3_BUCKET`] is created in
    /// it). `Ok(None)` when `s3s-fs` is not installed and `CI` is unset:
    /// the caller skips, loudly; in CI a missing server is an error.
    pub fn start(data: &Path) -> Result<Option<S3Server>, String> {
        let found = Command::new("s3s-fs").arg("--help").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
        if !found {
            if std::env::var_os("CI").is_some() {
                return Err("s3s-fs must be installed in CI (.ci/run installs it)".into());
            }
            eprintln!(
                "SKIPPED: this test needs s3s-fs 0.14.1 \
                 (cargo install s3s-fs --version 0.14.1 --features binary --locked)"
            );
            return Ok(None);
        }
        std::fs::create_dir_all(data.join(S3_BUCKET)).map_err(|e| format!("bucket folder: {e}"))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("free port: {e}"))?
            .port();
        let child = Command::new("s3s-fs")
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--access-key",
                S3_KEY,
                "--secret-key",
                S3_SECRET,
            ])
            .arg(data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start s3s-fs: {e}"))?;
        let server = S3Server { child, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err("s3s-fs did not start listening within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Some(server))
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A configuration for the test bucket under `prefix`.
    pub fn config(&self, prefix: &str) -> S3Config {
        S3Config {
            bucket: S3_BUCKET.into(),
            prefix: prefix.into(),
            endpoint: Some(self.endpoint()),
            region: Some("us-east-1".into()),
            path_style: true,
            credentials: Some((S3_KEY.into(), S3_SECRET.into())),
        }
    }
}

/// A TCP proxy on 127.0.0.1 in front of `upstream`: it counts the bytes the
/// upstream sends back (what a bucket served, counted outside arbor) and
/// holds each direction back by `one_way` (half a round trip), so a path
/// on this machine has the latency of a network path (this kernel has no
/// netem). Stops accepting when dropped.
pub struct Proxy {
    pub port: u16,
    sent: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    /// On a free 127.0.0.1 port.
    pub fn start(upstream: std::net::SocketAddr, one_way: Duration) -> std::io::Result<Proxy> {
        Self::start_on("127.0.0.1:0", upstream, one_way)
    }

    /// On `listen` (e.g. an address in a network namespace).
    pub fn start_on(listen: &str, upstream: std::net::SocketAddr, one_way: Duration) -> std::io::Result<Proxy> {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let listener = std::net::TcpListener::bind(listen)?;
        let port = listener.local_addr()?.port();
        let sent = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (sent2, stop2) = (sent.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(client) = conn else { continue };
                let Ok(server) = TcpStream::connect(upstream) else { continue };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else { continue };
                relay(client, server, one_way, None);
                relay(s2, c2, one_way, Some(sent2.clone()));
            }
        });
        Ok(Proxy { port, sent, stop })
    }

    /// Bytes the upstream has sent so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Copies `from` to `to` until `from` closes; with a `delay`, each piece
/// goes `delay` after it arrived (a reader thread stamps pieces, a writer
/// thread sends each when its time comes). At most 8 pieces wait in
/// between, so the proxy holds no more than a network path would.
fn relay(
    mut from: TcpStream,
    mut to: TcpStream,
    delay: Duration,
    count: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
) {
    use std::io::{Read, Write};
    // Bounded, like a real path: a sender that outruns it waits.
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Instant, Vec<u8>)>(8);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    });
    std::thread::spawn(move || {
        for (due, piece) in rx {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if let Some(c) = &count {
                c.fetch_add(piece.len() as u64, std::sync::atomic::Ordering::Relaxed);
            }
            if to.write_all(&piece).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

/// One HTTP/1.1 GET by hand, with an optional `Authorization` header:
/// (status line, body).
pub fn http_get(addr: &str, path: &str, auth: Option<&str>) -> std::io::Result<(String, String)> {
    use std::io::{Read, Write};
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let auth = auth.map(|a| format!("Authorization: {a}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text.lines().next().unwrap_or("").to_string();
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

/// Bytes of data blocks of every file under `dir` (holes not counted).
pub fn bytes_under(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&p) else { continue };
        for e in rd.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => n += m.blocks() * 512,
                Err(_) => {}
            }
        }
    }
    n
}
