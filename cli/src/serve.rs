//! `arbor mount`: the process that serves one branch or checkpoint.

use crate::control;
use crate::disk::{self, Disk};
use anyhow::{bail, Context, Result};
use arbor_engine::volume::{Config, Volume, MAX_LIVE};
use arbor_fs::MountOptions;
use arbor_snapshot::{check_name, Error as CatalogError, GC_GRACE};
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
}

impl MountArgs {
    fn root_name(&self) -> &str {
        self.checkpoint.as_deref().or(self.branch.as_deref()).unwrap_or("main")
    }
}

pub enum Event {
    Stop(&'static str),
    /// Unmount, then report how closing the volume went.
    Unmount(mpsc::Sender<Result<(), String>>),
}

#[derive(Clone)]
struct Prepared {
    disk: Arc<Disk>,
    mountpoint: PathBuf,
    cache_client: Option<Arc<arbor_net::CacheClient>>,
}

/// Segment sizes a mount accepts: addresses hold 32-bit offsets, and a
/// segment much smaller than a FUSE write would be mostly headers.
const SEGMENT_SIZES: std::ops::RangeInclusive<u64> = (1 << 20)..=(1 << 31);

/// Adds what `status` says of a mount's FUSE side to `status`: the
/// transport, its requests, and what reached arbor.
pub fn with_fuse(status: &mut Value, (transport, c): &Fuse) {
    use std::sync::atomic::Ordering::Relaxed;
    let fuse = json!({
        "fuse_transport": transport.describe(),
        "fuse_ring_requests": transport.ring_requests(),
        "fuse_read_requests": c.reads.load(Relaxed),
        "fuse_lookup_requests": c.lookups.load(Relaxed),
        "fuse_getxattr_requests": c.getxattrs.load(Relaxed),
        "fuse_direct_write_opens": c.direct_opens.load(Relaxed),
        "kernel_read_ahead": c.kernel_read_ahead.load(Relaxed),
    });
    if let (Some(to), Value::Object(from)) = (status.as_object_mut(), fuse) {
        to.extend(from);
    }
}

/// What `status` says of each cache server a mount reads through.
pub fn cache_servers_json(client: Option<&arbor_net::CacheClient>) -> serde_json::Value {
    let Some(c) = client else { return serde_json::Value::Null };
    c.stats()
        .into_iter()
        .map(|s| {
            json!({
                "addr": s.addr,
                "chunks": s.chunks,
                "bytes": s.bytes,
                "hits": s.hits,
                "parts": s.parts,
                "footers": s.footers,
                "fallback_down": s.fallback_down,
                "fallback_timeout": s.fallback_timeout,
                "fallback_error": s.fallback_error,
                "fallback_not_found": s.fallback_not_found,
                "rejected": s.rejected,
            })
        })
        .collect()
}

pub fn check_segment_size(size: u64) -> Result<()> {
    if !SEGMENT_SIZES.contains(&size) {
        bail!(
            "--segment-size must be between {} and {}",
            disk::Size(*SEGMENT_SIZES.start()),
            disk::Size(*SEGMENT_SIZES.end())
        );
    }
    Ok(())
}

/// Set for a mount process started in the background by a command that
/// has already asked its cache servers whether they answer.
const SERVERS_CHECKED: &str = "ARBOR_CACHE_SERVERS_CHECKED";

fn prepare(args: &MountArgs) -> Result<Prepared> {
    check_name(args.root_name())?;
    check_segment_size(args.segment_size)?;
    let auth = crate::cache_server::ClientAuth { token_file: args.token_file.as_deref(), tls: args.tls.as_ref() };
    let cache_client = crate::cache_server::client(&args.cache_servers, auth)?;
    // Checked once, by the command a user runs: not again by the mount
    // process it starts in the background.
    if let (Some(c), None) = (&cache_client, std::env::var_os(SERVERS_CHECKED)) {
        crate::cache_server::warn_about_servers(&crate::cache_server::check_servers(c).1);
    }
    let mut cache = args.cache.clone();
    cache.peers = cache_client.clone().map(|c| c as Arc<dyn arbor_engine::tier::ChunkSource>);
    let disk = disk::open_for_mount(&args.disk, args.root_name(), cache)?;
    if !disk.is_s3() && args.cache.durability != arbor_engine::tier::Durability::Local {
        eprintln!("note: a local-folder disk is its own durable copy; --durability applies to s3:// disks");
    }
    if !disk.is_s3() && (args.cache.dir.is_some() || cache_client.is_some()) {
        eprintln!(
            "note: a local-folder disk's segments are read in place; --cache-dir and --cache-server hold only imported files' chunks"
        );
    }
    let catalog = disk.catalog()?;
    match (&args.branch, &args.checkpoint) {
        (Some(_), Some(_)) => bail!("give --branch or --checkpoint, not both"),
        (_, Some(c)) => {
            catalog.checkpoint(c)?;
        }
        (b, None) => {
            catalog.branch_head(b.as_deref().unwrap_or("main"))?;
        }
    }
    let mountpoint = arbor_fs::mount_path(&args.mountpoint);
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
    Ok(Prepared { disk: Arc::new(disk), mountpoint, cache_client })
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

pub fn compact_json(r: arbor_engine::volume::CompactReport) -> Value {
    json!({"segments": r.segments.len(), "nodes": r.nodes, "bytes": r.bytes, "data_bytes": r.data_bytes})
}

pub fn addr_json(a: arbor_engine::format::Addr) -> Value {
    json!({"writer": a.seg.writer, "seq": a.seg.seq, "off": a.off, "len": a.len})
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

/// Opens branch `name` for writing in this process, noting `holder`
/// (a mountpoint, or where it is served) for other commands on this node.
pub fn open_branch(
    catalog: &arbor_snapshot::Catalog,
    name: &str,
    cfg: Config,
    holder: &str,
) -> Result<(Arc<Volume>, arbor_snapshot::BranchLock)> {
    let (v, mut l) = catalog.open_branch(name, cfg).map_err(|e| match e {
        CatalogError::Open(_) => match catalog.holder_of(name) {
            Some(mp) if mp.starts_with('/') => anyhow::anyhow!("branch {name} is already mounted read-write at {mp}"),
            Some(by) if !by.is_empty() => anyhow::anyhow!("branch {name} is already open read-write by {by}"),
            _ => anyhow::anyhow!("branch {name} is already mounted read-write"),
        },
        e => anyhow::Error::from(e).context(format!("cannot open branch {name}")),
    })?;
    l.record_holder(holder)?;
    Ok((v, l))
}

/// Mounts and serves until unmounted, signalled, or asked to stop.
pub fn run_foreground(args: &MountArgs) -> Result<()> {
    let p = prepare(args)?;
    let catalog = p.disk.catalog()?;
    if args.checkpoint.is_none() {
        if let Some(owner) = crate::shared::owner_to_mount_through(&p.disk, args)? {
            return crate::shared::mount_remote(&p.disk, &p.mountpoint, args, owner, p.cache_client.clone());
        }
        if args.cache.memory && args.cache.durability != arbor_engine::tier::Durability::Bucket {
            bail!(crate::MEMORY_ONLY_BRANCH);
        }
    }
    if args.checkpoint.is_none() {
        p.disk.make_private()?;
    }
    let cfg = Config {
        segment_size: args.segment_size,
        source_servers: p.cache_client.clone().map(|c| c as Arc<dyn arbor_engine::tier::ChunkSource>),
        source_files: p.disk.source_files()?,
        ..Config::default()
    };
    let opening = Instant::now();
    let (vol, _lock) = match &args.checkpoint {
        Some(c) => (catalog.open_checkpoint(c, cfg)?, None),
        None => {
            let (v, l) = open_branch(&catalog, args.root_name(), cfg, &p.mountpoint.display().to_string())?;
            (v, Some(l))
        }
    };
    let _ = OPEN_MS.set(opening.elapsed().as_millis() as u64);
    let control = control::Server::bind(&p.mountpoint)?;
    let opts = MountOptions {
        allow_other: args.allow_other,
        read_ahead: args.read_ahead,
        threads: args.threads,
        ..MountOptions::default()
    };
    let handle = arbor_fs::mount(vol.clone(), &p.mountpoint, &opts)
        .with_context(|| format!("cannot mount at {}", p.mountpoint.display()))?;
    let fuse = handle.transport().describe();
    tracing::info!(mountpoint = %p.mountpoint.display(), disk = %p.disk.url, root = args.root_name(), %fuse, "mounted");
    if !args.pre_fetch.is_empty() {
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
    let stopped = serve_until_stopped(handle, control, move |req, tx| ctl.handle(&args_view, req, tx))?;
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

/// How a mount was stopped: who waits to hear how closing went.
pub struct Stopped {
    ack: Option<mpsc::Sender<Result<(), String>>>,
    replied: mpsc::Receiver<()>,
}

impl Stopped {
    /// Tells an `arbor unmount` waiting on the control socket how closing went.
    pub fn report(self, closed: Result<(), String>) {
        if let Some(a) = self.ack {
            let _ = a.send(closed);
            let _ = self.replied.recv_timeout(Duration::from_secs(5));
        }
    }
}

/// Answers control requests with `handle` until a signal, an unmount
/// request, or an unmount from outside, then unmounts.
pub fn serve_until_stopped(
    handle: arbor_fs::MountHandle,
    control: control::Server,
    handle_req: impl Fn(&Value, &mpsc::Sender<Event>) -> (Value, bool) + Send + Sync + 'static,
) -> Result<Stopped> {
    let (tx, rx) = mpsc::channel();
    let sig_tx = tx.clone();
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM, libc::SIGHUP])?;
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            let _ = sig_tx.send(Event::Stop("signal"));
        }
    });
    let (replied_tx, replied_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        control.serve(|req| handle_req(req, &tx));
        let _ = replied_tx.send(());
    });
    // Mounted, and its control socket bound: `arbor status` answers.
    tell_systemd(sd_notify::NotifyState::Ready);
    let mut ack = None;
    let unmount = loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(Event::Stop(why)) => {
                tracing::info!(why, "unmounting");
                break true;
            }
            Ok(Event::Unmount(a)) => {
                ack = Some(a);
                break true;
            }
            Err(mpsc::RecvTimeoutError::Timeout) if handle.is_finished() => break false,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break true,
        }
    };
    tell_systemd(sd_notify::NotifyState::Stopping);
    let ended = if unmount { handle.unmount() } else { handle.join() };
    if let Err(e) = ended {
        tracing::warn!(error = %e, "session ended with an error");
    }
    Ok(Stopped { ack, replied: replied_rx })
}

