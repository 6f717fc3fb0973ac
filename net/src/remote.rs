//! Shared branches: the client's side. A mount of a branch another process
//! owns serves the kernel through [`RemoteFiles`]: every operation is sent
//! to the owner (see [`crate::files`]) and its answer, errno included,
//! returned as the owner's volume gave it.
//!
//! The mount is "hard": when the owner cannot be reached, an operation
//! waits and tries again (backoff from 50 ms to 250 ms; the owner's
//! address looked up again after 50 ms, 100 ms, … up to every 2 s, one
//! lookup for every thread of the mount, so a new owner is followed
//! without a request to the bucket per try), unless a
//! timeout was given, after which it fails with EIO. When the owner comes
//! back with a new epoch (it restarted), the client opens a new session
//! and opens again the files it holds open.
//!
//! # Writes the owner lost
//!
//! An owner killed with -9 loses what it had not made durable, and a
//! client's later `fsync` must not report those writes durable. So a
//! client keeps every write the owner acknowledged until an `fsync` (the
//! owner's, which covers its whole log) returns, and when the owner comes
//! back with a new epoch it sends them again, in order, before anything
//! else — the "unstable write" and verifier of NFS. A file is recognised by
//! its inode number and birth time (a file made anew after the restart may
//! get the same number); a file that did not survive the restart is lost,
//! and its next `fsync` fails with EIO. At most [`UNSYNCED_MAX`] bytes are
//! kept; past that the client asks the owner for an `fsync` itself.
//!
//! # Writes in flight
//!
//! A write is answered to the kernel once it is on its way: the FUSE
//! thread sends it on a write connection (one of [`WRITE_LANES`], chosen by
//! inode, so one file's writes stay in order) and returns without waiting
//! for the owner's answer; it reads answers only to keep at most
//! [`IN_FLIGHT_MAX`] bytes outstanding on its lane. The writer's copy, the
//! network and the owner's work then overlap instead of taking turns, the
//! way a local disk's write-back overlaps the caller and the device.
//! Every other operation first reads the answers to every write in flight
//! (so a read, a `stat`, a truncation, a rename or an `fsync` sees every
//! write before it), and a `close` reads those on its file's lane
//! (close-to-open). A write the owner refused is reported by the file's
//! next `write`, `fsync` or `close`, as NFS reports its unstable writes. A
//! lane whose connection breaks sends its writes in flight again, in order,
//! through the ordinary retrying path before anything else goes on it.

use crate::client::connect;
use crate::files::{Event, Events, Op, Out, Reply, SessionInfo, READDIR_BATCH};
use crate::frames::Written;
use crate::reads::DirectReads;
use arbor_engine::env::Timestamp;
use arbor_engine::format::decode_value;
use arbor_engine::volume::{Attr, DirEntryOut, RenameMode, SetAttr, StatFs, XattrFlags};
use arbor_engine::{Error, Result};
use arbor_fs::{Files, Lock};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper::header::{HeaderValue, AUTHORIZATION};
use hyper::{Method, Request, StatusCode};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Finds the owner's `HOST:PORT`: the address given on the command line,
/// or the owner record in the bucket, read again after every failure.
pub type Locate = Arc<dyn Fn() -> Option<String> + Send + Sync>;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Unsynced bytes a client keeps for resending before it syncs on its own.
pub const UNSYNCED_MAX: u64 = 128 << 20;
const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// The longest wait between two tries to reach the owner: a restarted
/// owner is found within this of answering again. A try at an address
/// nobody listens on costs a refused connect.
const BACKOFF_MAX: Duration = Duration::from_millis(250);
/// While the owner cannot be reached its address is looked up again
/// (each lookup of the owner record is a request to the bucket), first
/// after this, then twice as long after each lookup, up to
/// [`LOCATE_MAX`]: a new owner that took over is found as soon as before,
/// and a long outage costs the bucket one request per 2 s per mount, not
/// one per try per thread.
const LOCATE_MIN: Duration = Duration::from_millis(50);
const LOCATE_MAX: Duration = Duration::from_secs(2);

/// [`RemoteOptions::locate`], shared by every thread of a mount: between
/// two lookups every caller gets the last answer.
struct Locator {
    locate: Locate,
    state: Mutex<Located>,
    /// Lookups made (for tests and status).
    lookups: AtomicU64,
}

struct Located {
    /// The last answer and when it was given.
    last: Option<(Option<String>, Instant)>,
    /// How long that answer stands.
    wait: Duration,
}

impl Locator {
    fn new(locate: Locate) -> Locator {
        Locator { locate, state: Mutex::new(Located { last: None, wait: LOCATE_MIN }), lookups: AtomicU64::new(0) }
    }

    /// The owner's address, or `None` when no owner is recorded.
    fn owner(&self) -> Option<String> {
        // Held across the lookup: threads that fail at once share one.
        let mut s = self.state.lock();
        if let Some((addr, at)) = s.last.as_ref() {
            if at.elapsed() < s.wait {
                return addr.clone();
            }
        }
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let found = (self.locate)();
        // Asked again: the owner is being looked for; wait longer next time.
        if s.last.is_some() {
            s.wait = (s.wait * 2).min(LOCATE_MAX);
        }
        s.last = Some((found.clone(), Instant::now()));
        found
    }

    /// The owner answers again: the next outage looks for it at once.
    fn answered(&self) {
        self.state.lock().wait = LOCATE_MIN;
    }
}

#[derive(Clone)]
pub struct RemoteOptions {
    pub branch: String,
    pub token: String,
    pub locate: Locate,
    /// `None`: wait for the owner for as long as it takes (a hard mount);
    /// `Some(t)`: an operation fails with EIO after `t` without an answer.
    pub timeout: Option<Duration>,
    /// The disk's segments as this node reads them (the bucket through
    /// its chunk cache, or the disk's folder): file bytes already there are
    /// read from them, not through the owner ([`crate::reads`]). `None`:
    /// every read goes to the owner.
    pub segments: Option<Arc<dyn arbor_engine::device::Device>>,
}

