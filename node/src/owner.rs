//! The owner side of shared branches: this process owns a branch (its
//! lease, the owner record in the bucket) and applies what mounts on
//! other nodes send it (see `arbor_net::branch`; the mounts' side is
//! `crate::through_owner`).

use crate::disk::{self, Disk};
use crate::error::{Context, Error, Result};
use crate::open_branch;
use arbor_engine::volume::{Config, Volume};
use arbor_net::SharedBranch;
use arbor_snapshot::{BranchLock, Catalog, CheckpointInfo, Owner};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a stopping owner waits for the bucket to take its branches'
/// last bytes.
pub const STOP_WAIT: Duration = Duration::from_secs(30);

/// What a client's checkpoint request is answered with, from the
/// checkpoint made (the front end's shape; the client hands it on).
pub type CheckpointReply = fn(&CheckpointInfo) -> String;

/// The branches this process owns and how.
#[derive(Clone, Debug)]
pub struct OwnOptions {
    pub branches: Vec<String>,
    /// The `HOST:PORT` clients are told to connect to (default: the
    /// listening address, or this host's name and the port when listening
    /// on every interface).
    pub advertise: Option<String>,
    /// Take the branches even from a live lease (their holder is known dead).
    pub take_over: bool,
    /// The life of the owner's lease on its branches.
    pub lease_ttl: Duration,
    /// How long a new owner grants only the locks clients take back.
    pub lock_grace: Duration,
    /// How long a stop waits for the bucket.
    pub stop_timeout: Duration,
    pub durability: arbor_engine::tier::Durability,
    pub segment_size: u64,
    /// What clients may do to owners and privileges.
    pub policy: arbor_net::Policy,
    pub checkpoint_reply: CheckpointReply,
}

/// One branch this process owns.
pub struct Owned {
    shared: Arc<SharedBranch>,
    catalog: Arc<Catalog>,
    owner: Owner,
    disk: Arc<Disk>,
    _lock: BranchLock,
}

/// What a stop left behind when the bucket did not take a branch's last
/// bytes in time.
#[derive(Debug)]
pub struct Left {
    /// The branch being closed when the wait ran out.
    pub branch: String,
    /// Its bytes not in the bucket yet.
    pub pending_bytes: u64,
    /// How long the stop waited.
    pub waited: Duration,
    /// Every branch this process owned.
    pub branches: Vec<String>,
}

impl std::fmt::Display for Left {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stopped after {} s without closing branch {} ({} not uploaded; the bucket did not take it); branches: {}",
            self.waited.as_secs(),
            self.branch,
            disk::Size(self.pending_bytes),
            self.branches.join(",")
        )
    }
}

/// The address clients are told: `advertise`, else `addr` unless it is a
/// wildcard, else this host's name with `addr`'s port.
pub fn advertised(addr: std::net::SocketAddr, advertise: Option<&str>) -> String {
    match advertise {
        Some(a) => a.to_string(),
        None if addr.ip().is_unspecified() => format!("{}:{}", crate::identity::hostname(), addr.port()),
        None => addr.to_string(),
    }
}

/// Refuses an address for clients that does not read as `HOST:PORT`.
pub fn check_advertise(a: &OwnOptions) -> Result<()> {
    if let Some(addr) = &a.advertise {
        arbor_net::check_host_port(addr).map_err(|e| Error::Invalid(format!("--advertise {e}")))?;
    }
    Ok(())
}

