//! Shared branches: `arbor serve --branch` owns a branch and applies what
//! mounts on other nodes send it; `arbor mount` of a branch another
//! process owns mounts it through that owner (see `arbor_net::branch::owner`).

use crate::control;
use crate::disk::{self, Disk};
use crate::serve::{addr_json, open_branch, serve_until_stopped, unmount_request, MountArgs};
use anyhow::{bail, Context, Result};
use arbor_engine::files::Files;
use arbor_engine::volume::{Config, Volume};
use arbor_fs::MountOptions;
use arbor_net::branch::client::Locate;
use arbor_net::{BranchClient, BranchClientOptions, SharedBranch};
use arbor_snapshot::{BranchLock, Catalog, Owner};
use serde_json::json;
use std::path::Path;
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
        None if addr.ip().is_unspecified() => format!("{}:{}", crate::node::hostname(), addr.port()),
        None => addr.to_string(),
    }
}

/// Opens branch `name` of `disk_arg` for writing and records `addr` as
/// where it is served.
pub fn own(disk_arg: &str, name: &str, addr: &str, a: &OwnerArgs) -> Result<Owned> {
    arbor_snapshot::check_name(name)?;
    crate::serve::check_segment_size(a.segment_size)?;
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
    let owner = Owner { addr: addr.to_string(), host: crate::node::hostname(), pid: std::process::id() };
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
    pub fn cached_chunks(&self) -> Option<Arc<dyn arbor_engine::tier::ChunkSource>> {
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

/// For a branch mount: the owner to mount through, if the branch is served
/// by another process (`--server`, or an owner record: see below).
pub fn owner_to_mount_through(d: &Disk, args: &MountArgs) -> Result<Option<Locate>> {
    let name = args.branch.clone().unwrap_or_else(|| "main".into());
    if let Some(addr) = &args.server {
        arbor_net::check_host_port(addr).map_err(|e| anyhow::anyhow!("--server {e}"))?;
    }
    let catalog = d.catalog()?;
    let recorded = match &args.server {
        Some(_) => None,
        // A branch with an owner record is mounted through its owner,
        // whatever its lease says: the owner may be starting (it records
        // itself before it claims the branch) or restarting. Only a clean
        // stop of the owner removes the record.
        None => match catalog.owner_of(&name)? {
            Some(o) => Some(o),
            // A mount given the owner's credentials and no cache servers
            // (which the token would be for) means to go through an owner:
            // one stopped cleanly (a restart, an upgrade) has no record
            // for a moment, and the mount must not become the branch's
            // writer and lock its owner out. It waits for a record.
            None if (args.token_file.is_some() || crate::tls::has_identity(args.tls.as_ref()))
                && args.cache_servers.is_empty() =>
            {
                Some(wait_for_owner(
                    &catalog,
                    &name,
                    args.timeout.unwrap_or(arbor_net::branch::client::OWNER_START_WAIT),
                )?)
            }
            None => return Ok(None),
        },
    };
    if args.token_file.is_none() && !crate::tls::has_identity(args.tls.as_ref()) {
        let at = args.server.clone().or(recorded.map(|o| o.addr)).unwrap_or_default();
        bail!("branch {name} is served by arbor serve at {at}: give its token with --token-file (or ARBOR_TOKEN_FILE) to mount it through the owner");
    }
    Ok(Some(match args.server.clone() {
        Some(addr) => Arc::new(move || Some(addr.clone())),
        None => Arc::new(move || catalog.owner_of(&name).ok().flatten().map(|o| o.addr)),
    }))
}

/// The owner record of branch `name` once one appears, for up to `wait`.
fn wait_for_owner(catalog: &Catalog, name: &str, wait: std::time::Duration) -> Result<Owner> {
    let started = std::time::Instant::now();
    tracing::warn!(branch = %name, wait_s = wait.as_secs(), "the branch has no owner recorded; waiting for one");
    // Bounded by `wait`.
    loop {
        if let Some(o) = catalog.owner_of(name)? {
            return Ok(o);
        }
        if started.elapsed() >= wait {
            bail!(
                "branch {name} has no owner (no arbor serve --branch {name} recorded itself within {} s); \
                 mount it without --token-file to write it from this node",
                wait.as_secs()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

/// Mounts branch `args.branch` at `mountpoint` through its owner, and
/// serves until unmounted or signalled.
pub fn mount_remote(
    d: &Disk,
    mountpoint: &Path,
    args: &MountArgs,
    locate: Locate,
    cache_client: Option<Arc<arbor_net::CacheClient>>,
) -> Result<()> {
    let name = args.branch.clone().unwrap_or_else(|| "main".into());
    let auth = crate::cache_server::ClientAuth { token_file: args.token_file.as_deref(), tls: args.tls.as_ref() };
    let (token, tls) = auth.load().context("to mount through the owner")?;
    // File bytes already in the bucket (or the disk's folder) are read
    // from there, through this node's chunk cache and cache servers;
    // ARBOR_READ_THROUGH_OWNER=1 sends every read to the owner instead.
    let through_owner = std::env::var("ARBOR_READ_THROUGH_OWNER").is_ok_and(|v| v == "1");
    let segments = if through_owner { None } else { Some(d.catalog()?.segments().clone()) };
    let files = Arc::new(BranchClient::connect(BranchClientOptions {
        branch: name.clone(),
        token,
        locate,
        timeout: args.timeout,
        segments,
        tls,
    })?);
    let control = control::Server::bind(mountpoint)?;
    let opts = MountOptions {
        allow_other: args.allow_other,
        read_ahead: args.read_ahead,
        threads: args.threads,
        // Any node that writes the branch could have made a set-user-ID
        // file or a device node.
        suid_devices: args.allow_suid_devices,
        ..MountOptions::default()
    };
    let handle = arbor_fs::mount(files.clone(), mountpoint, &opts)
        .with_context(|| format!("cannot mount at {}", mountpoint.display()))?;
    files.follow(handle.invalidator())?;
    let owner = files.stats().owner.unwrap_or_default();
    let fuse = (handle.transport().clone(), handle.counters().clone());
    tracing::info!(mountpoint = %mountpoint.display(), disk = %d.url, branch = %name, %owner, fuse = %fuse.0.describe(), "mounted through the owner");
    let (url, mp, view) = (d.url.clone(), mountpoint.to_path_buf(), files.clone());
    let stopped = serve_until_stopped(handle, control, move |req, tx| match req["op"].as_str() {
        Some("status") => {
            let s = view.stats();
            let mut result = json!({
                "mountpoint": mp,
                "disk": url,
                "branch": name,
                "pid": std::process::id(),
                "read_only": false,
                "owner": s.owner,
                "owner_retries": s.retries,
                "owner_lookups": s.owner_lookups,
                "owner_sessions": s.sessions,
                "open_files": s.open_files,
                "reads": {
                    "from_segments": s.direct_reads,
                    "from_segments_bytes": s.direct_bytes,
                    "from_owner": s.owner_reads,
                    "from_owner_bytes": s.owner_bytes,
                    "locates": s.locates,
                    "segment_reads_failed": s.direct_failed,
                },
                "cache_servers": crate::serve::cache_servers_json(cache_client.as_deref()),
            });
            crate::serve::with_fuse(&mut result, &fuse);
            (json!({"ok": true, "result": result}), false)
        }
        Some("unmount") => unmount_request(tx),
        Some("commit") => match view.commit() {
            Ok(a) => (json!({"ok": true, "result": addr_json(a)}), false),
            Err(e) => (json!({"ok": false, "error": e.to_string()}), false),
        },
        Some("checkpoint") => {
            let Some(cp) = req["name"].as_str() else { return (json!({"ok": false, "error": "no name"}), false) };
            match view.checkpoint(cp) {
                Ok(made) => {
                    (json!({"ok": true, "result": serde_json::from_str::<serde_json::Value>(&made).ok()}), false)
                }
                Err(e) => (json!({"ok": false, "error": e}), false),
            }
        }
        Some(op) => (
            json!({"ok": false, "error": format!(
                "this mount writes through the owner at {}; run {op} against the disk on the owner's node",
                view.stats().owner.unwrap_or_default()
            )}),
            false,
        ),
        None => (json!({"ok": false, "error": "no op"}), false),
    })?;
    let closed = Files::close(&*files);
    stopped.report(closed.as_ref().map(|_| ()).map_err(|e| e.to_string()));
    closed?;
    d.remove_own_cache();
    tracing::info!("unmounted cleanly");
    Ok(())
}
