//! Shared branches: the owner's side. `arbor serve --branch` holds a
//! branch's writer lease like a mount does, and applies the file
//! operations that client mounts on other nodes send it, so a branch keeps
//! one writer (one log, one lease) however many nodes write to it.
//!
//! # Protocol
//!
//! On the cache server's port, behind the same token. File operations go
//! on framed connections ([`crate::branch::frames`]): a session is opened with
//! `Request::Session` (a [`SessionInfo`]: the session and the owner's
//! epoch), and each [`FileOp`] is answered with a [`Reply`], or "unknown
//! session" (open a new one). Changes other nodes made are long-polled
//! over HTTP/2, where waiting costs nothing:
//!
//! | request | answer |
//! | --- | --- |
//! | `GET /v1/files/<branch>/events?session=S&after=N` | [`Events`] after sequence N, waiting up to [`EVENT_WAIT`] for one; `409` unknown session; `404` branch not served here |
//!
//! Bodies are bincode (standard configuration). A reply is the result the
//! owner's `Volume` gave, an errno in place of an error, so a client
//! returns the same errno for the same bad input as a local mount.
//!
//! # Sessions
//!
//! A session is one client mount. The owner remembers what each session
//! holds open (an unlinked file lives while a client has it open) and its
//! locks. A session lives as long as its client does, whatever happens to
//! its connections (a client closes and opens them as its load changes):
//! only a session that sent nothing for [`SESSION_IDLE`] is dropped, with
//! everything it held, so a client killed with -9 leaves no lock and no
//! open file behind. A live client is heard from at least every
//! [`EVENT_WAIT`], by its event poll. The epoch changes when the owner
//! restarts; a client that sees a new one opens a new session and opens its
//! open files again.
//!
//! # Events
//!
//! Every change is recorded as the inodes and names it touched, in a ring
//! of the newest [`EVENT_RING`]; clients poll it and drop those inodes and
//! names from their kernel's caches, so a file made on one node shows on
//! the others at once. A client that fell behind the ring is told so (it
//! relies on its short cache timeouts for what it missed).
//!
//! # Privileges
//!
//! The owner applies what any holder of the token sends, so a change of
//! owner or mode carries its caller, and every change that could make a
//! file grant privileges, or give it away, is checked by the owner's
//! [`Policy`] first (see [`crate::branch::policy`]): by default no set-ID bits,
//! capabilities or device nodes from clients, and root squashed to nobody.

use crate::branch::locks::{
    conflicts, overlaps, reserved_client, CLEARED_SLOT, GENERATION_SLOT, GRANTED_SLOT, INODES_CLIENT, IN_GRACE,
    LOCKS_CLIENT, LOCK_GRACE,
};
use crate::branch::policy::{Change, Policy};
use crate::branch::requests::{Begin, Replies};
use arbor_engine::clock::BootInstant;
use arbor_engine::files::{drop_capabilities, Caller, Files, Lock};
use arbor_engine::volume::XattrFlags;
use arbor_engine::volume::{Attr, DirEntryOut, Place, RenameMode, RequestTag, SetAttr, StatFs, Takes, Volume};
use arbor_engine::Error;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// How long an event poll waits for something to happen.
pub const EVENT_WAIT: Duration = Duration::from_secs(5);
/// How long a session may be silent before it is dropped: three of its
/// client's event polls.
pub const SESSION_IDLE: Duration = Duration::from_secs(15);
/// Events kept for clients that poll late.
pub const EVENT_RING: usize = 8192;
/// Entries one `ReadDir` answers at most; a larger `max` is refused.
pub const READDIR_BATCH: u32 = 1024;
/// Bytes one `FileOp::Read` asks for at most (its answer travels as one
/// payload); a larger `len` is refused with EINVAL before anything is read.
pub const MAX_READ: u32 = crate::wire::frames::MAX_FRAME as u32;
/// Opens one `FileOp::Open` takes at most; a client that holds a file open
/// more often sends several.
pub const MAX_OPEN_COUNT: u32 = 1 << 16;
/// Sessions a branch keeps at once: a session lives [`SESSION_IDLE`]
/// past its client's last word, so this is many clients' worth.
pub const MAX_SESSIONS: usize = 16_384;

