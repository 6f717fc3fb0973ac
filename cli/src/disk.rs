//! What a DISK argument names, and the layout of a disk on the embedded
//! local-folder default.

use anyhow::{bail, Context, Result};
use arbor_engine::bucket::{LocalFolderStore, ObjectStore};
use arbor_engine::Error;
use std::path::{Path, PathBuf};

/// The identity object written by `arbor init`.
const IDENTITY: &str = "disk";
pub const FORMAT: &str = "arbor-disk v1";

pub struct Disk {
    pub root: PathBuf,
}

/// Parses a DISK argument: a local folder (the embedded default bucket).
pub fn parse(arg: &str) -> Result<PathBuf> {
    if let Some(rest) = arg.split_once("://") {
        bail!("{}:// disks are not supported yet; use a local folder (got {arg})", rest.0);
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
            Ok(_) => Ok(Disk { root }),
            Err(Error::AlreadyExists(_)) => bail!("{} is already an arbor disk", root.display()),
            Err(e) => Err(e).context("cannot write the disk identity"),
        }
    }

    pub fn open(arg: &str) -> Result<Disk> {
        let root = parse(arg)?;
        if !root.is_dir() {
            bail!("{} does not exist (create it with: arbor init {})", root.display(), arg);
        }
        let store = LocalFolderStore::open(&root)?;
        match store.get(IDENTITY) {
            Ok((body, _)) if body.starts_with(FORMAT.as_bytes()) => Ok(Disk { root }),
            Ok(_) => bail!("{} holds a disk of a format this arbor does not read", root.display()),
            Err(Error::NoSuchObject(_)) => {
                bail!("{} is not an arbor disk (create one with: arbor init {})", root.display(), arg)
            }
            Err(e) => Err(e).context("cannot read the disk identity"),
        }
    }

    /// Where a branch's segments live on this node unless `--cache-dir`
    /// says otherwise. On the local-folder default this is inside the disk,
    /// so the disk folder holds everything.
    pub fn default_cache_dir(&self, branch: &str) -> PathBuf {
        self.root.join("cache").join(branch)
    }
}

pub fn check_branch_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        && name != "."
        && name != "..";
    if !ok {
        bail!("invalid name {name:?}: use 1 to 128 of A-Z a-z 0-9 . _ -");
    }
    Ok(())
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
    fn branch_names_follow_the_rule() {
        for good in ["main", "run-1", "sweep_2.b", &"a".repeat(128)] {
            assert!(check_branch_name(good).is_ok(), "{good}");
        }
        for bad in ["", ".", "..", "a/b", "sp ace", &"a".repeat(129), "é"] {
            assert!(check_branch_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn init_once_then_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let arg = dir.path().join("d").display().to_string();
        assert!(Disk::open(&arg).is_err());
        Disk::init(&arg).expect("init");
        assert!(Disk::init(&arg).is_err(), "second init must fail");
        Disk::open(&arg).expect("open");
        assert!(parse("s3://bucket/x").is_err());
    }
}
