//! This node's server (`arbor serve`): a shared cache of a disk's segment
//! chunks for every node that mounts it (see `arbor_net::cache`), and the
//! owner of the branches it is given (see [`crate::owner`]). Started with
//! [`start`], it runs on threads of its own until [`Server::stop`].

use crate::disk::{self, Disk};
use crate::error::{Context, Error, Result};
use crate::owner::{self, OwnOptions, Owned};
use arbor_engine::chunks::{ChunkFiles, ChunkSource, LateSources};
use arbor_engine::tier::{CacheStats, SegmentCache};
use arbor_net::wire::tls::ServerFiles;
use arbor_net::{CacheServer, Fault, ServerOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Where the chunk cache lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheDir {
    /// A folder under this node's folder for the disk.
    Node,
    /// This folder.
    At(PathBuf),
    /// In memory only.
    Memory,
}

/// How clients prove themselves to the server: a token file (`None`:
/// only client certificates the client CA signed get in) and TLS.
#[derive(Clone, Default)]
pub struct ServerAuth {
    pub token_file: Option<PathBuf>,
    pub tls: Option<ServerFiles>,
}

impl ServerAuth {
    /// The token (empty: none, client certificates only) and the TLS,
    /// loaded and checked.
    pub fn load(&self) -> Result<(String, Option<arbor_net::ServerTls>)> {
        let token = match &self.token_file {
            Some(f) => arbor_net::read_token(f)?,
            None if self.tls.as_ref().is_some_and(|t| t.client_ca.is_some()) => String::new(),
            None => {
                return Err(Error::Invalid(
                    "give --token-file (or ARBOR_TOKEN_FILE), or --tls-cert/--tls-key with --tls-client-ca".into(),
                ))
            }
        };
        let tls = self.tls.as_ref().map(arbor_net::ServerTls::load).transpose()?;
        Ok((token, tls))
    }
}

/// The (bucket, key prefix) of every source object the disk's imports
/// may name, read from the disk's store: the only objects the server
/// fetches for clients with its own credentials.
pub type ImportedPrefixes =
    fn(&dyn arbor_engine::bucket::ObjectStore) -> std::result::Result<Vec<(String, String)>, String>;

/// What to serve and how.
#[derive(Clone)]
pub struct ServeOptions {
    /// The disk's URL (an s3:// disk; any disk with branches to own).
    pub disk: String,
    /// The address to listen on, `HOST:PORT`.
    pub listen: String,
    pub cache_dir: CacheDir,
    /// How much chunk data the cache keeps (in memory, or in its folder).
    pub cache_size: u64,
    /// Memory for chunks of imported files' source objects (0: not served).
    pub object_memory: u64,
    pub auth: ServerAuth,
    /// Misbehave on purpose (tests of the clients' checks).
    pub fault: Option<Fault>,
    /// Evict what nobody read for this long (`None`: by size alone).
    pub keep_for: Option<Duration>,
    pub imported_prefixes: ImportedPrefixes,
    /// The branches to own and serve.
    pub owner: OwnOptions,
    /// Called once, from a thread of the server's, with the name of a
    /// branch this process no longer owns (another writer took it, or
    /// the lease could not be kept): the process cannot serve it again
    /// and should end, so that a supervisor starts it anew.
    pub on_step_down: Arc<dyn Fn(&str) + Send + Sync>,
}

/// Refuses what [`start`] would refuse before it opens anything: the
/// token and TLS, and the address for clients.
pub fn check(opts: &ServeOptions) -> Result<()> {
    opts.auth.load()?;
    owner::check_advertise(&opts.owner)
}

/// A server running on threads of its own; [`Server::stop`] stops it
/// (dropped, it stops serving without closing its branches).
pub struct Server {
    url: String,
    addr: std::net::SocketAddr,
    advertised: String,
    place: String,
    cache: Option<Arc<SegmentCache>>,
    server: Arc<CacheServer>,
    owned: Vec<Owned>,
    stop_timeout: Duration,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    _cache_lock: Option<std::fs::File>,
    disk: Arc<Disk>,
}

/// What a front end in the server's process (an S3 endpoint) serves: the
/// branches the server owns, changed through their owner as client
/// mounts' changes are, and the disk's checkpoints, read-only.
#[derive(Clone)]
pub struct Roots {
    branches: Vec<(String, Arc<dyn arbor_engine::Files>)>,
    /// The catalog of an owned branch's disk (its chunks cached where the
    /// owner caches them), else `disk`'s, opened when first asked.
    catalog: Option<Arc<arbor_snapshot::Catalog>>,
    disk: Arc<Disk>,
}

impl Roots {
    /// The names of the branches owned here.
    pub fn branches(&self) -> Vec<String> {
        self.branches.iter().map(|(n, _)| n.clone()).collect()
    }

    /// The files of owned branch `name`, or `None` if it is not owned here.
    pub fn branch(&self, name: &str) -> Option<Arc<dyn arbor_engine::Files>> {
        self.branches.iter().find(|(n, _)| n == name).map(|(_, f)| f.clone())
    }

    fn catalog(&self) -> Result<Arc<arbor_snapshot::Catalog>> {
        match &self.catalog {
            Some(c) => Ok(c.clone()),
            None => Ok(self.disk.catalog()?),
        }
    }

    /// Every checkpoint of the disk.
    pub fn checkpoints(&self) -> Result<Vec<arbor_snapshot::CheckpointInfo>> {
        Ok(self.catalog()?.list_checkpoints()?)
    }

    /// Checkpoint `name`'s record.
    pub fn checkpoint(&self, name: &str) -> Result<arbor_snapshot::CheckpointInfo> {
        Ok(self.catalog()?.checkpoint(name)?)
    }

    /// Opens checkpoint `name` read-only in this process.
    pub fn open_checkpoint(&self, name: &str) -> Result<Arc<dyn arbor_engine::Files>> {
        let cfg = arbor_engine::volume::Config::default();
        let v = self.catalog()?.open_checkpoint(name, cfg).context(format!("cannot open checkpoint {name}"))?;
        Ok(v)
    }
}

/// The lock that keeps a second server off a cache folder.
fn lock_cache_dir(dir: &Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    arbor_engine::private::create_dir_all(dir).context(format!("cannot create {}", dir.display()))?;
    let f = arbor_engine::private::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("lock"))
        .context(format!("cannot open {}", dir.display()))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(Error::Busy(format!("cache folder {} is in use by another arbor serve", dir.display())));
    }
    Ok(f)
}

