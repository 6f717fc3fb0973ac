//! Branch heads: the device of a branch whose superblock is an object in
//! the store, over one set of segments shared by every branch (segment
//! names are globally unique), and the read-only device of a frozen root.
//!
//! A branch's superblock is its head object `branches/<name>`, replaced
//! only by compare-and-swap on the tag the writer last saw, so a second
//! writer of the same branch is fenced off instead of corrupting it.

use crate::bucket::{ETag, ObjectStore};
use crate::clock::BootInstant;
use crate::device::{Device, Replica, SegmentFile};
use crate::error::{Error, Result};
use crate::format::{Addr, SegId};
use crate::volume::Superblock;
use parking_lot::Mutex;
use std::sync::Arc;

pub use crate::layout::{branch_key, checkpoint_key};

const HEAD_MAGIC: &[u8; 4] = b"ARHD";
/// Heads whose lease says where its pid means something, how long it
/// lives by its holder's clock, and which renewal this is.
const HEAD_MAGIC_2: &[u8; 4] = b"ARH2";

/// Who writes a branch. A head object with a lease refuses a second
/// writer until the lease is seen to lapse: its holder renews it every
/// third of `ttl_ms`, each renewal changes the head, and a reader that
/// watches the head go unchanged for longer than `ttl_ms` by its own
/// clock knows the holder stopped. No two clocks are ever compared.
#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct Lease {
    /// The holder's writer epoch (its segments are `seg-<writer>-…`).
    pub writer: u64,
    pub host: String,
    pub pid: u32,
    /// Seconds since the Unix epoch by the holder's clock when the claim
    /// lapses: shown to people, never compared with another clock.
    pub expires: u64,
    /// Where `pid` names this process: the boot and PID namespace it was
    /// read in (see [`LeaseConfig::pid_scope`]); empty if unknown.
    pub pid_scope: String,
    /// How long one renewal holds, in milliseconds of the holder's clock.
    pub ttl_ms: u64,
    /// Counts the holder's head writes, so that every renewal changes
    /// the head (and its tag) even when nothing else did.
    pub renewal: u64,
}

/// The lease of heads written before [`Lease::pid_scope`] existed.
#[derive(bincode::Decode)]
struct LeaseV1 {
    writer: u64,
    host: String,
    pid: u32,
    expires: u64,
}

/// Whether process `pid` on this host is alive (the caller knows how;
/// the engine knows nothing of processes).
pub type ProcessAlive = Arc<dyn Fn(u32) -> bool + Send + Sync>;

/// The longest a reader waits to see a lease lapse, whatever life the
/// lease claims.
const LAPSE_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(600);

/// How a writer claims its branch: which host and process it is, how long
/// a claim lives without renewal (renewed every third of that), and how to
/// tell whether a holder in this node's own PID scope is still alive.
#[derive(Clone)]
pub struct LeaseConfig {
    pub host: String,
    pub pid: u32,
    /// The boot and PID namespace `pid` belongs to (e.g. the boot id and
    /// `/proc/self/ns/pid`): a holder is judged by `alive` only when its
    /// lease names the same non-empty scope, so a process in another
    /// container on this host is never thought dead because its pid
    /// means nothing here. Empty: never judged by pid.
    pub pid_scope: String,
    pub ttl: std::time::Duration,
    /// `None`: every holder is judged by watching its lease.
    pub alive: Option<ProcessAlive>,
    /// Take the branch even from a live lease: the operator knows its
    /// holder is dead (its node is gone). A holder that was not dead after
    /// all is fenced at its next head write or bucket fsync.
    pub take_over: bool,
}