/// What went wrong with one attempt.
enum Failed {
    /// The owner could not be reached or the connection broke: try again.
    Transport(String),
    /// The owner does not know our session (it restarted, or dropped us).
    Session,
    /// The owner refused our token.
    Refused,
}

/// A file this mount holds open: how many times, and its birth time,
/// which tells it from a later file given the same inode number.
#[derive(Clone, Copy)]
struct OpenFile {
    count: u32,
    crtime: Timestamp,
}

struct UnsyncedWrite {
    seq: u64,
    crtime: Timestamp,
    at: Written,
    data: Bytes,
}

/// Writes acknowledged but not yet covered by an fsync.
#[derive(Default)]
struct Unsynced {
    writes: Vec<UnsyncedWrite>,
    bytes: u64,
    next_seq: u64,
    /// Files whose unsynced writes the owner lost: their next fsync fails.
    lost: HashSet<u64>,
    /// Files this mount had open that did not survive an owner restart:
    /// reads and writes through those open files fail with EIO (their
    /// inode number may name another file now) until the file is opened
    /// anew.
    gone: HashSet<u64>,
    /// Files a write in flight to failed at the owner, and its errno: the
    /// file's next write, fsync or close reports it.
    failed: HashMap<u64, i32>,
}

impl Unsynced {
    /// The number of the next write, in the order writes were made.
    fn next(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq - 1
    }

    fn push(&mut self, seq: u64, crtime: Timestamp, at: Written, data: Bytes) {
        self.bytes += data.len() as u64;
        self.writes.push(UnsyncedWrite { seq, crtime, at, data });
    }

    /// Forgets write `seq` (the owner refused it: nothing to resend).
    fn drop_seq(&mut self, seq: u64) {
        if let Some(i) = self.writes.iter().position(|w| w.seq == seq) {
            let w = self.writes.remove(i);
            self.bytes -= w.data.len() as u64;
        }
    }
}

/// A framed connection to the owner (see [`crate::frames`]) and its
/// buffers, reused from operation to operation.
struct Conn {
    stream: TcpStream,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
}

/// Idle connections to the owner at `addr`; a FUSE thread takes one for an
/// operation and puts it back after.
#[derive(Default)]
struct Pool {
    addr: Option<String>,
    idle: Vec<Conn>,
}

/// Idle connections kept (one per FUSE thread is what a mount needs).
const POOL_MAX: usize = 16;

/// Write connections ("lanes"); a file's writes always take the same one.
pub const WRITE_LANES: usize = 2;
/// Bytes of writes a lane has outstanding at most (sent, answer not read).
pub const IN_FLIGHT_MAX: usize = 8 << 20;

/// A write sent on a lane whose answer has not been read.
struct Sent {
    seq: u64,
    at: Written,
    data: Bytes,
}

/// Why a lane's writes in flight must be sent again.
enum Broken {
    /// The owner does not know our session any more.
    Session,
    /// The connection broke (or answered garbage).
    Connection,
}

/// A write connection and what is in flight on it.
#[derive(Default)]
struct Lane {
    conn: Option<Conn>,
    sent: std::collections::VecDeque<Sent>,
    bytes: usize,
}

struct Inner {
    opts: RemoteOptions,
    locator: Arc<Locator>,
    auth: HeaderValue,
    /// The connection the event poll uses (HTTP/2, long-polling).
    conn: tokio::sync::Mutex<Option<(String, SendRequest<Full<Bytes>>)>>,
    pool: Mutex<Pool>,
    session: Mutex<Option<SessionInfo>>,
    /// The owner's epoch when we last had a session.
    epoch: Mutex<Option<u64>>,
    /// Files this mount holds open.
    open: Mutex<HashMap<u64, OpenFile>>,
    unsynced: Mutex<Unsynced>,
    /// Writes in flight, by lane.
    lanes: [Mutex<Lane>; WRITE_LANES],
    /// Held while a new session is set up (writes are resent under it).
    opening: Mutex<()>,
    retries: AtomicU64,
    sessions: AtomicU64,
    /// Whether the current outage was already logged.
    outage: AtomicBool,
    direct: Option<DirectReads>,
    owner_reads: AtomicU64,
    owner_bytes: AtomicU64,
}

pub struct RemoteFiles {
    inner: Arc<Inner>,
    rt: tokio::runtime::Runtime,
    events: Mutex<Option<(tokio::sync::oneshot::Sender<()>, std::thread::JoinHandle<()>)>>,
}

/// What a client mount has seen of its owner.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemoteStats {
    pub owner: Option<String>,
    /// Attempts that failed and were tried again.
    pub retries: u64,
    /// Sessions opened (more than one: the owner restarted or dropped us).
    pub sessions: u64,
    pub open_files: usize,
    /// Reads this mount made from the disk's segments itself, and their bytes.
    pub direct_reads: u64,
    pub direct_bytes: u64,
    /// Reads the owner answered (bytes not in the bucket yet, or no segments here).
    pub owner_reads: u64,
    pub owner_bytes: u64,
    /// Locates asked of the owner.
    pub locates: u64,
    /// Lookups of the owner's address (the owner record in the bucket, or
    /// `--server`): one at the start, then during an outage after 50 ms,
    /// 100 ms, … up to one per 2 s, shared by every thread.
    pub owner_lookups: u64,
    /// Reads from the segments that failed and went to the owner.
    pub direct_failed: u64,
}

fn errno_error(errno: i32) -> Error {
    match errno {
        libc::ENOENT => Error::NotFound,
        _ => Error::Io(std::io::Error::from_raw_os_error(errno)),
    }
}

