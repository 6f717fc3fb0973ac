//! `arbor mount`: the process that serves one branch or checkpoint.

use crate::control;
use crate::json::{addr_json, cache_servers_json, compact_json, with_fuse, Fuse};
use crate::session::{serve_until_stopped, spawn_detached, unmount_request, Event};
use anyhow::{bail, Context, Result};
use arbor_engine::volume::{Volume, MAX_LIVE};
use arbor_fs::MountOptions;
use arbor_node::cache_client::{self, ClientAuth};
use arbor_node::disk::{self, Disk};
use arbor_node::{Node, OpenOptions, Opened, OwnerOptions, Root};
use arbor_snapshot::{check_name, GC_GRACE};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// How long opening the volume took (recovery included), for `status`.
static OPEN_MS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

#[derive(Clone)]
pub struct MountArgs {
    pub disk: String,
    pub mountpoint: PathBuf,
    pub branch: Option<String>,
    pub checkpoint: Option<String>,
    pub read_ahead: u32,
    /// Threads answering FUSE requests.
    pub threads: usize,
    pub allow_other: bool,
    pub pre_fetch: Vec<PathBuf>,
    /// Seconds between background compaction + gc runs (0: none).
    pub maintain_every: u64,
    /// Seconds between refreshes of the branch's recorded imports (0: none).
    pub refresh_source: u64,
    pub segment_size: u64,
    pub cache: disk::CacheOptions,
    pub cache_servers: Vec<String>,
    pub token_file: Option<PathBuf>,
    /// TLS to the cache servers and the owner (`None`: clear text).
    pub tls: Option<arbor_net::wire::tls::ClientFiles>,
    /// The owner of the branch to mount through (else found in the bucket).
    pub server: Option<String>,
    /// Through an owner: fail with EIO after this long without an answer
    /// (`None`: wait for it).
    pub timeout: Option<Duration>,
    /// Through an owner: the mount is `suid,dev`, not `nosuid,nodev`.
    pub allow_suid_devices: bool,
    /// A keeper holds the FUSE connection and restarts the server on it.
    pub restartable: bool,
    /// `arbor keeper`'s socket: it holds the FUSE connection, and a mount
    /// started again takes it from there.
    pub keeper: Option<PathBuf>,
    /// Where to serve `/metrics` (`None`: nowhere).
    pub metrics: Option<std::net::SocketAddr>,
}

impl MountArgs {
    fn root_name(&self) -> &str {
        self.checkpoint.as_deref().or(self.branch.as_deref()).unwrap_or("main")
    }

    fn root(&self) -> Root {
        match &self.checkpoint {
            Some(c) => Root::Checkpoint(c.clone()),
            None => Root::Branch(self.root_name().to_string()),
        }
    }

    fn auth(&self) -> ClientAuth {
        ClientAuth { token_file: self.token_file.clone(), tls: self.tls.clone() }
    }
}

#[derive(Clone)]
struct Prepared {
    node: Arc<Node>,
    disk: Arc<Disk>,
    mountpoint: PathBuf,
    cache_client: Option<Arc<arbor_net::CacheClient>>,
}

/// Set for a mount process started in the background by a command that
/// has already asked its cache servers whether they answer.
const SERVERS_CHECKED: &str = "ARBOR_CACHE_SERVERS_CHECKED";

