//! `arbor serve`: a shared cache of a disk's segment chunks for every node
//! that mounts it (see `arbor_net`), and the cache-server options of
//! `arbor mount`.

use crate::disk;
use anyhow::{bail, Context, Result};
use arbor_engine::tier::SegmentCache;
use arbor_net::{CacheClient, CacheServer, ClientOptions, Fault, ServerOptions};
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
    pub owner: crate::shared::OwnerArgs,
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
    let own_chunks = Arc::new(arbor_engine::tier::LateSources::default());
    let sources = (!branches.is_empty()).then(|| own_chunks.clone() as Arc<dyn arbor_engine::tier::ChunkSource>);
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
            let others: arbor_engine::source::Others = Box::new(move || segments.stats().cached_bytes);
            let files = arbor_engine::source::ChunkFiles::open(&dir, args.cache_size, Some(others))
                .with_context(|| format!("cannot open cache folder {}", dir.display()))?;
            Some(files)
        }
        _ => None,
    };
    let listener =
        arbor_net::server::listen(&args.listen).with_context(|| format!("cannot listen on {}", args.listen))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let advertised = crate::shared::advertised(addr, args.owner.advertise.as_deref());
    if !branches.is_empty() {
        // An owner's branch heads and leases rest on conditional writes.
        d.check_conditional_writes()?;
    }
    let mut owned = Vec::new();
    for b in branches {
        match crate::shared::own(&args.disk, b, &advertised, &args.owner) {
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
            crate::serve::tell_systemd(sd_notify::NotifyState::Stopping);
        };
        announce();
        crate::serve::tell_systemd(sd_notify::NotifyState::Ready);
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
fn close_within(owned: Vec<crate::shared::Owned>, wait: Duration) -> Result<()> {
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
    let pid = crate::serve::spawn_detached(&log_path, "arbor serve", &[], || {
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

/// How a client proves itself to `arbor serve`: `--token-file`, and TLS
/// (`--tls-ca`/`--tls-fingerprint`, with `--tls-cert`/`--tls-key` a
/// certificate that may stand for the token).
#[derive(Clone, Copy)]
pub struct ClientAuth<'a> {
    pub token_file: Option<&'a Path>,
    pub tls: Option<&'a arbor_net::wire::tls::ClientFiles>,
}

impl ClientAuth<'_> {
    /// The token (empty: none, a client certificate instead) and the TLS
    /// to speak, loaded and checked.
    pub fn load(&self) -> Result<(String, Option<arbor_net::ClientTls>)> {
        let token = match self.token_file {
            Some(f) => arbor_net::read_token(f)?,
            None if crate::tls::has_identity(self.tls) => String::new(),
            None => bail!(
                "give --token-file (or ARBOR_TOKEN_FILE): the servers' shared token (or --tls-cert/--tls-key, for servers started with --tls-client-ca)"
            ),
        };
        let tls = self.tls.map(arbor_net::ClientTls::load).transpose()?;
        Ok((token, tls))
    }
}

/// The client a mount reads through, from `--cache-server`, `--token-file`
/// and the TLS options.
pub fn client(servers: &[String], auth: ClientAuth<'_>) -> Result<Option<Arc<CacheClient>>> {
    let servers: Vec<String> = servers.iter().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    if servers.is_empty() {
        return Ok(None);
    }
    let (token, tls) = auth.load().context("--cache-server")?;
    let timeout = arbor_net::cache::client::timeout_from_env();
    let client = CacheClient::new(ClientOptions { servers, token, timeout, tls })?;
    Ok(Some(Arc::new(client)))
}

/// Asks every cache server whether it answers and takes the token:
/// (how many do, what is wrong with each of the others, as "ADDR PROBLEM").
pub fn check_servers(client: &CacheClient) -> (usize, Vec<String>) {
    let checked = client.check(arbor_net::cache::client::timeout_from_env());
    let ok = checked.iter().filter(|(_, p)| p.is_none()).count();
    let problems = checked.into_iter().filter_map(|(addr, p)| Some(format!("{addr} {}", p?))).collect();
    (ok, problems)
}

/// Says on stderr which cache servers do not answer or refuse the token:
/// their chunks come from the bucket until they do.
pub fn warn_about_servers(problems: &[String]) {
    for p in problems {
        eprintln!("warning: cache server {p}; the chunks it owns come from the bucket until it answers");
    }
}

/// `arbor warm`: reads `paths` of checkpoint `checkpoint` through the cache
/// servers, so that each chunk is fetched from the bucket by its owner
/// before a job needs it. Needs no mount; keeps nothing on this node (its
/// own cache is a small one in memory).
pub fn warm(
    disk_arg: &str,
    checkpoint: &str,
    paths: &[String],
    servers: &[String],
    auth: ClientAuth<'_>,
) -> Result<()> {
    use arbor_engine::volume::FileKind;
    use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
    let Some(client) = client(servers, auth)? else {
        bail!("arbor warm needs --cache-server HOST:PORT,… (or ARBOR_CACHE_SERVERS)");
    };
    match check_servers(&client) {
        (0, problems) => bail!("nothing to warm: no cache server answered: {}", problems.join("; ")),
        (_, problems) => warn_about_servers(&problems),
    }
    let cache = disk::CacheOptions {
        size: 256 << 20,
        memory: true,
        peers: Some(client.clone() as Arc<dyn arbor_engine::tier::ChunkSource>),
        ..disk::CacheOptions::default()
    };
    let d = disk::open_with_cache(disk_arg, cache)?;
    if !d.is_s3() {
        bail!("{} is a local folder: there is no bucket to warm a cache from", d.url);
    }
    let cfg = arbor_engine::Config {
        source_servers: Some(client.clone() as Arc<dyn arbor_engine::tier::ChunkSource>),
        ..disk::quiet_config()
    };
    let vol = d.catalog()?.open_checkpoint(checkpoint, cfg)?;
    let mut files: Vec<(String, u64, u64)> = Vec::new();
    let mut stack: Vec<(String, u64)> = Vec::new();
    for p in paths {
        let ino = vol.lookup_path(p).with_context(|| format!("{p}: not in checkpoint {checkpoint}"))?.ino;
        stack.push((p.clone(), ino));
    }
    // Bounded by the checkpoint's own tree: every inode is visited once per path.
    while let Some((path, ino)) = stack.pop() {
        let attr = vol.getattr(ino)?;
        match attr.kind {
            FileKind::Regular => files.push((path, ino, attr.size)),
            FileKind::Directory => {
                let mut entries = Vec::new();
                vol.readdir(ino, 0, |e| {
                    if e.name != b"." && e.name != b".." {
                        entries.push(e);
                    }
                    true
                })?;
                for e in entries {
                    stack.push((format!("{path}/{}", String::from_utf8_lossy(&e.name)), e.ino));
                }
            }
            _ => {}
        }
    }
    let total: u64 = files.iter().map(|f| f.2).sum();
    let bar = ProgressBar::new(total)
        .with_style(ProgressStyle::with_template("warm {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")?);
    for (path, ino, size) in &files {
        let mut off = 0;
        while off < *size {
            let n = vol.read(*ino, off, 4 << 20).with_context(|| format!("cannot read {path}"))?.len() as u64;
            if n == 0 {
                break;
            }
            off += n;
            bar.inc(n);
        }
    }
    bar.finish_and_clear();
    let stats = client.stats();
    // `chunks` counts every answer; parts (small reads, such as the
    // tree's blocks) are told apart from whole chunks.
    let (given, parts, hits) = stats.iter().fold((0, 0, 0), |a, s| (a.0 + s.chunks, a.1 + s.parts, a.2 + s.hits));
    // What a server should have taken and did not: its share is not warm.
    // (A server saying it has no such segment is no failure: opening a
    // checkpoint looks for the segment after its last one.)
    let failed = |s: &arbor_net::cache::client::ServerStats| {
        s.fallback_down + s.fallback_timeout + s.fallback_error + s.rejected
    };
    let fallbacks: u64 = stats.iter().map(failed).sum();
    if given == 0 && fallbacks > 0 {
        bail!(
            "nothing was warmed: {}",
            stats.iter().map(|s| format!("{} {}", s.addr, failure_reasons(s))).collect::<Vec<_>>().join("; ")
        );
    }
    for s in stats.iter().filter(|s| failed(s) > 0) {
        eprintln!("warning: cache server {}: {} chunks not warmed ({})", s.addr, failed(s), failure_reasons(s));
    }
    let through = match stats.len() {
        1 => "1 server".to_string(),
        n => format!("{n} servers"),
    };
    println!(
        "warmed {} files, {} of checkpoint {checkpoint} through {through}: {} chunks and {parts} parts of chunks ({hits} already cached there), {fallbacks} read from the bucket instead",
        files.len(),
        HumanBytes(total),
        given - parts,
    );
    Ok(())
}

/// Why a cache server's chunks came from the bucket: "3 down, 1 timed out".
fn failure_reasons(s: &arbor_net::cache::client::ServerStats) -> String {
    let reasons = [
        (s.fallback_down, "down (not answering)"),
        (s.fallback_timeout, "timed out"),
        (s.fallback_error, "errors"),
        (s.rejected, "rejected (bad checksum)"),
    ];
    let said: Vec<String> = reasons.iter().filter(|(n, _)| *n > 0).map(|(n, why)| format!("{n} {why}")).collect();
    if said.is_empty() {
        "answered".into()
    } else {
        said.join(", ")
    }
}