impl Inner {
    async fn sender(&self) -> std::result::Result<(String, SendRequest<Full<Bytes>>), Failed> {
        let mut conn = self.conn.lock().await;
        if let Some((addr, s)) = conn.as_ref() {
            if !s.is_closed() {
                return Ok((addr.clone(), s.clone()));
            }
        }
        let locator = self.locator.clone();
        let addr = tokio::task::spawn_blocking(move || locator.owner())
            .await
            .ok()
            .flatten()
            .ok_or_else(|| Failed::Transport("no owner is recorded for the branch".into()))?;
        let send = connect(&addr, CONNECT_TIMEOUT).await.map_err(|e| Failed::Transport(format!("{addr}: {e}")))?;
        *conn = Some((addr.clone(), send.clone()));
        Ok((addr, send))
    }

    /// An HTTP GET of `/v1/files/<branch><path_and_query>` (the event poll).
    async fn get(&self, path_and_query: &str) -> std::result::Result<Bytes, Failed> {
        let (addr, mut send) = self.sender().await?;
        let req = Request::builder()
            .method(Method::GET)
            .uri(format!("http://{addr}/v1/files/{}{path_and_query}", self.opts.branch))
            .header(AUTHORIZATION, self.auth.clone())
            .body(Full::new(Bytes::new()))
            .map_err(|e| Failed::Transport(e.to_string()))?;
        let broke = |e: String| Failed::Transport(format!("{addr}: {e}"));
        let resp = match send.send_request(req).await {
            Ok(r) => r,
            Err(e) => {
                *self.conn.lock().await = None;
                return Err(broke(e.to_string()));
            }
        };
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| broke(e.to_string()))?.to_bytes();
        match status {
            StatusCode::OK => Ok(body),
            StatusCode::CONFLICT => Err(Failed::Session),
            StatusCode::UNAUTHORIZED => Err(Failed::Refused),
            s => {
                // 404: the branch is not (or no longer) served there; the
                // owner's record may name another process soon.
                *self.conn.lock().await = None;
                Err(broke(format!("{s} {}", String::from_utf8_lossy(&body).trim())))
            }
        }
    }

    /// A connection to the owner: an idle one, or a new one to the owner
    /// the pool knows, or to the owner found again.
    fn take_conn(&self) -> std::result::Result<(String, Conn), Failed> {
        let known = {
            let mut pool = self.pool.lock();
            if let (Some(addr), Some(c)) = (pool.addr.clone(), pool.idle.pop()) {
                return Ok((addr, c));
            }
            pool.addr.clone()
        };
        let addr = match known {
            Some(a) => a,
            None => {
                self.locator.owner().ok_or_else(|| Failed::Transport("no owner is recorded for the branch".into()))?
            }
        };
        // An owner that no longer answers at the address we knew is looked
        // for again next time (the write lanes may hold every connection we
        // had to it, so no broken one in the pool says so).
        let conn = self.dial(&addr).inspect_err(|_| self.forget_owner())?;
        self.pool.lock().addr = Some(addr.clone());
        Ok((addr, conn))
    }

    /// A new framed connection to `addr`, past the hello.
    fn dial(&self, addr: &str) -> std::result::Result<Conn, Failed> {
        use crate::frames::{read_frame, write_frame, Hello, Welcome, MAGIC, VERSION};
        use std::io::Write;
        let broke = |e: std::io::Error| Failed::Transport(format!("{addr}: {e}"));
        let stream = crate::frames::dial(addr, CONNECT_TIMEOUT).map_err(broke)?;
        stream.set_read_timeout(self.opts.timeout.or(Some(CONNECT_TIMEOUT))).map_err(broke)?;
        let mut c = Conn { stream, rbuf: Vec::new(), wbuf: Vec::new() };
        let hello =
            Hello { version: VERSION, token: self.opts.token.as_bytes().to_vec(), branch: self.opts.branch.clone() };
        c.stream.write_all(&MAGIC).map_err(broke)?;
        write_frame(&mut c.stream, &mut c.wbuf, &hello).map_err(broke)?;
        match read_frame::<Welcome>(&mut c.stream, &mut c.rbuf).map_err(broke)? {
            Welcome::Ok => {}
            Welcome::Refused => return Err(Failed::Refused),
            Welcome::NoBranch => {
                // The owner's record may name another process soon.
                self.forget_owner();
                return Err(Failed::Transport(format!("{addr}: the branch is not served there")));
            }
            Welcome::Version(v) => {
                return Err(Failed::Transport(format!("{addr}: the owner speaks protocol version {v}")))
            }
        }
        c.stream.set_read_timeout(self.opts.timeout).map_err(broke)?;
        Ok(c)
    }

    /// Drops every idle connection and the owner's address: the next
    /// operation looks for the owner again.
    fn forget_owner(&self) {
        let mut pool = self.pool.lock();
        pool.addr = None;
        pool.idle.clear();
    }

    /// One request and its answer, on a connection of the pool.
    fn exchange(&self, req: &crate::frames::Request) -> std::result::Result<crate::frames::Answer, Failed> {
        use crate::frames::{read_answer, write_request, Request};
        let (addr, mut c) = self.take_conn()?;
        // A lock wait may take as long as the holder keeps the lock.
        let waits = matches!(req, Request::Op { op: Op::SetLk { wait: true, .. }, .. });
        let result = (|| {
            if waits {
                c.stream.set_read_timeout(None)?;
            }
            write_request(&mut c.stream, &mut c.wbuf, req)?;
            let a = read_answer(&mut c.stream, &mut c.rbuf)?;
            if waits {
                c.stream.set_read_timeout(self.opts.timeout)?;
            }
            Ok::<_, std::io::Error>(a)
        })();
        match result {
            Ok(a) => {
                let mut pool = self.pool.lock();
                if pool.addr.as_deref() == Some(addr.as_str()) && pool.idle.len() < POOL_MAX {
                    pool.idle.push(c);
                }
                Ok(a)
            }
            Err(e) => {
                self.forget_owner();
                Err(Failed::Transport(format!("{addr}: {e}")))
            }
        }
    }

    /// Our session, opened (and our open files opened again, our unsynced
    /// writes sent again if the owner restarted) if there is none.
    fn session(&self) -> std::result::Result<SessionInfo, Failed> {
        if let Some(s) = *self.session.lock() {
            return Ok(s);
        }
        let _one = self.opening.lock();
        if let Some(s) = *self.session.lock() {
            return Ok(s);
        }
        let info = match self.exchange(&crate::frames::Request::Session)? {
            crate::frames::Answer::Session(info) => info,
            _ => return Err(Failed::Transport("a garbled session answer".into())),
        };
        let restarted = self.epoch.lock().is_some_and(|e| e != info.epoch);
        if let Some(d) = &self.direct {
            d.forget_all();
        }
        if restarted {
            tracing::warn!("the owner restarted; sending again the writes it had not made durable");
            self.resend(info.session)?;
        }
        let reopen: Vec<(u64, OpenFile)> = self.open.lock().iter().map(|(&i, &f)| (i, f)).collect();
        for (ino, f) in reopen {
            let r = self.send(info.session, &Op::Open { ino, count: f.count })?;
            match r {
                Ok(Out::Attr(a)) if a.crtime == f.crtime => {}
                Ok(_) => {
                    // Another file got the number: ours is gone.
                    let _ = self.send(info.session, &Op::Release { ino })?;
                    self.lose(ino);
                }
                Err(errno) => {
                    tracing::warn!(ino, errno, "a file this mount had open is gone on the owner");
                    self.lose(ino);
                }
            }
        }
        if self.sessions.fetch_add(1, Ordering::Relaxed) > 0 {
            tracing::info!(session = format!("{:016x}", info.session), "a new session with the owner");
        }
        *self.epoch.lock() = Some(info.epoch);
        *self.session.lock() = Some(info);
        Ok(info)
    }

    /// One operation under `session`, not retried.
    fn send(&self, session: u64, op: &Op) -> std::result::Result<Reply, Failed> {
        // The request owns its operation; the caller keeps its own.
        let req = crate::frames::Request::Op { session, op: op.clone() };
        match self.exchange(&req)? {
            crate::frames::Answer::Reply(r) => Ok(r),
            crate::frames::Answer::UnknownSession => Err(Failed::Session),
            crate::frames::Answer::Session(_) => Err(Failed::Transport("a garbled reply".into())),
        }
    }

    /// Forgets open file `ino`: the owner no longer has it.
    fn lose(&self, ino: u64) {
        self.open.lock().remove(&ino);
        let mut u = self.unsynced.lock();
        u.lost.insert(ino);
        u.gone.insert(ino);
        u.writes.retain(|w| w.at.ino != ino);
        u.bytes = u.writes.iter().map(|w| w.data.len() as u64).sum();
    }

    /// Sends the unsynced writes again, in order, to files that are still
    /// the same files.
    fn resend(&self, session: u64) -> std::result::Result<(), Failed> {
        let writes: Vec<(Timestamp, Written, Bytes)> =
            self.unsynced.lock().writes.iter().map(|w| (w.crtime, w.at, w.data.clone())).collect();
        let mut same: HashMap<u64, bool> = HashMap::new();
        for (crtime, at, data) in writes {
            let ino = at.ino;
            if let std::collections::hash_map::Entry::Vacant(e) = same.entry(ino) {
                let now = self.send(session, &Op::GetAttr { ino })?;
                e.insert(matches!(now, Ok(Out::Attr(a)) if a.crtime == crtime));
            }
            if !same[&ino] {
                continue;
            }
            if let Err(errno) = self.send(session, &at.op(data.to_vec()))? {
                tracing::warn!(ino, errno, "a write could not be sent again");
                same.insert(ino, false);
            }
        }
        for (ino, ok) in same {
            if !ok {
                tracing::warn!(ino, "a file's unsynced writes were lost with the owner");
                self.lose(ino);
            }
        }
        Ok(())
    }

    /// Sends `op` until the owner answers it (or the timeout passes), once
    /// every write in flight has been answered.
    fn call(&self, op: Op) -> Result<Out> {
        self.settle_all();
        self.call_raw(op)
    }

    /// [`Inner::call`] without waiting for the writes in flight.
    fn call_raw(&self, op: Op) -> Result<Out> {
        self.call_back(op).0
    }

    /// [`Inner::call_raw`], giving the operation back (a write keeps its buffer).
    fn call_back(&self, op: Op) -> (Result<Out>, Op) {
        let mut req = crate::frames::Request::Op { session: 0, op };
        let out = self.call_req(&mut req);
        match req {
            crate::frames::Request::Op { op, .. } => (out, op),
            crate::frames::Request::Session => (out, Op::StatFs),
        }
    }

    fn call_req(&self, req: &mut crate::frames::Request) -> Result<Out> {
        let started = Instant::now();
        let mut backoff = BACKOFF_MIN;
        loop {
            let attempt = self.session().and_then(|s| {
                if let crate::frames::Request::Op { session, op } = req {
                    *session = s.session;
                    // A new session may have found the file gone: its
                    // number may name another file now.
                    if let Op::Write { ino, .. } = op {
                        if self.unsynced.lock().gone.contains(ino) {
                            return Ok(crate::frames::Answer::Reply(Err(libc::EIO)));
                        }
                    }
                }
                self.exchange(req)
            });
            match attempt {
                Ok(crate::frames::Answer::Reply(reply)) => {
                    if self.outage.swap(false, Ordering::Relaxed) {
                        self.locator.answered();
                        tracing::info!("the owner answers again");
                    }
                    return reply.map_err(errno_error);
                }
                Ok(crate::frames::Answer::UnknownSession) => {
                    *self.session.lock() = None;
                }
                Ok(crate::frames::Answer::Session(_)) => return Err(errno_error(libc::EPROTO)),
                Err(Failed::Refused) => {
                    tracing::warn!("the owner refused our token (check --token-file)");
                    return Err(errno_error(libc::EACCES));
                }
                Err(Failed::Session) => {
                    *self.session.lock() = None;
                }
                Err(Failed::Transport(e)) => {
                    if !self.outage.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "the owner cannot be reached; retrying");
                    }
                }
            }
            self.retries.fetch_add(1, Ordering::Relaxed);
            if self.opts.timeout.is_some_and(|t| started.elapsed() >= t) {
                return Err(errno_error(libc::EIO));
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// Sends a write on its lane without waiting for the answer: `false`
    /// if it could not be sent (the caller writes it the retrying way).
    /// The data is copied for resending while the owner works on it.
    fn send_write(&self, at: Written, data: &[u8]) -> bool {
        let ino = at.ino;
        let mut lane = self.lanes[ino as usize % WRITE_LANES].lock();
        while !lane.sent.is_empty() && (lane.conn.is_none() || lane.bytes + data.len() > IN_FLIGHT_MAX) {
            self.settle_one(&mut lane);
        }
        let sent = self.session().ok().and_then(|session| {
            if lane.conn.is_none() {
                lane.conn = Some(self.take_conn().ok()?.1);
            }
            let c = lane.conn.as_mut()?;
            crate::frames::write_data(&mut c.stream, &mut c.wbuf, session.session, at, data).ok()
        });
        if sent.is_none() {
            // Part of it may have gone. The lane's earlier writes are sent
            // again, and the caller sends this one the retrying way after
            // them, so the owner sees them in order.
            if lane.conn.take().is_some() {
                self.forget_owner();
            }
            self.settle_lane(&mut lane);
            return false;
        }
        let data = Bytes::copy_from_slice(data);
        let crtime = self.open.lock().get(&ino).map(|f| f.crtime);
        let seq = {
            let mut u = self.unsynced.lock();
            let seq = u.next();
            if let Some(crtime) = crtime {
                u.push(seq, crtime, at, data.clone());
            }
            seq
        };
        lane.bytes += data.len();
        lane.sent.push_back(Sent { seq, at, data });
        true
    }

    /// Reads the answers to every write in flight on every lane.
    fn settle_all(&self) {
        for lane in &self.lanes {
            let mut lane = lane.lock();
            if !lane.sent.is_empty() {
                self.settle_lane(&mut lane);
            }
        }
    }

    /// Reads the answers to the writes in flight on `ino`'s lane while the
    /// owner answers; writes a broken connection carried stay in flight,
    /// for the next operation to send again. A `close` waits this way: it
    /// must not wait out an owner's absence, because a process that starts
    /// the next owner closes descriptors it inherited (every exec does) and
    /// would wait for itself.
    fn settle_reachable(&self, ino: u64) {
        let lane = &self.lanes[ino as usize % WRITE_LANES];
        // Bounded by the lane's holder: it sends or reads a few MiB, or is
        // retrying, which marks an outage.
        let mut lane = loop {
            if let Some(l) = lane.try_lock_for(Duration::from_millis(20)) {
                break l;
            }
            if self.outage.load(Ordering::Relaxed) {
                // Its holder is waiting for the owner.
                return;
            }
        };
        // Each turn answers one write or stops.
        while !lane.sent.is_empty() {
            if self.read_one(&mut lane).is_err() {
                lane.conn = None;
                return;
            }
        }
    }

    /// Reads the answers to every write in flight on `lane`.
    fn settle_lane(&self, lane: &mut Lane) {
        // Each turn answers one write or empties the lane.
        while !lane.sent.is_empty() {
            self.settle_one(lane);
        }
    }

    /// Reads the answer to the oldest write in flight on `lane`; if the
    /// connection broke, sends every write in flight again instead.
    fn settle_one(&self, lane: &mut Lane) {
        if let Err(broken) = self.read_one(lane) {
            lane.conn = None;
            match broken {
                Broken::Session => *self.session.lock() = None,
                Broken::Connection => self.forget_owner(),
            }
            self.resend_lane(lane);
        }
    }

    /// Reads the owner's answer to the oldest write in flight on `lane`.
    fn read_one(&self, lane: &mut Lane) -> std::result::Result<(), Broken> {
        use crate::frames::{read_answer, Answer};
        let Some(front) = lane.sent.front() else { return Ok(()) };
        let (seq, ino, len) = (front.seq, front.at.ino, front.data.len());
        let c = lane.conn.as_mut().ok_or(Broken::Connection)?;
        match read_answer(&mut c.stream, &mut c.rbuf) {
            Ok(Answer::Reply(reply)) => {
                lane.sent.pop_front();
                lane.bytes -= len;
                self.written(seq, ino, len, reply);
                Ok(())
            }
            Ok(Answer::UnknownSession) => Err(Broken::Session),
            Ok(Answer::Session(_)) | Err(_) => Err(Broken::Connection),
        }
    }

    /// The owner's answer to write `seq` of `len` bytes to `ino`.
    fn written(&self, seq: u64, ino: u64, len: usize, reply: Reply) {
        let errno = match reply {
            Ok(Out::Written(n)) if n as usize == len => return,
            // The volume writes all or nothing; anything else is a fault.
            Ok(_) => libc::EIO,
            Err(errno) => errno,
        };
        tracing::debug!(ino, errno, "the owner refused a write in flight");
        let mut u = self.unsynced.lock();
        u.drop_seq(seq);
        u.failed.entry(ino).or_insert(errno);
    }

    /// Sends `lane`'s writes in flight again, in order, the retrying way
    /// (their connection broke: the owner may or may not have them).
    fn resend_lane(&self, lane: &mut Lane) {
        while let Some(w) = lane.sent.pop_front() {
            lane.bytes -= w.data.len();
            if self.unsynced.lock().gone.contains(&w.at.ino) {
                // The owner restarted without this file: it is lost, and
                // the number may name another file now.
                continue;
            }
            let len = w.data.len();
            let reply = self.call_raw(w.at.op(w.data.to_vec())).map_err(|e| e.errno());
            self.written(w.seq, w.at.ino, len, reply);
        }
    }

    /// The error a write in flight to `ino` met, once.
    fn take_failed(&self, ino: u64) -> Result<()> {
        match self.unsynced.lock().failed.remove(&ino) {
            Some(errno) => Err(errno_error(errno)),
            None => Ok(()),
        }
    }

    /// One poll for what other nodes changed since `after`.
    async fn poll(&self, after: u64) -> std::result::Result<(SessionInfo, Events), Failed> {
        let s = self.session()?;
        let after = if after == 0 { s.seq } else { after };
        let q = format!("/events?session={:016x}&after={after}", s.session);
        let body = self.get(&q).await?;
        let ev = decode_value(&body, "events").map_err(|_| Failed::Transport("garbled events".into()))?;
        Ok((s, ev))
    }
}