impl LeaseConfig {
    /// A claim by `host` lasting `ttl`, judged by watching alone.
    pub fn new(host: &str, ttl: std::time::Duration) -> LeaseConfig {
        LeaseConfig { host: host.into(), pid: 0, pid_scope: String::new(), ttl, alive: None, take_over: false }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Lease {
    /// What the writer `me` configures can tell of this holder at once:
    /// `Some(alive)` for a holder on the same host in the same non-empty
    /// PID scope, judged by its process; `None` anywhere else, where only
    /// watching the lease tells (see [`HeadDevice`]).
    pub fn judged_here(&self, me: Option<&LeaseConfig>) -> Option<bool> {
        match me {
            Some(LeaseConfig { host, pid_scope, alive: Some(alive), .. })
                if *host == self.host && !pid_scope.is_empty() && *pid_scope == self.pid_scope =>
            {
                Some(alive(self.pid))
            }
            _ => None,
        }
    }

    /// Whether this lease is the one `me` writes.
    pub fn is_mine(&self, me: &LeaseConfig) -> bool {
        self.host == me.host && self.pid == me.pid && self.pid_scope == me.pid_scope
    }

    /// How long a reader watches this lease before it counts as lapsed.
    fn lapse_wait(&self) -> std::time::Duration {
        // A fifth more than its life, for clocks that run at other rates.
        (std::time::Duration::from_millis(self.ttl_ms) * 6 / 5).min(LAPSE_WAIT_MAX)
    }
}

/// A branch head object: the superblock, and the writer's lease if one holds it.
/// Without a lease it is the superblock's own encoding; with one,
/// `"ARH2" | superblock length u32 | superblock | lease | crc32c u32`
/// (heads of older writers say `"ARHD"` and carry a shorter lease).
pub fn encode_head(superblock: &[u8], lease: Option<&Lease>) -> Vec<u8> {
    let Some(lease) = lease else { return superblock.to_vec() };
    let mut out = HEAD_MAGIC_2.to_vec();
    out.extend_from_slice(&(superblock.len() as u32).to_le_bytes());
    out.extend_from_slice(superblock);
    out.extend_from_slice(&crate::format::encode_value(lease));
    let crc = crate::crc::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Splits a head object into its superblock bytes (checked) and lease.
pub fn decode_head(bytes: &[u8]) -> Result<(Vec<u8>, Superblock, Option<Lease>)> {
    let v2 = bytes.starts_with(HEAD_MAGIC_2);
    if !v2 && !bytes.starts_with(HEAD_MAGIC) {
        let sb = Superblock::decode(bytes)?;
        return Ok((bytes.to_vec(), sb, None));
    }
    let bad = || Error::corrupted("branch head", "lease");
    let split = bytes.len().checked_sub(4).ok_or_else(bad)?;
    if bytes.len() < 12 || crate::crc::crc32c(&bytes[..split]).to_le_bytes() != bytes[split..] {
        return Err(bad());
    }
    let sb_len = u32::from_le_bytes(bytes[4..8].try_into().map_err(|_| bad())?) as usize;
    let sb_end = 8usize.checked_add(sb_len).filter(|&e| e <= split).ok_or_else(bad)?;
    let sb_bytes = bytes[8..sb_end].to_vec();
    let sb = Superblock::decode(&sb_bytes)?;
    let lease: Lease = if v2 {
        crate::format::decode_value(&bytes[sb_end..split], "lease").map_err(|_| bad())?
    } else {
        let old: LeaseV1 = crate::format::decode_value(&bytes[sb_end..split], "lease").map_err(|_| bad())?;
        // Its life was a minute; its pid is judged nowhere.
        let (writer, host, pid, expires) = (old.writer, old.host, old.pid, old.expires);
        Lease { writer, host, pid, expires, pid_scope: String::new(), ttl_ms: 60_000, renewal: 0 }
    };
    Ok((sb_bytes, sb, Some(lease)))
}

/// Segments from `segments`, superblock from the branch's head object.
///
/// On a bucket-backed device the head never names a commit whose bytes are
/// not all in the bucket: the first write (the writer's claim at open)
/// waits for them, later ones are published when the uploads catch up.
/// Recovery replays the log from whichever commit the head names, so a
/// lagging head loses nothing the log holds.
pub struct HeadDevice {
    segments: Arc<dyn Device>,
    catalog: Arc<dyn ObjectStore>,
    key: String,
    /// The tag this writer last saw or wrote; `None` before its first
    /// head write.
    seen: Mutex<Option<ETag>>,
    claimed: std::sync::atomic::AtomicBool,
    me: std::sync::Weak<HeadDevice>,
    lease: Option<LeaseConfig>,
    /// The lease found at open, if any.
    found: Mutex<Option<Lease>>,
    /// The superblock last written, and when (for renewals and release).
    last: Mutex<Option<(Superblock, BootInstant)>>,
    /// Set when another writer took the branch.
    fenced: Mutex<Option<String>>,
    released: std::sync::atomic::AtomicBool,
    /// Head writes so far, carried in the lease ([`Lease::renewal`]).
    renewals: std::sync::atomic::AtomicU64,
    /// When the last head write that succeeded was sent: the lease holds
    /// from then for its life, by this process's clock.
    renewed_at: Mutex<Option<BootInstant>>,
    /// Whether the head names a commit of this writer's own log yet.
    own_head: std::sync::atomic::AtomicBool,
    /// The head bodies this writer sent since its last head write that it
    /// knows landed (at most [`TRIES_KEPT`]): one whose reply was lost may
    /// be in the bucket all the same. Each is unique to this writer and
    /// try (its lease's renewal count).
    tried: Mutex<std::collections::VecDeque<(Vec<u8>, Superblock)>>,
}

impl HeadDevice {
    pub fn new(segments: Arc<dyn Device>, catalog: Arc<dyn ObjectStore>, branch: &str) -> Arc<Self> {
        Self::with_lease(segments, catalog, branch, None)
    }

    /// A head whose writer holds a lease: a second writer (on any host)
    /// is refused while the lease is live; renewed in the background and
    /// released at close.
    pub fn with_lease(
        segments: Arc<dyn Device>,
        catalog: Arc<dyn ObjectStore>,
        branch: &str,
        lease: Option<LeaseConfig>,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| HeadDevice {
            segments,
            catalog,
            key: branch_key(branch),
            seen: Mutex::new(None),
            claimed: std::sync::atomic::AtomicBool::new(false),
            me: me.clone(),
            lease,
            found: Mutex::new(None),
            last: Mutex::new(None),
            fenced: Mutex::new(None),
            released: std::sync::atomic::AtomicBool::new(false),
            renewals: std::sync::atomic::AtomicU64::new(0),
            renewed_at: Mutex::new(None),
            own_head: std::sync::atomic::AtomicBool::new(false),
            tried: Mutex::new(std::collections::VecDeque::new()),
        })
    }

    fn lease_for(&self, superblock: &Superblock) -> Option<Lease> {
        let cfg = self.lease.as_ref()?;
        if self.released.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        Some(Lease {
            writer: superblock.commit.seg.writer,
            host: cfg.host.clone(),
            pid: cfg.pid,
            expires: unix_now() + cfg.ttl.as_secs(),
            pid_scope: cfg.pid_scope.clone(),
            ttl_ms: u64::try_from(cfg.ttl.as_millis()).unwrap_or(u64::MAX),
            renewal: self.renewals.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
        })
    }

    /// Renews the lease every third of its life while this head lives.
    fn spawn_renewal(&self) {
        let Some(cfg) = &self.lease else { return };
        let every = (cfg.ttl / 3).max(std::time::Duration::from_millis(100));
        let me = self.me.clone();
        let mut retry_at = BootInstant::now();
        let spawned = std::thread::Builder::new().name("arbor-lease".into()).spawn(move || loop {
            // Wakes every 100 ms (by the clock, so a pause counts whole):
            // renews when a third of the lease passed since the last head
            // write, and a second after a failed try.
            std::thread::sleep(std::time::Duration::from_millis(100));
            if me.strong_count() == 0 {
                return;
            }
            if BootInstant::now() < retry_at {
                continue;
            }
            let Some(head) = me.upgrade() else { return };
            if head.released.load(std::sync::atomic::Ordering::Acquire) || head.fenced.lock().is_some() {
                return;
            }
            if let Err(Error::Fenced(why)) = head.check_lease_age() {
                tracing::error!(%why, "lost the branch lease; refusing further writes");
                return;
            }
            match head.renew(every) {
                Ok(()) => {}
                Err(Error::Fenced(why)) => {
                    tracing::error!(%why, "lost the branch lease; refusing further writes");
                    *head.fenced.lock() = Some(why);
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "renewing the branch lease failed; trying again in a second");
                    retry_at = BootInstant::now() + std::time::Duration::from_secs(1);
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the lease renewal thread");
        }
    }

    /// Makes the branch this writer's: replaces the head it read (the
    /// superblock `sb`, unchanged) with one carrying this writer's lease,
    /// by compare-and-swap on the tag it read. Synchronous, so a second
    /// writer learns at open; and done before the volume reads anything
    /// the old writer logged, so a writer that goes on after it was
    /// deposed fails its next fsync ([`Replica::log_synced`]) instead of
    /// acknowledging bytes the new writer never read.
    fn claim(&self, sb: &Superblock) -> Result<()> {
        let held = self.found.lock().clone();
        if let (Some(cfg), Some(held)) = (&self.lease, held) {
            if !cfg.take_over && !held.is_mine(cfg) {
                match held.judged_here(Some(cfg)) {
                    Some(false) => tracing::info!(pid = held.pid, "the branch's last writer on this node is gone"),
                    Some(true) => return Err(self.busy(&held, "its process runs on this node")),
                    None => self.wait_for_lapse(&held)?,
                }
            }
        }
        self.compare_and_swap(sb)?;
        self.claimed.store(true, std::sync::atomic::Ordering::Release);
        self.spawn_renewal();
        Ok(())
    }

    fn busy(&self, held: &Lease, how: &str) -> Error {
        Error::Busy(format!(
            "{} is open read-write by pid {} on host {} ({how}); a second writer is refused",
            self.key, held.pid, held.host
        ))
    }

    /// Watches the head, by this process's clock, for longer than the
    /// lease's life: a renewal (any change of the head) means its holder
    /// lives and this writer is refused; a head left unchanged that long
    /// means the holder stopped, and the claim goes ahead on the tag read.
    fn wait_for_lapse(&self, held: &Lease) -> Result<()> {
        let Some(tag) = self.seen.lock().clone() else { return Ok(()) };
        let wait = held.lapse_wait();
        tracing::info!(
            branch = %self.key, pid = held.pid, host = %held.host, secs = wait.as_secs_f64(),
            "the branch holds a lease from another process; waiting to see it renewed or lapse"
        );
        let start = BootInstant::now();
        // Bounded by `wait` (at most LAPSE_WAIT_MAX).
        while start.elapsed() < wait {
            std::thread::sleep((wait - start.elapsed()).min(std::time::Duration::from_millis(250)));
            match self.catalog.get(&self.key) {
                Ok((_, now)) if now == tag => {}
                Ok(_) | Err(Error::NoSuchObject(_)) => {
                    return Err(self.busy(held, "it renewed its lease while this writer watched"));
                }
                Err(e) => return Err(e),
            }
        }
        tracing::info!(branch = %self.key, "the lease lapsed unrenewed; claiming the branch");
        Ok(())
    }

    /// A holder that could not renew its lease for four fifths of its
    /// life stops: a reader watching the head may claim the branch once
    /// a whole life passed, and this writer must acknowledge nothing by
    /// then, whatever its durability.
    fn check_lease_age(&self) -> Result<()> {
        let Some(cfg) = &self.lease else { return Ok(()) };
        if !self.claimed.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        let Some(at) = *self.renewed_at.lock() else { return Ok(()) };
        if at.elapsed() <= cfg.ttl * 4 / 5 {
            return Ok(());
        }
        let why = format!(
            "{}: the lease could not be renewed for {:.1} s of its {} s life; this writer stops and acknowledges nothing more",
            self.key,
            at.elapsed().as_secs_f64(),
            cfg.ttl.as_secs()
        );
        *self.fenced.lock() = Some(why.clone());
        Err(Error::Fenced(why))
    }

    /// Whether the head in the bucket is still the one this writer last
    /// wrote; fences this writer off if not.
    fn check_still_ours(&self) -> Result<()> {
        let mut seen = self.seen.lock();
        let Some(mine) = seen.as_deref() else { return Ok(()) };
        let fenced = match self.catalog.get(&self.key) {
            Ok((_, tag)) if tag == mine => return Ok(()),
            // A head write whose reply was lost (an error to this writer)
            // may have landed all the same: the head then holds bytes this
            // writer sent (no other writer's), and the branch is still
            // ours, on that tag.
            Ok((body, tag)) if self.tried.lock().iter().any(|(b, _)| *b == body) => {
                let mut tried = self.tried.lock();
                // The head names that try's superblock: renewals write it
                // (or a newer one), never an older one over it.
                if let Some((_, sb)) = tried.iter().find(|(b, _)| *b == body) {
                    *self.last.lock() = Some((sb.clone(), BootInstant::now()));
                }
                tried.clear();
                *seen = Some(tag);
                return Ok(());
            }
            Ok(_) | Err(Error::NoSuchObject(_)) => {
                format!("{} was taken by another writer; this one stops and acknowledges nothing more", self.key)
            }
            Err(e) => return Err(e),
        };
        drop(seen);
        tracing::error!(why = %fenced, "fenced off the branch");
        *self.fenced.lock() = Some(fenced.clone());
        Err(Error::Fenced(fenced))
    }

    /// Replaces the head object (with a fresh lease, if leased) if nobody
    /// else did since we last saw it.
    fn compare_and_swap(&self, superblock: &Superblock) -> Result<()> {
        let mut seen = self.seen.lock();
        self.swap_locked(&mut seen, superblock)
    }

    /// Writes the newest superblock again with a fresh lease, if it was
    /// written longer than `every` ago.
    fn renew(&self, every: std::time::Duration) -> Result<()> {
        let mut seen = self.seen.lock();
        let stale = self.renewed_at.lock().is_none_or(|at| at.elapsed() >= every);
        let due = self.last.lock().as_ref().filter(|_| stale).map(|(b, _)| b.clone());
        match due {
            Some(sb) => self.swap_locked(&mut seen, &sb),
            None => Ok(()),
        }
    }

    fn swap_locked(&self, seen: &mut Option<ETag>, superblock: &Superblock) -> Result<()> {
        let body = encode_head(&superblock.encode(), self.lease_for(superblock).as_ref());
        {
            let mut tried = self.tried.lock();
            if tried.len() >= TRIES_KEPT {
                tried.pop_front();
            }
            tried.push_back((body.clone(), superblock.clone()));
        }
        let sent = BootInstant::now();
        let written = match seen.as_deref() {
            Some(tag) => self.catalog.put_if_match(&self.key, &body, tag),
            None => self.catalog.put_if_absent(&self.key, &body),
        };
        match written {
            Ok(tag) => {
                self.tried.lock().clear();
                *seen = Some(tag);
                *self.last.lock() = Some((superblock.clone(), BootInstant::now()));
                *self.renewed_at.lock() = Some(sent);
                Ok(())
            }
            Err(Error::PreconditionFailed(_) | Error::AlreadyExists(_) | Error::NoSuchObject(_)) => {
                // A PUT whose reply was lost and that was sent again meets
                // its own first landing: the head then holds these bytes.
                // One whose every reply was lost left the head as one of
                // this writer's earlier tries: replaced again, on that tag.
                if let Ok((now, tag)) = self.catalog.get(&self.key) {
                    let again = if now == body {
                        Ok(tag)
                    } else if self.tried.lock().iter().any(|(b, _)| *b == now) {
                        self.catalog.put_if_match(&self.key, &body, &tag)
                    } else {
                        Err(Error::PreconditionFailed(self.key.clone()))
                    };
                    if let Ok(tag) = again {
                        self.tried.lock().clear();
                        *seen = Some(tag);
                        *self.last.lock() = Some((superblock.clone(), BootInstant::now()));
                        *self.renewed_at.lock() = Some(sent);
                        return Ok(());
                    }
                }
                let why = format!("{} was changed by another writer; this one stops", self.key);
                *self.fenced.lock() = Some(why.clone());
                Err(Error::Fenced(why))
            }
            Err(e) => Err(e),
        }
    }
}

/// Head bodies a writer remembers having sent without knowing they landed.
const TRIES_KEPT: usize = 64;

macro_rules! delegate_segments {
    () => {
        fn create_segment(&self, id: SegId) -> Result<Arc<dyn SegmentFile>> {
            self.segments.create_segment(id)
        }
        fn open_segment(&self, id: SegId) -> Result<Option<Arc<dyn SegmentFile>>> {
            self.segments.open_segment(id)
        }
        fn list_segments(&self) -> Result<Vec<SegId>> {
            self.segments.list_segments()
        }
        fn remove_segment(&self, id: SegId) -> Result<()> {
            self.segments.remove_segment(id)
        }
        fn io_name(&self) -> &'static str {
            self.segments.io_name()
        }
        fn direct_bytes(&self) -> u64 {
            self.segments.direct_bytes()
        }
        fn segment_modified(&self, id: SegId) -> Result<Option<std::time::SystemTime>> {
            self.segments.segment_modified(id)
        }
        fn clocks(&self) -> Result<crate::device::Clocks> {
            self.segments.clocks()
        }
        fn segment_age(&self, id: SegId, at: crate::device::Clocks) -> Result<Option<std::time::Duration>> {
            self.segments.segment_age(id, at)
        }
        fn free_bytes(&self) -> Option<u64> {
            self.segments.free_bytes()
        }
    };
}

impl Device for HeadDevice {
    delegate_segments!();

    fn check_writable(&self) -> Result<()> {
        if let Some(why) = self.fenced.lock().clone() {
            return Err(Error::Fenced(why));
        }
        self.check_lease_age()?;
        self.segments.check_writable()
    }

    fn failpoint(&self, name: &'static str) -> Result<()> {
        self.segments.failpoint(name)
    }

    /// A head always answers: closing gives its lease back, with or
    /// without a bucket tier underneath.
    fn replica(&self) -> Option<&dyn Replica> {
        Some(self)
    }

    /// Reads the head; a leased writer then claims the branch at once (see
    /// `HeadDevice::claim`), before anything of the old writer's log is read.
    fn read_superblock(&self) -> Result<Option<Vec<u8>>> {
        // A body damaged on the way is read again; one damaged at rest is
        // reported as corrupt.
        let mut last = None;
        for _ in 0..4 {
            match self.catalog.get(&self.key) {
                Ok((body, tag)) => match decode_head(&body) {
                    Ok((superblock, sb, lease)) => {
                        *self.seen.lock() = Some(tag);
                        *self.found.lock() = lease;
                        if self.lease.is_some() {
                            self.claim(&sb)?;
                        }
                        return Ok(Some(superblock));
                    }
                    Err(e) => last = Some(e),
                },
                Err(Error::NoSuchObject(_)) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::corrupted("branch head", &self.key)))
    }

    fn write_superblock(&self, sb: &Superblock) -> Result<()> {
        let commit = sb.commit;
        if let Some(why) = self.fenced.lock().clone() {
            return Err(Error::Fenced(why));
        }
        if !self.claimed.load(std::sync::atomic::Ordering::Acquire) {
            // A branch made by this writer: its first head is the claim.
            if let Some(r) = self.segments.replica() {
                r.flush_to_bucket(commit)?;
            }
            self.claim(sb)?;
            self.own_head.store(true, std::sync::atomic::Ordering::Release);
            return Ok(());
        }
        if !self.own_head.load(std::sync::atomic::Ordering::Acquire) {
            // The claim (at open) kept the old writer's commit in the head.
            // Until the head names a commit of this writer's own log,
            // recovery would not find this log: the first such head is
            // written now, before anything is acknowledged, not later.
            if let Some(r) = self.segments.replica() {
                r.flush_to_bucket(commit)?;
            }
            self.compare_and_swap(sb)?;
            self.own_head.store(true, std::sync::atomic::Ordering::Release);
            return Ok(());
        }
        let me = self.me.clone();
        let sb = sb.clone();
        crate::device::publish_when_stored(
            self.segments.as_ref(),
            commit,
            Box::new(move || match me.upgrade() {
                Some(head) => head.compare_and_swap(&sb),
                None => Ok(()),
            }),
        )
    }
}

impl Replica for HeadDevice {
    fn segment_sealed(&self, id: SegId, len: u64) {
        if let Some(r) = self.segments.replica() {
            r.segment_sealed(id, len)
        }
    }
    /// The log is durable up to `len` of `id`. With bucket durability, the
    /// bytes are in the bucket now; an fsync is acknowledged only if the
    /// branch is still this writer's after that (a new writer claims the
    /// head before it reads the log, so either it sees these bytes or this
    /// check sees its claim).
    fn log_synced(&self, id: SegId, len: u64) -> Result<()> {
        if let Some(why) = self.fenced.lock().clone() {
            return Err(Error::Fenced(why));
        }
        let Some(r) = self.segments.replica() else { return self.check_lease_age() };
        r.log_synced(id, len)?;
        if r.fsync_reaches_bucket() && self.claimed.load(std::sync::atomic::Ordering::Acquire) {
            self.check_still_ours()?;
        }
        self.check_lease_age()
    }
    fn fsync_reaches_bucket(&self) -> bool {
        self.segments.replica().is_some_and(|r| r.fsync_reaches_bucket())
    }
    fn publish_when_stored(&self, upto: Addr, publish: Box<dyn Fn() -> Result<()> + Send>) -> Result<()> {
        crate::device::publish_when_stored(self.segments.as_ref(), upto, publish)
    }
    fn flush_to_bucket(&self, upto: Addr) -> Result<()> {
        self.segments.replica().map_or(Ok(()), |r| r.flush_to_bucket(upto))
    }
    fn seal_recovered(&self, segments: &[SegId]) -> Result<(u64, u64)> {
        self.segments.replica().map_or(Ok((0, 0)), |r| r.seal_recovered(segments))
    }
    fn pending_upload_bytes(&self) -> u64 {
        self.segments.replica().map_or(0, |r| r.pending_upload_bytes())
    }
    fn segment_shared(&self, id: SegId) -> bool {
        self.segments.replica().is_none_or(|r| r.segment_shared(id))
    }

    /// Waits for the uploads, then gives the lease back.
    fn drain(&self) -> Result<()> {
        self.segments.replica().map_or(Ok(()), |r| r.drain())?;
        if self.lease.is_some() && self.claimed.load(std::sync::atomic::Ordering::Acquire) {
            self.released.store(true, std::sync::atomic::Ordering::Release);
            let last = self.last.lock().as_ref().map(|(sb, _)| sb.clone());
            if let Some(sb) = last {
                self.compare_and_swap(&sb)?;
            }
        }
        Ok(())
    }
}

/// A frozen root: opens read-only at `commit`, never writes a superblock.
pub struct FixedRootDevice {
    segments: Arc<dyn Device>,
    superblock: Vec<u8>,
}

impl FixedRootDevice {
    pub fn new(segments: Arc<dyn Device>, commit: crate::format::Addr) -> Arc<Self> {
        Arc::new(FixedRootDevice { segments, superblock: Superblock::frozen(commit).encode() })
    }
}

impl Device for FixedRootDevice {
    delegate_segments!();

    fn failpoint(&self, name: &'static str) -> Result<()> {
        self.segments.failpoint(name)
    }

    fn replica(&self) -> Option<&dyn Replica> {
        self.segments.replica()
    }

    fn read_superblock(&self) -> Result<Option<Vec<u8>>> {
        Ok(Some(self.superblock.clone()))
    }

    fn write_superblock(&self, _sb: &Superblock) -> Result<()> {
        Err(Error::ReadOnly)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::MemObjectStore;
    use crate::device::SimDevice;
    use crate::env::TestEnv;
    use crate::volume::{Config, Volume, ROOT_INO};

    fn cfg(read_only: bool) -> Config {
        Config { commit_interval: None, read_only, env: TestEnv::new(5), ..Config::default() }
    }

    #[test]
    fn a_second_writer_of_a_branch_is_fenced_off() {
        let segs: Arc<dyn Device> = Arc::new(SimDevice::new());
        let catalog: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
        let a = Volume::open(HeadDevice::new(segs.clone(), catalog.clone(), "main"), cfg(false)).expect("a");
        let b = Volume::open(HeadDevice::new(segs.clone(), catalog.clone(), "main"), cfg(false)).expect("b");
        a.create(ROOT_INO, b"from-a", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        assert!(matches!(a.commit(), Err(Error::Fenced(_))), "a's head was replaced by b's open");
        assert!(a.is_poisoned());
        b.create(ROOT_INO, b"from-b", libc::S_IFREG | 0o644, 0, 0, 0).expect("b keeps working");
        b.commit().expect("commit");
    }

    #[test]
    fn a_fixed_root_opens_read_only_without_replaying_the_parent_log() {
        let segs: Arc<dyn Device> = Arc::new(SimDevice::new());
        let catalog: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
        let main = Volume::open(HeadDevice::new(segs.clone(), catalog.clone(), "main"), cfg(false)).expect("main");
        main.create(ROOT_INO, b"before", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        main.commit().expect("commit");
        let frozen = main.last_commit().expect("commit addr");
        main.create(ROOT_INO, b"after", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        main.sync_all().expect("sync");
        let snap = Volume::open(FixedRootDevice::new(segs, frozen), cfg(true)).expect("snapshot");
        assert!(snap.lookup(ROOT_INO, b"before").is_ok());
        assert_eq!(snap.lookup(ROOT_INO, b"after").expect_err("not in the snapshot").errno(), libc::ENOENT);
        assert_eq!(snap.create(ROOT_INO, b"x", libc::S_IFREG, 0, 0, 0).expect_err("ro").errno(), libc::EROFS);
    }

    /// Faults on replacements of branch heads: the first `allowed` go
    /// through, every later one fails without landing (a head PUT that
    /// meets a 503, a writer killed before its uploader published); and
    /// with `lose_next`, the next one lands and its writer hears an error
    /// (a reply lost after the bucket took the body). Everything else
    /// passes.
    struct HeadGate {
        inner: Arc<dyn ObjectStore>,
        allowed: std::sync::atomic::AtomicI64,
        lose_next: std::sync::atomic::AtomicBool,
    }

    impl HeadGate {
        fn new(inner: &Arc<dyn ObjectStore>, allowed: i64) -> Arc<HeadGate> {
            Arc::new(HeadGate { inner: inner.clone(), allowed: allowed.into(), lose_next: false.into() })
        }
    }

    impl ObjectStore for HeadGate {
        fn put(&self, key: &str, body: &[u8]) -> Result<ETag> {
            self.inner.put(key, body)
        }
        fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<ETag> {
            self.inner.put_if_absent(key, body)
        }
        fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<ETag> {
            use std::sync::atomic::Ordering::SeqCst;
            if !key.starts_with("branches/") {
                return self.inner.put_if_match(key, body, etag);
            }
            if self.lose_next.swap(false, SeqCst) {
                self.inner.put_if_match(key, body, etag)?;
                return Err(Error::Io(std::io::Error::other("injected: the head PUT landed, its reply was lost")));
            }
            if self.allowed.fetch_sub(1, SeqCst) <= 0 {
                return Err(Error::Io(std::io::Error::other("injected: the head PUT did not happen")));
            }
            self.inner.put_if_match(key, body, etag)
        }
        fn get(&self, key: &str) -> Result<(Vec<u8>, ETag)> {
            self.inner.get(key)
        }
        fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Vec<u8>> {
            self.inner.get_range(key, range)
        }
        fn list(&self, prefix: &str) -> Result<Vec<String>> {
            self.inner.list(prefix)
        }
        fn size(&self, key: &str) -> Result<u64> {
            self.inner.size(key)
        }
        fn delete(&self, key: &str) -> Result<()> {
            self.inner.delete(key)
        }
    }

    fn tier(durability: crate::tier::Durability) -> crate::tier::TierConfig {
        crate::tier::TierConfig {
            durability,
            chunk_size: 64 << 10,
            drain_timeout: Some(std::time::Duration::from_secs(30)),
            ..crate::tier::TierConfig::default()
        }
    }

    fn leased(host: &str, take_over: bool) -> Option<LeaseConfig> {
        Some(LeaseConfig { take_over, ..LeaseConfig::new(host, std::time::Duration::from_secs(60)) })
    }

    /// A writer on a bucket disk: its cache in `cache`, heads through `catalog`.
    fn bucket_writer(
        store: &Arc<dyn ObjectStore>,
        catalog: Arc<dyn ObjectStore>,
        cache: &std::path::Path,
        durability: crate::tier::Durability,
        lease: Option<LeaseConfig>,
    ) -> (Arc<Volume>, Arc<crate::tier::BucketDevice>) {
        let dev = crate::tier::BucketDevice::open(store.clone(), cache, tier(durability)).expect("cache");
        let head = HeadDevice::with_lease(dev.clone(), catalog, "main", lease);
        (Volume::open(head, Config { segment_size: 1 << 20, ..cfg(false) }).expect("open"), dev)
    }

    #[test]
    fn an_fsync_the_taking_writer_acknowledged_survives_its_crash() {
        use crate::tier::Durability::Bucket;
        let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
        let dir = tempfile::tempdir().expect("dir");
        let (a, da) = bucket_writer(&store, store.clone(), &dir.path().join("a"), Bucket, leased("node-a", false));
        a.create(ROOT_INO, b"from-a", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        a.sync_all().expect("sync");
        a.commit().expect("commit");
        da.drain().expect("drain");
        // node-a dies.
        drop(a);
        drop(da);
        // node-b takes the branch: its claim is a head write; its first
        // commit's head is published later, by its uploader, and that PUT
        // does not happen before node-b dies too.
        let gate: Arc<dyn ObjectStore> = HeadGate::new(&store, 1);
        // node-b's open publishes its first head itself, so with that PUT
        // refused the open fails and nothing is acknowledged; with it let
        // through (and every later one refused), what node-b acknowledges
        // survives.
        let dev = crate::tier::BucketDevice::open(store.clone(), &dir.path().join("b0"), tier(Bucket)).expect("cache");
        let head = HeadDevice::with_lease(dev.clone(), gate, "main", leased("node-b", true));
        assert!(
            Volume::open(head, Config { segment_size: 1 << 20, ..cfg(false) }).is_err(),
            "opened without its own head"
        );
        drop(dev);
        let gate: Arc<dyn ObjectStore> = HeadGate::new(&store, 2);
        let (b, db) = bucket_writer(&store, gate, &dir.path().join("b"), Bucket, leased("node-b", true));
        let f = b.create(ROOT_INO, b"from-b", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        b.write(f.ino, 0, b"acknowledged").expect("write");
        b.fsync(f.ino).expect("fsync: in the bucket, and the head is still node-b's");
        drop(b);
        drop(db);
        // node-c takes the branch over, with an empty cache.
        let (c, _dc) = bucket_writer(&store, store.clone(), &dir.path().join("c"), Bucket, leased("node-c", true));
        assert!(c.lookup(ROOT_INO, b"from-a").is_ok());
        let got = c.lookup(ROOT_INO, b"from-b").map(|a| c.read(a.ino, 0, 100).expect("read"));
        assert_eq!(got.ok(), Some(b"acknowledged".to_vec()), "node-b's acknowledged fsync is gone");
    }

    #[test]
    fn a_writer_whose_branch_was_taken_acknowledges_no_fsync() {
        use crate::tier::Durability::Local;
        let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
        let dir = tempfile::tempdir().expect("dir");
        let (a, da) = bucket_writer(&store, store.clone(), &dir.path().join("a"), Local, leased("node-a", false));
        a.create(ROOT_INO, b"before", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        a.sync_all().expect("sync");
        // node-a stops (SIGSTOP, a partition from the bucket, a VM pause)
        // and node-b takes the branch (past the lease, or --take-over).
        let (_b, _db) = bucket_writer(&store, store.clone(), &dir.path().join("b"), Local, leased("node-b", true));
        // node-a goes on. With local durability an fsync does not ask the
        // bucket (that is the point of it), so node-a learns of node-b at
        // its next head write — its next commit, every second by default —
        // and acknowledges nothing after it. (Taken without --take-over,
        // node-a stops on its own first: see bucket_tier's lease tests.)
        let f = a.create(ROOT_INO, b"after", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        a.write(f.ino, 0, b"lost").expect("write");
        // The commit's head is published once its bytes are stored.
        let published = a.commit().and_then(|_| da.drain());
        assert!(published.is_err(), "node-a's head write went through: {published:?}");
        assert!(a.fsync(f.ino).is_err(), "a deposed writer acknowledged an fsync after its head write failed");
    }

    #[test]
    fn a_head_write_whose_reply_was_lost_does_not_fence_its_own_writer() {
        use crate::tier::Durability::Bucket;
        let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
        let lossy = HeadGate::new(&store, i64::MAX);
        let dir = tempfile::tempdir().expect("dir");
        let (a, da) = bucket_writer(&store, lossy.clone(), &dir.path().join("a"), Bucket, leased("node-a", false));
        a.create(ROOT_INO, b"first", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        a.sync_all().expect("sync");
        a.commit().expect("commit");
        da.drain().expect("drain");
        // The next head replacement lands in the bucket; its writer hears
        // an error. Then an fsync asks the bucket whether the branch is
        // still this writer's: the head's tag is not the one it last saw,
        // but its body is the one it last sent.
        lossy.allowed.store(0, std::sync::atomic::Ordering::SeqCst);
        lossy.lose_next.store(true, std::sync::atomic::Ordering::SeqCst);
        let f = a.create(ROOT_INO, b"second", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        a.fsync(f.ino).expect("fsync before the lost reply");
        a.commit().expect("commit (its head is published by the uploader)");
        // Bounded: 10 s for the uploader to publish.
        for _ in 0..1000 {
            if !lossy.lose_next.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!lossy.lose_next.load(std::sync::atomic::Ordering::SeqCst), "no head write was made");
        // Its retries of the head write (new bodies) fail meanwhile.
        let f = a.create(ROOT_INO, b"after", libc::S_IFREG | 0o644, 0, 0, 0).expect("create after the lost reply");
        a.write(f.ino, 0, b"acknowledged").expect("write");
        a.fsync(f.ino).expect("the writer fenced itself off over its own head write");
        assert!(!a.is_poisoned());
        lossy.allowed.store(i64::MAX, std::sync::atomic::Ordering::SeqCst);
        a.commit().expect("commit on the adopted tag");
        da.drain().expect("drain");
        drop(a);
        drop(da);
        let (b, _db) = bucket_writer(&store, store.clone(), &dir.path().join("b"), Bucket, leased("node-b", true));
        let got = b.lookup(ROOT_INO, b"after").map(|x| b.read(x.ino, 0, 100).expect("read"));
        assert_eq!(got.ok(), Some(b"acknowledged".to_vec()));
    }
}
