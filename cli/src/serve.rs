//! `arbor serve`: a shared cache of a disk's segment chunks for every node
//! that mounts it (see `arbor_net`), and the owner of the branches it is
//! given (see `crate::shared`).

use anyhow::{bail, Context, Result};
use arbor_engine::tier::SegmentCache;
use arbor_net::{CacheServer, Fault, ServerOptions};
use arbor_node::disk;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub struct ServeArgs {
    pub disk: String,
    pub listen: String,
    /// `None`: a folder under the node folder (unless `memory`).
    pub cache_dir: Option<PathBuf>,
    /// The cache lives in memory only.
    pub memory: bool,
    pub cache_size: u64,
    /// Memory for chunks of imported files' source objects (0: not served).
    pub object_memory: u64,
    /// `None`: only client certificates the client CA signed get in.
    pub token_file: Option<PathBuf>,
    pub tls: Option<arbor_net::wire::tls::ServerFiles>,
    pub fault: Option<Fault>,
    /// Evict what nobody read for this long (`None`: by size alone).
    pub keep_for: Option<Duration>,
    /// The branches to own and serve.
    pub owner: crate::owner::OwnerArgs,
}

/// The lock that keeps a second server off a cache folder.
fn lock_cache_dir(dir: &Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    arbor_engine::private::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let f = arbor_engine::private::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("lock"))
        .with_context(|| format!("cannot open {}", dir.display()))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        bail!("cache folder {} is in use by another arbor serve", dir.display());
    }
    Ok(f)
}

fn cache_dir(args: &ServeArgs, d: &disk::Disk) -> Result<PathBuf> {
    Ok(match &args.cache_dir {
        Some(dir) => std::path::absolute(dir)?,
        None => d.node_dir().join("serve"),
    })
}