impl RemoteFiles {
    /// A client of `opts.branch`'s owner; it checks at once that the owner
    /// answers and takes the token, so a mount fails with a clear message
    /// instead of hanging.
    pub fn connect(opts: RemoteOptions) -> std::result::Result<RemoteFiles, crate::Error> {
        let auth = crate::bearer(&opts.token)?;
        let rt = crate::client_runtime("arbor-remote")?;
        let direct = opts.segments.clone().map(DirectReads::new);
        let inner = Arc::new(Inner {
            direct,
            locator: Arc::new(Locator::new(opts.locate.clone())),
            opts,
            auth,
            conn: tokio::sync::Mutex::new(None),
            pool: Mutex::new(Pool::default()),
            session: Mutex::new(None),
            epoch: Mutex::new(None),
            open: Mutex::new(HashMap::new()),
            unsynced: Mutex::new(Unsynced::default()),
            lanes: Default::default(),
            opening: Mutex::new(()),
            retries: AtomicU64::new(0),
            sessions: AtomicU64::new(0),
            outage: AtomicBool::new(false),
            owner_reads: AtomicU64::new(0),
            owner_bytes: AtomicU64::new(0),
        });
        let first = inner.session();
        match first {
            Ok(_) => {}
            Err(Failed::Refused) => {
                return Err(crate::Error::Config("the owner refused our token (check --token-file)".into()))
            }
            Err(Failed::Session) => return Err(crate::Error::Config("the owner refused a session".into())),
            Err(Failed::Transport(e)) => {
                return Err(crate::Error::Config(format!("cannot reach the owner of the branch: {e}")))
            }
        }
        Ok(RemoteFiles { inner, rt, events: Mutex::new(None) })
    }

