//! What a DISK argument names: `s3://bucket/prefix`, or a local folder
//! (the embedded default). Both hold the same objects:
//!
//! ```text
//! disk                   identity, written once by `arbor init`
//! segments/…             every branch's segments (names are globally unique)
//! wal/…                  log tails of writers with bucket durability (s3 disks)
//! branches/<name>        branch heads        checkpoints/<name>  checkpoints
//! ```
//!
//! A local-folder disk keeps its segments in place (the folder is both the
//! bucket and the cache) and its node-local state inside it: `locks/`
//! (writer locks) and `logs/` (logs of background mounts). An s3 disk keeps
//! node-local state under `$XDG_CACHE_HOME/arbor/<disk-id>/` (or
//! `~/.cache/…`): `locks/`, `logs/`, and one cache directory per mount
//! (`mounts/<branch or checkpoint>`) unless `--cache-dir` says otherwise.

use anyhow::{anyhow, bail, Context, Result};
use arbor_engine::bucket::{LocalFolderStore, ObjectStore, RetryPolicy, RetryStore, S3Config, S3Store};
use arbor_engine::device::{Device, FileDevice};
use arbor_engine::io::IoMode;
use arbor_engine::tier::{BucketDevice, Durability, TierConfig, TierStats, CACHE_SIZE, READ_AHEAD};
use arbor_engine::Error;
use arbor_snapshot::Catalog;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

const IDENTITY: &str = "disk";
const PROBE: &str = "probe/conditional-writes";
pub const FORMAT: &str = "arbor-disk v1";

#[derive(Clone, Debug, PartialEq)]
pub enum Location {
    Local(PathBuf),
    S3 { bucket: String, prefix: String },
}

/// How a mount of an s3 disk uses this node.
#[derive(Clone, Debug)]
pub struct CacheOptions {
    /// The cache directory; by default one per mount under the node folder.
    pub dir: Option<PathBuf>,
    pub size: u64,
    pub durability: Durability,
    pub read_ahead: u64,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions { dir: None, size: CACHE_SIZE, durability: Durability::Local, read_ahead: READ_AHEAD }
    }
}

pub struct Disk {
    /// The disk's name as shown to people: an absolute path or an s3:// URL.
    pub url: String,
    pub location: Location,
    store: Arc<dyn ObjectStore>,
    /// Node-local state: locks, logs, caches.
    node_dir: PathBuf,
    cache: CacheOptions,
    /// Which cache directory this process uses, if it is not a mount's.
    cache_name: String,
    catalog: OnceLock<Arc<Catalog>>,
    tier: OnceLock<Arc<BucketDevice>>,
}

/// Parses a DISK argument.
pub fn parse(arg: &str) -> Result<(String, Location)> {
    if arg.is_empty() {
        bail!("DISK must not be empty");
    }
    if let Some(rest) = arg.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        let ok_bucket = (3..=63).contains(&bucket.len())
            && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !ok_bucket {
            bail!("{arg}: {bucket:?} is not a valid bucket name");
        }
        if prefix.split('/').any(|p| p.is_empty() && !prefix.is_empty() || p == "." || p == "..") {
            bail!("{arg}: the prefix must be a plain path");
        }
        let url = if prefix.is_empty() { format!("s3://{bucket}") } else { format!("s3://{bucket}/{prefix}") };
        return Ok((url, Location::S3 { bucket: bucket.into(), prefix: prefix.into() }));
    }
    if let Some((scheme, _)) = arg.split_once("://") {
        bail!("{scheme}:// disks are not supported; use s3://bucket/prefix or a local folder (got {arg})");
    }
    let path = std::path::absolute(arg)?;
    Ok((path.display().to_string(), Location::Local(path)))
}

/// S3 settings from the environment: the standard AWS chain for
/// credentials and region, `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` for
/// an S3-compatible server (which then gets path-style addressing unless
/// `ARBOR_S3_PATH_STYLE=0`).
fn s3_config(bucket: &str, prefix: &str) -> S3Config {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let endpoint = env("AWS_ENDPOINT_URL_S3").or_else(|| env("AWS_ENDPOINT_URL"));
    let path_style = match env("ARBOR_S3_PATH_STYLE").as_deref() {
        Some("0") | Some("false") => false,
        Some(_) => true,
        None => endpoint.is_some(),
    };
    S3Config {
        bucket: bucket.into(),
        prefix: prefix.into(),
        endpoint,
        // Resolved by the store (environment, profile, else us-east-1).
        region: None,
        path_style,
        credentials: None,
    }
}