/// Runs the server until SIGINT or SIGTERM.
pub fn run_foreground(args: &ServeArgs) -> Result<()> {
    let (token, tls) = server_auth(args)?;
    check_advertise(args)?;
    let d = disk::open(&args.disk)?;
    let branches = &args.owner.branches;
    if !d.is_s3() && branches.is_empty() {
        bail!("{} is a local folder: every reader already has its bytes; arbor serve is for s3:// disks (or --branch, to share a branch)", d.url);
    }
    // The branches this process owns cache the segments they write: a
    // client's chunk of one of those comes from there, not the bucket.
    let own_chunks = Arc::new(arbor_engine::chunks::LateSources::default());
    let sources = (!branches.is_empty()).then(|| own_chunks.clone() as Arc<dyn arbor_engine::chunks::ChunkSource>);
    let (cache, cache_lock, place) = if !d.is_s3() {
        (None, None, "none (a local-folder disk)".to_string())
    } else if args.memory {
        let cache = SegmentCache::with_sources(d.store().clone(), None, args.cache_size, sources)?;
        (Some(Arc::new(cache)), None, "memory".to_string())
    } else {
        let dir = cache_dir(args, &d)?;
        let lock = lock_cache_dir(&dir)?;
        let cache = SegmentCache::with_sources(d.store().clone(), Some(&dir.join("chunks")), args.cache_size, sources)
            .with_context(|| format!("cannot open cache folder {}", dir.display()))?;
        (Some(Arc::new(cache)), Some(lock), dir.display().to_string())
    };
    // Source-object chunks on disk beside the segment chunks, in the same
    // --cache-size budget (they give way to segment chunks).
    let object_files = match (&cache, &cache_lock) {
        (Some(segments), Some(_)) if args.object_memory > 0 => {
            let dir = cache_dir(args, &d)?.join("objects");
            let segments = segments.clone();
            let others: arbor_engine::chunks::Others = Box::new(move || segments.stats().cached_bytes);
            let files = arbor_engine::chunks::ChunkFiles::open(&dir, args.cache_size, Some(others))
                .with_context(|| format!("cannot open cache folder {}", dir.display()))?;
            Some(files)
        }
        _ => None,
    };
    let listener =
        arbor_net::server::listen(&args.listen).with_context(|| format!("cannot listen on {}", args.listen))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let advertised = crate::owner::advertised(addr, args.owner.advertise.as_deref());
    if !branches.is_empty() {
        // An owner's branch heads and leases rest on conditional writes.
        d.check_conditional_writes()?;
    }
    let mut owned = Vec::new();
    for b in branches {
        match crate::owner::own(&args.disk, b, &advertised, &args.owner) {
            Ok(o) => {
                if let Some(c) = o.cached_chunks() {
                    own_chunks.add(c);
                }
                owned.push(o)
            }
            Err(e) => {
                for o in owned {
                    let _ = o.close();
                }
                return Err(e);
            }
        }
    }
    let shared: Vec<_> = owned.iter().map(|o| o.shared.clone()).collect();
    // Every branch is open (a later one may have waited for a lease to
    // lapse): the lock grace periods start now, as clients can be served.
    for b in &shared {
        b.start_lock_grace();
    }
    // An owner that stepped down (another writer took its branch, or it
    // could not keep its lease) cannot serve it again in this process: it
    // exits, so that a supervisor starts it anew and it claims the branch
    // again (or finds the new owner holds it).
    let watched = shared.clone();
    // The owner records are kept naming this process (every 5 s) until it
    // stops: another owner that lost the race for a branch may put back a
    // stale record.
    let keepers: Vec<_> = owned.iter().map(|o| o.record_keeper()).collect();
    let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopping_seen = stopping.clone();
    let mut turn = 0u64;
    std::thread::Builder::new().name("arbor-step-down".into()).spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(250));
        turn += 1;
        // Stepping down is looked at first: a deposed owner must not
        // record itself again over its successor on its way out.
        if let Some(b) = watched.iter().find(|b| b.stepped_down()) {
            tracing::error!(branch = %b.name(), "no longer the branch's owner; exiting so that a supervisor starts this owner again");
            std::process::exit(75);
        }
        if turn % 20 == 1 && !stopping_seen.load(std::sync::atomic::Ordering::Acquire) {
            for k in &keepers {
                k();
            }
        }
    })?;
    let objects = (args.object_memory > 0).then(|| {
        let sources = Arc::new(arbor_engine::source::EnvSources::default());
        Arc::new(arbor_engine::source::SourceReader::serving(sources, args.object_memory, object_files))
    });
    // Source objects are fetched with this server's credentials: only
    // those an import of the disk names.
    let records = d.store().clone();
    let object_scope = Arc::new(arbor_net::ObjectScope::new(Box::new(move || {
        crate::import::imported_prefixes(records.as_ref()).map_err(|e| format!("{e:#}"))
    })));
    let opts = ServerOptions {
        token,
        fault: args.fault,
        keep_for: args.keep_for,
        objects,
        object_scope: Some(object_scope),
        tls,
        ..ServerOptions::default()
    };
    let server = CacheServer::owner(cache, shared, opts);
    if let Some(f) = args.fault {
        tracing::warn!(fault = ?f, "serving with a fault switched on: clients will reject what they get");
    }
    // Said once the stop signals are handled (tests and supervisors wait
    // for this line before they may stop it).
    let announce = || {
        tracing::info!(
            disk = %d.url,
            listen = %addr,
            cache = %place,
            size = %disk::Size(args.cache_size),
            objects = %disk::Size(args.object_memory),
            branches = ?branches,
            tls = args.tls.as_ref().map_or("off", |t| if t.client_ca.is_some() { "on, client certificates" } else { "on" }),
            "serving"
        );
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("arbor-serve").build()?;
    let served = rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        // The handlers are in place before anyone is told the server is
        // ready, so that a SIGTERM sent right after is a clean stop.
        use tokio::signal::unix::{signal, SignalKind};
        let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
        let stop = async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            crate::session::tell_systemd(sd_notify::NotifyState::Stopping);
        };
        announce();
        crate::session::tell_systemd(sd_notify::NotifyState::Ready);
        server.run(listener, stop).await
    });
    stopping.store(true, std::sync::atomic::Ordering::Release);
    rt.shutdown_timeout(Duration::from_secs(5));
    served?;
    close_within(owned, args.owner.stop_timeout)?;
    tracing::info!("stopped");
    Ok(())
}

