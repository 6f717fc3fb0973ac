//! A disk, opened from what a person names it: `s3://bucket/prefix`, or a
//! local folder (the embedded default). Both hold the same objects (see
//! [`arbor_engine::layout`]); this module assembles the stack that reads
//! and writes them — the store (S3 with retries, or the folder), the
//! segment device (the folder's `segments/`, or the bucket tier through a
//! cache folder on this node) and the catalog — so the CLI, the benches
//! and the tests open a disk the same way:
//!
//! ```no_run
//! # use arbor_snapshot::disk::{Disk, DiskOptions};
//! let disk = Disk::open("s3://datasets/team-a", DiskOptions::default())?;
//! let branches = disk.catalog()?.list_branches()?;
//! # Ok::<(), arbor_snapshot::Error>(())
//! ```
//!
//! A local-folder disk keeps its segments in place (the folder is both the
//! bucket and the cache) and its node-local state inside it. An s3 disk
//! keeps node-local state under `$XDG_CACHE_HOME/arbor/<disk-id>/` (or
//! `~/.cache/…`), with one cache folder per mount unless the options name
//! one.

use crate::catalog::Catalog;
use crate::error::{Error, Result};
use arbor_engine::bucket::{LocalFolderStore, ObjectStore, ObservedStore, RetryPolicy, RetryStore, S3Config, S3Store};
use arbor_engine::chunks::{ChunkFiles, ChunkSource, ChunkStore};
use arbor_engine::device::{Device, FileDevice};
use arbor_engine::head::LeaseConfig;
use arbor_engine::io::IoMode;
use arbor_engine::layout::{self, FORMAT, IDENTITY, PROBE};
use arbor_engine::tier::{BucketDevice, Durability, TierConfig, TierStats, CACHE_SIZE, READ_AHEAD};
use arbor_engine::Error as EngineError;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

#[derive(Clone, Debug, PartialEq)]
pub enum Location {
    Local(PathBuf),
    S3 { bucket: String, prefix: String },
}

/// How a process uses this node for an s3 disk.
#[derive(Clone, Debug)]
pub struct CacheOptions {
    /// The cache folder; by default one per mount (or per command) under
    /// the node folder.
    pub dir: Option<PathBuf>,
    pub size: u64,
    pub durability: Durability,
    pub read_ahead: u64,
    /// Cache servers asked for a chunk before the bucket.
    pub peers: Option<Arc<dyn ChunkSource>>,
    /// Chunks in memory only (`size` bytes), never on this node's disk;
    /// the cache folder then holds no data and goes with the process.
    pub memory: bool,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            dir: None,
            size: CACHE_SIZE,
            durability: Durability::Local,
            read_ahead: READ_AHEAD,
            peers: None,
            memory: false,
        }
    }
}

/// How to open a disk. The defaults suit a short-lived command.
#[derive(Clone, Default)]
pub struct DiskOptions {
    pub cache: CacheOptions,
    /// The mount this process serves (`main`, a checkpoint's name): its
    /// cache folder is kept between runs. `None`: a command's own cache,
    /// removed when the command ends.
    pub mount: Option<String>,
    /// How this process claims branches it writes; `None` judges other
    /// writers by their leases' expiry alone.
    pub lease: Option<LeaseConfig>,
    /// How segment writes reach the kernel.
    pub io: IoMode,
    /// S3 settings; `None` takes them from the environment
    /// ([`s3_config_from_env`]).
    pub s3: Option<S3Overrides>,
    /// Tries per bucket call (the disk's and imported objects' buckets);
    /// `None`: the default.
    pub retries: Option<u32>,
    /// This node's folder for an s3 disk; `None`: under
    /// `$XDG_CACHE_HOME/arbor/`. (A local disk's is its own folder.)
    pub node_dir: Option<PathBuf>,
}

/// S3 settings a caller gives instead of the environment's.
#[derive(Clone, Debug, Default)]
pub struct S3Overrides {
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub path_style: bool,
    pub credentials: Option<(String, String)>,
}

impl From<&S3Config> for S3Overrides {
    /// Everything but the bucket and prefix, which the disk's URL names.
    fn from(c: &S3Config) -> S3Overrides {
        S3Overrides {
            endpoint: c.endpoint.clone(),
            region: c.region.clone(),
            path_style: c.path_style,
            credentials: c.credentials.clone(),
        }
    }
}