/// One file operation, in the engine's terms.
#[derive(Clone, Debug, bincode::Encode, bincode::Decode)]
pub enum FileOp {
    Lookup {
        parent: u64,
        name: Vec<u8>,
    },
    GetAttr {
        ino: u64,
    },
    /// `caller` asked for `change`; `kill_suidgid`: its kernel says the
    /// change takes the file's set-ID bits ([`Files::setattr_by`]).
    SetAttr {
        ino: u64,
        change: SetAttr,
        caller: Caller,
        kill_suidgid: bool,
    },
    ReadLink {
        ino: u64,
    },
    Create {
        parent: u64,
        name: Vec<u8>,
        mode: u32,
        uid: u32,
        gid: u32,
        rdev: u32,
    },
    CreateOpen {
        parent: u64,
        name: Vec<u8>,
        mode: u32,
        uid: u32,
        gid: u32,
    },
    Mkdir {
        parent: u64,
        name: Vec<u8>,
        perm: u16,
        uid: u32,
        gid: u32,
    },
    Symlink {
        parent: u64,
        name: Vec<u8>,
        target: Vec<u8>,
        uid: u32,
        gid: u32,
    },
    Link {
        ino: u64,
        new_parent: u64,
        new_name: Vec<u8>,
    },
    Unlink {
        parent: u64,
        name: Vec<u8>,
    },
    Rmdir {
        parent: u64,
        name: Vec<u8>,
    },
    Rename {
        parent: u64,
        name: Vec<u8>,
        new_parent: u64,
        new_name: Vec<u8>,
        mode: RenameMode,
    },
    /// Opens `ino` `count` times (a client opening its files again after
    /// the owner restarted sends its counts).
    Open {
        ino: u64,
        count: u32,
    },
    Release {
        ino: u64,
    },
    Read {
        ino: u64,
        off: u64,
        len: u32,
    },
    /// `unprivileged`: written by a caller without CAP_FSETID, so the
    /// file first loses its set-user-ID bits ([`arbor_engine::files::clear_privileges`]);
    /// under root squash every write is.
    /// Any write drops the file's capabilities.
    Write {
        ino: u64,
        off: u64,
        data: Vec<u8>,
        unprivileged: bool,
        /// At the end of the file as the owner has it (`O_APPEND`: the
        /// client's kernel only knows the size it last saw), not at `off`.
        append: bool,
    },
    Fsync {
        ino: u64,
    },
    ReadDir {
        ino: u64,
        offset: u64,
        max: u32,
    },
    StatFs,
    SetXattr {
        ino: u64,
        name: Vec<u8>,
        value: Vec<u8>,
        flags: XattrFlags,
    },
    GetXattr {
        ino: u64,
        name: Vec<u8>,
    },
    ListXattr {
        ino: u64,
    },
    RemoveXattr {
        ino: u64,
        name: Vec<u8>,
    },
    GetLk {
        ino: u64,
        owner: u64,
        lock: Lock,
    },
    /// `reclaim`: a lock the client held under the owner before this one
    /// (see [`crate::branch::locks`]).
    SetLk {
        ino: u64,
        owner: u64,
        lock: Lock,
        wait: bool,
        reclaim: bool,
    },
    /// Drops every lock `owner` holds on `ino`.
    UnlockAll {
        ino: u64,
        owner: u64,
    },
    /// Commits now: the branch's current state, for `arbor diff` and the like.
    Commit,
    /// Freezes the branch as checkpoint `name`, unsynced writes included.
    Checkpoint {
        name: String,
    },
    /// Where the bytes of a range are, for a client that reads the
    /// disk's segments itself: [`Out::Located`].
    Locate {
        ino: u64,
        off: u64,
        len: u64,
    },
    /// The newest sequence of each of `client`'s request slots the
    /// branch's state includes: [`Out::Slots`]. A client asks after the
    /// owner changed, to learn which of its answered requests survived.
    Slots {
        client: u64,
    },
    /// Makes `len` bytes of `dst` from `dst_off` the bytes of `src` from
    /// `src_off`, sharing them ([`Files::clone_range`]): [`Out::Written`]
    /// with `len`. The range must lie within the source (EINVAL past its
    /// end, so a copy sent again is answered truly). It drops `dst`'s
    /// set-ID bits and capabilities whatever the caller's privileges.
    CloneRange {
        src: u64,
        src_off: u64,
        dst: u64,
        dst_off: u64,
        len: u64,
    },
}

impl FileOp {
    /// EINVAL for a size or count past what an owner does for one
    /// request, checked before anything is allocated or done. (A `Vec`
    /// in a request is bounded by its frame; `Locate` answers at most
    /// [`LOCATE_MAX_SPANS`] whatever its `len`.)
    pub fn check(&self) -> Result<(), i32> {
        match *self {
            FileOp::Read { len, .. } if len > MAX_READ => Err(libc::EINVAL),
            FileOp::Open { count, .. } if count > MAX_OPEN_COUNT => Err(libc::EINVAL),
            FileOp::ReadDir { max, .. } if max > READDIR_BATCH => Err(libc::EINVAL),
            FileOp::SetLk { wait: true, reclaim: true, .. } => Err(libc::EINVAL),
            FileOp::CloneRange { len: 0, .. } => Err(libc::EINVAL),
            FileOp::Slots { client } if reserved_client(client) => Err(libc::EPERM),
            _ => Ok(()),
        }
    }

    /// The files and folders a change alters (a folder for a change of
    /// its names): whose fsync must report the change if it is lost.
    pub fn touches(&self) -> Vec<u64> {
        match self {
            FileOp::SetAttr { ino, .. } | FileOp::SetXattr { ino, .. } | FileOp::RemoveXattr { ino, .. } => vec![*ino],
            FileOp::Write { ino, .. } => vec![*ino],
            FileOp::CloneRange { dst, .. } => vec![*dst],
            FileOp::Create { parent, .. }
            | FileOp::CreateOpen { parent, .. }
            | FileOp::Mkdir { parent, .. }
            | FileOp::Symlink { parent, .. }
            | FileOp::Unlink { parent, .. }
            | FileOp::Rmdir { parent, .. } => vec![*parent],
            FileOp::Link { ino, new_parent, .. } => vec![*new_parent, *ino],
            FileOp::Rename { parent, new_parent, .. } => vec![*parent, *new_parent],
            _ => Vec::new(),
        }
    }

    /// Whether a copy of the request sent again (after a lost reply) must
    /// be answered, not applied twice: a change of the branch, or of the
    /// session's open files and locks. An open or release applied twice
    /// leaves a file's open count wrong (a deleted file kept forever, or
    /// freed while still open), and an unlock arriving late, after a newer
    /// lock of the same owner, would drop that lock while its holder
    /// believes it held. Such requests carry a tag.
    pub fn once(&self) -> bool {
        self.changes()
            || matches!(
                self,
                FileOp::Open { .. } | FileOp::Release { .. } | FileOp::SetLk { .. } | FileOp::UnlockAll { .. }
            )
    }

    /// Whether the operation changes the branch: such a request's tag is
    /// recorded in the branch with it, so that a later owner, too, knows
    /// it applied.
    pub fn changes(&self) -> bool {
        matches!(
            self,
            FileOp::SetAttr { .. }
                | FileOp::Create { .. }
                | FileOp::CreateOpen { .. }
                | FileOp::Mkdir { .. }
                | FileOp::Symlink { .. }
                | FileOp::Link { .. }
                | FileOp::Unlink { .. }
                | FileOp::Rmdir { .. }
                | FileOp::Rename { .. }
                | FileOp::Write { .. }
                | FileOp::CloneRange { .. }
                | FileOp::SetXattr { .. }
                | FileOp::RemoveXattr { .. }
        )
    }
}

/// What an operation gave.
#[derive(Clone, Debug, bincode::Encode, bincode::Decode)]
pub enum Out {
    Unit,
    Attr(Attr),
    Bytes(Vec<u8>),
    Written(u64),
    Entries(Vec<DirEntryOut>),
    StatFs(StatFs),
    Names(Vec<Vec<u8>>),
    Lock(Option<Lock>),
    Commit {
        writer: u64,
        seq: u32,
        off: u32,
        len: u32,
    },
    /// A checkpoint's description (JSON), or why it was refused.
    Message(Result<String, String>),
    Located(Located),
    /// `(slot, newest sequence)` of one client's requests ([`FileOp::Slots`]).
    Slots(Vec<(u32, u64)>),
}

