//! A disk: one set of segments shared by every branch (segment names are
//! globally unique), and a catalog of named roots in an object store.
//!
//! A branch's superblock is its head object `branches/<name>`, replaced
//! only by compare-and-swap on the tag the writer last saw, so a second
//! writer of the same branch is fenced off instead of corrupting it.

use crate::bucket::{ETag, ObjectStore};
use crate::device::{Device, Replica, SegmentFile};
use crate::error::{Error, Result};
use crate::format::{Addr, SegId};
use crate::volume::Superblock;
use parking_lot::Mutex;
use std::sync::Arc;

pub use crate::layout::{branch_key, checkpoint_key};

const HEAD_MAGIC: &[u8; 4] = b"ARHD";

/// Who writes a branch, and until when the claim holds without renewal.
/// A head object with a live lease refuses a second writer.
#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct Lease {
    /// The holder's writer epoch (its segments are `seg-<writer>-…`).
    pub writer: u64,
    pub host: String,
    pub pid: u32,
    /// Seconds since the Unix epoch, by the holder's clock.
    pub expires: u64,
}

/// Whether process `pid` on this host is alive (the caller knows how;
/// the engine knows nothing of processes).
pub type ProcessAlive = Arc<dyn Fn(u32) -> bool + Send + Sync>;

/// How a writer claims its branch: which host and process it is, how long
/// a claim lives without renewal (renewed every third of that), and how to
/// tell whether a holder on this host is still alive.
#[derive(Clone)]
pub struct LeaseConfig {
    pub host: String,
    pub pid: u32,
    pub ttl: std::time::Duration,
    /// `None`: a holder on this host is judged by its lease's expiry too.
    pub alive: Option<ProcessAlive>,
    /// Take the branch even from a live lease: the operator knows its
    /// holder is dead (its node is gone). A holder that was not dead after
    /// all is fenced at its next head write.
    pub take_over: bool,
}