/// Closes the branches (each a last commit and its upload), for up to
/// `wait`: a bucket that is away does not hold a stop forever. What
/// clients fsynced is durable either way (in the bucket, or with local
/// durability in this node's log, which the next owner here uploads).
fn close_within(owned: Vec<crate::owner::Owned>, wait: Duration) -> Result<()> {
    let names: Vec<String> = owned.iter().map(|o| o.shared.name().to_string()).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let closing = std::thread::Builder::new().name("arbor-close".into()).spawn(move || {
        let mut closed = Ok(());
        for o in owned {
            let pending = o.pending_upload();
            let _ = tx.send(Err((o.shared.name().to_string(), pending)));
            if let Err(e) = o.close() {
                tracing::error!(error = %format!("{e:#}"), "closing a branch failed");
                closed = Err(e);
            }
        }
        let _ = tx.send(Ok(closed));
    })?;
    let deadline = std::time::Instant::now() + wait;
    let mut at = None;
    // Bounded by `deadline`; each message is one branch begun, or the end.
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
            Ok(Ok(closed)) => {
                let _ = closing.join();
                return closed;
            }
            Ok(Err(branch)) => at = Some(branch),
            Err(_) => break,
        }
    }
    let (branch, pending) = at.unwrap_or_default();
    tracing::error!(
        branch,
        pending_bytes = pending,
        waited_s = wait.as_secs(),
        "stopping without the last upload: what clients fsynced is durable (in the bucket, or with local durability in this node's log, which the next owner here uploads); what they had not fsynced is lost"
    );
    anyhow::bail!(
        "stopped after {} s without closing branch {branch} ({} not uploaded; the bucket did not take it); branches: {}",
        wait.as_secs(),
        disk::Size(pending),
        names.join(",")
    )
}

/// The address given to clients must read as one.
fn check_advertise(args: &ServeArgs) -> Result<()> {
    if let Some(a) = &args.owner.advertise {
        arbor_net::check_host_port(a).map_err(|e| anyhow::anyhow!("--advertise {e}"))?;
    }
    Ok(())
}

/// Starts the server as a background process and returns once it accepts
/// connections: (pid, log).
pub fn spawn_background(args: &ServeArgs) -> Result<(u32, PathBuf)> {
    // Refuse what the child would refuse, here, with the message on the terminal.
    server_auth(args)?;
    check_advertise(args)?;
    let log_path = disk::open(&args.disk)?.log_path("serve");
    for b in &args.owner.branches {
        arbor_snapshot::check_name(b)?;
    }
    // The process started below is ready once something answers at the
    // address, so the address must be free now: a server already there
    // would look like this one started.
    if args.listen.rsplit(':').next() == Some("0") {
        bail!("--listen {}: give a port (port 0 is for --foreground, which logs the one it got)", args.listen);
    }
    drop(std::net::TcpListener::bind(&args.listen).with_context(|| format!("cannot listen on {}", args.listen))?);
    let pid = crate::session::spawn_detached(&log_path, "arbor serve", &[], || {
        std::net::TcpStream::connect(&args.listen).is_ok()
    })?;
    Ok((pid, log_path))
}

/// The token `arbor serve` asks for (empty: none, client certificates
/// only) and its TLS, loaded and checked.
fn server_auth(args: &ServeArgs) -> Result<(String, Option<arbor_net::ServerTls>)> {
    let token = match &args.token_file {
        Some(f) => arbor_net::read_token(f)?,
        None if args.tls.as_ref().is_some_and(|t| t.client_ca.is_some()) => String::new(),
        None => bail!("give --token-file (or ARBOR_TOKEN_FILE), or --tls-cert/--tls-key with --tls-client-ca"),
    };
    let tls = args.tls.as_ref().map(arbor_net::ServerTls::load).transpose()?;
    Ok((token, tls))
}
