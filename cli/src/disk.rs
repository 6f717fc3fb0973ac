//! What a DISK argument names, and the layout of a disk on the embedded
//! local-folder default:
//!
//! ```text
//! DISK/disk              identity, written once by `arbor init`
//! DISK/segments/         every branch's segments (names are globally unique)
//! DISK/branches/<name>   branch heads        DISK/checkpoints/<name>  checkpoints
//! DISK/locks/<branch>    node-local writer locks
//! DISK/logs/<name>.log   logs of background mounts
//! ```

use anyhow::{bail, Context, Result};
use arbor_engine::bucket::{LocalFolderStore, ObjectStore};
use arbor_engine::device::{Device, FileDevice};
use arbor_engine::io::IoMode;
use arbor_engine::Error;
use arbor_snapshot::Catalog;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const IDENTITY: &str = "disk";
pub const FORMAT: &str = "arbor-disk v1";

pub struct Disk {
    pub root: PathBuf,
}

/// Parses a DISK argument: a local folder (the embedded default bucket).
pub fn parse(arg: &str) -> Result<PathBuf> {
    if let Some((scheme, _)) = arg.split_once("://") {
        bail!("{scheme}:// disks are not supported yet; use a local folder (got {arg})");
    }
    if arg.is_empty() {
        bail!("DISK must not be empty");
    }
    Ok(std::path::absolute(arg)?)
}

impl Disk {
    pub fn init(arg: &str) -> Result<Disk> {
        let root = parse(arg)?;
        let store = LocalFolderStore::open(&root).with_context(|| format!("cannot create {}", root.display()))?;
        let identity = format!("{FORMAT}\ncreated-by: arbor {}\n", env!("CARGO_PKG_VERSION"));
        match store.put_if_absent(IDENTITY, identity.as_bytes()) {
            Ok(_) => {}
            Err(Error::AlreadyExists(_)) => bail!("{} is already an arbor disk", root.display()),
            Err(e) => return Err(e).context("cannot write the disk identity"),
        }
        let disk = Disk { root };
        // Create branch main now, so every later command finds it.
        let (vol, _lock) = disk.catalog()?.open_branch("main", quiet_config())?;
        vol.close()?;
        Ok(disk)
    }

    pub fn open(arg: &str) -> Result<Disk> {
        let root = parse(arg)?;
        if !root.is_dir() {
            bail!("{} does not exist (create it with: arbor init {arg})", root.display());
        }
        let store = LocalFolderStore::open(&root)?;
        match store.get(IDENTITY) {
            Ok((body, _)) if body.starts_with(FORMAT.as_bytes()) => Ok(Disk { root }),
            Ok(_) => bail!("{} holds a disk of a format this arbor does not read", root.display()),
            Err(Error::NoSuchObject(_)) => {
                bail!("{} is not an arbor disk (create one with: arbor init {arg})", root.display())
            }
            Err(e) => Err(e).context("cannot read the disk identity"),
        }
    }

    pub fn segments(&self) -> Result<Arc<dyn Device>> {
        Ok(FileDevice::open(self.root.join("segments"), io_mode()?)?)
    }

    pub fn catalog(&self) -> Result<Catalog> {
        let store: Arc<dyn ObjectStore> = Arc::new(LocalFolderStore::open(&self.root)?);
        Ok(Catalog::new(store, self.segments()?, Some(self.root.join("locks"))))
    }

    pub fn log_path(&self, name: &str) -> PathBuf {
        self.root.join("logs").join(format!("{name}.log"))
    }
}

/// How segment writes reach the kernel: `ARBOR_IO=uring|syscall`, else
/// io_uring where the kernel allows it.
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
        assert!(parse("s3://bucket/x").is_err());
    }
}