/// `resuming`: the mount point is a live mount this process is to serve
/// (nothing may ask it anything: it has no server yet).
fn prepare(args: &MountArgs, resuming: bool) -> Result<Prepared> {
    check_name(args.root_name())?;
    arbor_node::check_segment_size(args.segment_size)?;
    let cache_client = cache_client::client(&args.cache_servers, &args.auth())?;
    // Checked once, by the command a user runs: not again by the mount
    // process it starts in the background.
    if let (Some(c), None) = (&cache_client, std::env::var_os(SERVERS_CHECKED)) {
        crate::warm::warn_about_servers(&cache_client::check_servers(c).1);
    }
    let node = Node::open(&args.disk, &args.root(), args.cache.clone(), cache_client.clone())?;
    let disk = node.disk().clone();
    if !disk.is_s3() && args.cache.durability != arbor_engine::tier::Durability::Local {
        eprintln!("note: a local-folder disk is its own durable copy; --durability applies to s3:// disks");
    }
    if !disk.is_s3() && (args.cache.dir.is_some() || cache_client.is_some()) {
        eprintln!(
            "note: a local-folder disk's segments are read in place; --cache-dir and --cache-server hold only imported files' chunks"
        );
    }
    if args.branch.is_some() && args.checkpoint.is_some() {
        bail!("give --branch or --checkpoint, not both");
    }
    node.find(&args.root())?;
    let mountpoint = arbor_fs::mount_path(&args.mountpoint);
    if resuming {
        return Ok(Prepared { node: Arc::new(node), disk, mountpoint, cache_client });
    }
    arbor_fs::recover_stale_mount(&mountpoint)?;
    match std::fs::metadata(&mountpoint) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => bail!("mountpoint {} is not a directory", mountpoint.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("mountpoint {} does not exist", mountpoint.display())
        }
        Err(e) => bail!("mountpoint {}: {e}", mountpoint.display()),
    }
    if arbor_fs::is_mountpoint(&mountpoint) {
        bail!("{} is busy: something is already mounted there", mountpoint.display());
    }
    Ok(Prepared { node: Arc::new(node), disk, mountpoint, cache_client })
}

fn status(p: &Prepared, args: &MountArgs, vol: &Volume, fuse: &Fuse) -> Value {
    let s = vol.stats();
    let tier = p.disk.tier_stats();
    let r = vol.recovery();
    let recovery = json!({
        "open_ms": OPEN_MS.get(),
        "replayed": r.replayed,
        "torn_at": r.torn_at,
        "segments": r.segments.len(),
        "sealed": r.sealed,
        "wal_pieces_deleted": r.wal_pieces_deleted,
        "wal_pieces_read": tier.as_ref().map(|t| t.cache.wal_pieces_read),
    });
    let mut status = json!({
        "mountpoint": p.mountpoint,
        "disk": p.disk.url,
        "branch": if args.checkpoint.is_none() { Some(args.root_name()) } else { None },
        "checkpoint": args.checkpoint,
        "pid": std::process::id(),
        "keeper_pid": crate::keeper::keeper_pid(),
        "keeper_socket": args.keeper,
        "read_only": s.read_only,
        "poisoned": s.poisoned,
        "io_backend": s.io_backend,
        "log_direct_bytes": s.direct_bytes,
        "writer": format!("{:016x}", s.writer),
        "last_seq": s.last_seq,
        "durable_seq": s.durable_seq,
        "ops_since_commit": s.ops_since_commit,
        "inodes_allocated": s.inodes_allocated,
        "node_cache_bytes": s.node_cache_bytes,
        "segment": s.log_position.map(|(seg, off)| json!({"name": seg.file_name(), "bytes": off})),
        "pending_upload_bytes": vol.pending_upload_bytes(),
        "durability": tier.as_ref().and_then(|t| t.durability).map(|d| format!("{d:?}").to_lowercase()),
        "uploads": tier.as_ref().map(|t| json!({
            "queued_segments": t.queued_segments,
            "uploaded_bytes": t.uploaded_bytes,
            "wal_pieces": t.wal_pieces,
            "failures": t.upload_failures,
            "last_error": t.last_error,
        })),
        "cache": tier.as_ref().map(|t| json!({
            "bytes": t.cache.cached_bytes,
            "imported_bytes": t.cache.object_bytes,
            "capacity": t.cache.capacity,
            "gets": t.cache.gets,
            "fetched_bytes": t.cache.fetched_bytes,
            "hits": t.cache.hits,
            "evicted_bytes": t.cache.evicted_bytes,
            "checksum_retries": t.cache.checksum_retries,
            "kept_footers": t.cache.kept_footers,
            "bucket_footers": t.cache.bucket_footers,
        })),
        "recovery": recovery,
        "cache_servers": cache_servers_json(p.cache_client.as_deref()),
        "imported": imported_json(vol.source_stats()),
        "live_bytes": vol.live_bytes().iter().map(|(_, n)| n).sum::<u64>(),
        "segments_referenced": vol.live_bytes().len(),
        // What `arbor compact` (default --max-live) would move and free.
        "compactable": vol.compactable(MAX_LIVE).ok().map(|c| json!({
            "segments": c.len(),
            "live_bytes": c.iter().map(|(_, n)| n).sum::<u64>(),
        })),
    });
    with_fuse(&mut status, fuse);
    status
}