/// Where a range of a file's bytes is ([`FileOp::Locate`]).
#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct Located {
    /// The file's size when located.
    pub size: u64,
    /// How far `spans` reach (holes between them read as zeros).
    pub end: u64,
    pub spans: Vec<Span>,
}

#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct Span {
    /// The file offset it starts at.
    pub at: u64,
    pub len: u64,
    /// The extent (`arbor_engine::volume::Extent::encode`) in a segment the
    /// client can read itself; `None`: only the owner has these bytes (not
    /// uploaded yet, inline, or an imported file's object).
    pub extent: Option<Vec<u8>>,
}

/// Spans one [`FileOp::Locate`] answers at most: a large file written in small
/// pieces is located a window at a time.
pub const LOCATE_MAX_SPANS: usize = 1024;

/// Makes a checkpoint of the owned branch's volume: the owner's process
/// knows its catalog; the network code does not.
pub type Checkpointer = Arc<dyn Fn(&str) -> Result<String, String> + Send + Sync>;

/// An operation's result: what it gave, or an errno.
pub type Reply = Result<Out, i32>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct SessionInfo {
    pub session: u64,
    /// Changes when the owner restarts.
    pub epoch: u64,
    /// The newest event now: the session polls for what comes after it.
    pub seq: u64,
    /// How many owners the branch had, this one included (durable before
    /// it answers): a client takes back only locks the owner just before
    /// this one granted it.
    pub generation: u64,
}

/// Something another node changed.
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub enum Event {
    /// An inode's attributes or bytes.
    Inode(u64),
    /// What a name in a directory points at.
    Entry(u64, Vec<u8>),
}

#[derive(Clone, Debug, bincode::Encode, bincode::Decode)]
pub struct Events {
    /// The sequence to ask after next time.
    pub next: u64,
    pub epoch: u64,
    /// Some events after the asked sequence were already dropped.
    pub gap: bool,
    pub items: Vec<Event>,
}

#[derive(Clone)]
struct Held {
    session: u64,
    owner: u64,
    lock: Lock,
}

struct Session {
    last_seen: BootInstant,
    open: HashMap<u64, u32>,
    /// The client id its first tagged request or slots question named:
    /// the only one it may speak for afterwards.
    client: Option<u64>,
}

#[derive(Default)]
struct State {
    sessions: HashMap<u64, Session>,
    /// Locks by inode.
    locks: HashMap<u64, Vec<Held>>,
    /// (sequence, session it came from, event), oldest first.
    events: VecDeque<(u64, u64, Event)>,
    next_seq: u64,
    /// Sessions opened so far: each gets a number never given before in
    /// this owner's life (a client resends writes only under the session
    /// they went out on, so an id must not come back).
    sessions_made: u64,
}

/// One branch this process owns.
pub struct SharedBranch {
    name: String,
    vol: Arc<Volume>,
    checkpoint: Option<Checkpointer>,
    /// What clients may do to owners and privileges.
    policy: Policy,
    epoch: u64,
    state: Mutex<State>,
    /// Answers to recent tagged requests.
    replies: Replies,
    /// Woken when an event is recorded or a lock is dropped.
    changed: tokio::sync::Notify,
    /// The lock grace period and the branch's durable mark of locks.
    grace: Mutex<Grace>,
    /// Inode numbers are given out below this only: it is durable before
    /// a number near it is (see [`SharedBranch::reserve_inodes`]).
    inodes_reserved: Mutex<u64>,
}

/// Mixed into the client id of a session's opens and locks in the reply
/// cache (see [`SharedBranch::apply_request`]).
const SESSION_KEYED: u64 = 0x5e55_10e0_0000_0001;

/// Inode numbers reserved at once: one durable record (and sync) per this
/// many new files.
pub const INODE_BLOCK: u64 = 1 << 16;

/// Whether this owner grants only reclaims, and what the branch records of
/// locks (see [`crate::branch::locks`]).
struct Grace {
    /// When this owner began to serve.
    started: BootInstant,
    /// How long its grace period is.
    length: Duration,
    /// The branch may have locks from an owner before this one: a grace
    /// period applies until `started + length`.
    from_before: bool,
    /// The mark's two counts as this owner knows them.
    granted: u64,
    cleared: u64,
    /// This owner made the mark (before its first grant).
    marked: bool,
    /// This owner's generation (see [`SessionInfo::generation`]).
    generation: u64,
}

impl Grace {
    /// What `vol` records of locks: a grace period of [`LOCK_GRACE`] if an
    /// owner before may have granted some.
    fn read(vol: &Volume) -> Grace {
        let slots = match vol.request_slots(LOCKS_CLIENT) {
            Ok(slots) => Some(slots),
            Err(e) => {
                // Unreadable: locks from before assumed (a grace period
                // costs only waiting), none taken back (a generation no
                // client can follow), the mark read again before a grant.
                tracing::warn!(error = %e, "cannot read the branch's mark of locks; assuming locks from before");
                None
            }
        };
        let count = |slot| slots.as_ref().and_then(|v| v.iter().find(|(s, _)| *s == slot)).map_or(0, |&(_, n)| n);
        let (granted, cleared) = (count(GRANTED_SLOT), count(CLEARED_SLOT));
        // One more owner, durably before any answer; u64::MAX (no
        // reclaim matches) if it cannot be recorded.
        let generation = count(GENERATION_SLOT).saturating_add(1);
        let tag = RequestTag { client: LOCKS_CLIENT, slot: GENERATION_SLOT, seq: generation };
        let generation = match slots {
            Some(_) => vol
                .tagged(tag, Takes::Operation, |_| Ok(()))
                .and_then(|()| vol.sync_all())
                .map_or(u64::MAX, |()| generation),
            None => u64::MAX,
        };
        let from_before = slots.is_none() || granted > cleared;
        Grace {
            started: BootInstant::now(),
            length: LOCK_GRACE,
            from_before,
            granted,
            cleared,
            marked: false,
            generation,
        }
    }

    fn active(&self) -> bool {
        self.from_before && self.started.elapsed() < self.length
    }