/// Tells the service manager how this foreground process stands, when it
/// runs as a `Type=notify` systemd unit (`NOTIFY_SOCKET` set): ready once
/// it serves, stopping once it begins to close. Nothing otherwise.
pub fn tell_systemd(state: sd_notify::NotifyState<'_>) {
    if let Err(e) = sd_notify::notify(&[state]) {
        tracing::warn!(error = %e, "cannot notify systemd (NOTIFY_SOCKET)");
    }
}

/// The `unmount` control request: unmounts, and answers once closing is done.
pub fn unmount_request(tx: &mpsc::Sender<Event>) -> (Value, bool) {
    let (ack_tx, ack_rx) = mpsc::channel();
    let _ = tx.send(Event::Unmount(ack_tx));
    match ack_rx.recv_timeout(Duration::from_secs(600)) {
        Ok(Ok(())) => (json!({"ok": true, "result": null}), true),
        Ok(Err(e)) => (json!({"ok": false, "error": format!("unmounted, but closing failed: {e}")}), true),
        Err(_) => (
            json!({"ok": false, "error": format!(
                "unmounted, but still uploading after 10 minutes; the server (pid {}) keeps trying: see its log",
                std::process::id()
            )}),
            true,
        ),
    }
}

struct ControlState {
    p: Prepared,
    vol: Arc<Volume>,
    fuse: Fuse,
    invalidate: Arc<arbor_fs::Invalidator>,
}