fn imported_json(i: arbor_engine::source::SourceStats) -> Value {
    json!({"gets": i.gets, "fetched_bytes": i.fetched_bytes, "hits": i.hits, "misses": i.misses,
           "changed": i.changed, "errors": i.errors, "from_servers": i.from_servers, "from_disk": i.from_disk,
           "server_checked": i.server_checked, "server_rejected": i.server_rejected,
           "disk_bytes": i.disk_bytes, "disk_capacity": i.disk_capacity, "disk_damaged": i.disk_damaged})
}

/// One background maintenance run: compaction of the mounted branch, then
/// gc with the same grace as `arbor gc`.
fn maintain(vol: &Volume, disk: &Disk) -> Result<()> {
    let compacted = vol.compact(MAX_LIVE)?;
    let gc = disk.catalog()?.gc(GC_GRACE)?;
    tracing::info!(
        moved_bytes = compacted.data_bytes + compacted.bytes,
        deleted = gc.deleted.len(),
        "background maintenance"
    );
    Ok(())
}

fn reply<T>(r: Result<T, impl std::fmt::Display>, ok: impl FnOnce(T) -> Value) -> (Value, bool) {
    match r {
        Ok(v) => (json!({"ok": true, "result": ok(v)}), false),
        Err(e) => (json!({"ok": false, "error": e.to_string()}), false),
    }
}