    fn call(&self, op: Op) -> Result<Out> {
        self.inner.call(op)
    }

    pub fn stats(&self) -> RemoteStats {
        let owner = self.inner.pool.lock().addr.clone();
        RemoteStats {
            owner,
            retries: self.inner.retries.load(Ordering::Relaxed),
            owner_lookups: self.inner.locator.lookups.load(Ordering::Relaxed),
            sessions: self.inner.sessions.load(Ordering::Relaxed),
            open_files: self.inner.open.lock().len(),
            direct_reads: self.inner.direct.as_ref().map_or(0, |d| d.counters.direct_reads.load(Ordering::Relaxed)),
            direct_bytes: self.inner.direct.as_ref().map_or(0, |d| d.counters.direct_bytes.load(Ordering::Relaxed)),
            owner_reads: self.inner.owner_reads.load(Ordering::Relaxed),
            owner_bytes: self.inner.owner_bytes.load(Ordering::Relaxed),
            locates: self.inner.direct.as_ref().map_or(0, |d| d.counters.locates.load(Ordering::Relaxed)),
            direct_failed: self.inner.direct.as_ref().map_or(0, |d| d.counters.failed.load(Ordering::Relaxed)),
        }
    }

    /// Polls the owner for what other nodes change and drops it from the
    /// kernel's caches through `notifier`, until [`RemoteFiles::close`].
    /// The poll also tells the owner this mount is alive.
    pub fn follow(&self, notifier: fuser::Notifier) -> std::io::Result<()> {
        use std::os::unix::ffi::OsStrExt;
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let inner = self.inner.clone();
        let handle = self.rt.handle().clone();
        let t = std::thread::Builder::new().name("arbor-follow".into()).spawn(move || {
            handle.block_on(async move {
                let (mut session, mut after) = (0u64, 0u64);
                let mut backoff = BACKOFF_MIN;
                loop {
                    let polled = tokio::select! {
                        _ = &mut stop_rx => return,
                        p = inner.poll(after) => p,
                    };
                    match polled {
                        Ok((s, ev)) => {
                            if backoff != BACKOFF_MIN {
                                inner.locator.answered();
                            }
                            backoff = BACKOFF_MIN;
                            if s.session != session {
                                session = s.session;
                            }
                            if ev.gap {
                                tracing::debug!(
                                    "missed some changes of other nodes; the kernel's short timeouts cover them"
                                );
                            }
                            after = ev.next;
                            for e in ev.items {
                                // ENOENT: the kernel does not hold that inode or name.
                                let _ = match e {
                                    Event::Inode(ino) => {
                                        if let Some(d) = &inner.direct {
                                            d.forget(ino);
                                        }
                                        notifier.inval_inode(fuser::INodeNo(ino), 0, 0)
                                    }
                                    Event::Entry(parent, name) => {
                                        notifier.inval_entry(fuser::INodeNo(parent), std::ffi::OsStr::from_bytes(&name))
                                    }
                                };
                            }
                        }
                        Err(Failed::Session) => {
                            *inner.session.lock() = None;
                            after = 0;
                        }
                        Err(_) => {
                            after = 0;
                            tokio::select! {
                                _ = &mut stop_rx => return,
                                _ = tokio::time::sleep(backoff) => {}
                            }
                            backoff = (backoff * 2).min(BACKOFF_MAX);
                        }
                    }
                }
            })
        })?;
        *self.events.lock() = Some((stop_tx, t));
        Ok(())
    }