pub struct Disk {
    /// The disk's name as shown to people: an absolute path or an s3:// URL.
    pub url: String,
    pub location: Location,
    store: Arc<dyn ObjectStore>,
    /// Node-local state: locks, logs, caches.
    node_dir: PathBuf,
    opts: DiskOptions,
    catalog: OnceLock<Arc<Catalog>>,
    tier: OnceLock<Arc<BucketDevice>>,
    /// Imported files' chunks on this node, once a mount asked for them.
    source_files: OnceLock<Arc<ChunkFiles>>,
    /// Set when the mount's cache folder was in use and this process took
    /// a folder of its own.
    own_cache: OnceLock<PathBuf>,
}

/// Removes the cache folders of commands and mounts that are gone. Each
/// process's own folder (`cmd-<pid>`) goes when the process ends cleanly;
/// one killed, or ending before its last handle on the cache was dropped,
/// leaves it behind. A folder is another's while its process is alive on
/// this host or its cache lock is held (a process in another pid
/// namespace sharing the node folder).
fn sweep_command_caches(node_dir: &Path) {
    use std::os::fd::AsRawFd;
    let Ok(entries) = std::fs::read_dir(node_dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("cmd-")).and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: signal 0 only asks whether the process exists.
        let exists = pid == std::process::id() as i32
            || unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        // A process that started after the folder last changed is another
        // one given the same number: the folder's own process is gone.
        let changed = e.metadata().ok().map(|m| {
            use std::os::unix::fs::MetadataExt;
            std::time::UNIX_EPOCH + Duration::new(m.ctime().max(0) as u64, m.ctime_nsec().clamp(0, 999_999_999) as u32)
        });
        let reused = changed.is_some_and(|c| started_after(pid, c + Duration::from_secs(1)));
        if exists && !reused {
            continue;
        }
        let lock = std::fs::OpenOptions::new().read(true).open(e.path().join(layout::SEGMENT_DIR).join("lock"));
        if let Ok(f) = &lock {
            // SAFETY: plain syscall on a descriptor we own.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                continue;
            }
        }
        match std::fs::remove_dir_all(e.path()) {
            Ok(()) => {
                tracing::info!(folder = %e.path().display(), "removed the cache folder of an arbor process that is gone")
            }
            Err(err) => {
                tracing::debug!(folder = %e.path().display(), error = %err, "cannot remove a stale cache folder")
            }
        }
    }
}

/// Whether process `pid` started after `when` (`false` when that cannot
/// be told): its start in `/proc/PID/stat` is in clock ticks since boot.
fn started_after(pid: i32, when: std::time::SystemTime) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // Fields after the parenthesised name start at field 3; the start time
    // is field 22.
    let Some(ticks) = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(19)?.parse::<u64>().ok())
    else {
        return false;
    };
    // SAFETY: sysconf and clock_gettime only read.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let mut boot = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    if hz <= 0 || unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut boot) } != 0 {
        return false;
    }
    let since_boot = Duration::new(boot.tv_sec as u64, boot.tv_nsec as u32);
    let started_ago = since_boot.saturating_sub(Duration::from_millis(ticks * 1000 / hz as u64));
    std::time::SystemTime::now().checked_sub(started_ago).is_some_and(|started| started > when)
}

/// The tmpfs a memory-only writer keeps its log in until the bucket has it.
const SHM: &str = "/dev/shm";

/// A setup error with a person's explanation and the errno it stands for.
fn fail(errno: i32, message: String) -> Error {
    Error::Disk { message, errno }
}

/// Parses a DISK argument into its display name and location.
pub fn parse(arg: &str) -> Result<(String, Location)> {
    let invalid = |m: String| fail(libc::EINVAL, m);
    if arg.is_empty() {
        return Err(invalid("DISK must not be empty".into()));
    }
    if let Some(rest) = arg.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        let ok_bucket = (3..=63).contains(&bucket.len())
            && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !ok_bucket {
            return Err(invalid(format!("{arg}: {bucket:?} is not a valid bucket name")));
        }
        if prefix.split('/').any(|p| p.is_empty() && !prefix.is_empty() || p == "." || p == "..") {
            return Err(invalid(format!("{arg}: the prefix must be a plain path")));
        }
        let url = if prefix.is_empty() { format!("s3://{bucket}") } else { format!("s3://{bucket}/{prefix}") };
        return Ok((url, Location::S3 { bucket: bucket.into(), prefix: prefix.into() }));
    }
    if let Some((scheme, _)) = arg.split_once("://") {
        return Err(invalid(format!(
            "{scheme}:// disks are not supported; use s3://bucket/prefix or a local folder (got {arg})"
        )));
    }
    let path = std::path::absolute(arg).map_err(|e| fail(libc::EINVAL, format!("{arg}: {}", io_cause(&e))))?;
    Ok((path.display().to_string(), Location::Local(path)))
}

