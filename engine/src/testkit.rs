//! Support for tests and benchmarks: a real S3-compatible server
//! (`s3s-fs` 0.14.1) on a free 127.0.0.1 port, with its own data folder,
//! stopped when dropped; a TCP proxy that counts what a server sends and
//! can hold it back like a network path; a plain HTTP GET; disk usage;
//! whether a folder's file system takes O_DIRECT writes.
//!
//! Compiled only into the engine's own tests and, through the `testkit`
//! feature, into the test and benchmark crates: never into a build of the
//! `arbor` binary on its own (`cargo build -p arbor-cli`).

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
        if let Ok(Some(status)) = self.child.try_wait() {
            // Its requests failed as refused connections; say why.
            eprintln!("s3s-fs on port {} had exited before its test ended: {status}", self.port);
        }
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
        let (child, port) = start_http_child("s3s-fs", Duration::from_secs(20), |port| {
            Command::new("s3s-fs")
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
                .stderr(Stdio::inherit()) // silent unless it panics
                .spawn()
        })?;
        Ok(Some(S3Server { child, port }))
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
///
/// The pieces wait in pipes (`splice` in from one socket and out to the
/// other): the proxy copies nothing through its own memory, so on a
/// machine whose cores the programs measured share, the stand-in network
/// costs them as little as it can. Where a pipe cannot be made, pieces are
/// copied through buffers instead.
fn relay(from: TcpStream, to: TcpStream, delay: Duration, count: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>) {
    match (0..PIECES).map(|_| Pipe::new()).collect::<std::io::Result<Vec<Pipe>>>() {
        Ok(pipes) => relay_spliced(from, to, delay, count, pipes),
        Err(_) => relay_copied(from, to, delay, count),
    }
}

/// Pieces in flight through a relay at most.
const PIECES: usize = 8;
/// The most one piece holds (a pipe's size, where the kernel allows it).
const PIECE: usize = 1 << 20;

/// A pipe: its read and write ends.
struct Pipe {
    r: std::os::fd::OwnedFd,
    w: std::os::fd::OwnedFd,
}

impl Pipe {
    fn new() -> std::io::Result<Pipe> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let mut fds = [0i32; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just made and are owned here alone.
        let pipe = unsafe { Pipe { r: OwnedFd::from_raw_fd(fds[0]), w: OwnedFd::from_raw_fd(fds[1]) } };
        // Larger pieces, fewer hand-offs; the default size still works.
        // SAFETY: a valid pipe descriptor and an int argument.
        unsafe { libc::fcntl(pipe.w.as_raw_fd(), libc::F_SETPIPE_SZ, PIECE as libc::c_int) };
        Ok(pipe)
    }
}

/// Moves up to `len` bytes from `from` to `to` without copying them
/// through user memory; 0 at the end of `from`.
fn splice(from: &impl std::os::fd::AsRawFd, to: &impl std::os::fd::AsRawFd, len: usize) -> std::io::Result<usize> {
    // SAFETY: two valid descriptors; null offsets (both are streams).
    let n = unsafe {
        libc::splice(
            from.as_raw_fd(),
            std::ptr::null_mut(),
            to.as_raw_fd(),
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Sleeps of this thread end when they are due: a network holds a packet
/// back by its delay, not by the delay plus the 50 µs the kernel may add
/// to a sleeping thread's timer by default to batch wake-ups.
fn precise_sleeps() {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument, this thread's.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
}

fn relay_spliced(
    from: TcpStream,
    to: TcpStream,
    delay: Duration,
    count: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
    pipes: Vec<Pipe>,
) {
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Instant, Pipe, usize)>(PIECES);
    let (free_tx, free_rx) = std::sync::mpsc::channel::<Pipe>();
    for p in pipes {
        let _ = free_tx.send(p);
    }
    std::thread::spawn(move || {
        // Bounded: a free pipe is needed for every piece.
        while let Ok(pipe) = free_rx.recv() {
            match splice(&from, &pipe.w, PIECE) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((Instant::now() + delay, pipe, n)).is_err() {
                        break;
                    }
                }
            }
        }
    });
    std::thread::spawn(move || {
        precise_sleeps();
        'pieces: for (due, pipe, n) in rx {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if let Some(c) = &count {
                c.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            }
            let mut left = n;
            while left > 0 {
                match splice(&pipe.r, &to, left) {
                    Ok(0) | Err(_) => break 'pieces,
                    Ok(m) => left -= m,
                }
            }
            if free_tx.send(pipe).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

fn relay_copied(
    mut from: TcpStream,
    mut to: TcpStream,
    delay: Duration,
    count: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
) {
    use std::io::{Read, Write};
    // Bounded, like a real path: a sender that outruns it waits.
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Instant, Vec<u8>)>(PIECES);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; PIECE];
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
        precise_sleeps();
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

/// A 127.0.0.1 port nothing listens on now, for a child process to listen
/// on (or for a test that needs a closed port). The kernel may hand a port
/// it just gave back to the next `bind(0)`, so two tests running at once
/// could both probe the same port before either child binds it and one
/// child would then fail, or serve the other test's requests. This process
/// never hands out the same port twice.
pub fn free_port() -> std::io::Result<u16> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    // Bounded: the kernel has ~28,000 ephemeral ports and a test process
    // is handed a few dozen.
    for _ in 0..1000 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if !given.contains(&port) {
            given.push(port);
            return Ok(port);
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "no 127.0.0.1 port this process was not given already"))
}

