//! A disk opened on this node, and a branch or checkpoint of it opened
//! for file operations: here (a `Volume` this process writes or reads),
//! or through the process that owns the branch (`arbor serve --branch`).

use crate::disk::{self, CacheOptions, Disk};
use crate::error::{Error, Result};
use crate::through_owner::{self, OwnerOptions};
use crate::Files;
use arbor_engine::chunks::ChunkSource;
use arbor_engine::tier::Durability;
use arbor_engine::volume::{Config, Volume};
use arbor_net::{BranchClient, CacheClient};
use arbor_snapshot::{BranchLock, Catalog, Error as CatalogError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Segment sizes a branch accepts: addresses hold 32-bit offsets, and a
/// segment much smaller than a FUSE write would be mostly headers.
const SEGMENT_SIZES: std::ops::RangeInclusive<u64> = (1 << 20)..=(1 << 31);

/// Why a branch cannot be opened here with its cache in memory only.
pub const MEMORY_ONLY_BRANCH: &str = "--cache-dir none (memory only) is for checkpoint mounts, mounts through a branch's owner (arbor serve --branch) and branch mounts with --durability bucket (fsync then means the bucket has it); with local durability a branch mount needs a cache folder for its log";

/// Refuses a segment size outside 1 MiB to 2 GiB.
pub fn check_segment_size(size: u64) -> Result<()> {
    if !SEGMENT_SIZES.contains(&size) {
        return Err(Error::Invalid(format!(
            "--segment-size must be between {} and {}",
            disk::Size(*SEGMENT_SIZES.start()),
            disk::Size(*SEGMENT_SIZES.end())
        )));
    }
    Ok(())
}

/// What to open: a branch (read-write) or a checkpoint (read-only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Root {
    Branch(String),
    Checkpoint(String),
}

impl Root {
    pub fn name(&self) -> &str {
        match self {
            Root::Branch(n) | Root::Checkpoint(n) => n,
        }
    }
}

/// How a branch or checkpoint is opened.
#[derive(Clone)]
pub struct OpenOptions {
    /// How large a segment of the branch's log grows before it is sealed.
    pub segment_size: u64,
    /// What this node shows the branch's owner.
    pub owner: OwnerOptions,
    /// Who has the branch open, for other commands on this node (a
    /// mountpoint, or where it is served).
    pub holder: String,
}

/// A disk opened on this node, with the cache servers it reads through.
pub struct Node {
    disk: Arc<Disk>,
    cache_client: Option<Arc<CacheClient>>,
    memory_only: bool,
    durability: Durability,
}

impl Node {
    /// Opens disk `url` (s3://bucket/prefix or a local folder) to open
    /// `root` from, with `cache` (its peers: `cache_client`) and this
    /// process's writer lease.
    pub fn open(
        url: &str,
        root: &Root,
        mut cache: CacheOptions,
        cache_client: Option<Arc<CacheClient>>,
    ) -> Result<Node> {
        let (memory_only, durability) = (cache.memory, cache.durability);
        cache.peers = cache_client.clone().map(|c| c as Arc<dyn ChunkSource>);
        let disk = Arc::new(disk::open_for_mount(url, root.name(), cache)?);
        Ok(Node { disk, cache_client, memory_only, durability })
    }

    pub fn disk(&self) -> &Arc<Disk> {
        &self.disk
    }

    pub fn cache_client(&self) -> Option<&Arc<CacheClient>> {
        self.cache_client.as_ref()
    }

    /// Fails unless `root` exists on the disk.
    pub fn find(&self, root: &Root) -> Result<()> {
        let catalog = self.disk.catalog()?;
        match root {
            Root::Checkpoint(c) => {
                catalog.checkpoint(c)?;
            }
            Root::Branch(b) => {
                catalog.branch_head(b)?;
            }
        }
        Ok(())
    }

    /// Opens `root` for file operations: a branch another process owns
    /// through that owner, anything else here.
    pub fn open_root(&self, root: &Root, opts: &OpenOptions) -> Result<Opened> {
        let catalog = self.disk.catalog()?;
        if let Root::Branch(name) = root {
            let cache_servers = self.cache_client.is_some();
            if let Some(locate) = through_owner::owner_of(&catalog, name, &opts.owner, cache_servers)? {
                let files = through_owner::connect(&self.disk, name, locate, &opts.owner)?;
                return Ok(Opened::Owner(files));
            }
            if self.memory_only && self.durability != Durability::Bucket {
                return Err(Error::Invalid(MEMORY_ONLY_BRANCH.into()));
            }
            self.disk.make_private()?;
        }
        let cfg = Config {
            segment_size: opts.segment_size,
            source_servers: self.cache_client.clone().map(|c| c as Arc<dyn ChunkSource>),
            source_files: self.disk.source_files()?,
            sources: self.disk.sources(),
            ..Config::default()
        };
        let opening = Instant::now();
        let (volume, lock) = match root {
            Root::Checkpoint(c) => (catalog.open_checkpoint(c, cfg)?, None),
            Root::Branch(b) => {
                let (v, l) = open_branch(&catalog, b, cfg, &opts.holder)?;
                (v, Some(l))
            }
        };
        Ok(Opened::Local(Local { volume, lock, opened_in: opening.elapsed() }))
    }
}

/// A branch or checkpoint opened for file operations.
pub enum Opened {
    /// Opened here: this process writes the branch (or reads the checkpoint).
    Local(Local),
    /// Through the process that owns the branch.
    Owner(Arc<BranchClient>),
}

impl Opened {
    /// The file handle a front end mounts or serves.
    pub fn files(&self) -> Arc<dyn Files> {
        match self {
            Opened::Local(l) => l.volume.clone(),
            Opened::Owner(r) => r.clone(),
        }
    }
}

/// A branch or checkpoint this process opened itself.
pub struct Local {
    pub volume: Arc<Volume>,
    /// A branch's lock on this node (`None` for a checkpoint).
    pub lock: Option<BranchLock>,
    /// How long opening took (recovery included).
    pub opened_in: Duration,
}

/// Opens branch `name` for writing in this process, noting `holder`
/// (a mountpoint, or where it is served) for other commands on this node.
pub fn open_branch(catalog: &Catalog, name: &str, cfg: Config, holder: &str) -> Result<(Arc<Volume>, BranchLock)> {
    let (v, mut l) = catalog.open_branch(name, cfg).map_err(|e| match e {
        CatalogError::Open(_) => Error::Busy(match catalog.holder_of(name) {
            Some(mp) if mp.starts_with('/') => format!("branch {name} is already mounted read-write at {mp}"),
            Some(by) if !by.is_empty() => format!("branch {name} is already open read-write by {by}"),
            _ => format!("branch {name} is already mounted read-write"),
        }),
        e => Error::from(e).context(format!("cannot open branch {name}")),
    })?;
    l.record_holder(holder)?;
    Ok((v, l))
}