/// Mounts and serves until unmounted, signalled, or asked to stop.
pub fn run_foreground(args: &MountArgs) -> Result<()> {
    if crate::keeper::wanted(args.restartable) {
        return crate::keeper::run(&arbor_fs::mount_path(&args.mountpoint));
    }
    let holder = crate::keeper::Holder::of(args.keeper.as_deref());
    let resume = holder.take_over(&arbor_fs::mount_path(&args.mountpoint))?;
    let p = prepare(args, resume.is_some())?;
    let opts = OpenOptions {
        segment_size: args.segment_size,
        owner: OwnerOptions { server: args.server.clone(), timeout: args.timeout, auth: args.auth() },
        holder: p.mountpoint.display().to_string(),
    };
    let local = match p.node.open_root(&args.root(), &opts)? {
        Opened::Local(local) => local,
        Opened::Owner(files) => {
            let fuse_opts = MountOptions {
                allow_other: args.allow_other,
                read_ahead: args.read_ahead,
                threads: args.threads,
                // Any node that writes the branch could have made a set-user-ID
                // file or a device node.
                suid_devices: args.allow_suid_devices,
                transport: crate::settings::fuse().transport,
                direct_writes: crate::settings::fuse().direct_writes,
                restartable: holder.restartable(),
                ..MountOptions::default()
            };
            let name = args.root_name().to_string();
            let servers = p.cache_client.clone();
            let at = crate::remote_mount::At { disk: &p.disk, mountpoint: &p.mountpoint, resume, holder: &holder };
            return crate::remote_mount::mount(at, name, files, &fuse_opts, servers, args.metrics);
        }
    };
    let (vol, _lock) = (local.volume, local.lock);
    let _ = OPEN_MS.set(local.opened_in.as_millis() as u64);
    let control = control::Server::bind(&p.mountpoint)?;
    let fuse_counters = Arc::new(std::sync::OnceLock::new());
    let metrics = crate::mount_metrics::Sources {
        fuse: fuse_counters.clone(),
        disk: p.disk.clone(),
        vol: Some(vol.clone()),
        servers: p.cache_client.clone(),
    };
    let endpoint = args.metrics.map(|addr| metrics.serve(addr)).transpose()?;
    let opts = MountOptions {
        allow_other: args.allow_other,
        read_ahead: args.read_ahead,
        threads: args.threads,
        transport: crate::settings::fuse().transport,
        direct_writes: crate::settings::fuse().direct_writes,
        restartable: holder.restartable(),
        ..MountOptions::default()
    };
    let resuming = resume.is_some();
    let handle = match resume {
        Some(dev) => arbor_fs::resume(vol.clone(), dev, &p.mountpoint, &opts)
            .with_context(|| format!("cannot take the mount at {} over", p.mountpoint.display()))?,
        None => arbor_fs::mount(vol.clone(), &p.mountpoint, &opts)
            .with_context(|| format!("cannot mount at {}", p.mountpoint.display()))?,
    };
    if let Some(dev) = handle.device() {
        holder.hand_over(&p.mountpoint, dev, resuming)?;
    }
    let _ = fuse_counters.set(handle.counters().clone());
    let fuse = handle.transport().describe();
    tracing::info!(mountpoint = %p.mountpoint.display(), disk = %p.disk.url, root = args.root_name(), %fuse, resuming, "mounted");
    if !args.pre_fetch.is_empty() && !resuming {
        let paths: Vec<PathBuf> = args.pre_fetch.iter().map(|r| p.mountpoint.join(r)).collect();
        std::thread::spawn(move || {
            let (files, bytes) = crate::prefetch::warm(&paths, &mut |_| {});
            tracing::info!(files, bytes, "pre-fetch done");
        });
    }

    // Background maintenance of a branch mount: compaction, then gc. It
    // stops (finishing a run in progress) before the volume is closed.
    let (maintain_stop, maintainer) = match (args.maintain_every, &args.checkpoint) {
        (secs, None) if secs > 0 => {
            let (stop_tx, stop_rx) = mpsc::channel::<()>();
            let (vol, disk) = (vol.clone(), p.disk.clone());
            let every = Duration::from_secs(secs);
            let t = std::thread::Builder::new().name("arbor-maintain".into()).spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = stop_rx.recv_timeout(every) {
                    if let Err(e) = maintain(&vol, &disk) {
                        tracing::warn!(error = %format!("{e:#}"), "background maintenance failed");
                    }
                }
            })?;
            (Some(stop_tx), Some(t))
        }
        _ => (None, None),
    };

    // Imports recorded for this branch, refreshed on a timer.
    let invalidate = Arc::new(handle.invalidator());
    let (refresh_stop, refresher) = match (args.refresh_source, &args.checkpoint) {
        (secs, None) if secs > 0 => {
            let (stop_tx, stop_rx) = mpsc::channel::<()>();
            let (vol, store, branch) = (vol.clone(), p.disk.store().clone(), args.root_name().to_string());
            let invalidate = invalidate.clone();
            let every = Duration::from_secs(secs);
            let t = std::thread::Builder::new().name("arbor-refresh".into()).spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = stop_rx.recv_timeout(every) {
                    let imports = match crate::import::recorded(store.as_ref(), &branch) {
                        Ok(i) => i,
                        Err(e) => {
                            tracing::warn!(error = %format!("{e:#}"), "cannot read the recorded imports");
                            continue;
                        }
                    };
                    for i in imports {
                        let mode = crate::import::Mode::Refresh;
                        match crate::import::into_mount(&vol, &invalidate, &i.source, &i.at, i.owner, mode) {
                            Ok(r) => tracing::info!(source = %i.source, at = %i.at, report = %r, "refreshed"),
                            Err(e) => tracing::warn!(source = %i.source, error = %format!("{e:#}"), "refresh failed"),
                        }
                    }
                }
            })?;
            (Some(stop_tx), Some(t))
        }
        _ => (None, None),
    };

    let ctl = ControlState {
        p: p.clone(),
        vol: vol.clone(),
        fuse: (handle.transport().clone(), handle.counters().clone()),
        invalidate: invalidate.clone(),
    };
    let args_view = MountArgs { pre_fetch: Vec::new(), ..args.clone() };
    let flushed = vol.clone();
    let hand_over = holder.on_term(&p.mountpoint, handle.device(), move || {
        flushed.sync_all().and_then(|_| flushed.commit()).map_err(|e| e.to_string())
    });
    let stopped = serve_until_stopped(handle, control, hand_over, move |req, tx| ctl.handle(&args_view, req, tx))?;
    holder.released(&p.mountpoint);
    // It holds the volume: gone before the volume closes.
    drop(endpoint);
    drop(maintain_stop);
    if let Some(t) = maintainer {
        let _ = t.join();
    }
    drop(refresh_stop);
    if let Some(t) = refresher {
        let _ = t.join();
    }
    let closed = vol.close();
    drop(vol);
    stopped.report(closed.as_ref().map(|_| ()).map_err(|e| format!("{e:#}")));
    closed.context("final commit failed")?;
    // Closed: every byte is in the bucket.
    p.disk.remove_own_cache();
    tracing::info!("unmounted cleanly");
    Ok(())
}

