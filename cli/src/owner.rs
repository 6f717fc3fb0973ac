//! The owner side of shared branches: `arbor serve --branch` owns a
//! branch and applies what mounts on other nodes send it (see
//! `arbor_net::files`; the mounts' side is `crate::remote_mount`).

use crate::json::addr_json;
use anyhow::{Context, Result};
use arbor_engine::volume::{Config, Volume};
use arbor_net::SharedBranch;
use arbor_node::disk::{self, Disk};
use arbor_node::open_branch;
use arbor_snapshot::{BranchLock, Catalog, Owner};
use serde_json::json;
use std::sync::Arc;

/// What `arbor serve --branch` owns besides its chunk cache.
#[derive(Clone, Debug)]
pub struct OwnerArgs {
    pub branches: Vec<String>,
    /// The `HOST:PORT` clients are told to connect to (default: the
    /// listening address, or this host's name and the port when listening
    /// on every interface).
    pub advertise: Option<String>,
    /// Take the branches even from a live lease (their holder is known dead).
    pub take_over: bool,
    /// The life of the owner's lease on its branches.
    pub lease_ttl: std::time::Duration,
    /// How long a new owner grants only the locks clients take back.
    pub lock_grace: std::time::Duration,
    /// How long a stop waits for the bucket.
    pub stop_timeout: std::time::Duration,
    pub durability: arbor_engine::tier::Durability,
    pub segment_size: u64,
    /// What clients may do to owners and privileges.
    pub policy: arbor_net::Policy,
}

/// One branch this process owns.
pub struct Owned {
    pub shared: Arc<SharedBranch>,
    catalog: Arc<Catalog>,
    owner: Owner,
    _disk: Arc<Disk>,
    _lock: BranchLock,
}

/// The address clients are told: `advertise`, else `addr` unless it is a
/// wildcard, else this host's name with `addr`'s port.
pub fn advertised(addr: std::net::SocketAddr, advertise: Option<&str>) -> String {
    match advertise {
        Some(a) => a.to_string(),
        None if addr.ip().is_unspecified() => format!("{}:{}", arbor_node::identity::hostname(), addr.port()),
        None => addr.to_string(),
    }
}

/// Opens branch `name` of `disk_arg` for writing and records `addr` as
/// where it is served.
pub fn own(disk_arg: &str, name: &str, addr: &str, a: &OwnerArgs) -> Result<Owned> {
    arbor_snapshot::check_name(name)?;
    arbor_node::check_segment_size(a.segment_size)?;
    if a.lock_grace > arbor_net::branch::locks::MAX_LOCK_GRACE {
        anyhow::bail!("--lock-grace must be at most {}s", arbor_net::branch::locks::MAX_LOCK_GRACE.as_secs());
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
    let cfg = Config { source_files: d.source_files()?, segment_size: a.segment_size, ..Config::default() };
    // Recorded before the branch is opened (which may wait for an old
    // lease to lapse): a client mount started meanwhile finds the record,
    // never takes the branch itself, and waits for this owner to answer.
    let owner = Owner { addr: addr.to_string(), host: arbor_node::identity::hostname(), pid: std::process::id() };
    let before = catalog.owner_of(name).ok().flatten();
    catalog.record_owner(name, &owner).with_context(|| format!("cannot record where branch {name} is served"))?;
    let (vol, lock) = match open_branch(&catalog, name, cfg, &format!("arbor serve at {addr}")) {
        Ok(opened) => opened,
        Err(e) => {
            // Not ours after all: the record goes back to what it was (a
            // live owner's clients must still find it).
            // Only a record that is still ours is put back: another
            // owner that started meanwhile may have won the branch and
            // recorded itself (it also re-asserts its record, see
            // Owned::keep_record).
            let restored = match &before {
                Some(b) if catalog.owner_of(name).ok().flatten().as_ref() == Some(&owner) => {
                    catalog.record_owner(name, b)
                }
                Some(_) => Ok(()),
                None => catalog.clear_owner(name, &owner),
            };
            if let Err(r) = restored {
                tracing::warn!(branch = name, error = %r, "cannot restore the owner record");
            }
            return Err(e.into());
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
    let (cp_catalog, cp_vol, branch) = (catalog.clone(), vol.clone(), name.to_string());
    let checkpoint: arbor_net::branch::owner::Checkpointer = Arc::new(move |cp: &str| {
        cp_catalog
            .checkpoint_volume(cp, &branch, &cp_vol)
            .map(|c| json!({"name": c.name, "commit": addr_json(c.commit)}).to_string())
            .map_err(|e| e.to_string())
    });
    let shared = SharedBranch::new(name, vol, Some(checkpoint), a.policy);
    shared.set_lock_grace(a.lock_grace);
    if shared.in_lock_grace() {
        tracing::info!(
            branch = name,
            grace_s = a.lock_grace.as_secs(),
            "the branch may have locks from its owner before; granting only their holders' locks for the grace period"
        );
    }
    Ok(Owned { shared, catalog, owner, _disk: d, _lock: lock })
}

/// How long a stopping owner waits for the bucket to take its branches'
/// last bytes.
pub const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl Owned {
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

    /// Bytes of this branch's log not in the bucket yet (0 on a
    /// local-folder disk).
    pub fn pending_upload(&self) -> u64 {
        self._disk.tier_stats().map_or(0, |t| t.pending_bytes)
    }

    /// The chunks the branch's device holds (on an s3 disk): what this
    /// process's cache server gives clients before asking the bucket.
    pub fn cached_chunks(&self) -> Option<Arc<dyn arbor_engine::chunks::ChunkSource>> {
        self._disk.bucket_device().map(|d| d.cached_chunks())
    }

    /// Forgets the owner record (if still ours) and makes the last commit.
    pub fn close(self) -> Result<()> {
        let name = self.shared.name().to_string();
        if let Err(e) = self.catalog.clear_owner(&name, &self.owner) {
            tracing::warn!(branch = %name, error = %e, "cannot remove the owner record");
        }
        let vol: &Arc<Volume> = self.shared.volume();
        vol.close().with_context(|| format!("final commit of branch {name} failed"))
    }
}
