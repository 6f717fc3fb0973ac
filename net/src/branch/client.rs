//! Shared branches: the client's side. A mount of a branch another process
//! owns serves the kernel through [`BranchClient`]: every operation is sent
//! to the owner (see [`crate::branch::owner`]) and its answer, errno included,
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
//! # Requests, at most once, and what the owner lost
//!
//! Every request that changes the branch carries a tag (this mount's
//! client id, a slot, the slot's sequence), kept when it is sent again, so
//! the owner applies it at most once ([`crate::branch::requests`]). An owner
//! killed with -9 loses what it had not made durable, and a client's later
//! `fsync` must not report those changes durable; nor may a client send
//! them again, because another client may have changed the same file
//! since. So a client keeps the tags of the requests the owner answered
//! until an `fsync` (the owner's, which covers its whole log) returns, and
//! when the owner comes back with a new epoch it asks which of them the
//! branch includes: the rest were lost, and the next `fsync` says so with
//! EIO ([`crate::branch::journal`]). A clean restart loses nothing and sends
//! nothing again. A file is recognised by its inode number and birth time
//! (a file made anew after the restart may get the same number); a file
//! that did not survive the restart is lost too. At most
//! [`crate::branch::journal::JOURNAL_MAX`] requests are kept; past that the client
//! asks the owner for an `fsync` itself.
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
//! with their tags, through the ordinary retrying path before anything else
//! goes on it — to the same owner only; a new owner is asked instead
//! whether it has them.