struct ControlState {
    p: Prepared,
    vol: Arc<Volume>,
    fuse: Fuse,
    invalidate: Arc<arbor_fs::Invalidator>,
}

impl ControlState {
    fn handle(&self, args: &MountArgs, req: &Value, tx: &mpsc::Sender<Event>) -> (Value, bool) {
        match req["op"].as_str() {
            Some("status") => (json!({"ok": true, "result": status(&self.p, args, &self.vol, &self.fuse)}), false),
            Some("sync") => reply(self.vol.sync_all().and_then(|_| self.vol.commit()), |_| Value::Null),
            // Commits now and returns the commit: a branch's current state.
            Some("commit") => reply(
                self.vol.commit().and_then(|_| self.vol.last_commit().ok_or(arbor_engine::Error::ReadOnly)),
                addr_json,
            ),
            Some("checkpoint") => {
                let Some(name) = req["name"].as_str() else { return reply(Err("no name"), |()| Value::Null) };
                if args.checkpoint.is_some() {
                    return reply(Err("a checkpoint mount is read-only; checkpoint its branch instead"), |()| {
                        Value::Null
                    });
                }
                let made =
                    self.p.disk.catalog().map_err(|e| e.to_string()).and_then(|c| {
                        c.checkpoint_volume(name, args.root_name(), &self.vol).map_err(|e| e.to_string())
                    });
                reply(made, |c| json!({"name": c.name, "commit": addr_json(c.commit)}))
            }
            Some("compact") => {
                if args.checkpoint.is_some() {
                    return reply(Err("a checkpoint mount is read-only"), |()| Value::Null);
                }
                let max_live = req["max_live"].as_f64().unwrap_or(MAX_LIVE);
                reply(self.vol.compact(max_live), compact_json)
            }
            Some("import") => {
                if args.checkpoint.is_some() {
                    return reply(Err("a checkpoint mount is read-only; import into its branch instead"), |()| {
                        Value::Null
                    });
                }
                let (source, at) = (req["source"].as_str().unwrap_or(""), req["at"].as_str().unwrap_or("/"));
                let owner = (req["uid"].as_u64().unwrap_or(0) as u32, req["gid"].as_u64().unwrap_or(0) as u32);
                let mode = match req["refresh"].as_bool() {
                    Some(true) => crate::import::Mode::Refresh,
                    _ => crate::import::Mode::Import,
                };
                let done = crate::import::into_mount(&self.vol, &self.invalidate, source, at, owner, mode);
                reply(done.map_err(|e| format!("{e:#}")), |v| v)
            }
            Some("unmount") => unmount_request(tx),
            other => (json!({"ok": false, "error": format!("unknown request {other:?}")}), false),
        }
    }
}

/// Starts `arbor mount … --foreground` in the background, logging to a
/// file, and returns once the file system answers.
/// Starts the mount process; returns its log and the FUSE transport it uses.
pub fn spawn_background(args: &MountArgs) -> Result<(PathBuf, String)> {
    // A live connection the keeper holds is taken over by the mount
    // process (this copy only says there is one).
    let holder = crate::keeper::Holder::of(args.keeper.as_deref());
    let resuming = holder.take_over(&arbor_fs::mount_path(&args.mountpoint))?.is_some();
    let p = prepare(args, resuming)?;
    let log_path = p.disk.log_path(args.root_name());
    let mountpoint = p.mountpoint.clone();
    // The server opens the disk (and its cache directory) itself.
    drop(p);
    spawn_detached(&log_path, "mount", &[(SERVERS_CHECKED, "1")], || {
        arbor_fs::is_mountpoint(&mountpoint) && control::request(&mountpoint, json!({"op": "status"})).is_ok()
    })?;
    let fuse = control::request(&mountpoint, json!({"op": "status"}))
        .ok()
        .and_then(|s| s["fuse_transport"].as_str().map(String::from))
        .unwrap_or_else(|| "unknown".into());
    Ok((log_path, fuse))
}