/// The chunk cache, the lock on its folder, and where it is said to be.
struct Cache {
    segments: Option<Arc<SegmentCache>>,
    lock: Option<std::fs::File>,
    dir: Option<PathBuf>,
    place: String,
}

/// Opens the chunk cache of disk `d` where `opts` says; `sources` come
/// before the bucket.
fn open_cache(opts: &ServeOptions, d: &Disk, sources: Option<Arc<dyn ChunkSource>>) -> Result<Cache> {
    let dir = match &opts.cache_dir {
        _ if !d.is_s3() => {
            return Ok(Cache { segments: None, lock: None, dir: None, place: "none (a local-folder disk)".into() })
        }
        CacheDir::Memory => {
            let cache = SegmentCache::with_sources(d.store().clone(), None, opts.cache_size, sources)?;
            return Ok(Cache { segments: Some(Arc::new(cache)), lock: None, dir: None, place: "memory".into() });
        }
        CacheDir::At(dir) => std::path::absolute(dir)?,
        CacheDir::Node => d.node_dir().join("serve"),
    };
    let lock = lock_cache_dir(&dir)?;
    let cache = SegmentCache::with_sources(d.store().clone(), Some(&dir.join("chunks")), opts.cache_size, sources)
        .context(format!("cannot open cache folder {}", dir.display()))?;
    let place = dir.display().to_string();
    Ok(Cache { segments: Some(Arc::new(cache)), lock: Some(lock), dir: Some(dir), place })
}