use crate::branch::frames::Written;
use crate::branch::journal::{Journal, SlotTable, Who, JOURNAL_MAX};
use crate::branch::locks::{HeldLocks, IN_GRACE, MAX_LOCK_GRACE, RECLAIM_WINDOW};
use crate::branch::owner::{Event, Events, FileOp, Out, Reply, SessionInfo, MAX_OPEN_COUNT, MAX_READ, READDIR_BATCH};
use crate::branch::reads::DirectReads;
use crate::branch::requests::PIPELINED_SLOT;
use crate::wire::http::connect;
use crate::wire::stream::Stream;
use arbor_engine::clock::BootInstant;
use arbor_engine::env::Timestamp;
use arbor_engine::files::{Caller, Files, Invalidate, Lock};
use arbor_engine::format::decode_value;
use arbor_engine::volume::RequestTag;
use arbor_engine::volume::{Attr, DirEntryOut, RenameMode, SetAttr, StatFs, XattrFlags};
use arbor_engine::{Error, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper::header::{HeaderValue, AUTHORIZATION};
use hyper::{Method, Request, StatusCode};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Finds the owner's `HOST:PORT`: the address given on the command line,
/// or the owner record in the bucket, read again after every failure.
pub type Locate = Arc<dyn Fn() -> Option<String> + Send + Sync>;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Who the request this thread serves is for: its thread as FUSE names it
/// (its process is looked up only if a change of it is lost).
fn calling_process() -> Who {
    Who { process: 0, thread: arbor_engine::files::calling_pid() }
}

/// How often a hard mount waiting for an answer checks whether the branch
/// has a new owner (the one it waits for may be paused, or cut off, and
/// deposed).
const OWNER_CHECK: Duration = Duration::from_secs(10);
/// Unsynced bytes a client keeps for resending before it syncs on its own.
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

/// [`BranchClientOptions::locate`], shared by every thread of a mount: between
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
pub struct BranchClientOptions {
    pub branch: String,
    pub token: String,
    pub locate: Locate,
    /// `None`: wait for the owner for as long as it takes (a hard mount);
    /// `Some(t)`: an operation fails with EIO after `t` without an answer.
    pub timeout: Option<Duration>,
    /// The disk's segments as this node reads them (the bucket through
    /// its chunk cache, or the disk's folder): file bytes already there are
    /// read from them, not through the owner ([`crate::branch::reads`]). `None`:
    /// every read goes to the owner.
    pub segments: Option<Arc<dyn arbor_engine::device::Device>>,
    /// Speak TLS to the owner, trusting it this way (never clear text).
    pub tls: Option<crate::wire::tls::ClientTls>,
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

/// A framed connection to the owner (see [`crate::wire::frames`]) and its
/// buffers, reused from operation to operation.
struct Conn {
    stream: Stream,
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
/// At most this many writes in flight on a lane, well inside the replies
/// an owner keeps per lane (`requests::PIPELINED_WINDOW`).
pub const IN_FLIGHT_WRITES: usize = 1024;

/// A write sent on a lane whose answer has not been read.
struct Sent {
    tag: RequestTag,
    /// The owner's epoch it was sent to.
    epoch: u64,
    /// The session it was sent under: only under that session is it sent
    /// again (a new session, of the same owner or another, is asked
    /// instead whether it has it).
    session: u64,
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
    /// The owner address `conn` reaches.
    addr: String,
    sent: std::collections::VecDeque<Sent>,
    bytes: usize,
    /// The sequence of the lane's last request (its slot is pipelined).
    seq: u64,
    /// Which lane this is.
    idx: usize,
}

struct Inner {
    opts: BranchClientOptions,
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
    /// This mount's id in its requests' tags, random for each mount.
    client: u64,
    slots: SlotTable,
    journal: Mutex<Journal>,
    /// What the owner of this epoch had of each slot when we met it.
    floors: Mutex<(u64, HashMap<u32, u64>)>,
    /// The locks the owner granted this mount (see [`crate::branch::locks`]).
    locks: Mutex<HeldLocks>,
    /// When the newest request the owner answered under our session was
    /// sent, by this node's monotonic clock: whether we may reclaim our
    /// locks from a new owner.
    heard: Mutex<Option<BootInstant>>,
    /// Writes in flight, by lane.
    lanes: [Mutex<Lane>; WRITE_LANES],
    /// Each lane's newest sequence, readable while a lane's holder waits
    /// for the owner.
    lane_seqs: [AtomicU64; WRITE_LANES],
    /// A handle on each lane's connection, to hang it up while its holder
    /// waits for the owner (see [`Inner::abandon`]).
    lane_socks: [Mutex<Option<std::net::TcpStream>>; WRITE_LANES],
    /// Files whose close gave up on writes in flight (the owner did not
    /// answer them), with their lane's newest sequence then: those writes
    /// are never sent again (see [`Inner::abandon`]).
    abandoned: Mutex<HashMap<u64, u64>>,
    /// Held while a new session is set up (writes are resent under it).
    opening: Mutex<()>,
    retries: AtomicU64,
    sessions: AtomicU64,
    /// Whether the current outage was already logged.
    outage: AtomicBool,
    /// A new owner was met since the event thread last dropped what the
    /// kernel caches of this mount's open files.
    owner_changed: AtomicBool,
    direct: Option<DirectReads>,
    owner_reads: AtomicU64,
    owner_bytes: AtomicU64,
    /// Each write waits for the owner's answer (see
    /// [`BranchClient::write_synchronously`]).
    synchronous: AtomicBool,
}

/// How long a new client mount waits for an owner that does not answer
/// yet (starting, restarting) when it has no `--timeout`.
pub const OWNER_START_WAIT: Duration = Duration::from_secs(45);

pub struct BranchClient {
    inner: Arc<Inner>,
    rt: tokio::runtime::Runtime,
    events: Mutex<Option<(tokio::sync::oneshot::Sender<()>, std::thread::JoinHandle<()>)>>,
}

/// What a client mount has seen of its owner.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BranchClientStats {
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
        let send = connect(&addr, CONNECT_TIMEOUT, self.opts.tls.as_ref())
            .await
            .map_err(|e| Failed::Transport(format!("{addr}: {e}")))?;
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
        use crate::wire::frames::{read_welcome, write_hello, Hello, Welcome, MAGIC, VERSION};
        use std::io::Write;
        let broke = |e: std::io::Error| Failed::Transport(format!("{addr}: {e}"));
        let stream = Stream::dial(addr, CONNECT_TIMEOUT, self.opts.tls.as_ref()).map_err(broke)?;
        stream.tcp().set_read_timeout(self.opts.timeout.or(Some(CONNECT_TIMEOUT))).map_err(broke)?;
        let mut c = Conn { stream, rbuf: Vec::new(), wbuf: Vec::new() };
        let hello =
            Hello { version: VERSION, token: self.opts.token.as_bytes().to_vec(), branch: self.opts.branch.clone() };
        c.stream.write_all(&MAGIC).map_err(broke)?;
        write_hello(&mut c.stream, &mut c.wbuf, &hello).map_err(broke)?;
        match read_welcome(&mut c.stream, &mut c.rbuf).map_err(broke)? {
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
        c.stream.tcp().set_read_timeout(self.read_timeout()).map_err(broke)?;
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
    fn exchange(
        &self,
        req: &crate::branch::frames::Request,
    ) -> std::result::Result<crate::branch::frames::Answer, Failed> {
        use crate::branch::frames::{read_answer, write_request, Request};
        let (addr, mut c) = self.take_conn()?;
        // A lock wait may take as long as the holder keeps the lock.
        let waits = matches!(req, Request::Op { op: FileOp::SetLk { wait: true, .. }, .. });
        let result = (|| {
            if waits {
                c.stream.tcp().set_read_timeout(None)?;
            }
            write_request(&mut c.stream, &mut c.wbuf, req)?;
            if !waits && self.opts.timeout.is_none() {
                self.await_answer(&mut c, &addr)?;
            }
            let a = read_answer(&mut c.stream, &mut c.rbuf)?;
            if waits {
                c.stream.tcp().set_read_timeout(self.read_timeout())?;
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

    /// Waits, on a hard mount, for the first byte of an answer, checking
    /// every [`OWNER_CHECK`] whether another owner was recorded meanwhile;
    /// if so, this one is given up (the request is sent again to the new
    /// owner, which applies a tagged request at most once).
    fn await_answer(&self, c: &mut Conn, addr: &str) -> std::io::Result<()> {
        use std::io::ErrorKind::{TimedOut, WouldBlock};
        // Each turn ends with an answer, an error, or OWNER_CHECK spent.
        loop {
            match c.stream.wait_readable() {
                Ok(_) => break,
                Err(e) if matches!(e.kind(), TimedOut | WouldBlock) => {
                    if let Some(now) = (self.opts.locate)().filter(|now| now != addr) {
                        tracing::warn!(waited_on = addr, owner = %now, "the branch has a new owner; asking it instead");
                        return Err(std::io::Error::other("the owner was replaced while an answer was awaited"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// A connection's read timeout: the mount's `--timeout`, or, on a hard
    /// mount, [`OWNER_CHECK`], after which [`Inner::await_answer`] looks
    /// for a new owner and waits on.
    fn read_timeout(&self) -> Option<Duration> {
        self.opts.timeout.or(Some(OWNER_CHECK))
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
        // Before this exchange: when the old owner last answered us.
        let heard = *self.heard.lock();
        let had_session = self.epoch.lock().is_some();
        let info = match self.exchange(&crate::branch::frames::Request::Session)? {
            crate::branch::frames::Answer::Session(info) => info,
            _ => return Err(Failed::Transport("a garbled session answer".into())),
        };
        let restarted = self.epoch.lock().is_some_and(|e| e != info.epoch);
        if let Some(d) = &self.direct {
            d.forget_all();
        }
        if had_session {
            // A new owner, or the same one after our session expired: it is
            // asked which of our requests it has, and writes in flight under
            // the old session are never sent again (another node may have
            // written over them meanwhile).
            self.owner_changed.store(true, Ordering::Release);
            self.reconcile(info, restarted)?;
        } else {
            self.journal.lock().met(info.epoch);
        }
        // Locks first: a reclaim must reach the new owner within its grace
        // period, however many files there are to open again.
        if had_session {
            self.reclaim_locks(info, restarted, heard)?;
        } else {
            let mut l = self.locks.lock();
            l.epoch = info.epoch;
            l.session = info.session;
            l.generation = info.generation;
        }
        let reopen: Vec<(u64, OpenFile)> = self.open.lock().iter().map(|(&i, &f)| (i, f)).collect();
        for (ino, f) in reopen {
            match self.reopen(info.session, ino, f.count)? {
                Ok(Out::Attr(a)) if a.crtime == f.crtime => {}
                Ok(_) => {
                    // Another file got the number: ours is gone.
                    let _ = self.send(info.session, &FileOp::Release { ino })?;
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

    /// Opens `ino` `count` times under `session`, at most
    /// [`MAX_OPEN_COUNT`] a request: what the last request gave, or the
    /// first refusal.
    fn reopen(&self, session: u64, ino: u64, count: u32) -> std::result::Result<Reply, Failed> {
        let mut left = count.max(1);
        // Bounded: each round takes at least one open off `left`.
        loop {
            let n = left.min(MAX_OPEN_COUNT);
            let r = self.send(session, &FileOp::Open { ino, count: n })?;
            left -= n;
            if left == 0 || r.is_err() {
                return Ok(r);
            }
        }
    }

    /// One operation under `session`, not retried.
    fn send(&self, session: u64, op: &FileOp) -> std::result::Result<Reply, Failed> {
        // The request owns its operation; the caller keeps its own.
        let req = crate::branch::frames::Request::Op { session, op: op.clone(), tag: None };
        match self.exchange(&req)? {
            crate::branch::frames::Answer::Reply(r) => Ok(r),
            crate::branch::frames::Answer::UnknownSession => Err(Failed::Session),
            crate::branch::frames::Answer::Session(_) => Err(Failed::Transport("a garbled reply".into())),
        }
    }

    /// Forgets open file `ino`: the owner no longer has it.
    fn lose(&self, ino: u64) {
        self.open.lock().remove(&ino);
        self.journal.lock().forget_file(ino);
    }

    /// A new owner (epoch `info.epoch`): learns which of our answered
    /// requests it has, and marks the rest lost. Nothing is sent again.
    fn reconcile(&self, info: SessionInfo, restarted: bool) -> std::result::Result<(), Failed> {
        let floors: HashMap<u32, u64> = match self.send(info.session, &FileOp::Slots { client: self.client })? {
            Ok(Out::Slots(v)) => v.into_iter().collect(),
            _ => return Err(Failed::Transport("a garbled answer about our requests".into())),
        };
        let lost = self.journal.lock().reconcile(&floors, info.epoch);
        if lost > 0 {
            tracing::error!(
                lost,
                "the owner changed and lost requests it had answered (not made durable); \
                 the next fsync of their files (of any file, for changes of names) fails with EIO"
            );
        } else if restarted {
            tracing::info!("the owner changed; it has every request this mount was answered");
        } else {
            tracing::info!("a new session with the same owner; it has every request this mount was answered");
        }
        *self.floors.lock() = (info.epoch, floors);
        Ok(())
    }

    /// Whether the owner of `epoch` had write `tag` when we met it.
    fn owner_had(&self, epoch: u64, tag: RequestTag) -> bool {
        let floors = self.floors.lock();
        floors.0 == epoch && floors.1.get(&tag.slot).is_some_and(|&f| tag.seq <= f)
    }

    /// Forgets our session if it is still `used` (0: whatever it is): an
    /// answer about an older one must not drop a newer one.
    fn drop_session(&self, used: u64) {
        let mut s = self.session.lock();
        if used == 0 || s.is_some_and(|c| c.session == used) {
            *s = None;
        }
    }

    /// The owner answered, under our session, a request sent at `sent`.
    fn heard_at(&self, sent: BootInstant) {
        let mut h = self.heard.lock();
        if h.is_none_or(|t| t < sent) {
            *h = Some(sent);
        }
    }

    /// Takes back from a new owner (epoch changed: `restarted`) the locks
    /// this mount held, if the old owner cannot have dropped our session
    /// (`heard`: when the newest request it answered was sent, see
    /// [`crate::branch::locks`]); the rest are lost, and reported. After the same
    /// owner dropped our session, every lock is lost.
    /// The table stays locked throughout: a grant read meanwhile from the
    /// old owner is then seen to come from it, and refused.
    fn reclaim_locks(
        &self,
        info: SessionInfo,
        restarted: bool,
        heard: Option<BootInstant>,
    ) -> std::result::Result<(), Failed> {
        let mut locks = self.locks.lock();
        let held = locks.all();
        let session = info.session;
        if held.is_empty() {
            locks.epoch = info.epoch;
            locks.session = info.session;
            locks.generation = info.generation;
            return Ok(());
        }
        let in_window = restarted
            && heard.is_some_and(|t| t.elapsed() < RECLAIM_WINDOW)
            && locks.generation != u64::MAX
            && info.generation == locks.generation + 1;
        let mut lost: Vec<(u64, u64)> = Vec::new();
        for (ino, owner, lock) in held {
            if lost.contains(&(ino, owner)) {
                continue;
            }
            let kept = in_window
                && self.send(session, &FileOp::SetLk { ino, owner, lock, wait: false, reclaim: true })?.is_ok();
            if !kept {
                lost.push((ino, owner));
            }
        }
        locks.epoch = info.epoch;
        locks.session = info.session;
        locks.generation = info.generation;
        if lost.is_empty() {
            tracing::info!("the owner changed; this mount took back every lock it held");
            return Ok(());
        }
        tracing::error!(
            lost = lost.len(),
            reclaimed_in_time = in_window,
            "locks this mount held were lost with the owner's session; \
             the next fsync of their files fails with EIO, the next lock request of their holders with ENOLCK"
        );
        let mut journal = self.journal.lock();
        for (ino, owner) in lost {
            locks.lose(ino, owner);
            journal.lost.insert(ino);
        }
        Ok(())
    }

    /// A lock request, asked again while the owner is in its lock grace
    /// period (bounded: the period ends), and the epoch of the owner that
    /// answered.
    fn lock_call(&self, op: FileOp) -> Result<(Out, u64, u64)> {
        self.settle_all();
        let until = Instant::now() + MAX_LOCK_GRACE + Duration::from_secs(5);
        loop {
            // A fresh tag each round: a refusal (in grace, a conflict) is
            // kept as the answer to its tag.
            let tag = self.slots.take(self.client);
            let mut req = crate::branch::frames::Request::Op { session: 0, op: op.clone(), tag: Some(tag) };
            let mut epoch = 0;
            let answered = self.call_req(&mut req, None, &mut epoch);
            self.slots.give(tag);
            match answered {
                Err(e) if e.errno() == IN_GRACE && Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) if e.errno() == IN_GRACE => return Err(errno_error(libc::ENOLCK)),
                out => {
                    let session = match &req {
                        crate::branch::frames::Request::Op { session, .. } => *session,
                        _ => 0,
                    };
                    return out.map(|o| (o, epoch, session));
                }
            }
        }
    }

    /// Sends `op` until the owner answers it (or the timeout passes), once
    /// every write in flight has been answered.
    fn call(&self, op: FileOp) -> Result<Out> {
        self.settle_all();
        self.call_raw(op)
    }

    /// [`Inner::call`] without waiting for the writes in flight.
    fn call_raw(&self, op: FileOp) -> Result<Out> {
        self.call_back(op).0
    }

    /// [`Inner::call_raw`], giving the operation back (a write keeps its
    /// buffer). A change of the branch takes a slot for its tag.
    fn call_back(&self, op: FileOp) -> (Result<Out>, FileOp) {
        let tag = op.once().then(|| self.slots.take(self.client));
        let out = self.call_tagged(op, tag, None);
        if let Some(tag) = tag {
            self.slots.give(tag);
        }
        out
    }

    /// Sends `op` as request `tag` until it is answered; with `bound`, only
    /// under that session (ESTALE once we have another).
    fn call_tagged(&self, op: FileOp, tag: Option<RequestTag>, bound: Option<u64>) -> (Result<Out>, FileOp) {
        let ino = match &op {
            FileOp::Write { ino, .. } => Some(*ino),
            _ => None,
        };
        let mut req = crate::branch::frames::Request::Op { session: 0, op, tag };
        let touched = match (&req, ino) {
            (crate::branch::frames::Request::Op { op, .. }, None) => op.touches(),
            _ => Vec::new(),
        };
        let by = if touched.is_empty() { Who::default() } else { calling_process() };
        // Only changes of the branch are journaled until an fsync: opens and
        // locks are tagged too, but live in the session, not the branch.
        let changes = matches!(&req, crate::branch::frames::Request::Op { op, .. } if op.changes());
        let mut epoch = 0;
        let out = self.call_req(&mut req, bound, &mut epoch);
        if let (Ok(_), Some(tag), true) = (&out, tag, changes) {
            self.answered(tag, ino, touched, by, epoch);
        }
        match req {
            crate::branch::frames::Request::Op { op, .. } => (out, op),
            crate::branch::frames::Request::Session => (out, FileOp::StatFs),
        }
    }

    /// Notes request `tag` answered with success; a journal grown past
    /// [`JOURNAL_MAX`] is made durable at once.
    fn answered(&self, tag: RequestTag, ino: Option<u64>, touched: Vec<u64>, by: Who, epoch: u64) {
        let over = {
            let mut j = self.journal.lock();
            j.answered(tag, ino, touched, by, epoch);
            j.len() > JOURNAL_MAX
        };
        if over {
            let upto = self.journal.lock().position();
            if self.call_raw(FileOp::Fsync { ino: arbor_engine::volume::ROOT_INO }).is_ok() {
                self.journal.lock().synced(upto);
            }
        }
    }

    /// Sends `req` until it is answered; `by` is set to the epoch of the
    /// owner that answered.
    fn call_req(&self, req: &mut crate::branch::frames::Request, bound: Option<u64>, by: &mut u64) -> Result<Out> {
        let started = Instant::now();
        let mut backoff = BACKOFF_MIN;
        loop {
            let mut used = 0;
            let attempt = self.session().and_then(|s| {
                used = s.session;
                if bound.is_some_and(|b| b != s.session) {
                    return Ok(crate::branch::frames::Answer::Reply(Err(libc::ESTALE)));
                }
                *by = s.epoch;
                if let crate::branch::frames::Request::Op { session, op, tag } = req {
                    *session = s.session;
                    // Nor is a write sent again whose file's close gave up
                    // on it: reported lost there, it could now land over
                    // what another node wrote since.
                    if let (FileOp::Write { ino, .. }, Some(t)) = (&*op, *tag) {
                        if self.abandoned(*ino, t) {
                            return Ok(crate::branch::frames::Answer::Reply(Err(libc::EIO)));
                        }
                    }
                    // A new session may have found the file gone: its
                    // number may name another file now.
                    // Nor does a write go to a file whose lock was lost with
                    // the session: it could land over what the lock's next
                    // holder wrote.
                    if let FileOp::Write { ino, .. } = op {
                        if self.journal.lock().gone.contains(ino) || self.locks.lock().writes_refused(*ino) {
                            return Ok(crate::branch::frames::Answer::Reply(Err(libc::EIO)));
                        }
                    }
                    // Nor does a truncate.
                    if let FileOp::SetAttr { ino, change, .. } = op {
                        if change.size.is_some() && self.locks.lock().writes_refused(*ino) {
                            return Ok(crate::branch::frames::Answer::Reply(Err(libc::EIO)));
                        }
                    }
                }
                let sent = BootInstant::now();
                let answer = self.exchange(req);
                if let Ok(crate::branch::frames::Answer::Reply(_)) = &answer {
                    self.heard_at(sent);
                }
                answer
            });
            match attempt {
                Ok(crate::branch::frames::Answer::Reply(reply)) => {
                    if self.outage.swap(false, Ordering::Relaxed) {
                        self.locator.answered();
                        tracing::info!("the owner answers again");
                    }
                    return reply.map_err(errno_error);
                }
                Ok(crate::branch::frames::Answer::UnknownSession) => {
                    self.drop_session(used);
                }
                Ok(crate::branch::frames::Answer::Session(_)) => return Err(errno_error(libc::EPROTO)),
                Err(Failed::Refused) => {
                    tracing::warn!("the owner refused our token (check --token-file)");
                    return Err(errno_error(libc::EACCES));
                }
                Err(Failed::Session) => {
                    self.drop_session(used);
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
        lane.idx = ino as usize % WRITE_LANES;
        while !lane.sent.is_empty()
            && (lane.conn.is_none() || lane.bytes + data.len() > IN_FLIGHT_MAX || lane.sent.len() >= IN_FLIGHT_WRITES)
        {
            self.settle_one(&mut lane);
        }
        let slot = PIPELINED_SLOT | (ino as usize % WRITE_LANES) as u32;
        let tag = RequestTag { client: self.client, slot, seq: lane.seq + 1 };
        let sent = self.session().ok().and_then(|session| {
            // Checked again under the session the write goes out on: setting
            // it up may have found the file's lock lost.
            if self.journal.lock().gone.contains(&ino) || self.locks.lock().writes_refused(ino) {
                return None;
            }
            if lane.conn.is_none() {
                let (addr, c) = self.take_conn().ok()?;
                if self.opts.timeout.is_none() {
                    // A paused owner's kernel still takes bytes, then stops:
                    // a hard mount checks for a successor (see read_one).
                    c.stream.tcp().set_write_timeout(Some(OWNER_CHECK)).ok()?;
                }
                *self.lane_socks[ino as usize % WRITE_LANES].lock() = c.stream.tcp().try_clone().ok();
                lane.addr = addr;
                lane.conn = Some(c);
            }
            let c = lane.conn.as_mut()?;
            crate::branch::frames::write_data(&mut c.stream, &mut c.wbuf, session.session, Some(tag), at, data).ok()?;
            Some((session.epoch, session.session))
        });
        let Some((epoch, session)) = sent else {
            // Part of it may have gone. The lane's earlier writes are sent
            // again, and the caller sends this one the retrying way after
            // them, so the owner sees them in order.
            if lane.conn.is_some() {
                self.drop_conn(&mut lane);
                self.forget_owner();
            }
            self.settle_lane(&mut lane);
            return false;
        };
        lane.seq = tag.seq;
        self.lane_seqs[ino as usize % WRITE_LANES].store(tag.seq, Ordering::Release);
        let data = Bytes::copy_from_slice(data);
        lane.bytes += data.len();
        lane.sent.push_back(Sent { tag, epoch, session, at, data });
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
    /// would wait for itself. Whether no write to `ino` is left in flight;
    /// if some are, they are given up ([`Inner::abandon`]).
    fn settle_reachable(&self, ino: u64) -> bool {
        let lane = &self.lanes[ino as usize % WRITE_LANES];
        // Bounded by the lane's holder: it sends or reads a few MiB, or is
        // retrying, which marks an outage.
        let mut lane = loop {
            if let Some(mut l) = lane.try_lock_for(Duration::from_millis(20)) {
                l.idx = ino as usize % WRITE_LANES;
                break l;
            }
            if self.outage.load(Ordering::Relaxed) {
                // Its holder is waiting for the owner (with writes in
                // flight, perhaps some of this file's).
                self.abandon(ino);
                return false;
            }
        };
        // Each turn answers one write or stops.
        while !lane.sent.is_empty() {
            if self.read_one(&mut lane).is_err() {
                self.drop_conn(&mut lane);
                if lane.sent.iter().any(|w| w.at.ino == ino) {
                    // Given up while the lane is held: no other thread can
                    // send them again in between.
                    self.abandon(ino);
                    return false;
                }
                return true;
            }
        }
        true
    }

    /// Drops `lane`'s connection, hanging it up (its handle in
    /// `lane_socks` would keep it open otherwise).
    fn drop_conn(&self, lane: &mut Lane) {
        lane.conn = None;
        if let Some(s) = self.lane_socks[lane.idx].lock().take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Gives up on the writes to `ino` in flight now, which a close could
    /// not have answered: reported lost (the close fails with EIO, and so
    /// does the file's next fsync) and never sent again. Sent later, after
    /// the close returned, one could land over what another node wrote to
    /// the file since (close-to-open), whichever owner takes it.
    fn abandon(&self, ino: u64) {
        let lane = ino as usize % WRITE_LANES;
        // The lane's connection is hung up: an owner applies nothing it
        // reads from a connection its client hung up (it may be paused
        // with these writes in its socket buffer).
        if let Some(s) = self.lane_socks[lane].lock().take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let upto = self.lane_seqs[lane].load(Ordering::Acquire);
        self.abandoned.lock().insert(ino, upto);
        self.journal.lock().lost.insert(ino);
        tracing::warn!(ino, "a file was closed while the owner had not answered its writes; they count as lost");
    }

    /// Whether write `tag` to `ino` was given up by its file's close.
    fn abandoned(&self, ino: u64, tag: RequestTag) -> bool {
        tag.slot & PIPELINED_SLOT != 0 && self.abandoned.lock().get(&ino).is_some_and(|&upto| tag.seq <= upto)
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
            self.drop_conn(lane);
            match broken {
                Broken::Session => *self.session.lock() = None,
                Broken::Connection => self.forget_owner(),
            }
            self.resend_lane(lane);
        }
    }

    /// Reads the owner's answer to the oldest write in flight on `lane`.
    fn read_one(&self, lane: &mut Lane) -> std::result::Result<(), Broken> {
        use crate::branch::frames::{read_answer, Answer};
        let Some(front) = lane.sent.front() else { return Ok(()) };
        let (tag, ino, len, epoch) = (front.tag, front.at.ino, front.data.len(), front.epoch);
        let c = lane.conn.as_mut().ok_or(Broken::Connection)?;
        if self.opts.timeout.is_none() && self.await_answer(c, &lane.addr).is_err() {
            return Err(Broken::Connection);
        }
        match read_answer(&mut c.stream, &mut c.rbuf) {
            Ok(Answer::Reply(reply)) => {
                lane.sent.pop_front();
                lane.bytes -= len;
                self.written(tag, ino, len, reply, epoch);
                Ok(())
            }
            Ok(Answer::UnknownSession) => Err(Broken::Session),
            Ok(Answer::Session(_)) | Err(_) => Err(Broken::Connection),
        }
    }

    /// The owner's answer to write `tag` of `len` bytes to `ino`.
    fn written(&self, tag: RequestTag, ino: u64, len: usize, reply: Reply, epoch: u64) {
        let errno = match reply {
            Ok(Out::Written(n)) if n as usize == len => {
                return self.answered(tag, Some(ino), Vec::new(), Who::default(), epoch)
            }
            // The volume writes all or nothing; anything else is a fault.
            Ok(_) => libc::EIO,
            Err(errno) => errno,
        };
        tracing::debug!(ino, errno, "the owner refused a write in flight");
        self.journal.lock().failed.entry(ino).or_insert(errno);
    }

    /// Sends `lane`'s writes in flight again, in order, with their tags
    /// (their connection broke: the owner may or may not have them, and
    /// applies each at most once) — to the owner they were sent to only.
    /// Once another owner answers, a write is asked about instead: it had
    /// it, or it is lost (its `write` returned long ago; sent now, it could
    /// land over what another client wrote since).
    fn resend_lane(&self, lane: &mut Lane) {
        while let Some(w) = lane.sent.pop_front() {
            lane.bytes -= w.data.len();
            let ino = w.at.ino;
            if self.journal.lock().gone.contains(&ino) {
                // The owner restarted without this file: it is lost, and
                // the number may name another file now.
                continue;
            }
            if self.abandoned(ino, w.tag) {
                // Its file's close reported it lost.
                continue;
            }
            let len = w.data.len();
            let (out, _) = self.call_tagged(w.at.op(w.data.to_vec()), Some(w.tag), Some(w.session));
            match out {
                Err(_) if self.abandoned(ino, w.tag) => {}
                Err(e) if e.errno() == libc::ESTALE => {
                    let epoch = (*self.session.lock()).map_or(0, |s| s.epoch);
                    // The same owner under a new session (ours expired):
                    // its floor says the lane got that far, not whether
                    // this write succeeded, and its refusal may have been
                    // the answer we lost. Counted lost: a false alarm at
                    // worst, never a refused write acknowledged.
                    if epoch != w.epoch && self.owner_had(epoch, w.tag) {
                        self.answered(w.tag, Some(ino), Vec::new(), Who::default(), epoch);
                    } else {
                        tracing::warn!(
                            ino,
                            "a write in flight was lost with the owner or our session; its file's fsync and close fail"
                        );
                        let mut j = self.journal.lock();
                        j.lost.insert(ino);
                        j.failed.entry(ino).or_insert(libc::EIO);
                    }
                }
                // `call_tagged` journaled a success.
                Ok(_) => {}
                Err(e) => self.written(w.tag, ino, len, Err(e.errno()), w.epoch),
            }
        }
    }

    /// The error a write in flight to `ino` met, once.
    fn take_failed(&self, ino: u64) -> Result<()> {
        match self.journal.lock().failed.remove(&ino) {
            Some(errno) => Err(errno_error(errno)),
            None => Ok(()),
        }
    }

    /// Drops what other nodes changed from the kernel's caches (and our
    /// located reads), and moves `after` past it.
    fn invalidate(&self, kernel: &dyn Invalidate, ev: Events, after: &mut u64) {
        if self.owner_changed.swap(false, Ordering::AcqRel) {
            // The new owner may lack what the old one answered: the pages
            // and attributes the kernel keeps of open files may hold it.
            let open: Vec<u64> = self.open.lock().keys().copied().collect();
            for ino in open {
                kernel.inode(ino);
            }
        }
        if ev.gap {
            // Located reads of files changed in the gap would go stale.
            if let Some(d) = &self.direct {
                d.forget_all();
            }
            tracing::debug!("missed some changes of other nodes; the kernel's short timeouts cover them");
        }
        *after = ev.next;
        for e in ev.items {
            match e {
                Event::Inode(ino) => {
                    if let Some(d) = &self.direct {
                        d.forget(ino);
                    }
                    kernel.inode(ino);
                }
                Event::Entry(parent, name) => kernel.entry(parent, &name),
            }
        }
    }

    /// One poll under session `s` for what other nodes changed since `after`.
    async fn poll(&self, s: SessionInfo, after: u64) -> std::result::Result<(SessionInfo, Events), Failed> {
        let after = if after == 0 { s.seq } else { after };
        let q = format!("/events?session={:016x}&after={after}", s.session);
        let body = self.get(&q).await?;
        let ev = decode_value(&body, "events").map_err(|_| Failed::Transport("garbled events".into()))?;
        Ok((s, ev))
    }
}

impl BranchClient {
    /// A client of `opts.branch`'s owner; it checks at once that the owner
    /// answers and takes the token, so a mount fails with a clear message
    /// instead of hanging.
    pub fn connect(opts: BranchClientOptions) -> std::result::Result<BranchClient, crate::Error> {
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
            client: new_client_id(),
            slots: SlotTable::default(),
            journal: Mutex::new(Journal::default()),
            floors: Mutex::new((0, HashMap::new())),
            locks: Mutex::new(HeldLocks::default()),
            heard: Mutex::new(None),
            lanes: Default::default(),
            lane_seqs: Default::default(),
            lane_socks: Default::default(),
            abandoned: Mutex::new(HashMap::new()),
            opening: Mutex::new(()),
            retries: AtomicU64::new(0),
            sessions: AtomicU64::new(0),
            outage: AtomicBool::new(false),
            owner_changed: AtomicBool::new(false),
            owner_reads: AtomicU64::new(0),
            owner_bytes: AtomicU64::new(0),
            synchronous: AtomicBool::new(false),
        });
        // An owner starting (or restarting) does not answer yet: waited
        // for, up to the mount's timeout or OWNER_START_WAIT.
        let wait = inner.opts.timeout.unwrap_or(OWNER_START_WAIT);
        let started = Instant::now();
        let mut first = inner.session();
        let mut told = false;
        // Bounded by `wait`.
        while let Err(Failed::Transport(e)) = &first {
            if started.elapsed() >= wait {
                break;
            }
            if !told {
                tracing::warn!(error = %e, wait_s = wait.as_secs(), "the owner does not answer yet; waiting for it");
                told = true;
            }
            std::thread::sleep(Duration::from_millis(250));
            inner.forget_owner();
            first = inner.session();
        }
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
        Ok(BranchClient { inner, rt, events: Mutex::new(None) })
    }

    fn call(&self, op: FileOp) -> Result<Out> {
        self.inner.call(op)
    }

    pub fn stats(&self) -> BranchClientStats {
        let owner = self.inner.pool.lock().addr.clone();
        BranchClientStats {
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
    /// kernel's caches through `kernel`, until [`BranchClient::close`].
    /// The poll also tells the owner this mount is alive.
    pub fn follow(&self, kernel: impl Invalidate + 'static) -> std::io::Result<()> {
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let inner = self.inner.clone();
        let handle = self.rt.handle().clone();
        let t = std::thread::Builder::new().name("arbor-follow".into()).spawn(move || {
            let mut after = 0u64;
            let mut backoff = BACKOFF_MIN;
            // Whether `stop` came while waiting `d`.
            let wait = |stop: &mut tokio::sync::oneshot::Receiver<()>, d: Duration| {
                handle.block_on(async {
                    tokio::select! {
                        _ = stop => true,
                        _ = tokio::time::sleep(d) => false,
                    }
                })
            };
            loop {
                // The session is opened outside the runtime: finding the
                // owner may read the bucket, which blocks on a runtime of
                // its own, and a new owner is asked about our requests.
                let sent = BootInstant::now();
                let mut used = 0;
                let polled = match inner.session() {
                    Ok(s) => {
                        used = s.session;
                        let poll = inner.poll(s, after);
                        let got = handle.block_on(async {
                            tokio::select! {
                                _ = &mut stop_rx => None,
                                p = poll => Some(p),
                            }
                        });
                        match got {
                            Some(p) => p,
                            None => return,
                        }
                    }
                    Err(e) => Err(e),
                };
                match polled {
                    Ok((_, ev)) => {
                        inner.heard_at(sent);
                        if backoff != BACKOFF_MIN {
                            inner.locator.answered();
                        }
                        backoff = BACKOFF_MIN;
                        inner.invalidate(&kernel, ev, &mut after);
                    }
                    Err(Failed::Session) => {
                        inner.drop_session(used);
                        after = 0;
                    }
                    Err(_) => {
                        after = 0;
                        if wait(&mut stop_rx, backoff) {
                            return;
                        }
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                }
            }
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
            let mut j = self.inner.journal.lock();
            if j.gone.remove(&a.ino) {
                // Another file with the lost one's number.
                j.failed.remove(&a.ino);
                j.lost.remove(&a.ino);
            }
        }
        let mut open = self.inner.open.lock();
        let f = open.entry(a.ino).or_insert(OpenFile { count: 0, crtime: a.crtime });
        f.count += 1;
        f.crtime = a.crtime;
    }

    /// Commits the branch at the owner: its current commit.
    pub fn commit(&self) -> Result<arbor_engine::format::Addr> {
        match self.call(FileOp::Commit)? {
            Out::Commit { writer, seq, off, len } => {
                Ok(arbor_engine::format::Addr { seg: arbor_engine::format::SegId { writer, seq }, off, len })
            }
            _ => Err(errno_error(libc::EPROTO)),
        }
    }

    /// Has the owner freeze the branch as checkpoint `name`: its
    /// description (JSON), or why it was refused.
    pub fn checkpoint(&self, name: &str) -> std::result::Result<String, String> {
        match self.call(FileOp::Checkpoint { name: name.into() }) {
            Ok(Out::Message(m)) => m,
            Ok(_) => Err("a garbled answer from the owner".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// EIO for a file that did not survive an owner restart, or whose
    /// lock this mount lost (until its holder hears so).
    fn check_alive(&self, ino: u64) -> Result<()> {
        if self.inner.journal.lock().gone.contains(&ino) || self.inner.locks.lock().writes_refused(ino) {
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
        let pipelined = !self.inner.synchronous.load(Ordering::Relaxed);
        if pipelined && !data.is_empty() && self.inner.send_write(at, data) {
            return Ok(data.len());
        }
        match self.inner.call_raw(at.op(data.to_vec()))? {
            Out::Written(n) => Ok((n as usize).min(data.len())),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }

    /// From now on a write returns once the owner applied it, not once it
    /// is on its way. A mount whose serving process may die and be
    /// replaced under it needs this: a write answered while still on its
    /// way would die with the process, and the process that takes over
    /// knows nothing of it to report at the file's next fsync.
    pub fn write_synchronously(&self) {
        self.inner.synchronous.store(true, Ordering::Relaxed);
    }

    /// Requests the owner answered that no fsync has covered yet.
    pub fn unsynced_requests(&self) -> usize {
        self.inner.journal.lock().len()
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

impl Files for BranchClient {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        attr(self.call(FileOp::Lookup { parent, name: name.to_vec() }))
    }
    fn getattr(&self, ino: u64) -> Result<Attr> {
        attr(self.call(FileOp::GetAttr { ino }))
    }
    /// A change with no caller is made as root would make it (which an
    /// owner squashing root makes nobody's).
    fn setattr(&self, ino: u64, change: SetAttr) -> Result<Attr> {
        self.setattr_by(ino, change, Caller::ROOT, false)
    }
    /// One request: the owner checks `caller` and clears what the change
    /// takes from the file as it applies it.
    fn setattr_by(&self, ino: u64, change: SetAttr, caller: Caller, kill_suidgid: bool) -> Result<Attr> {
        self.forget(ino);
        attr(self.call(FileOp::SetAttr { ino, change, caller, kill_suidgid }))
    }
    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        bytes(self.call(FileOp::ReadLink { ino }))
    }
    fn create(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32, rdev: u32) -> Result<Attr> {
        attr(self.call(FileOp::Create { parent, name: name.to_vec(), mode, uid, gid, rdev }))
    }
    fn create_open(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        let a = attr(self.call(FileOp::CreateOpen { parent, name: name.to_vec(), mode, uid, gid }))?;
        self.opened(&a);
        Ok(a)
    }
    fn mkdir(&self, parent: u64, name: &[u8], perm: u16, uid: u32, gid: u32) -> Result<Attr> {
        attr(self.call(FileOp::Mkdir { parent, name: name.to_vec(), perm, uid, gid }))
    }
    fn symlink(&self, parent: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<Attr> {
        attr(self.call(FileOp::Symlink { parent, name: name.to_vec(), target: target.to_vec(), uid, gid }))
    }
    fn link(&self, ino: u64, new_parent: u64, new_name: &[u8]) -> Result<Attr> {
        attr(self.call(FileOp::Link { ino, new_parent, new_name: new_name.to_vec() }))
    }
    fn unlink(&self, parent: u64, name: &[u8]) -> Result<()> {
        unit(self.call(FileOp::Unlink { parent, name: name.to_vec() }))
    }
    fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()> {
        unit(self.call(FileOp::Rmdir { parent, name: name.to_vec() }))
    }
    fn rename(&self, parent: u64, name: &[u8], new_parent: u64, new_name: &[u8], mode: RenameMode) -> Result<()> {
        unit(self.call(FileOp::Rename { parent, name: name.to_vec(), new_parent, new_name: new_name.to_vec(), mode }))
    }
    fn open(&self, ino: u64) -> Result<Attr> {
        let a = attr(self.call(FileOp::Open { ino, count: 1 }))?;
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
        unit(self.call(FileOp::Release { ino }))
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
            let locate = |ino, off, len| match self.call(FileOp::Locate { ino, off, len })? {
                Out::Located(l) => Ok(l),
                _ => Err(errno_error(libc::EPROTO)),
            };
            match d.read_into(ino, off, buf, locate) {
                Ok(Some(n)) => return Ok(n),
                Ok(None) => {}
                Err(crate::branch::reads::Failed::Owner(e)) => return Err(e),
                Err(crate::branch::reads::Failed::Here(e)) => {
                    d.forget(ino);
                    d.counters.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(ino, off, error = %e, "a read from the segments failed; the owner reads it");
                }
            }
        }
        // A read larger than an owner answers at once goes in pieces;
        // bounded: each round fills more of `buf` or ends.
        let mut n = 0;
        while n < buf.len() {
            let len = (buf.len() - n).min(MAX_READ as usize) as u32;
            let b = bytes(self.call(FileOp::Read { ino, off: off + n as u64, len }))?;
            self.inner.owner_reads.fetch_add(1, Ordering::Relaxed);
            self.inner.owner_bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
            let got = b.len().min(len as usize);
            buf[n..n + got].copy_from_slice(&b[..got]);
            n += got;
            if got < len as usize {
                break;
            }
        }
        Ok(n)
    }
    fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<usize> {
        self.write_as(Written { ino, off, unprivileged: false, append: false }, data)
    }
    /// One request: the owner clears the file's privileges as it applies
    /// the write, answered later like any write. The kernel's cached mode
    /// is dropped whatever it was (the answer comes later).
    fn write_unprivileged(&self, ino: u64, off: u64, data: &[u8]) -> Result<(usize, bool)> {
        Ok((self.write_as(Written { ino, off, unprivileged: true, append: false }, data)?, true))
    }
    /// At the owner's end of the file, in flight like any write.
    fn write_appending(&self, ino: u64, off: u64, data: &[u8], unprivileged: bool) -> Result<(usize, bool)> {
        Ok((self.write_as(Written { ino, off, unprivileged, append: true }, data)?, unprivileged))
    }
    fn fsync(&self, ino: u64) -> Result<()> {
        self.inner.settle_all();
        let upto = self.inner.journal.lock().position();
        unit(self.inner.call_raw(FileOp::Fsync { ino }))?;
        // The owner's fsync covers its whole log: every request answered
        // before it was sent is durable now. What an earlier owner lost
        // (found when this one was met) fails this fsync.
        let mut j = self.inner.journal.lock();
        j.synced(upto);
        let failed = j.failed.remove(&ino);
        let lost = j.lost.remove(&ino);
        if j.take_lost_change(ino, calling_process()) || lost {
            return Err(errno_error(libc::EIO));
        }
        match failed {
            Some(errno) => Err(errno_error(errno)),
            None => Ok(()),
        }
    }
    fn flush(&self, ino: u64) -> Result<()> {
        // Close-to-open: what was written is at the owner before close
        // returns, and a write it refused or lost is reported here. Writes
        // the owner did not answer are given up, not left to land later.
        if !self.inner.settle_reachable(ino) {
            return Err(errno_error(libc::EIO));
        }
        self.inner.take_failed(ino)?;
        // Reported, and kept for the file's next fsync: a close by one
        // process does not hide the loss from another's fsync.
        if self.inner.journal.lock().lost.contains(&ino) {
            return Err(errno_error(libc::EIO));
        }
        Ok(())
    }
    fn readdir(&self, ino: u64, mut offset: u64, f: &mut dyn FnMut(DirEntryOut) -> bool) -> Result<()> {
        // Bounded by the directory: each batch moves the offset forward.
        loop {
            let Out::Entries(batch) = self.call(FileOp::ReadDir { ino, offset, max: READDIR_BATCH })? else {
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
        match self.call(FileOp::StatFs)? {
            Out::StatFs(s) => Ok(s),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }
    fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: XattrFlags) -> Result<()> {
        unit(self.call(FileOp::SetXattr { ino, name: name.to_vec(), value: value.to_vec(), flags }))
    }
    fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        bytes(self.call(FileOp::GetXattr { ino, name: name.to_vec() }))
    }
    fn listxattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        match self.call(FileOp::ListXattr { ino })? {
            Out::Names(n) => Ok(n),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }
    fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()> {
        unit(self.call(FileOp::RemoveXattr { ino, name: name.to_vec() }))
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
        match self.inner.lock_call(FileOp::GetLk { ino, owner, lock })?.0 {
            Out::Lock(l) => Ok(l),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }
    fn setlk(&self, ino: u64, owner: u64, lock: Lock, wait: bool) -> Result<()> {
        let inner = &self.inner;
        if lock.typ == libc::F_UNLCK {
            // Believed dropped before it is: holding less is safe to believe.
            inner.locks.lock().apply(ino, owner, lock);
            inner.locks.lock().take_lost(ino, owner);
            return unit(inner.call(FileOp::SetLk { ino, owner, lock, wait, reclaim: false }));
        }
        if inner.locks.lock().take_lost(ino, owner) {
            return Err(errno_error(libc::ENOLCK));
        }
        let (_, epoch, session) = inner.lock_call(FileOp::SetLk { ino, owner, lock, wait, reclaim: false })?;
        let mut locks = inner.locks.lock();
        if locks.epoch != epoch || locks.session != session {
            // Granted by an owner that is gone (its answer read late): the
            // owner now has no such lock.
            return Err(errno_error(libc::ENOLCK));
        }
        locks.apply(ino, owner, lock);
        // A loss found while this lock was asked for is over: the lock is
        // held anew (and the kernel's cache of the file dropped); what was
        // written under the lost one fails its fsync.
        locks.take_lost(ino, owner);
        Ok(())
    }
    fn unlock_all(&self, ino: u64, owner: u64) -> Result<()> {
        {
            let mut locks = self.inner.locks.lock();
            locks.unlock_all(ino, owner);
            // Its close (flush) reported the loss already, with EIO.
            locks.take_lost(ino, owner);
        }
        unit(self.inner.call(FileOp::UnlockAll { ino, owner }))
    }
}

impl Drop for BranchClient {
    fn drop(&mut self) {
        let _ = Files::close(self);
    }
}

/// A client id for this mount's request tags: random, never 0.
fn new_client_id() -> u64 {
    use std::hash::BuildHasher;
    // RandomState is seeded from the system's randomness once per process
    // and moves on with every instance.
    let id = std::collections::hash_map::RandomState::new().hash_one((std::process::id(), Instant::now()));
    id.max(1)
}