/// S3 settings from the environment (see [`S3Config::from_env`]).
pub fn s3_config_from_env(bucket: &str, prefix: &str) -> S3Config {
    S3Config::from_env(bucket, prefix)
}

/// Where this node keeps its state of s3 disks.
fn node_base() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("XDG_CACHE_HOME")
        .or_else(|| env("HOME").map(|h| h.join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/var/cache"))
        .join("arbor")
}

impl Disk {
    fn at(arg: &str, create: bool, opts: DiskOptions) -> Result<Disk> {
        let (url, location) = parse(arg)?;
        let (store, node_dir): (Arc<dyn ObjectStore>, PathBuf) = match &location {
            Location::Local(root) => {
                match std::fs::metadata(root) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => {
                        return Err(fail(
                            libc::ENOTDIR,
                            format!(
                                "{} is not a folder; a DISK is a folder made by arbor init, or s3://bucket/prefix",
                                root.display()
                            ),
                        ))
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound && !create => {
                        return Err(fail(
                            libc::ENOENT,
                            format!("{} does not exist (create it with: arbor init {arg})", root.display()),
                        ))
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_fail(&e, root.display().to_string())),
                }
                let store = LocalFolderStore::open(root).map_err(|e| match e {
                    EngineError::Io(io) => io_fail(&io, format!("cannot open {}", root.display())),
                    e => fail(e.errno(), format!("cannot open {}: {e}", root.display())),
                })?;
                (Arc::new(store), root.clone())
            }
            Location::S3 { bucket, prefix } => {
                let config = match &opts.s3 {
                    None => s3_config_from_env(bucket, prefix),
                    Some(o) => S3Config {
                        bucket: bucket.clone(),
                        prefix: prefix.clone(),
                        endpoint: o.endpoint.clone(),
                        region: o.region.clone(),
                        path_style: o.path_style,
                        credentials: o.credentials.clone(),
                    },
                };
                let s3 = S3Store::open(&config).map_err(|e| fail(e.errno(), format!("cannot set up {url}: {e}")))?;
                let node = opts
                    .node_dir
                    .clone()
                    .unwrap_or_else(|| node_base().join(format!("{:08x}", arbor_engine::crc::crc32c(url.as_bytes()))));
                (RetryStore::new(Arc::new(s3), RetryPolicy::with_attempts(opts.retries)), node)
            }
        };
        Ok(Disk {
            url,
            location,
            // Traced and counted for a mount's or a server's `/metrics`.
            store: ObservedStore::new(store),
            node_dir,
            opts,
            catalog: OnceLock::new(),
            tier: OnceLock::new(),
            source_files: OnceLock::new(),
            own_cache: OnceLock::new(),
        })
    }

    pub fn is_s3(&self) -> bool {
        matches!(self.location, Location::S3 { .. })
    }

    /// The disk's objects (the bucket, or the local folder standing in for one).
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Creates a disk: its identity object, after checking that the
    /// bucket honours conditional writes, and branch `main`.
    pub fn init(arg: &str, opts: DiskOptions) -> Result<Disk> {
        let disk = Disk::at(arg, true, opts)?;
        let identity = format!("{FORMAT}\ncreated-by: arbor {}\n", env!("CARGO_PKG_VERSION"));
        match disk.store.put_if_absent(IDENTITY, identity.as_bytes()) {
            Ok(_) => {}
            Err(EngineError::AlreadyExists(_)) => {
                return Err(fail(libc::EEXIST, format!("{} is already an arbor disk", disk.url)))
            }
            Err(e) => return Err(disk.bucket_error(e, "cannot write the disk identity")),
        }
        if let Err(e) = disk.check_conditional_writes() {
            let _ = disk.store.delete(IDENTITY);
            return Err(e);
        }
        // Create branch main now, so every later command finds it.
        let (vol, _lock) = disk.catalog()?.open_branch("main", quiet_config())?;
        vol.close()?;
        Ok(disk)
    }

    /// Branch heads are only safe where a conditional PUT is refused when
    /// its condition fails; a bucket that ignores the condition is refused
    /// (`arbor init`, and every process that starts owning a branch). The
    /// probe object is this process's own, so two processes probing at
    /// once do not see each other's writes.
    pub fn check_conditional_writes(&self) -> Result<()> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let probe = format!("{PROBE}-{}-{nanos}", std::process::id());
        let probe = probe.as_str();
        let refuse = |what: &str| {
            fail(
                libc::ENOTSUP,
                format!(
                    "{} does not honour conditional writes ({what} was ignored); arbor refuses to use it, \
                     as two writers could then overwrite each other's branch heads",
                    self.url
                ),
            )
        };
        self.store.put_if_absent(probe, b"1").map_err(|e| self.bucket_error(e, "cannot write a probe object"))?;
        let outcome = (|| {
            match self.store.put_if_absent(probe, b"2") {
                Err(EngineError::AlreadyExists(_)) => {}
                Ok(_) => return Err(refuse("If-None-Match")),
                Err(e) => return Err(self.bucket_error(e, "cannot write a probe object")),
            }
            // A well-formed tag no object of ours has (the probe holds "2" or "1").
            match self.store.put_if_match(probe, b"3", "\"00000000000000000000000000000000\"") {
                Err(EngineError::PreconditionFailed(_)) => Ok(()),
                Ok(_) => Err(refuse("If-Match")),
                Err(e) => Err(self.bucket_error(e, "cannot write a probe object")),
            }
        })();
        let _ = self.store.delete(probe);
        outcome
    }

    /// Opens an existing disk.
    pub fn open(arg: &str, opts: DiskOptions) -> Result<Disk> {
        let disk = Disk::at(arg, false, opts)?;
        match disk.store.get(IDENTITY) {
            Ok((body, _)) if body.starts_with(FORMAT.as_bytes()) => Ok(disk),
            Ok(_) => Err(fail(libc::EINVAL, format!("{} holds a disk of a format this arbor does not read", disk.url))),
            Err(EngineError::NoSuchObject(_)) => Err(fail(
                libc::ENOENT,
                format!("{} is not an arbor disk (create one with: arbor init {arg})", disk.url),
            )),
            Err(e) => Err(disk.bucket_error(e, "cannot read the disk identity")),
        }
    }

    /// The node folder: locks, logs and caches of this disk on this node.
    pub fn node_dir(&self) -> &Path {
        &self.node_dir
    }

    fn cache_name(&self) -> String {
        match &self.opts.mount {
            // A memory-only mount's folder holds no data and goes with it.
            Some(_) if self.opts.cache.memory => layout::command_cache(std::process::id()),
            Some(name) => layout::mount_cache(name),
            None => layout::command_cache(std::process::id()),
        }
    }

    /// The cache folder this process uses for an s3 disk.
    pub fn cache_dir(&self) -> PathBuf {
        if let Some(d) = self.own_cache.get() {
            return d.clone();
        }
        if let Some(d) = &self.opts.cache.dir {
            return d.clone();
        }
        match self.memory_base() {
            Some(base) => base.join(layout::command_cache(std::process::id())),
            None => self.node_dir.join(self.cache_name()),
        }
    }

    /// Whether this process's cache folder is its own, to go when it ends:
    /// a command's, a memory-only mount's, or one taken because the
    /// branch's folder was in use.
    fn ephemeral_cache(&self) -> bool {
        let c = &self.opts.cache;
        self.own_cache.get().is_some() || (c.dir.is_none() && (self.opts.mount.is_none() || c.memory))
    }

    /// Removes this process's own cache folder (see `ephemeral_cache`);
    /// call it once the volume is closed (every byte then in the bucket).
    /// Its device removes it too when dropped, but a thread still winding
    /// down at exit may hold that last handle; and a memory-only writer's
    /// folder is memory to give back.
    pub fn remove_own_cache(&self) {
        if !self.is_s3() || !self.ephemeral_cache() {
            return;
        }
        let dir = self.cache_dir();
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(folder = %dir.display(), error = %e, "cannot remove this process's cache folder");
            }
        }
    }

    /// Where a memory-only mount that writes (bucket durability) keeps its
    /// log until the bucket has it: a tmpfs (`/dev/shm`), never this node's
    /// disk. `None` for every other cache.
    fn memory_base(&self) -> Option<PathBuf> {
        let c = &self.opts.cache;
        if !(c.memory && c.dir.is_none() && c.durability == Durability::Bucket && self.opts.mount.is_some()) {
            return None;
        }
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let disk = self.node_dir.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        Some(PathBuf::from(SHM).join(format!("arbor-{uid}")).join(disk))
    }

    /// The segments of the disk: the folder itself, or the bucket through
    /// this process's cache folder.
    fn segments(&self) -> Result<Arc<dyn Device>> {
        match &self.location {
            Location::Local(root) => Ok(FileDevice::open(root.join(layout::SEGMENT_DIR), self.opts.io)?),
            Location::S3 { .. } => {
                sweep_command_caches(&self.node_dir);
                if let Some(base) = self.memory_base() {
                    if !Path::new(SHM).is_dir() {
                        return Err(fail(
                            libc::ENOTSUP,
                            format!("a memory-only mount that writes keeps its log in {SHM} (a tmpfs), which this node lacks"),
                        ));
                    }
                    sweep_command_caches(&base);
                }
                let dir = self.cache_dir();
                let cache = &self.opts.cache;
                let mut tier = TierConfig {
                    // A command's own cache goes when its last user does.
                    ephemeral: self.ephemeral_cache(),
                    memory_cache: cache.memory,
                    durability: cache.durability,
                    cache_size: cache.size,
                    read_ahead: cache.read_ahead,
                    io: self.opts.io,
                    peers: cache.peers.clone(),
                    ..TierConfig::default()
                };
                if self.memory_base().is_some() {
                    // The log waiting for upload is memory too: the memory
                    // budget bounds it.
                    tier.max_pending = tier.max_pending.min(cache.size.max(64 << 20));
                }
                let opened = match BucketDevice::open(self.store.clone(), &dir, tier.clone()) {
                    // The branch's cache folder is taken on this node: by
                    // the process that owns the branch, or another mount
                    // through it. A mount through the owner only reads, so
                    // it caches in a folder of its own, gone when it exits;
                    // a mount of its own is refused at the branch's lock.
                    Err(EngineError::Busy(_)) if cache.dir.is_none() && self.opts.mount.is_some() => {
                        let own = self.node_dir.join(layout::command_cache(std::process::id()));
                        tracing::info!(
                            busy = %dir.display(),
                            folder = %own.display(),
                            "the branch's cache folder on this node is in use; this process caches in a folder of its own"
                        );
                        tier.ephemeral = true;
                        let _ = self.own_cache.set(own.clone());
                        BucketDevice::open(self.store.clone(), &own, tier).map_err(|e| (own, e))
                    }
                    other => other.map_err(|e| (dir, e)),
                };
                let dev = opened.map_err(|(dir, e)| match e {
                    EngineError::Busy(_) => fail(
                        libc::EBUSY,
                        format!(
                            "cache directory {} is in use by another arbor process ({} is already mounted on this node?)",
                            dir.display(),
                            self.opts.mount.as_deref().unwrap_or("it")
                        ),
                    ),
                    EngineError::Io(io) => io_fail(&io, format!("cannot open cache directory {}", dir.display())),
                    e => fail(e.errno(), format!("cannot open cache directory {}: {e}", dir.display())),
                })?;
                let _ = self.tier.set(dev.clone());
                Ok(dev)
            }
        }
    }

    /// The disk's catalog, opened once per process.
    pub fn catalog(&self) -> Result<Arc<Catalog>> {
        if let Some(c) = self.catalog.get() {
            return Ok(c.clone());
        }
        let segments = self.segments()?;
        let mut catalog = Catalog::new(self.store.clone(), segments, Some(self.node_dir.join(layout::LOCK_DIR)));
        if let Some(lease) = &self.opts.lease {
            catalog = catalog.with_lease(lease.clone());
        }
        let catalog = Arc::new(catalog);
        Ok(self.catalog.get_or_init(|| catalog).clone())
    }

    /// Makes this node's files of the disk (a local disk's whole folder, an
    /// s3 disk's caches, logs and locks) private to their owner, as this
    /// build creates them: a disk from an older build was readable by all.
    /// Says so once in the log when it changed anything.
    pub fn make_private(&self) -> Result<()> {
        if !self.node_dir.exists() {
            return Ok(());
        }
        let changed = arbor_engine::private::tighten(&self.node_dir)
            .map_err(|e| io_fail(&e, format!("cannot make {} private", self.node_dir.display())))?;
        if changed > 0 {
            tracing::warn!(
                changed,
                folder = %self.node_dir.display(),
                "made the disk's files and folders private to their owner (an older arbor created them readable by others)"
            );
        }
        Ok(())
    }

    /// The bucket tier this process opened for an s3 disk, if it did.
    pub fn bucket_device(&self) -> Option<Arc<BucketDevice>> {
        self.tier.get().cloned()
    }

    /// Upload and cache counters, for an s3 disk opened by this process.
    pub fn tier_stats(&self) -> Option<TierStats> {
        self.tier.get().map(|t| t.stats())
    }

    /// The buckets of imported files, reached with this disk's retries.
    pub fn sources(&self) -> Arc<dyn arbor_engine::source::Sources> {
        Arc::new(arbor_engine::source::S3Sources::new(RetryPolicy::with_attempts(self.opts.retries)))
    }

    /// Where a mount keeps imported files' chunks on this node: the
    /// `objects` folder of its cache folder, in the chunk store of the
    /// segment tier (one `--cache-size` budget, one order of eviction for
    /// both kinds of chunk); a local-folder disk's store holds them alone.
    /// Opened once per process. `None` for a command, or a cache in memory
    /// only.
    pub fn source_files(self: &Arc<Self>) -> Result<Option<Arc<ChunkFiles>>> {
        if self.opts.mount.is_none() || self.opts.cache.memory {
            return Ok(None);
        }
        if let Some(files) = self.source_files.get() {
            return Ok(Some(files.clone()));
        }
        // The segment tier (an s3 disk's) is opened with the catalog.
        self.catalog()?;
        let store = match self.tier.get() {
            Some(tier) => tier.chunk_store(),
            None => ChunkStore::new(self.opts.cache.size),
        };
        let dir = self.cache_dir().join("objects");
        let files = ChunkFiles::open(&dir, &store)
            .map_err(|e| fail(e.errno(), format!("cannot open cache directory {}: {e}", dir.display())))?;
        Ok(Some(self.source_files.get_or_init(|| files).clone()))
    }

    /// Where a background mount of `name` logs.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.node_dir.join(layout::LOG_DIR).join(format!("{name}.log"))
    }

    /// Says what a failed bucket call means for a person.
    pub fn bucket_error(&self, e: EngineError, doing: &str) -> Error {
        bucket_error(e, &self.url, doing)
    }
}