/// The reader of imported files' source objects, with their chunks on
/// disk beside the segment chunks in the segment cache's chunk store (one
/// `cache_size` budget, one order of eviction for both).
fn open_objects(
    opts: &ServeOptions,
    d: &Disk,
    cache: &Cache,
) -> Result<Option<Arc<arbor_engine::source::SourceReader>>> {
    if opts.object_memory == 0 {
        return Ok(None);
    }
    let files = match (&cache.segments, &cache.dir) {
        (Some(segments), Some(dir)) => {
            let dir = dir.join("objects");
            let files = ChunkFiles::open(&dir, &segments.chunk_store())
                .context(format!("cannot open cache folder {}", dir.display()))?;
            Some(files)
        }
        _ => None,
    };
    Ok(Some(Arc::new(arbor_engine::source::SourceReader::serving(d.sources(), opts.object_memory, files))))
}

/// Owns every branch `opts` names, recording `advertised` as where they
/// are served; their cached chunks go to `own_chunks`. On a failure the
/// branches already owned are closed.
fn own_all(opts: &ServeOptions, advertised: &str, own_chunks: &LateSources) -> Result<Vec<Owned>> {
    let mut owned = Vec::new();
    for b in &opts.owner.branches {
        match owner::own(&opts.disk, b, advertised, &opts.owner) {
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
    Ok(owned)
}

/// Opens the disk, its cache and the branches to own, and serves them
/// on `opts.listen` until [`Server::stop`].
pub fn start(opts: &ServeOptions) -> Result<Server> {
    let (token, tls) = opts.auth.load()?;
    owner::check_advertise(&opts.owner)?;
    let d = disk::open(&opts.disk)?;
    let branches = &opts.owner.branches;
    if !d.is_s3() && branches.is_empty() {
        return Err(Error::Invalid(format!("{} is a local folder: every reader already has its bytes; arbor serve is for s3:// disks (or --branch, to share a branch)", d.url)));
    }
    // The branches this process owns cache the segments they write: a
    // client's chunk of one of those comes from there, not the bucket.
    let own_chunks = Arc::new(LateSources::default());
    let sources = (!branches.is_empty()).then(|| own_chunks.clone() as Arc<dyn ChunkSource>);
    let cache = open_cache(opts, &d, sources)?;
    let objects = open_objects(opts, &d, &cache)?;
    let listener = arbor_net::server::listen(&opts.listen).context(format!("cannot listen on {}", opts.listen))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let advertised = owner::advertised(addr, opts.owner.advertise.as_deref());
    if !branches.is_empty() {
        // An owner's branch heads and leases rest on conditional writes.
        d.check_conditional_writes()?;
    }
    let owned = own_all(opts, &advertised, &own_chunks)?;
    let shared: Vec<_> = owned.iter().map(|o| o.shared().clone()).collect();
    // Every branch is open (a later one may have waited for a lease to
    // lapse): the lock grace periods start now, as clients can be served.
    for b in &shared {
        b.start_lock_grace();
    }
    let stopping = Arc::new(AtomicBool::new(false));
    watch_owned(&owned, stopping.clone(), opts.on_step_down.clone())?;
    // Source objects are fetched with this server's credentials: only
    // those an import of the disk names.
    let (records, imported) = (d.store().clone(), opts.imported_prefixes);
    let object_scope = Arc::new(arbor_net::ObjectScope::new(Box::new(move || imported(records.as_ref()))));
    let server_opts = ServerOptions {
        token,
        fault: opts.fault,
        keep_for: opts.keep_for,
        objects,
        object_scope: Some(object_scope),
        tls,
        ..ServerOptions::default()
    };
    let server = CacheServer::owner(cache.segments.clone(), shared, server_opts);
    let (stop, thread) = run(server.clone(), listener, stopping)?;
    Ok(Server {
        url: d.url.to_string(),
        addr,
        advertised,
        place: cache.place,
        cache: cache.segments,
        server,
        owned,
        stop_timeout: opts.owner.stop_timeout,
        stop: Some(stop),
        thread: Some(thread),
        _cache_lock: cache.lock,
        disk: Arc::new(d),
    })
}

/// Watches the owned branches from a thread of its own. An owner that
/// stepped down (another writer took its branch, or it could not keep
/// its lease) cannot serve it again in this process: `on_step_down`
/// hears of it. The owner records are kept naming this process (every
/// 5 s) until it stops: another owner that lost the race for a branch
/// may put back a stale record.
fn watch_owned(
    owned: &[Owned],
    stopping: Arc<AtomicBool>,
    on_step_down: Arc<dyn Fn(&str) + Send + Sync>,
) -> Result<()> {
    let watched: Vec<_> = owned.iter().map(|o| o.shared().clone()).collect();
    let keepers: Vec<_> = owned.iter().map(|o| o.record_keeper()).collect();
    let mut turn = 0u64;
    std::thread::Builder::new().name("arbor-step-down".into()).spawn(move || loop {
        std::thread::sleep(Duration::from_millis(250));
        turn += 1;
        // Stepping down is looked at first: a deposed owner must not
        // record itself again over its successor on its way out.
        if let Some(b) = watched.iter().find(|b| b.stepped_down()) {
            on_step_down(b.name());
            return;
        }
        if turn % 20 == 1 && !stopping.load(Ordering::Acquire) {
            for k in &keepers {
                k();
            }
        }
    })?;
    Ok(())
}

type Running = (tokio::sync::oneshot::Sender<()>, std::thread::JoinHandle<std::io::Result<()>>);

/// Serves `listener` from a runtime on a thread of its own until told
/// to stop.
fn run(server: Arc<CacheServer>, listener: std::net::TcpListener, stopping: Arc<AtomicBool>) -> Result<Running> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("arbor-serve").build()?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new().name("arbor-serve-main".into()).spawn(move || {
        let served = rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            server
                .run(listener, async move {
                    let _ = rx.await;
                })
                .await
        });
        stopping.store(true, Ordering::Release);
        rt.shutdown_timeout(Duration::from_secs(5));
        served
    })?;
    Ok((tx, thread))
}