/// Opens branch `name` of `disk_arg` for writing and records `addr` as
/// where it is served.
pub fn own(disk_arg: &str, name: &str, addr: &str, a: &OwnOptions) -> Result<Owned> {
    arbor_snapshot::check_name(name)?;
    crate::check_segment_size(a.segment_size)?;
    if a.lock_grace > arbor_net::branch::locks::MAX_LOCK_GRACE {
        return Err(Error::Invalid(format!(
            "--lock-grace must be at most {}s",
            arbor_net::branch::locks::MAX_LOCK_GRACE.as_secs()
        )));
    }
    let cache = disk::CacheOptions { durability: a.durability, ..disk::CacheOptions::default() };
    let d = Arc::new(disk::open_for_owner(disk_arg, name, cache, a.take_over, a.lease_ttl)?);
    d.make_private()?;
    let catalog = d.catalog()?;
    if name != "main" {
        catalog.branch_head(name)?;
    }
    // Imported files its clients read keep their chunks in the owner's
    // cache folder, as a mount's do.
    let cfg = Config {
        source_files: d.source_files()?,
        sources: d.sources(),
        segment_size: a.segment_size,
        ..Config::default()
    };
    // Recorded before the branch is opened (which may wait for an old
    // lease to lapse): a client mount started meanwhile finds the record,
    // never takes the branch itself, and waits for this owner to answer.
    let owner = Owner { addr: addr.to_string(), host: crate::identity::hostname(), pid: std::process::id() };
    let before = catalog.owner_of(name).ok().flatten();
    catalog.record_owner(name, &owner).context(format!("cannot record where branch {name} is served"))?;
    let (vol, lock) = match open_branch(&catalog, name, cfg, &format!("arbor serve at {addr}")) {
        Ok(opened) => opened,
        Err(e) => {
            restore_record(&catalog, name, &owner, before.as_ref());
            return Err(e);
        }
    };
    // Ours now: recorded again, over whatever an owner that lost the race
    // put back meanwhile.
    if let Err(e) = catalog.record_owner(name, &owner) {
        tracing::warn!(branch = name, error = %e, "cannot record where the branch is served");
    }
    tracing::info!(
        branch = name,
        addr,
        allow_suid_devices = a.policy.allow_suid_devices,
        root_squash = a.policy.root_squash,
        "owning branch"
    );
    let shared = SharedBranch::new(name, vol.clone(), Some(checkpointer(&catalog, name, vol, a)), a.policy);
    shared.set_lock_grace(a.lock_grace);
    if shared.in_lock_grace() {
        tracing::info!(
            branch = name,
            grace_s = a.lock_grace.as_secs(),
            "the branch may have locks from its owner before; granting only their holders' locks for the grace period"
        );
    }
    Ok(Owned { shared, catalog, owner, disk: d, _lock: lock })
}

/// The branch was not ours after all: the record goes back to what it
/// was (a live owner's clients must still find it). Only a record that
/// is still ours is put back: another owner that started meanwhile may
/// have won the branch and recorded itself (it also re-asserts its
/// record, see [`Owned::record_keeper`]).
fn restore_record(catalog: &Catalog, name: &str, owner: &Owner, before: Option<&Owner>) {
    let restored = match before {
        Some(b) if catalog.owner_of(name).ok().flatten().as_ref() == Some(owner) => catalog.record_owner(name, b),
        Some(_) => Ok(()),
        None => catalog.clear_owner(name, owner),
    };
    if let Err(r) = restored {
        tracing::warn!(branch = name, error = %r, "cannot restore the owner record");
    }
}

/// Makes the checkpoints clients of branch `name` ask for.
fn checkpointer(
    catalog: &Arc<Catalog>,
    name: &str,
    vol: Arc<Volume>,
    a: &OwnOptions,
) -> arbor_net::branch::owner::Checkpointer {
    let (catalog, branch, reply) = (catalog.clone(), name.to_string(), a.checkpoint_reply);
    Arc::new(move |cp: &str| catalog.checkpoint_volume(cp, &branch, &vol).map(|c| reply(&c)).map_err(|e| e.to_string()))
}

impl Owned {
    /// The branch as its clients are served.
    pub fn shared(&self) -> &Arc<SharedBranch> {
        &self.shared
    }