/// While an unmount waits for the bucket, shows what is left to upload.
fn show_upload_progress<T>(mountpoint: &Path, req: &std::thread::ScopedJoinHandle<'_, T>) {
    use indicatif::{ProgressBar, ProgressStyle};
    let pending = |mp: &Path| {
        control::request(mp, json!({"op": "status"})).ok().and_then(|s| {
            s["durability"].as_str()?;
            s["pending_upload_bytes"].as_u64()
        })
    };
    let mut bar: Option<ProgressBar> = None;
    let mut most = 0;
    // Bounded: an hour of 200 ms polls; the unmount itself has its own limit.
    for _ in 0..18_000 {
        if req.is_finished() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        let Some(left) = pending(mountpoint) else { continue };
        if left == 0 && bar.is_none() {
            continue;
        }
        most = most.max(left);
        let b = bar.get_or_insert_with(|| {
            let b = ProgressBar::new(most);
            if let Ok(style) = ProgressStyle::with_template("uploading {bar:40} {bytes}/{total_bytes} {bytes_per_sec}")
            {
                b.set_style(style);
            }
            b
        });
        b.set_length(most);
        b.set_position(most - left);
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
}

/// Unmounts through the control socket (which waits for the final
/// commit), or detaches a mount whose server is gone (after telling its
/// keeper, if given, to let its connection go: a held connection would
/// keep the dead mount waiting for a server instead of failing).
pub fn unmount(mountpoint: &Path, keeper: Option<&Path>) -> Result<()> {
    let waited = std::thread::scope(|s| {
        let req = s.spawn(|| control::request(mountpoint, json!({"op": "unmount"})));
        show_upload_progress(mountpoint, &req);
        req.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the unmount request failed")))
    });
    if let Err(e) = waited {
        if !arbor_fs::is_mountpoint(mountpoint) {
            return Err(e);
        }
        if let Some(k) = keeper {
            if let Err(e) = crate::keeper::client::Client::new(k).release(&arbor_fs::mount_path(mountpoint)) {
                eprintln!("note: {e:#}");
            }
        }
        if !settles_within(mountpoint, HELD_PROBE) {
            bail!(
                "{} has no server and does not fail either: `arbor keeper` may hold its connection (start its `arbor mount --keeper` again, or `arbor unmount {} --keeper SOCKET`)",
                mountpoint.display(),
                mountpoint.display()
            );
        }
        arbor_fs::recover_stale_mount(mountpoint)?;
        if arbor_fs::is_mountpoint(mountpoint) {
            bail!("{} is mounted but not served by arbor on this node", mountpoint.display());
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while arbor_fs::is_mountpoint(mountpoint) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    if arbor_fs::is_mountpoint(mountpoint) {
        bail!("{} is still mounted a minute later (is a process using it?)", mountpoint.display());
    }
    Ok(())
}

/// How long `arbor unmount` waits for a mount without a server to answer
/// or fail before it says why it may do neither.
const HELD_PROBE: Duration = Duration::from_secs(5);

/// Whether a `statfs` of the mount point returns (answered, or failed as a
/// dead mount fails) within `wait`. A mount whose connection `arbor
/// keeper` holds with no server waits instead; the probe's thread then
/// waits with it, until the process exits.
fn settles_within(mountpoint: &Path, wait: Duration) -> bool {
    let (tx, rx) = mpsc::channel();
    let mp = mountpoint.to_path_buf();
    let probe = std::thread::Builder::new().name("arbor-probe".into()).spawn(move || {
        let _ = nix::sys::statfs::statfs(&mp);
        let _ = tx.send(());
    });
    probe.is_ok() && rx.recv_timeout(wait).is_ok()
}