    /// Forgets where `ino`'s bytes were: it changes, or is opened anew.
    fn forget(&self, ino: u64) {
        if let Some(d) = &self.inner.direct {
            d.forget(ino);
        }
    }

    /// Notes an open of `a`'s file (a file with that number that was lost
    /// before is another file now). Close-to-open: its bytes are located
    /// anew.
    fn opened(&self, a: &Attr) {
        self.forget(a.ino);
        {
            let mut u = self.inner.unsynced.lock();
            u.lost.remove(&a.ino);
            if u.gone.remove(&a.ino) {
                // Another file with the lost one's number.
                u.failed.remove(&a.ino);
            }
        }
        let mut open = self.inner.open.lock();
        let f = open.entry(a.ino).or_insert(OpenFile { count: 0, crtime: a.crtime });
        f.count += 1;
        f.crtime = a.crtime;
    }

    /// Commits the branch at the owner: its current commit.
    pub fn commit(&self) -> Result<arbor_engine::format::Addr> {
        match self.call(Op::Commit)? {
            Out::Commit { writer, seq, off, len } => {
                Ok(arbor_engine::format::Addr { seg: arbor_engine::format::SegId { writer, seq }, off, len })
            }
            _ => Err(errno_error(libc::EPROTO)),
        }
    }