    /// Records, durably and once, that this owner grants locks. The counts
    /// are read again first: those read at the start may not have been.
    fn mark(&mut self, vol: &Volume) -> Result<(), Error> {
        if self.marked {
            return Ok(());
        }
        let slots = vol.request_slots(LOCKS_CLIENT)?;
        let count = |slot| slots.iter().find(|(s, _)| *s == slot).map_or(0, |&(_, n)| n);
        (self.granted, self.cleared) = (count(GRANTED_SLOT), count(CLEARED_SLOT));
        if self.granted <= self.cleared {
            let seq = self.granted.max(self.cleared) + 1;
            vol.tagged(RequestTag { client: LOCKS_CLIENT, slot: GRANTED_SLOT, seq }, Takes::Operation, |_| Ok(()))?;
            vol.sync_all()?;
            self.granted = seq;
        }
        self.marked = true;
        Ok(())
    }
}

fn errno(e: &Error) -> i32 {
    if let Error::Corrupted { what, addr } = e {
        tracing::error!(what, addr, "returning EIO for corrupt data");
    }
    e.errno()
}

/// An errno the policy answered, as the volume's errors carry one.
fn refused(n: i32) -> Error {
    Error::Io(std::io::Error::from_raw_os_error(n))
}

/// `held` (one owner's locks on one file) with `range` taken out.
fn cut(held: Vec<Held>, session: u64, owner: u64, range: &Lock) -> Vec<Held> {
    let mut out = Vec::with_capacity(held.len() + 1);
    for h in held {
        if h.session != session || h.owner != owner || !overlaps(&h.lock, range) {
            out.push(h);
            continue;
        }
        if h.lock.start < range.start {
            out.push(Held { lock: Lock { end: range.start - 1, ..h.lock }, ..h });
        }
        if h.lock.end > range.end {
            out.push(Held { session, owner, lock: Lock { start: range.end + 1, ..h.lock } });
        }
    }
    out
}