    /// Records this owner again when called if the record names another
    /// (an owner that lost the race for the branch may have put back the
    /// record it read before it started, a stale one).
    pub fn record_keeper(&self) -> impl Fn() + Send + 'static {
        let (catalog, owner, name) = (self.catalog.clone(), self.owner.clone(), self.shared.name().to_string());
        let shared = self.shared.clone();
        // An owner deposed (fenced, or its log failed) must not put its
        // name back over its successor's: it is about to exit. Asked again
        // after the read, which may have taken a while.
        move || match catalog.owner_of(&name) {
            _ if shared.stepped_down() => {}
            Ok(Some(o)) if o == owner => {}
            Ok(_) => {
                tracing::warn!(branch = %name, "the owner record named another owner; recording this one again");
                if let Err(e) = catalog.record_owner(&name, &owner) {
                    tracing::warn!(branch = %name, error = %e, "cannot record where the branch is served");
                }
            }
            Err(e) => tracing::debug!(branch = %name, error = %e, "cannot read the owner record"),
        }
    }

    /// The catalog of the branch's disk, as this owner opened it.
    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// The branch's files, for a front end in this process (an S3
    /// endpoint): changed as the owner applies its clients' changes.
    pub fn files(&self) -> Arc<dyn arbor_engine::Files> {
        crate::owner_files::OwnerFiles::new(self.shared.clone())
    }

    /// Bytes of this branch's log not in the bucket yet (0 on a
    /// local-folder disk).
    pub fn pending_upload(&self) -> u64 {
        self.disk.tier_stats().map_or(0, |t| t.pending_bytes)
    }

    /// The chunks the branch's device holds (on an s3 disk): what this
    /// process's cache server gives clients before asking the bucket.
    pub fn cached_chunks(&self) -> Option<Arc<dyn arbor_engine::chunks::ChunkSource>> {
        self.disk.bucket_device().map(|d| d.cached_chunks())
    }

    /// Forgets the owner record (if still ours) and makes the last commit.
    pub fn close(self) -> Result<()> {
        let name = self.shared.name().to_string();
        if let Err(e) = self.catalog.clear_owner(&name, &self.owner) {
            tracing::warn!(branch = %name, error = %e, "cannot remove the owner record");
        }
        let vol: &Arc<Volume> = self.shared.volume();
        vol.close().context(format!("final commit of branch {name} failed"))
    }
}

/// Closes the branches (each a last commit and its upload), for up to
/// `wait`: a bucket that is away does not hold a stop forever. What
/// clients fsynced is durable either way (in the bucket, or with local
/// durability in this node's log, which the next owner here uploads).
pub fn close_within(owned: Vec<Owned>, wait: Duration) -> Result<()> {
    let names: Vec<String> = owned.iter().map(|o| o.shared.name().to_string()).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let closing = std::thread::Builder::new().name("arbor-close".into()).spawn(move || {
        let mut closed = Ok(());
        for o in owned {
            let pending = o.pending_upload();
            let _ = tx.send(Err((o.shared.name().to_string(), pending)));
            if let Err(e) = o.close() {
                tracing::error!(error = %crate::error::chain(&e), "closing a branch failed");
                closed = Err(e);
            }
        }
        let _ = tx.send(Ok(closed));
    })?;
    let deadline = Instant::now() + wait;
    let mut at = None;
    // Bounded by `deadline`; each message is one branch begun, or the end.
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Ok(closed)) => {
                let _ = closing.join();
                return closed;
            }
            Ok(Err(branch)) => at = Some(branch),
            Err(_) => break,
        }
    }
    let (branch, pending_bytes) = at.unwrap_or_default();
    tracing::error!(
        branch,
        pending_bytes,
        waited_s = wait.as_secs(),
        "stopping without the last upload: what clients fsynced is durable (in the bucket, or with local durability in this node's log, which the next owner here uploads); what they had not fsynced is lost"
    );
    Err(Error::NotClosed(Left { branch, pending_bytes, waited: wait, branches: names }))
}