/// Says what a failed bucket call means for a person. A local folder's
/// errors are file system errors and keep their errno's meaning.
pub fn bucket_error(e: EngineError, url: &str, doing: &str) -> Error {
    let s3 = url.starts_with("s3://");
    match &e {
        EngineError::Io(io) if s3 && io.kind() == std::io::ErrorKind::PermissionDenied => fail(
            libc::EACCES,
            format!("{doing}: {url}: access denied; check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE, …): {io}"),
        ),
        EngineError::Io(io) if s3 => fail(libc::EIO, format!("{doing}: {url}: the bucket is unreachable: {io}")),
        EngineError::Io(io) => io_fail(io, format!("{doing}: {url}")),
        _ => fail(e.errno(), format!("{doing}: {url}: {e}")),
    }
}

fn io_fail(e: &std::io::Error, what: String) -> Error {
    fail(e.raw_os_error().unwrap_or(libc::EIO), format!("{what}: {}", io_cause(e)))
}

/// An I/O error as a person reads it: what the errno means here, then the
/// system's own words.
pub fn io_cause(e: &std::io::Error) -> String {
    let hint = match e.raw_os_error() {
        Some(libc::ENOENT) => "no such file or folder",
        Some(libc::EACCES) | Some(libc::EPERM) => "permission denied",
        Some(libc::ENOTDIR) => "a part of the path is not a folder",
        Some(libc::EROFS) => "the file system is read-only",
        Some(libc::ENOSPC) => "no space left on the device",
        Some(libc::EDQUOT) => "disk quota exceeded",
        Some(libc::ENOTCONN) => "a stale mount (its arbor process is gone; mount it again)",
        _ => return e.to_string(),
    };
    format!("{hint} ({e})")
}