impl LeaseConfig {
    /// A claim by `host` lasting `ttl`, judged by expiry alone.
    pub fn new(host: &str, ttl: std::time::Duration) -> LeaseConfig {
        LeaseConfig { host: host.into(), pid: 0, ttl, alive: None, take_over: false }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Lease {
    /// Whether this lease still keeps other writers out, as seen by the
    /// writer `me` configures: a holder on the same host is live while its
    /// process is (when `me` can tell), any other while its lease runs.
    pub fn is_live(&self, me: Option<&LeaseConfig>) -> bool {
        match me {
            Some(LeaseConfig { host, alive: Some(alive), .. }) if *host == self.host => alive(self.pid),
            _ => self.expires > unix_now(),
        }
    }
}

/// A branch head object: the superblock, and the writer's lease if one holds it.
/// Without a lease it is the superblock's own encoding; with one,
/// `"ARHD" | superblock length u32 | superblock | lease | crc32c u32`.
pub fn encode_head(superblock: &[u8], lease: Option<&Lease>) -> Vec<u8> {
    let Some(lease) = lease else { return superblock.to_vec() };
    let mut out = HEAD_MAGIC.to_vec();
    out.extend_from_slice(&(superblock.len() as u32).to_le_bytes());
    out.extend_from_slice(superblock);
    out.extend_from_slice(&crate::format::encode_value(lease));
    let crc = crate::crc::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Splits a head object into its superblock bytes (checked) and lease.
pub fn decode_head(bytes: &[u8]) -> Result<(Vec<u8>, Superblock, Option<Lease>)> {
    if !bytes.starts_with(HEAD_MAGIC) {
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
    let lease: Lease = crate::format::decode_value(&bytes[sb_end..split], "lease").map_err(|_| bad())?;
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
    last: Mutex<Option<(Superblock, std::time::Instant)>>,
    /// Set when another writer took the branch.
    fenced: Mutex<Option<String>>,
    released: std::sync::atomic::AtomicBool,
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
        })
    }

    fn lease_for(&self, superblock: &Superblock) -> Option<Lease> {
        let cfg = self.lease.as_ref()?;
        if self.released.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        let writer = superblock.commit.seg.writer;
        Some(Lease { writer, host: cfg.host.clone(), pid: cfg.pid, expires: unix_now() + cfg.ttl.as_secs() })
    }

    /// Renews the lease every third of its life while this head lives.
    fn spawn_renewal(&self) {
        let Some(cfg) = &self.lease else { return };
        let every = (cfg.ttl / 3).max(std::time::Duration::from_millis(100));
        let me = self.me.clone();
        let spawned = std::thread::Builder::new().name("arbor-lease".into()).spawn(move || loop {
            // Wake often enough to notice the head is gone.
            let mut slept = std::time::Duration::ZERO;
            while slept < every {
                std::thread::sleep(std::time::Duration::from_millis(100));
                slept += std::time::Duration::from_millis(100);
                if me.strong_count() == 0 {
                    return;
                }
            }
            let Some(head) = me.upgrade() else { return };
            if head.released.load(std::sync::atomic::Ordering::Acquire) || head.fenced.lock().is_some() {
                return;
            }
            match head.renew(every) {
                Ok(()) => {}
                Err(Error::Fenced(why)) => {
                    tracing::error!(%why, "lost the branch lease; refusing further writes");
                    *head.fenced.lock() = Some(why);
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "renewing the branch lease failed; trying again"),
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
        if let (Some(cfg), Some(held)) = (&self.lease, self.found.lock().as_ref()) {
            if held.is_live(Some(cfg)) && !cfg.take_over {
                return Err(Error::Busy(format!(
                    "{} is open read-write by pid {} on host {} (its lease runs {} s more without renewal); \
                     a second writer is refused",
                    self.key,
                    held.pid,
                    held.host,
                    held.expires.saturating_sub(unix_now())
                )));
            }
        }
        self.compare_and_swap(sb)?;
        self.claimed.store(true, std::sync::atomic::Ordering::Release);
        self.spawn_renewal();
        Ok(())
    }

    /// Whether the head in the bucket is still the one this writer last
    /// wrote; fences this writer off if not.
    fn check_still_ours(&self) -> Result<()> {
        let seen = self.seen.lock();
        let Some(mine) = seen.as_deref() else { return Ok(()) };
        let fenced = match self.catalog.get(&self.key) {
            Ok((_, tag)) if tag == mine => return Ok(()),
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
        let due = self.last.lock().as_ref().filter(|(_, at)| at.elapsed() >= every).map(|(b, _)| b.clone());
        match due {
            Some(sb) => self.swap_locked(&mut seen, &sb),
            None => Ok(()),
        }
    }

    fn swap_locked(&self, seen: &mut Option<ETag>, superblock: &Superblock) -> Result<()> {
        let body = encode_head(&superblock.encode(), self.lease_for(superblock).as_ref());
        let written = match seen.as_deref() {
            Some(tag) => self.catalog.put_if_match(&self.key, &body, tag),
            None => self.catalog.put_if_absent(&self.key, &body),
        };
        match written {
            Ok(tag) => {
                *seen = Some(tag);
                *self.last.lock() = Some((superblock.clone(), std::time::Instant::now()));
                Ok(())
            }
            Err(Error::PreconditionFailed(_) | Error::AlreadyExists(_) | Error::NoSuchObject(_)) => {
                Err(Error::Fenced(format!("{} was changed by another writer; this one stops", self.key)))
            }
            Err(e) => Err(e),
        }
    }
}

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
    /// [`HeadDevice::claim`]), before anything of the old writer's log is read.
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
            return self.claim(sb);
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
        let Some(r) = self.segments.replica() else { return Ok(()) };
        r.log_synced(id, len)?;
        if r.fsync_reaches_bucket() && self.claimed.load(std::sync::atomic::Ordering::Acquire) {
            self.check_still_ours()?;
        }
        Ok(())
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
}
