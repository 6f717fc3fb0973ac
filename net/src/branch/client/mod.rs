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
//!
//! # Rooms
//!
//! `connection.rs` (the owner's connections and the session), `calls.rs`
//! (one operation sent until answered), `lanes.rs` (writes in flight),
//! `events.rs` (the owner's events into the kernel) and `files.rs` (the
//! [`Files`] operations); this file holds the state they share.

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
use arbor_engine::metrics::Counter;
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

mod calls;
mod connection;
mod events;
mod files;
mod lanes;

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
    lookups: Counter,
}

struct Located {
    /// The last answer and when it was given.
    last: Option<(Option<String>, Instant)>,
    /// How long that answer stands.
    wait: Duration,
}

impl Locator {
    fn new(locate: Locate) -> Locator {
        Locator { locate, state: Mutex::new(Located { last: None, wait: LOCATE_MIN }), lookups: Counter::new() }
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
        self.lookups.inc();
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
    counts: ClientCounters,
    /// Whether the current outage was already logged.
    outage: AtomicBool,
    /// A new owner was met since the event thread last dropped what the
    /// kernel caches of this mount's open files.
    owner_changed: AtomicBool,
    direct: Option<DirectReads>,
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

arbor_engine::counters! {
    /// What a client mount counts of its owner.
    struct ClientCounters;
    /// What a client mount has seen of its owner.
    #[derive(PartialEq, Eq)]
    pub struct BranchClientStats {
        /// Attempts that failed and were tried again.
        retries: Counter,
        /// Sessions opened (more than one: the owner restarted or dropped us).
        sessions: Counter,
        /// Reads the owner answered (bytes not in the bucket yet, or no segments here).
        owner_reads: Counter,
        owner_bytes: Counter,
    } and {
        owner: Option<String>,
        open_files: usize,
        /// Reads this mount made from the disk's segments itself, and their bytes.
        direct_reads: u64,
        direct_bytes: u64,
        /// Locates asked of the owner.
        locates: u64,
        /// Lookups of the owner's address (the owner record in the bucket, or
        /// `--server`): one at the start, then during an outage after 50 ms,
        /// 100 ms, … up to one per 2 s, shared by every thread.
        owner_lookups: u64,
        /// Reads from the segments that failed and went to the owner.
        direct_failed: u64,
    }
}

fn errno_error(errno: i32) -> Error {
    match errno {
        libc::ENOENT => Error::NotFound,
        _ => Error::Io(std::io::Error::from_raw_os_error(errno)),
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
            counts: ClientCounters::default(),
            outage: AtomicBool::new(false),
            owner_changed: AtomicBool::new(false),
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
        let direct = self.inner.direct.as_ref().map(|d| d.counters.snapshot()).unwrap_or_default();
        BranchClientStats {
            owner: self.inner.pool.lock().addr.clone(),
            open_files: self.inner.open.lock().len(),
            direct_reads: direct.direct_reads,
            direct_bytes: direct.direct_bytes,
            locates: direct.locates,
            owner_lookups: self.inner.locator.lookups.get(),
            direct_failed: direct.direct_failed,
            ..self.inner.counts.snapshot()
        }
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