/// Starts an HTTP server as a child process on a [`free_port`] and waits,
/// up to `timeout` in all, until the child itself answers HTTP on it.
/// Another process may still take the port before the child binds it, and
/// a connect alone would then prove nothing, so the child must be alive
/// and answer a request; one that exits is started again on another port,
/// up to 5 times.
pub fn start_http_child(
    what: &str,
    timeout: Duration,
    mut spawn: impl FnMut(u16) -> std::io::Result<Child>,
) -> Result<(Child, u16), String> {
    let deadline = Instant::now() + timeout;
    for _ in 0..5 {
        let port = free_port().map_err(|e| format!("free port for {what}: {e}"))?;
        let mut child = spawn(port).map_err(|e| format!("start {what}: {e}"))?;
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                break; // lost the port: try another
            }
            if answers_http(port) {
                return Ok((child, port));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{what} did not answer HTTP within {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Err(format!("{what} exited on start 5 times (could not keep a free port)"))
}

/// Whether something on 127.0.0.1:`port` answers a HEAD request with an
/// HTTP status line (any status: s3s-fs refuses an unsigned request).
fn answers_http(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    if s.set_read_timeout(Some(Duration::from_secs(2))).is_err()
        || s.write_all(b"HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").is_err()
    {
        return false;
    }
    let mut head = [0u8; 7];
    s.read_exact(&mut head).is_ok() && &head == b"HTTP/1."
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

/// Whether the file system under `dir` takes an aligned O_DIRECT write
/// (what the log's large writes use where they can).
pub fn takes_direct_writes(dir: &Path) -> bool {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let page = crate::log::PAGE;
    let probe = dir.join(".direct-probe");
    let Ok(f) =
        std::fs::File::options().write(true).create(true).truncate(true).custom_flags(libc::O_DIRECT).open(&probe)
    else {
        return false;
    };
    /// One page, page-aligned, as O_DIRECT wants its memory.
    #[repr(C, align(4096))]
    struct Page([u8; crate::log::PAGE]);
    const _: () = assert!(std::mem::align_of::<Page>() == crate::log::PAGE);
    let mem = Box::new(Page([0; crate::log::PAGE]));
    // SAFETY: `mem` holds `page` bytes the kernel only reads.
    let ok = unsafe { libc::pwrite(f.as_raw_fd(), mem.0.as_ptr().cast(), page, 0) } == page as isize;
    let _ = std::fs::remove_file(&probe);
    ok
}

/// The linear part of crc32c over `d` (what XOR-ing `d` into a message
/// changes in its crc32c, whatever surrounds it).
pub fn crc_lin(d: &[u8]) -> u32 {
    crate::crc::crc32c(d) ^ crate::crc::crc32c(&vec![0u8; d.len()])
}

/// Rewrites `block` to start with `evil` and keeps its crc32c, by choosing
/// its last 4 bytes (a 32x32 system over GF(2)). Then every crc32c over
/// any range holding the whole block is kept too (the chunk's, the
/// block's).
pub fn forge_keeping_crc(block: &mut [u8], evil: &[u8]) {
    let n = block.len();
    let mut diff = vec![0u8; n];
    for (i, &b) in evil.iter().enumerate() {
        diff[i] = block[i] ^ b;
    }
    let target = crc_lin(&diff);
    // Columns: the crc change of each of the 32 bits of the last 4 bytes.
    let cols: Vec<u32> = (0..32)
        .map(|bit| {
            let mut e = vec![0u8; n];
            e[n - 4 + bit / 8] = 1 << (bit % 8);
            crc_lin(&e)
        })
        .collect();
    // Solve sum(x_j * cols[j]) = target: rows are the 32 crc bits.
    let mut rows: Vec<(u32, bool)> =
        (0..32).map(|r| ((0..32).fold(0u32, |a, j| a | (((cols[j] >> r) & 1) << j)), (target >> r) & 1 == 1)).collect();
    let mut pivots = Vec::new();
    let mut r0 = 0;
    for j in 0..32 {
        let Some(p) = (r0..32).find(|&r| (rows[r].0 >> j) & 1 == 1) else { continue };
        rows.swap(r0, p);
        for r in 0..32 {
            if r != r0 && (rows[r].0 >> j) & 1 == 1 {
                rows[r].0 ^= rows[r0].0;
                rows[r].1 ^= rows[r0].1;
            }
        }
        pivots.push((r0, j));
        r0 += 1;
    }
    let mut x = 0u32;
    for (r, j) in pivots {
        if rows[r].1 {
            x |= 1 << j;
        }
    }
    for bit in 0..32 {
        if (x >> bit) & 1 == 1 {
            diff[n - 4 + bit / 8] ^= 1 << (bit % 8);
        }
    }
    assert_eq!(crc_lin(&diff), 0, "the forgery keeps the crc");
    for (b, d) in block.iter_mut().zip(&diff) {
        *b ^= d;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn an_http_child_that_loses_its_port_starts_again_on_another() {
        // The first child exits at once, as a server does whose port was
        // taken; the second is a real HTTP server.
        let mut ports = Vec::new();
        let (mut child, port) = start_http_child("http.server", Duration::from_secs(30), |port| {
            ports.push(port);
            if ports.len() == 1 {
                Command::new("true").spawn()
            } else {
                Command::new("python3")
                    .args(["-m", "http.server", "--bind", "127.0.0.1", &port.to_string()])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
            }
        })
        .expect("started");
        assert_eq!(ports.len(), 2, "{ports:?}");
        assert_eq!(port, ports[1]);
        assert!(answers_http(port));
        let _ = child.kill();
        let _ = child.wait();

        // A child that never answers HTTP is an error, not a server: here a
        // listener that accepts and stays silent holds the child's port.
        let mut silent = None;
        let err = start_http_child("silent", Duration::from_millis(500), |port| {
            silent = std::net::TcpListener::bind(("127.0.0.1", port)).ok();
            Command::new("sleep").arg("30").spawn()
        })
        .expect_err("a silent listener is not an HTTP server");
        assert!(err.contains("did not answer HTTP"), "{err}");
        assert!(silent.is_some());
        let err = start_http_child("true", Duration::from_secs(5), |_| Command::new("true").spawn())
            .expect_err("a child that always exits");
        assert!(err.contains("5 times"), "{err}");
    }

    #[test]
    fn the_proxy_delays_each_way_and_passes_every_byte_in_order() {
        // An upstream that echoes what it gets.
        let upstream = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = upstream.local_addr().expect("addr");
        let echo = std::thread::spawn(move || {
            let (mut s, _) = upstream.accept().expect("accept");
            let mut buf = vec![0u8; 64 << 10];
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => s.write_all(&buf[..n]).expect("echo"),
                }
            }
        });
        let one_way = Duration::from_millis(5);
        let proxy = Proxy::start(addr, one_way).expect("proxy");
        let mut c = TcpStream::connect(proxy.addr()).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        // A round trip costs both delays.
        let t = Instant::now();
        c.write_all(b"ping").expect("ping");
        let mut pong = [0u8; 4];
        c.read_exact(&mut pong).expect("pong");
        assert_eq!(&pong, b"ping");
        assert!(t.elapsed() >= 2 * one_way, "{:?}", t.elapsed());
        // Megabytes both ways, whole and in order.
        let body: Vec<u8> = (0..3u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let mut w = c.try_clone().expect("clone");
        let sent = body.clone();
        let writer = std::thread::spawn(move || w.write_all(&sent).expect("send"));
        let mut back = vec![0u8; body.len()];
        c.read_exact(&mut back).expect("read back");
        writer.join().expect("writer");
        assert!(back == body, "the bytes came back changed");
        // What the upstream sent is counted.
        assert_eq!(proxy.sent(), 4 + body.len() as u64);
        drop(c);
        echo.join().expect("echo");
    }
}