impl SharedBranch {
    pub fn new(name: &str, vol: Arc<Volume>, checkpoint: Option<Checkpointer>, policy: Policy) -> Arc<SharedBranch> {
        // Random, so two owner processes never share an epoch (a clock
        // and pid alone repeat across container restarts).
        let mut random = [0u8; 8];
        let drawn =
            std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random));
        let fallback =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
                ^ ((std::process::id() as u64) << 40);
        let epoch = if drawn.is_ok() { u64::from_le_bytes(random) | 1 } else { fallback };
        let vol_for_grace = vol.clone();
        Arc::new(SharedBranch {
            name: name.into(),
            vol,
            checkpoint,
            policy,
            epoch,
            state: Mutex::new(State { next_seq: 1, ..State::default() }),
            replies: Replies::default(),
            changed: tokio::sync::Notify::new(),
            grace: Mutex::new(Grace::read(&vol_for_grace)),
            inodes_reserved: Mutex::new(reserved_inodes(&vol_for_grace)),
        })
    }

    /// Makes sure the next new file's number is reserved durably, so that
    /// a crash of this owner never lets the next one give a number out
    /// again (a client may hold the lost file open under it): a reserved
    /// record and a sync once per [`INODE_BLOCK`] new files.
    fn reserve_inodes(&self) -> Result<(), Error> {
        let next = self.vol.next_inode();
        let mut reserved = self.inodes_reserved.lock();
        if next.saturating_add(INODE_BLOCK / 2) < *reserved {
            return Ok(());
        }
        let upto = next.saturating_add(INODE_BLOCK);
        let tag = RequestTag { client: INODES_CLIENT, slot: 0, seq: upto };
        self.vol.tagged(tag, Takes::Operation, |_| Ok(()))?;
        self.vol.sync_all()?;
        *reserved = upto;
        Ok(())
    }

    /// Sets the lock grace period (see [`crate::branch::locks`]); zero turns it
    /// off, which lets locks from before be granted to others at once.
    pub fn set_lock_grace(&self, length: Duration) {
        self.grace.lock().length = length.min(crate::branch::locks::MAX_LOCK_GRACE);
    }

    /// Starts the grace period now (when clients can first be served).
    pub fn start_lock_grace(&self) {
        self.grace.lock().started = BootInstant::now();
    }

    /// Whether this owner is in its lock grace period.
    pub fn in_lock_grace(&self) -> bool {
        self.grace.lock().active()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn volume(&self) -> &Arc<Volume> {
        &self.vol
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Client sessions now.
    pub fn sessions(&self) -> usize {
        self.state.lock().sessions.len()
    }

    /// Locks held now, over all files.
    pub fn locks(&self) -> usize {
        self.state.lock().locks.values().map(Vec::len).sum()
    }

    /// A new session, or `None` when the branch keeps [`MAX_SESSIONS`].
    pub fn open_session(&self) -> Option<SessionInfo> {
        let mut st = self.state.lock();
        if st.sessions.len() >= MAX_SESSIONS {
            return None;
        }
        // splitmix is a bijection: a new count gives an id never seen.
        st.sessions_made += 1;
        let mut id = splitmix(self.epoch ^ st.sessions_made);
        while id == 0 {
            st.sessions_made += 1;
            id = splitmix(self.epoch ^ st.sessions_made);
        }
        st.sessions.insert(id, Session { last_seen: BootInstant::now(), open: HashMap::new(), client: None });
        let generation = self.grace.lock().generation;
        Some(SessionInfo { session: id, epoch: self.epoch, seq: st.next_seq - 1, generation })
    }

    /// Marks `session` as heard from; false if it is unknown.
    pub fn touch(&self, session: u64) -> bool {
        let mut st = self.state.lock();
        match st.sessions.get_mut(&session) {
            Some(s) => {
                s.last_seen = BootInstant::now();
                true
            }
            None => false,
        }
    }

    /// Whether this owner stopped serving its branch: its volume refuses
    /// writes (another writer took the branch, or its log failed). Clients
    /// are then turned away, to look for the branch's owner again.
    pub fn stepped_down(&self) -> bool {
        self.vol.is_poisoned() || self.vol.is_fenced()
    }

    /// Drops sessions that went away, with their open files and locks.
    pub fn reap(&self) {
        self.reap_idle(SESSION_IDLE)
    }

    /// Drops the sessions not heard from for longer than `idle`.
    pub fn reap_idle(&self, idle: Duration) {
        self.replies.reap();
        self.clear_lock_mark();
        let now = BootInstant::now();
        let gone: Vec<(u64, Session)> = {
            let mut st = self.state.lock();
            let dead: Vec<u64> =
                st.sessions.iter().filter(|(_, s)| now.duration_since(s.last_seen) > idle).map(|(id, _)| *id).collect();
            let mut gone = Vec::new();
            for id in dead {
                if let Some(s) = st.sessions.remove(&id) {
                    gone.push((id, s));
                }
            }
            for held in st.locks.values_mut() {
                held.retain(|h| !gone.iter().any(|(id, _)| *id == h.session));
            }
            st.locks.retain(|_, v| !v.is_empty());
            gone
        };
        if gone.is_empty() {
            return;
        }
        for (id, s) in &gone {
            tracing::info!(branch = %self.name, session = format!("{id:016x}"), open_files = s.open.len(), "a client went away; dropping its open files and locks");
            for (&ino, &n) in &s.open {
                for _ in 0..n {
                    if let Err(e) = self.vol.release(ino) {
                        tracing::warn!(ino, error = %e, "releasing a departed client's file failed");
                    }
                }
            }
        }
        self.changed.notify_waiters();
    }

    fn record(&self, from: u64, events: impl IntoIterator<Item = Event>) {
        let mut st = self.state.lock();
        for e in events {
            // A run of writes to one file is one event.
            if st.events.back().is_some_and(|(_, s, last)| *s == from && *last == e) {
                continue;
            }
            let seq = st.next_seq;
            st.next_seq += 1;
            st.events.push_back((seq, from, e));
            if st.events.len() > EVENT_RING {
                st.events.pop_front();
            }
        }
        drop(st);
        self.changed.notify_waiters();
    }

    /// Events after `after` that other sessions caused, waiting up to
    /// `wait` for one.
    pub async fn events(&self, session: u64, mut after: u64, wait: Duration) -> Events {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.state.lock();
                let next = st.next_seq - 1;
                let first = st.events.front().map_or(st.next_seq, |e| e.0);
                let gap = after + 1 < first;
                let items: Vec<Event> =
                    st.events.iter().filter(|(seq, s, _)| *seq > after && *s != session).map(|e| e.2.clone()).collect();
                if !items.is_empty() || gap || tokio::time::Instant::now() >= deadline {
                    return Events { next, epoch: self.epoch, gap, items };
                }
                // Only this session's own changes so far.
                after = next.max(after);
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// [`FileOp::SetAttr`], once the policy allows it.
    fn set_attr(&self, ino: u64, asked: Change) -> Result<Attr, Error> {
        let file = self.vol.getattr(ino)?;
        let c = self.policy.setattr(&file, asked).map_err(refused)?;
        Files::setattr_by(&*self.vol, ino, c.change, c.caller, c.kill_suidgid)
    }

    /// Who owns a new file of `mode` `creator` makes, once the policy
    /// allows it.
    fn creator(&self, mode: u32, uid: u32, gid: u32) -> Result<Caller, Error> {
        self.policy.create(mode, Caller { uid, gid }).map_err(refused)
    }

    fn lookup_ino(&self, parent: u64, name: &[u8]) -> Option<u64> {
        self.vol.lookup(parent, name).ok().map(|a| a.ino)
    }

    /// Applies request `op` for `session` at most once: a copy of a tagged
    /// request gets the first copy's answer (see [`crate::branch::requests`]).
    pub fn apply_request(&self, session: u64, tag: Option<RequestTag>, op: FileOp) -> Reply {
        // Before the tag: a refused request leaves nothing in the reply cache.
        op.check()?;
        if matches!(
            op,
            FileOp::Create { .. } | FileOp::CreateOpen { .. } | FileOp::Mkdir { .. } | FileOp::Symlink { .. }
        ) {
            // Outside the request's own tagged call, which it must not nest in.
            self.reserve_inodes().map_err(|e| errno(&e))?;
        }
        if let FileOp::Slots { client } = op {
            self.speaks_for(session, client)?;
        }
        let Some(mut tag) = tag.filter(|_| op.once()) else { return self.apply(session, op) };
        self.speaks_for(session, tag.client)?;
        if !op.changes() {
            // Opens and locks belong to the session: their replies are kept
            // per session, so a copy sent again under a newer session (the
            // old one expired, its locks given away) is applied there, not
            // answered with what the old session got.
            tag.client ^= session.rotate_left(32) ^ SESSION_KEYED;
        }
        let floors = || self.vol.request_slots(tag.client).map_err(|e| errno(&e));
        match self.replies.begin(tag, floors)? {
            Begin::Answered(reply) => return reply,
            Begin::AppliedBefore => return self.answer_again(session, &op),
            Begin::Run => {}
        }
        if !op.changes() {
            // Opens and locks live in the session, which dies with this
            // owner: the reply cache is all a copy needs, and the branch
            // records nothing.
            let reply = self.apply(session, op);
            self.replies.finish(tag, &reply);
            return reply;
        }
        // A write's (and a clone's) tag waits for its own intent, past the
        // set-ID bits it may drop first.
        let takes = if matches!(op, FileOp::Write { .. } | FileOp::CloneRange { .. }) {
            Takes::Write
        } else {
            Takes::Operation
        };
        let reply = self
            .vol
            .tagged(tag, takes, |_| {
                self.apply(session, op).map_err(|n| Error::Io(std::io::Error::from_raw_os_error(n)))
            })
            .map_err(|e| errno(&e));
        self.replies.finish(tag, &reply);
        reply
    }

    /// Binds `session` to client id `client` the first time, and refuses
    /// (EPERM) a session that speaks for another client than it did: one
    /// token holder cannot move another mount's request slots.
    fn speaks_for(&self, session: u64, client: u64) -> Result<(), i32> {
        if reserved_client(client) {
            return Err(libc::EPERM);
        }
        let mut st = self.state.lock();
        let s = st.sessions.get_mut(&session).ok_or(libc::ESTALE)?;
        match s.client {
            None => {
                s.client = Some(client);
                Ok(())
            }
            Some(c) if c == client => Ok(()),
            Some(_) => Err(libc::EPERM),
        }
    }

    /// The answer to a request an earlier owner applied, from the state as
    /// it is now (the first answer died with that owner).
    fn answer_again(&self, session: u64, op: &FileOp) -> Reply {
        let v = &self.vol;
        let out = match op {
            FileOp::Write { data, .. } => Ok(Out::Written(data.len() as u64)),
            // A clone is applied only for its exact range.
            FileOp::CloneRange { len, .. } => Ok(Out::Written(*len)),
            FileOp::Create { parent, name, .. }
            | FileOp::Mkdir { parent, name, .. }
            | FileOp::Symlink { parent, name, .. }
            | FileOp::Link { new_parent: parent, new_name: name, .. } => v.lookup(*parent, name).map(Out::Attr),
            FileOp::CreateOpen { parent, name, .. } => {
                v.lookup(*parent, name).and_then(|a| self.open(session, a.ino, 1)).map(Out::Attr)
            }
            FileOp::SetAttr { ino, .. } => v.getattr(*ino).map(Out::Attr),
            // An open or lock older than the session's newest: not applied
            // now, and nothing was taken for this copy.
            FileOp::Open { .. } | FileOp::SetLk { .. } => return Err(libc::ESTALE),
            _ => Ok(Out::Unit),
        };
        out.map_err(|e| errno(&e))
    }

    /// Applies `op` for `session` (blocking: call it off the async threads;
    /// lock waits are [`SharedBranch::set_lock`]).
    pub fn apply(&self, session: u64, op: FileOp) -> Reply {
        use Event::{Entry, Inode};
        op.check()?;
        let v = &self.vol;
        let out =
            match op {
                FileOp::Lookup { parent, name } => v.lookup(parent, &name).map(Out::Attr),
                FileOp::GetAttr { ino } => v.getattr(ino).map(Out::Attr),
                FileOp::ReadLink { ino } => v.readlink(ino).map(Out::Bytes),
                FileOp::Read { ino, off, len } => v.read(ino, off, len as usize).map(Out::Bytes),
                FileOp::Locate { ino, off, len } => v.locate(ino, off, len, LOCATE_MAX_SPANS).map(|l| {
                    let spans = l
                        .places
                        .into_iter()
                        .map(|(at, place)| match place {
                            Place::Log(e) => Span { at, len: e.len as u64, extent: Some(e.encode()) },
                            Place::Here(len) => Span { at, len, extent: None },
                        })
                        .collect();
                    Out::Located(Located { size: l.size, end: l.end, spans })
                }),
                FileOp::StatFs => Ok(Out::StatFs(v.statfs())),
                FileOp::Slots { client } => v.request_slots(client).map(Out::Slots),
                FileOp::GetXattr { ino, name } => v.getxattr(ino, &name).map(Out::Bytes),
                FileOp::ListXattr { ino } => v.listxattr(ino).map(Out::Names),
                FileOp::ReadDir { ino, offset, max } => {
                    let mut entries = Vec::new();
                    let max = max.max(1) as usize;
                    v.readdir(ino, offset, |e| {
                        entries.push(e);
                        entries.len() < max
                    })
                    .map(|()| Out::Entries(entries))
                }
                FileOp::SetAttr { ino, change, caller, kill_suidgid } => {
                    let r = self.set_attr(ino, Change { change, caller, kill_suidgid }).map(Out::Attr);
                    self.record(session, [Inode(ino)]);
                    r
                }
                FileOp::Write { ino, data, unprivileged, append: true, .. } => {
                    let cleared = if self.policy.write_clears_set_id(unprivileged) {
                        v.getattr(ino).and_then(|a| arbor_engine::files::clear_privileges(&**v, a)).map(|_| ())
                    } else {
                        drop_capabilities(&**v, ino)
                    };
                    let r = cleared.and_then(|()| v.append(ino, &data)).map(|n| Out::Written(n as u64));
                    self.record(session, [Inode(ino)]);
                    r
                }
                FileOp::Write { ino, off, data, unprivileged, .. } => {
                    // A client's kernel checks a file's capabilities once and
                    // then trusts its mark (another node may have set them
                    // since), so the owner drops them on every write.
                    let r = if self.policy.write_clears_set_id(unprivileged) {
                        Files::write_unprivileged(&**v, ino, off, &data).map(|(n, _)| n)
                    } else {
                        drop_capabilities(&**v, ino).and_then(|()| v.write(ino, off, &data))
                    };
                    let r = r.map(|n| Out::Written(n as u64));
                    self.record(session, [Inode(ino)]);
                    r
                }
                FileOp::CloneRange { src, src_off, dst, dst_off, len } => {
                    // Checked before the set-ID bits go: a refused clone
                    // changes nothing.
                    let r = v.check_clone(src, src_off, dst, dst_off, len).and_then(|cut| {
                        if cut != len {
                            return Err(Error::Invalid("a clone past the source's end"));
                        }
                        let a = v.getattr(dst)?;
                        arbor_engine::files::clear_privileges(&**v, a)?;
                        v.clone_range(src, src_off, dst, dst_off, len)
                    });
                    let r = r.map(Out::Written);
                    self.record(session, [Inode(dst)]);
                    r
                }
                FileOp::Fsync { ino } => v.fsync(ino).map(|()| Out::Unit),
                FileOp::Create { parent, name, mode, uid, gid, rdev } => {
                    let r = self
                        .creator(mode, uid, gid)
                        .and_then(|o| v.create(parent, &name, mode, o.uid, o.gid, rdev))
                        .map(Out::Attr);
                    self.record(session, [Entry(parent, name), Inode(parent)]);
                    r
                }
                FileOp::CreateOpen { parent, name, mode, uid, gid } => {
                    let r = self
                        .creator(mode, uid, gid)
                        .and_then(|o| v.create(parent, &name, mode, o.uid, o.gid, 0))
                        .and_then(|a| self.open(session, a.ino, 1));
                    self.record(session, [Entry(parent, name), Inode(parent)]);
                    r.map(Out::Attr)
                }
                FileOp::Mkdir { parent, name, perm, uid, gid } => {
                    let r = self
                        .creator(libc::S_IFDIR | u32::from(perm), uid, gid)
                        .and_then(|o| v.mkdir(parent, &name, perm, o.uid, o.gid))
                        .map(Out::Attr);
                    self.record(session, [Entry(parent, name), Inode(parent)]);
                    r
                }
                FileOp::Symlink { parent, name, target, uid, gid } => {
                    let r = self
                        .creator(libc::S_IFLNK | 0o777, uid, gid)
                        .and_then(|o| v.symlink(parent, &name, &target, o.uid, o.gid))
                        .map(Out::Attr);
                    self.record(session, [Entry(parent, name), Inode(parent)]);
                    r
                }
                FileOp::Link { ino, new_parent, new_name } => {
                    let r = v.link(ino, new_parent, &new_name).map(Out::Attr);
                    self.record(session, [Entry(new_parent, new_name), Inode(new_parent), Inode(ino)]);
                    r
                }
                FileOp::Unlink { parent, name } => {
                    let child = self.lookup_ino(parent, &name);
                    let r = v.unlink(parent, &name).map(|()| Out::Unit);
                    self.record(session, [Entry(parent, name), Inode(parent)].into_iter().chain(child.map(Inode)));
                    r
                }
                FileOp::Rmdir { parent, name } => {
                    let child = self.lookup_ino(parent, &name);
                    let r = v.rmdir(parent, &name).map(|()| Out::Unit);
                    self.record(session, [Entry(parent, name), Inode(parent)].into_iter().chain(child.map(Inode)));
                    r
                }
                FileOp::Rename { parent, name, new_parent, new_name, mode } => {
                    let moved = self.lookup_ino(parent, &name);
                    let replaced = self.lookup_ino(new_parent, &new_name);
                    let r = v.rename(parent, &name, new_parent, &new_name, mode).map(|()| Out::Unit);
                    let touched = [Entry(parent, name), Entry(new_parent, new_name), Inode(parent), Inode(new_parent)];
                    self.record(session, touched.into_iter().chain(moved.map(Inode)).chain(replaced.map(Inode)));
                    r
                }
                FileOp::Open { ino, count } => self.open(session, ino, count).map(Out::Attr),
                FileOp::Release { ino } => self.release(session, ino).map(|()| Out::Unit),
                FileOp::SetXattr { ino, name, value, flags } => {
                    let r = self.policy.setxattr(&name).map_err(refused);
                    let r = r.and_then(|()| v.setxattr(ino, &name, &value, flags)).map(|()| Out::Unit);
                    self.record(session, [Inode(ino)]);
                    r
                }
                FileOp::RemoveXattr { ino, name } => {
                    let r = v.removexattr(ino, &name).map(|()| Out::Unit);
                    self.record(session, [Inode(ino)]);
                    r
                }
                FileOp::GetLk { ino, owner, lock } => {
                    if self.in_lock_grace() {
                        return Err(IN_GRACE);
                    }
                    return Ok(Out::Lock(self.get_lock(session, ino, owner, &lock)));
                }
                FileOp::SetLk { ino, owner, lock, reclaim, .. } => {
                    return self.take_lock(session, ino, owner, lock, reclaim);
                }
                FileOp::Commit => v
                    .commit()
                    .and_then(|()| v.last_commit().ok_or(Error::ReadOnly))
                    .map(|a| Out::Commit { writer: a.seg.writer, seq: a.seg.seq, off: a.off, len: a.len }),
                FileOp::Checkpoint { name } => match &self.checkpoint {
                    Some(f) => Ok(Out::Message(f(&name))),
                    None => Err(Error::Io(std::io::Error::from_raw_os_error(libc::ENOSYS))),
                },
                FileOp::UnlockAll { ino, owner } => {
                    let all = Lock { start: 0, end: u64::MAX, typ: libc::F_UNLCK, pid: 0 };
                    return self.try_lock(session, ino, owner, all);
                }
            };
        out.map_err(|e| errno(&e))
    }

    fn open(&self, session: u64, ino: u64, count: u32) -> Result<Attr, Error> {
        let mut attr = None;
        let mut taken = 0;
        for _ in 0..count.max(1) {
            match self.vol.acquire(ino) {
                Ok(a) => {
                    attr = Some(a);
                    taken += 1;
                }
                Err(e) => {
                    for _ in 0..taken {
                        let _ = self.vol.release(ino);
                    }
                    return Err(e);
                }
            }
        }
        let kept = {
            let mut st = self.state.lock();
            match st.sessions.get_mut(&session) {
                Some(s) => {
                    let held = s.open.entry(ino).or_default();
                    held.checked_add(taken).map(|n| *held = n).ok_or(libc::EMFILE)
                }
                // The session was dropped meanwhile: nobody will release these.
                None => Err(libc::ESTALE),
            }
        };
        if let Err(errno) = kept {
            for _ in 0..taken {
                let _ = self.vol.release(ino);
            }
            return Err(Error::Io(std::io::Error::from_raw_os_error(errno)));
        }
        attr.ok_or(Error::NotFound)
    }

    fn release(&self, session: u64, ino: u64) -> Result<(), Error> {
        {
            let mut st = self.state.lock();
            let Some(s) = st.sessions.get_mut(&session) else { return Ok(()) };
            match s.open.get_mut(&ino) {
                Some(n) if *n > 1 => *n -= 1,
                Some(_) => {
                    s.open.remove(&ino);
                }
                // Opened before the owner restarted and not opened again.
                None => return Ok(()),
            }
            // POSIX: closing any descriptor of a file drops the process's
            // fcntl locks on it; the kernel sends an unlock for those
            // itself, so nothing more is done here.
        }
        self.vol.release(ino)
    }

    /// Whether a lock may be granted now: a reclaim only in the grace
    /// period, anything else only after it; never by an owner that lost
    /// the branch or whose lease lapsed (its grants could meet a new
    /// owner's). The branch is marked as having locks first.
    fn may_grant(&self, reclaim: bool) -> Result<(), i32> {
        let mut g = self.grace.lock();
        match (reclaim, g.active()) {
            (true, false) => return Err(libc::ENOLCK),
            (false, true) => return Err(IN_GRACE),
            _ => {}
        }
        if self.vol.is_fenced() {
            return Err(libc::ENOLCK);
        }
        g.mark(&self.vol).map_err(|e| {
            tracing::error!(branch = %self.name, error = %e, "cannot record that the branch has locks; refusing the lock");
            libc::ENOLCK
        })
    }

    /// Clears the branch's mark of locks once the grace period ended with
    /// none granted by this owner and none held.
    fn clear_lock_mark(&self) {
        let none_held = self.state.lock().locks.is_empty();
        let mut g = self.grace.lock();
        if !none_held || g.marked || !g.from_before || g.active() {
            return;
        }
        let tag = RequestTag { client: LOCKS_CLIENT, slot: CLEARED_SLOT, seq: g.granted };
        match self.vol.tagged(tag, Takes::Operation, |_| Ok(())) {
            Ok(()) => {
                g.cleared = g.granted;
                g.from_before = false;
                tracing::info!(branch = %self.name, "lock grace period over; no lock was reclaimed");
            }
            Err(e) => tracing::warn!(branch = %self.name, error = %e, "cannot clear the branch's mark of locks"),
        }
    }

    fn get_lock(&self, session: u64, ino: u64, owner: u64, lock: &Lock) -> Option<Lock> {
        let st = self.state.lock();
        st.locks
            .get(&ino)?
            .iter()
            .find(|h| !(h.session == session && h.owner == owner) && conflicts(&h.lock, lock))
            .map(|h| {
                // The pid is only meaningful on the holder's node.
                h.lock
            })
    }

    /// Takes or drops `lock` now, or EAGAIN ([`IN_GRACE`] in the lock
    /// grace period).
    pub fn try_lock(&self, session: u64, ino: u64, owner: u64, lock: Lock) -> Reply {
        self.take_lock(session, ino, owner, lock, false)
    }

    /// [`SharedBranch::try_lock`], or with `reclaim` a lock the client held
    /// under the owner before: granted only in the grace period (ENOLCK
    /// after it), and the only locks granted then.
    fn take_lock(&self, session: u64, ino: u64, owner: u64, lock: Lock, reclaim: bool) -> Reply {
        if lock.typ != libc::F_UNLCK {
            self.may_grant(reclaim)?;
        }
        let mut st = self.state.lock();
        if !st.sessions.contains_key(&session) {
            return Err(libc::ESTALE);
        }
        let mut held = st.locks.remove(&ino).unwrap_or_default();
        if reclaim {
            // A reclaim taken by an earlier session of the same client (its
            // reclaims broke off when the owner went away again; that
            // session is abandoned, and dies in SESSION_IDLE) is the same
            // holder's: it moves to this session rather than conflict.
            let client = st.sessions.get(&session).and_then(|s| s.client);
            let mine = |h: &Held| {
                h.owner == owner
                    && h.session != session
                    && client.is_some()
                    && st.sessions.get(&h.session).and_then(|s| s.client) == client
            };
            let moved: Vec<Held> = held.iter().filter(|h| mine(h)).cloned().collect();
            held.retain(|h| !mine(h));
            held.extend(moved.into_iter().map(|h| Held { session, ..h }));
        }
        if lock.typ != libc::F_UNLCK
            && held.iter().any(|h| !(h.session == session && h.owner == owner) && conflicts(&h.lock, &lock))
        {
            st.locks.insert(ino, held);
            return Err(libc::EAGAIN);
        }
        let mut held = cut(held, session, owner, &lock);
        if lock.typ != libc::F_UNLCK {
            held.push(Held { session, owner, lock });
        }
        if !held.is_empty() {
            st.locks.insert(ino, held);
        }
        drop(st);
        if lock.typ == libc::F_UNLCK {
            self.changed.notify_waiters();
        }
        Ok(Out::Unit)
    }

    /// Takes `lock`, waiting while others hold a conflicting one (or until
    /// the session is dropped).
    pub async fn set_lock(&self, session: u64, ino: u64, owner: u64, lock: Lock) -> Reply {
        self.set_lock_while(session, ino, owner, lock, || true).await
    }

    /// [`SharedBranch::set_lock`], giving up with `EINTR` once `go_on`
    /// says so (checked at least every half second).
    pub async fn set_lock_while(
        &self,
        session: u64,
        ino: u64,
        owner: u64,
        lock: Lock,
        go_on: impl Fn() -> bool,
    ) -> Reply {
        loop {
            if !go_on() {
                return Err(libc::EINTR);
            }
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_lock(session, ino, owner, lock) {
                Err(libc::EAGAIN | IN_GRACE) => {}
                r => return r,
            }
            // A lock is dropped with a notification; the timeout covers a
            // holder that went away between the try and the wait.
            let _ = tokio::time::timeout(Duration::from_millis(500), notified).await;
        }
    }
}

/// How far inode numbers were reserved on `vol` (the volume itself gives
/// none out below that once opened, see `Volume::open`).
fn reserved_inodes(vol: &Volume) -> u64 {
    vol.request_slots(INODES_CLIENT)
        .ok()
        .and_then(|slots| slots.iter().find(|(s, _)| *s == 0).map(|&(_, n)| n))
        .unwrap_or(0)
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(start: u64, end: u64, typ: i32) -> Lock {
        Lock { start, end, typ, pid: 1 }
    }

    #[test]
    fn unlocking_the_middle_of_a_range_leaves_both_ends() {
        let held = vec![Held { session: 1, owner: 7, lock: l(0, 99, libc::F_WRLCK) }];
        let left = cut(held, 1, 7, &l(10, 19, libc::F_UNLCK));
        let ranges: Vec<(u64, u64)> = left.iter().map(|h| (h.lock.start, h.lock.end)).collect();
        assert_eq!(ranges, vec![(0, 9), (20, 99)]);
    }

    #[test]
    fn a_branch_keeps_at_most_its_sessions_and_makes_room_as_they_go() {
        let cfg = arbor_engine::volume::Config {
            commit_interval: None,
            env: arbor_engine::env::TestEnv::new(3),
            ..Default::default()
        };
        let vol = Volume::open(Arc::new(arbor_engine::device::SimDevice::new()), cfg).expect("open");
        let b = SharedBranch::new("main", vol, None, crate::branch::policy::Policy::default());
        for _ in 0..MAX_SESSIONS {
            b.open_session().expect("a session under the cap");
        }
        assert!(b.open_session().is_none(), "one past the cap");
        std::thread::sleep(Duration::from_millis(2));
        b.reap_idle(Duration::from_millis(1));
        assert_eq!(b.sessions(), 0);
        assert!(b.open_session().is_some(), "room once they went");
    }

    #[test]
    fn read_locks_share_and_write_locks_exclude() {
        assert!(!conflicts(&l(0, 10, libc::F_RDLCK), &l(5, 20, libc::F_RDLCK)));
        assert!(conflicts(&l(0, 10, libc::F_RDLCK), &l(5, 20, libc::F_WRLCK)));
        assert!(!conflicts(&l(0, 10, libc::F_WRLCK), &l(11, 20, libc::F_WRLCK)));
    }
}