fn node_base() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("XDG_CACHE_HOME")
        .or_else(|| env("HOME").map(|h| h.join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/var/cache"))
        .join("arbor")
}

/// How many attempts a bucket call gets: `ARBOR_S3_RETRIES`, else the
/// store's default.
fn retry_policy() -> RetryPolicy {
    let default = RetryPolicy::default();
    let attempts = std::env::var("ARBOR_S3_RETRIES").ok().and_then(|v| v.parse().ok()).unwrap_or(default.attempts);
    RetryPolicy { attempts, ..default }
}

impl Disk {
    fn at(arg: &str, create: bool) -> Result<Disk> {
        let (url, location) = parse(arg)?;
        let (store, node_dir): (Arc<dyn ObjectStore>, PathBuf) = match &location {
            Location::Local(root) => {
                match std::fs::metadata(root) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => bail!(
                        "{} is not a folder; a DISK is a folder made by arbor init, or s3://bucket/prefix",
                        root.display()
                    ),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound && !create => {
                        bail!("{} does not exist (create it with: arbor init {arg})", root.display())
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => bail!("{}: {}", root.display(), io_cause(&e)),
                }
                let store = LocalFolderStore::open(root).map_err(|e| match e {
                    Error::Io(io) => anyhow!("cannot open {}: {}", root.display(), io_cause(&io)),
                    e => anyhow::Error::from(e).context(format!("cannot open {}", root.display())),
                })?;
                (Arc::new(store), root.clone())
            }
            Location::S3 { bucket, prefix } => {
                let s3 = S3Store::open(&s3_config(bucket, prefix)).with_context(|| format!("cannot set up {url}"))?;
                let node = node_base().join(format!("{:08x}", crc32c::crc32c(url.as_bytes())));
                (RetryStore::new(Arc::new(s3), retry_policy()), node)
            }
        };
        Ok(Disk {
            url,
            location,
            store,
            node_dir,
            cache: CacheOptions::default(),
            cache_name: format!("cmd-{}", std::process::id()),
            catalog: OnceLock::new(),
            tier: OnceLock::new(),
        })
    }

    pub fn is_s3(&self) -> bool {
        matches!(self.location, Location::S3 { .. })
    }

    pub fn init(arg: &str) -> Result<Disk> {
        let disk = Disk::at(arg, true)?;
        let identity = format!("{FORMAT}\ncreated-by: arbor {}\n", env!("CARGO_PKG_VERSION"));
        match disk.store.put_if_absent(IDENTITY, identity.as_bytes()) {
            Ok(_) => {}
            Err(Error::AlreadyExists(_)) => bail!("{} is already an arbor disk", disk.url),
            Err(e) => return Err(bucket_error(e, &disk.url)).context("cannot write the disk identity"),
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
    /// its condition fails; a bucket that ignores the condition is refused.
    fn check_conditional_writes(&self) -> Result<()> {
        let refuse = |what: &str| {
            anyhow!(
                "{} does not honour conditional writes ({what} was ignored); arbor refuses to use it, \
                 as two writers could then overwrite each other's branch heads",
                self.url
            )
        };
        let _ = self.store.delete(PROBE);
        self.store.put_if_absent(PROBE, b"1").map_err(|e| bucket_error(e, &self.url))?;
        let outcome = (|| {
            match self.store.put_if_absent(PROBE, b"2") {
                Err(Error::AlreadyExists(_)) => {}
                Ok(_) => return Err(refuse("If-None-Match")),
                Err(e) => return Err(bucket_error(e, &self.url)),
            }
            // A well-formed tag no object of ours has (the probe holds "2" or "1").
            match self.store.put_if_match(PROBE, b"3", "\"00000000000000000000000000000000\"") {
                Err(Error::PreconditionFailed(_)) => Ok(()),
                Ok(_) => Err(refuse("If-Match")),
                Err(e) => Err(bucket_error(e, &self.url)),
            }
        })();
        let _ = self.store.delete(PROBE);
        outcome
    }

    pub fn open(arg: &str) -> Result<Disk> {
        let disk = Disk::at(arg, false)?;
        match disk.store.get(IDENTITY) {
            Ok((body, _)) if body.starts_with(FORMAT.as_bytes()) => Ok(disk),
            Ok(_) => bail!("{} holds a disk of a format this arbor does not read", disk.url),
            Err(Error::NoSuchObject(_)) => {
                bail!("{} is not an arbor disk (create one with: arbor init {arg})", disk.url)
            }
            Err(e) => Err(bucket_error(e, &disk.url)).context("cannot read the disk identity"),
        }
    }

    /// Opens the disk for a mount of `name` with its cache options.
    pub fn open_for_mount(arg: &str, name: &str, cache: CacheOptions) -> Result<Disk> {
        let mut disk = Disk::open(arg)?;
        disk.cache = cache;
        disk.cache_name = format!("mounts/{name}");
        Ok(disk)
    }

    fn cache_dir(&self) -> PathBuf {
        self.cache.dir.clone().unwrap_or_else(|| self.node_dir.join(&self.cache_name))
    }

    /// The segments of the disk: the folder itself, or the bucket through
    /// this process's cache directory.
    fn segments(&self) -> Result<Arc<dyn Device>> {
        match &self.location {
            Location::Local(root) => Ok(FileDevice::open(root.join("segments"), io_mode()?)?),
            Location::S3 { .. } => {
                let dir = self.cache_dir();
                let tier = TierConfig {
                    // A command's own cache goes when its last user does.
                    ephemeral: self.cache.dir.is_none() && self.cache_name.starts_with("cmd-"),
                    durability: self.cache.durability,
                    cache_size: self.cache.size,
                    read_ahead: self.cache.read_ahead,
                    io: io_mode()?,
                    ..TierConfig::default()
                };
                let dev = BucketDevice::open(self.store.clone(), &dir, tier).map_err(|e| match e {
                    Error::Busy(_) => anyhow!(
                        "cache directory {} is in use by another arbor process ({} is already mounted on this node?)",
                        dir.display(),
                        self.cache_name.trim_start_matches("mounts/")
                    ),
                    e => anyhow::Error::from(e).context(format!("cannot open cache directory {}", dir.display())),
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
        let catalog = Catalog::new(self.store.clone(), segments, Some(self.node_dir.join("locks")))
            .with_lease(crate::node::lease());
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
            .with_context(|| format!("cannot make {} private", self.node_dir.display()))?;
        if changed > 0 {
            tracing::warn!(
                changed,
                folder = %self.node_dir.display(),
                "made the disk's files and folders private to their owner (an older arbor created them readable by others)"
            );
        }
        Ok(())
    }

    /// Upload and cache counters, for an s3 disk opened by this process.
    pub fn tier_stats(&self) -> Option<TierStats> {
        self.tier.get().map(|t| t.stats())
    }

    pub fn log_path(&self, name: &str) -> PathBuf {
        self.node_dir.join("logs").join(format!("{name}.log"))
    }
}

/// Says what a failed bucket call means for a person. A local folder's
/// errors are file system errors and keep their errno's meaning.
pub fn bucket_error(e: Error, url: &str) -> anyhow::Error {
    let s3 = url.starts_with("s3://");
    match &e {
        Error::Io(io) if s3 && io.kind() == std::io::ErrorKind::PermissionDenied => {
            anyhow!("{url}: access denied; check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE, …): {io}")
        }
        Error::Io(io) if s3 => anyhow!("{url}: the bucket is unreachable: {io}"),
        Error::Io(io) => anyhow!("{url}: {}", io_cause(io)),
        _ => anyhow::Error::from(e),
    }
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

/// A byte count as a person writes it: parsed from `10G`, shown as `10G`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Size(pub u64);

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let units = [(1u64 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
        match units.iter().find(|(u, _)| self.0 >= *u && self.0.is_multiple_of(*u)) {
            Some((u, name)) => write!(f, "{}{name}", self.0 / u),
            None => write!(f, "{}", self.0),
        }
    }
}

impl std::str::FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Size, String> {
        parse_size(s).map(Size)
    }
}

/// Parses a size such as `10G`, `512MiB`, `1.5T` or `4096`.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (try 10G or 512M)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("{s:?}: unknown unit (use K, M, G or T)")),
    };
    if !n.is_finite() || n < 0.0 {
        return Err(format!("{s:?} is not a size"));
    }
    Ok((n * mult as f64) as u64)
}

/// How segment writes reach the kernel: `ARBOR_IO=uring|syscall`, else
/// plain syscalls.
fn io_mode() -> Result<IoMode> {
    match std::env::var("ARBOR_IO").as_deref() {
        Err(_) | Ok("") | Ok("auto") => Ok(IoMode::Auto),
        Ok("uring") => Ok(IoMode::Uring),
        Ok("syscall") => Ok(IoMode::Syscall),
        Ok(other) => bail!("ARBOR_IO must be auto, uring or syscall (got {other:?})"),
    }
}

/// A volume configuration for short-lived opens by commands.
pub fn quiet_config() -> arbor_engine::Config {
    arbor_engine::Config { commit_interval: None, ..arbor_engine::Config::default() }
}

pub fn is_mountpoint(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return false };
    let target = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    info.lines().any(|l| l.split(' ').nth(4).is_some_and(|mp| Path::new(&unescape(mp)) == target))
}

/// /proc/self/mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_once_then_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let arg = dir.path().join("d").display().to_string();
        assert!(Disk::open(&arg).is_err());
        Disk::init(&arg).expect("init");
        assert!(Disk::init(&arg).is_err(), "second init must fail");
        let d = Disk::open(&arg).expect("open");
        let branches = d.catalog().expect("catalog").list_branches().expect("list");
        assert_eq!(branches.len(), 1, "init creates main");
    }

    #[test]
    fn disk_urls_parse_or_say_why_not() {
        assert_eq!(
            parse("s3://my-bucket/team/disk1/").expect("s3").1,
            Location::S3 { bucket: "my-bucket".into(), prefix: "team/disk1".into() }
        );
        assert_eq!(parse("s3://my-bucket").expect("s3").0, "s3://my-bucket");
        for bad in ["s3://", "s3://Upper/x", "s3://b/x/../y", "gs://b/x", ""] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5k"), Ok(1536));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("ten").is_err());
        assert!(parse_size("5X").is_err());
        for n in [CACHE_SIZE, READ_AHEAD, 1536, 4096, (3 << 40) + 1] {
            assert_eq!(Size(n).to_string().parse::<Size>(), Ok(Size(n)), "{n} shown as {}", Size(n));
        }
        assert_eq!(Size(10 << 30).to_string(), "10G");
    }
}