/// A volume configuration for short-lived opens by commands.
pub fn quiet_config() -> arbor_engine::Config {
    arbor_engine::Config { commit_interval: None, ..arbor_engine::Config::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_given_a_dead_ones_number_is_told_apart_by_its_start() {
        let before = std::time::SystemTime::now();
        std::thread::sleep(Duration::from_millis(100));
        let mut child = std::process::Command::new("sleep").arg("5").spawn().expect("spawn");
        let pid = child.id() as i32;
        let started = started_after(pid, before);
        let not_yet = started_after(pid, std::time::SystemTime::now() + Duration::from_secs(1));
        let _ = child.kill();
        let _ = child.wait();
        assert!(started, "a process started after a folder changed is not its owner");
        assert!(!not_yet);
        assert!(!started_after(std::process::id() as i32, before), "this process started before");
    }

    #[test]
    fn only_cache_folders_of_processes_that_are_gone_are_swept() {
        use std::os::fd::AsRawFd;
        let node = tempfile::tempdir().expect("tempdir");
        let folder = |name: &str| {
            let d = node.path().join(name);
            std::fs::create_dir_all(d.join(layout::SEGMENT_DIR)).expect("mkdir");
            std::fs::write(d.join(layout::SEGMENT_DIR).join("lock"), b"").expect("lock");
            d
        };
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let gone = child.id();
        child.wait().expect("wait");
        let dead = folder(&format!("cmd-{gone}"));
        let mine = folder(&format!("cmd-{}", std::process::id()));
        let other = folder("mounts/main");
        // A folder whose process is gone from this pid namespace but whose
        // lock is held (a process elsewhere sharing the node folder).
        let held = folder(&format!("cmd-{}", gone + 1_000_000));
        let lock = std::fs::File::open(held.join(layout::SEGMENT_DIR).join("lock")).expect("open");
        // SAFETY: plain syscall on a descriptor we own.
        assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);

        sweep_command_caches(node.path());
        assert!(!dead.exists(), "a gone process's folder is removed");
        assert!(mine.exists() && other.exists() && held.exists());
        drop(lock);
        sweep_command_caches(node.path());
        assert!(!held.exists(), "removed once nobody holds its lock");
    }

    #[test]
    fn init_once_then_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let arg = dir.path().join("d").display().to_string();
        let err = Disk::open(&arg, DiskOptions::default()).err().expect("no disk yet");
        assert_eq!(err.errno(), libc::ENOENT, "{err}");
        Disk::init(&arg, DiskOptions::default()).expect("init");
        let again = Disk::init(&arg, DiskOptions::default()).err().expect("second init must fail");
        assert_eq!(again.errno(), libc::EEXIST, "{again}");
        let d = Disk::open(&arg, DiskOptions::default()).expect("open");
        let branches = d.catalog().expect("catalog").list_branches().expect("list");
        assert_eq!(branches.len(), 1, "init creates main");
        assert!(dir.path().join("d").join(IDENTITY).is_file(), "the identity is where layout says");
    }

    #[test]
    fn a_folder_that_is_not_a_disk_is_named_as_such() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = Disk::open(&dir.path().display().to_string(), DiskOptions::default()).err().expect("not a disk");
        assert!(err.to_string().contains("is not an arbor disk"), "{err}");
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").expect("write");
        let err = Disk::open(&file.display().to_string(), DiskOptions::default()).err().expect("a file");
        assert_eq!(err.errno(), libc::ENOTDIR, "{err}");
    }

    #[test]
    fn disk_urls_parse_or_say_why_not() {
        assert_eq!(
            parse("s3://my-bucket/team/disk1/").expect("s3").1,
            Location::S3 { bucket: "my-bucket".into(), prefix: "team/disk1".into() }
        );
        assert_eq!(parse("s3://my-bucket").expect("s3").0, "s3://my-bucket");
        for bad in ["s3://", "s3://Upper/x", "s3://b/x/../y", "gs://b/x", ""] {
            assert_eq!(parse(bad).err().map(|e| e.errno()), Some(libc::EINVAL), "{bad:?}");
        }
    }
}