    /// Has the owner freeze the branch as checkpoint `name`: its
    /// description (JSON), or why it was refused.
    pub fn checkpoint(&self, name: &str) -> std::result::Result<String, String> {
        match self.call(Op::Checkpoint { name: name.into() }) {
            Ok(Out::Message(m)) => m,
            Ok(_) => Err("a garbled answer from the owner".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// EIO for a file that did not survive an owner restart.
    fn check_alive(&self, ino: u64) -> Result<()> {
        if self.inner.unsynced.lock().gone.contains(&ino) {
            return Err(errno_error(libc::EIO));
        }
        Ok(())
    }

    /// A write, in flight on its lane where it can be (see "Writes in
    /// flight" above).
    fn write_as(&self, at: Written, data: &[u8]) -> Result<usize> {
        let Written { ino, off, .. } = at;
        self.check_alive(ino)?;
        self.forget(ino);
        self.inner.take_failed(ino)?;
        if off.checked_add(data.len() as u64).is_none_or(|end| end > arbor_engine::volume::MAX_FILE_SIZE) {
            // The one refusal that depends on the request alone is given at
            // once, as a local mount gives it.
            return Err(Error::TooBig);
        }
        if !data.is_empty() && self.inner.send_write(at, data) {
            if self.inner.unsynced.lock().bytes > UNSYNCED_MAX {
                Files::fsync(self, ino)?;
            }
            return Ok(data.len());
        }
        let (out, op) = self.inner.call_back(at.op(data.to_vec()));
        let n = match out? {
            Out::Written(n) => (n as usize).min(data.len()),
            _ => return Err(errno_error(libc::EPROTO)),
        };
        let crtime = self.inner.open.lock().get(&ino).map(|f| f.crtime);
        let over = match (crtime, op) {
            (Some(crtime), Op::Write { mut data, .. }) => {
                // The operation's own buffer is kept for resending: no copy.
                data.truncate(n);
                let mut u = self.inner.unsynced.lock();
                let seq = u.next();
                u.push(seq, crtime, at, Bytes::from(data));
                u.bytes > UNSYNCED_MAX
            }
            // Written through no open file of ours (the kernel always
            // writes through one): nothing to resend it from.
            _ => false,
        };
        if over {
            Files::fsync(self, ino)?;
        }
        Ok(n)
    }

    /// Bytes written but not yet made durable by an fsync.
    pub fn unsynced_bytes(&self) -> u64 {
        self.inner.unsynced.lock().bytes
    }
}

fn attr(r: Result<Out>) -> Result<Attr> {
    match r? {
        Out::Attr(a) => Ok(a),
        _ => Err(errno_error(libc::EPROTO)),
    }
}

fn unit(r: Result<Out>) -> Result<()> {
    match r? {
        Out::Unit => Ok(()),
        _ => Err(errno_error(libc::EPROTO)),
    }
}

fn bytes(r: Result<Out>) -> Result<Vec<u8>> {
    match r? {
        Out::Bytes(b) => Ok(b),
        _ => Err(errno_error(libc::EPROTO)),
    }
}

impl Files for RemoteFiles {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        attr(self.call(Op::Lookup { parent, name: name.to_vec() }))
    }
    fn getattr(&self, ino: u64) -> Result<Attr> {
        attr(self.call(Op::GetAttr { ino }))
    }
    fn setattr(&self, ino: u64, change: SetAttr) -> Result<Attr> {
        self.forget(ino);
        attr(self.call(Op::SetAttr { ino, change }))
    }
    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        bytes(self.call(Op::ReadLink { ino }))
    }
    fn create(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32, rdev: u32) -> Result<Attr> {
        attr(self.call(Op::Create { parent, name: name.to_vec(), mode, uid, gid, rdev }))
    }
    fn create_open(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        let a = attr(self.call(Op::CreateOpen { parent, name: name.to_vec(), mode, uid, gid }))?;
        self.opened(&a);
        Ok(a)
    }
    fn mkdir(&self, parent: u64, name: &[u8], perm: u16, uid: u32, gid: u32) -> Result<Attr> {
        attr(self.call(Op::Mkdir { parent, name: name.to_vec(), perm, uid, gid }))
    }
    fn symlink(&self, parent: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<Attr> {
        attr(self.call(Op::Symlink { parent, name: name.to_vec(), target: target.to_vec(), uid, gid }))
    }
    fn link(&self, ino: u64, new_parent: u64, new_name: &[u8]) -> Result<Attr> {
        attr(self.call(Op::Link { ino, new_parent, new_name: new_name.to_vec() }))
    }
    fn unlink(&self, parent: u64, name: &[u8]) -> Result<()> {
        unit(self.call(Op::Unlink { parent, name: name.to_vec() }))
    }
    fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()> {
        unit(self.call(Op::Rmdir { parent, name: name.to_vec() }))
    }
    fn rename(&self, parent: u64, name: &[u8], new_parent: u64, new_name: &[u8], mode: RenameMode) -> Result<()> {
        unit(self.call(Op::Rename { parent, name: name.to_vec(), new_parent, new_name: new_name.to_vec(), mode }))
    }
    fn open(&self, ino: u64) -> Result<Attr> {
        let a = attr(self.call(Op::Open { ino, count: 1 }))?;
        self.opened(&a);
        Ok(a)
    }
    fn release(&self, ino: u64) -> Result<()> {
        {
            let mut open = self.inner.open.lock();
            match open.get_mut(&ino) {
                Some(f) if f.count > 1 => f.count -= 1,
                _ => {
                    open.remove(&ino);
                }
            }
        }
        unit(self.call(Op::Release { ino }))
    }
    fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        // Bounded like a FUSE read; a larger one is a short read.
        let mut buf = vec![0u8; len.min(u32::MAX as usize)];
        let n = self.read_into(ino, off, &mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }
    fn read_into(&self, ino: u64, off: u64, buf: &mut [u8]) -> Result<usize> {
        self.check_alive(ino)?;
        if let Some(d) = &self.inner.direct {
            let locate = |ino, off, len| match self.call(Op::Locate { ino, off, len })? {
                Out::Located(l) => Ok(l),
                _ => Err(errno_error(libc::EPROTO)),
            };
            match d.read_into(ino, off, buf, locate) {
                Ok(Some(n)) => return Ok(n),
                Ok(None) => {}
                Err(crate::reads::Failed::Owner(e)) => return Err(e),
                Err(crate::reads::Failed::Here(e)) => {
                    d.forget(ino);
                    d.counters.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(ino, off, error = %e, "a read from the segments failed; the owner reads it");
                }
            }
        }
        let len = buf.len().min(u32::MAX as usize) as u32;
        let b = bytes(self.call(Op::Read { ino, off, len }))?;
        self.inner.owner_reads.fetch_add(1, Ordering::Relaxed);
        self.inner.owner_bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
        let n = b.len().min(buf.len());
        buf[..n].copy_from_slice(&b[..n]);
        Ok(n)
    }
    fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<usize> {
        self.write_as(Written { ino, off, unprivileged: false }, data)
    }
    /// One request: the owner clears the file's privileges as it applies
    /// the write, answered later like any write. The kernel's cached mode
    /// is dropped whatever it was (the answer comes later).
    fn write_unprivileged(&self, ino: u64, off: u64, data: &[u8]) -> Result<(usize, bool)> {
        Ok((self.write_as(Written { ino, off, unprivileged: true }, data)?, true))
    }
    fn fsync(&self, ino: u64) -> Result<()> {
        let upto = self.inner.unsynced.lock().next_seq;
        unit(self.call(Op::Fsync { ino }))?;
        // The owner's fsync covers its whole log: every write acknowledged
        // before it is durable now.
        let mut u = self.inner.unsynced.lock();
        u.writes.retain(|w| w.seq >= upto);
        u.bytes = u.writes.iter().map(|w| w.data.len() as u64).sum();
        let failed = u.failed.remove(&ino);
        if u.lost.remove(&ino) {
            return Err(errno_error(libc::EIO));
        }
        match failed {
            Some(errno) => Err(errno_error(errno)),
            None => Ok(()),
        }
    }
    fn flush(&self, ino: u64) -> Result<()> {
        // Close-to-open: what was written is at the owner before close
        // returns, and a write it refused is reported here.
        self.inner.settle_reachable(ino);
        self.inner.take_failed(ino)
    }
    fn readdir(&self, ino: u64, mut offset: u64, f: &mut dyn FnMut(DirEntryOut) -> bool) -> Result<()> {
        // Bounded by the directory: each batch moves the offset forward.
        loop {
            let Out::Entries(batch) = self.call(Op::ReadDir { ino, offset, max: READDIR_BATCH })? else {
                return Err(errno_error(libc::EPROTO));
            };
            let full = batch.len() as u32 >= READDIR_BATCH;
            for e in batch {
                offset = e.offset;
                if !f(e) {
                    return Ok(());
                }
            }
            if !full {
                return Ok(());
            }
        }
    }
    fn statfs(&self) -> Result<StatFs> {
        match self.call(Op::StatFs)? {
            Out::StatFs(s) => Ok(s),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }
    fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: XattrFlags) -> Result<()> {
        unit(self.call(Op::SetXattr { ino, name: name.to_vec(), value: value.to_vec(), flags }))
    }
    fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        bytes(self.call(Op::GetXattr { ino, name: name.to_vec() }))
    }
    fn listxattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        match self.call(Op::ListXattr { ino })? {
            Out::Names(n) => Ok(n),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }
    fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()> {
        unit(self.call(Op::RemoveXattr { ino, name: name.to_vec() }))
    }
    /// Delivers the writes in flight and stops following the owner. The
    /// owner commits.
    fn close(&self) -> Result<()> {
        self.inner.settle_all();
        if let Some((stop, t)) = self.events.lock().take() {
            let _ = stop.send(());
            let _ = t.join();
        }
        if let Some(d) = &self.inner.direct {
            d.close();
        }
        Ok(())
    }
    fn is_read_only(&self) -> bool {
        false
    }
    fn is_shared(&self) -> bool {
        true
    }
    fn getlk(&self, ino: u64, owner: u64, lock: Lock) -> Result<Option<Lock>> {
        match self.call(Op::GetLk { ino, owner, lock })? {
            Out::Lock(l) => Ok(l),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }
    fn setlk(&self, ino: u64, owner: u64, lock: Lock, wait: bool) -> Result<()> {
        unit(self.call(Op::SetLk { ino, owner, lock, wait }))
    }
    fn unlock_all(&self, ino: u64, owner: u64) -> Result<()> {
        unit(self.call(Op::UnlockAll { ino, owner }))
    }
}

impl Drop for RemoteFiles {
    fn drop(&mut self) {
        let _ = Files::close(self);
    }
}