impl Server {
    /// The disk's URL, as opened.
    pub fn disk_url(&self) -> &str {
        &self.url
    }

    /// The address it listens on.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The address clients of its branches are told.
    pub fn advertised(&self) -> &str {
        &self.advertised
    }

    /// Where its chunk cache is: a folder, `memory`, or none (a
    /// local-folder disk).
    pub fn cache_place(&self) -> &str {
        &self.place
    }

    /// Its chunk cache's counters (`None`: a local-folder disk, no cache).
    pub fn cache_stats(&self) -> Option<CacheStats> {
        self.cache.as_ref().map(|c| c.stats())
    }

    /// Its `/metrics` (Prometheus text).
    pub fn metrics_text(&self) -> String {
        self.server.metrics_text()
    }

    /// What a front end in this process serves beside it (see [`Roots`]).
    pub fn roots(&self) -> Roots {
        Roots {
            branches: self.owned.iter().map(|o| (o.shared().name().to_string(), o.files())).collect(),
            catalog: self.owned.first().map(|o| o.catalog().clone()),
            disk: self.disk.clone(),
        }
    }

    /// The branches it owns.
    pub fn branches(&self) -> Vec<String> {
        self.owned.iter().map(|o| o.shared().name().to_string()).collect()
    }

    /// Stops serving (requests in flight are answered first), then
    /// closes the branches, waiting up to the stop timeout for the
    /// bucket: past it, [`Error::NotClosed`] says what was left.
    pub fn stop(mut self) -> Result<()> {
        self.stop_serving()?;
        owner::close_within(std::mem::take(&mut self.owned), self.stop_timeout)
    }

    fn stop_serving(&mut self) -> Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(served)) => Ok(served?),
            Some(Err(_)) => Err(Error::Invalid("the server's thread panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop_serving();
    }
}