/// A mount's transport and what reached it.
pub type Fuse = (Arc<arbor_fs::Transport>, Arc<arbor_fs::Counters>);

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
    let p = prepare(args)?;
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

/// Runs this command again with `--foreground` (and `env`) as a process of
/// its own session, logging to `log_path`, and returns its pid once `ready` says
/// so (within 60 s); a child that exits first fails with its last log line.
pub fn spawn_detached(
    log_path: &Path,
    what: &str,
    env: &[(&str, &str)],
    mut ready: impl FnMut() -> bool,
) -> Result<u32> {
    use std::os::unix::process::CommandExt;
    arbor_engine::private::create_dir_all(log_path.parent().unwrap_or(Path::new(".")))?;
    let log = arbor_engine::private::options().create(true).append(true).open(log_path)?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1)).arg("--foreground").envs(env.iter().copied());
    // The child is not the process a service manager started: readiness
    // is this process's exit (a `Type=forking` unit).
    cmd.env_remove("NOTIFY_SOCKET");
    cmd.stdin(std::process::Stdio::null()).stdout(log.try_clone()?).stderr(log);
    // SAFETY: setsid is async-signal-safe; it detaches the child from our terminal.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().with_context(|| format!("cannot start the {what} process"))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            bail!("{what} failed ({status}): {}", last_line(log_path));
        }
        if ready() {
            return Ok(child.id());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    bail!("{what} did not answer within 60 s; see {}", log_path.display())
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

fn last_line(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no log output");
    line.split_once("arbor: ").map_or(line, |(_, msg)| msg).to_string()
}

/// Unmounts through the control socket (which waits for the final
/// commit), or detaches a mount whose server is gone.
pub fn unmount(mountpoint: &Path) -> Result<()> {
    let waited = std::thread::scope(|s| {
        let req = s.spawn(|| control::request(mountpoint, json!({"op": "unmount"})));
        show_upload_progress(mountpoint, &req);
        req.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the unmount request failed")))
    });
    if let Err(e) = waited {
        if !arbor_fs::is_mountpoint(mountpoint) {
            return Err(e);
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
