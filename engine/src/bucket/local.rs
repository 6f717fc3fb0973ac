//! A local folder as a bucket. Objects are files under the root; every
//! write goes to a temporary file, is synced, and is renamed (or, to
//! create once, hard-linked) into place, so a crash leaves the old object
//! or the new one. A create-once is a `link`, which fails if the name
//! exists; replacing and deleting hold an exclusive `flock` on a per-key
//! lock file. So two processes (or two threads with their own stores)
//! sharing a folder get the same create-once and compare-and-replace
//! semantics as S3.

use super::{check_key, ETag, ObjectStore};
use crate::error::{Error, Result};
use crate::private;
use std::fs::{self, File};
use std::hash::{Hash, Hasher};
use std::io::{ErrorKind, Write};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

const LOCKS: &str = ".arbor-locks";
const TMP: &str = ".arbor-tmp";

pub struct LocalFolderStore {
    root: PathBuf,
}

/// Holds an exclusive flock until dropped.
struct KeyLock(File);

impl Drop for KeyLock {
    fn drop(&mut self) {
        // SAFETY: plain syscall on a descriptor we own.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

fn etag_of(body: &[u8]) -> ETag {
    let mut h = std::hash::DefaultHasher::new();
    body.hash(&mut h);
    format!("{:016x}-{:08x}-{}", h.finish(), crate::crc::crc32c(body), body.len())
}

/// Errors of `link` on a file system without hard links.
fn link_unsupported(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPERM | libc::EOPNOTSUPP | libc::ENOSYS | libc::EXDEV))
}

fn not_found(key: &str) -> Error {
    Error::NoSuchObject(key.to_string())
}

impl LocalFolderStore {
    pub fn open(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        private::create_dir_all(&root.join(LOCKS))?;
        private::create_dir_all(&root.join(TMP))?;
        Ok(LocalFolderStore { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        check_key(key)?;
        Ok(self.root.join(key))
    }

    fn lock(&self, key: &str) -> Result<KeyLock> {
        let mut h = std::hash::DefaultHasher::new();
        key.hash(&mut h);
        let f = private::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.root.join(LOCKS).join(format!("{:016x}", h.finish())))?;
        loop {
            // SAFETY: plain syscall on a descriptor we own.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(KeyLock(f));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(e.into());
            }
        }
    }

    /// Writes `body` to a new temporary file and syncs it.
    fn write_tmp(&self, body: &[u8]) -> Result<PathBuf> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let tmp =
            self.root.join(TMP).join(format!("{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
        let written = (|| -> Result<()> {
            let mut f = private::create(&tmp)?;
            f.write_all(body)?;
            Ok(f.sync_all()?)
        })();
        match written {
            Ok(()) => Ok(tmp),
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Puts the synced temporary file `tmp` at `path` with `place` (a
    /// rename, or a link that fails if `path` exists), creating the folders
    /// on the way the first time, then syncs the folder.
    fn place(&self, tmp: &Path, path: &Path, place: fn(&Path, &Path) -> std::io::Result<()>) -> Result<()> {
        let parent = path.parent().ok_or(Error::Invalid("object key"))?;
        let mut placed = place(tmp, path);
        if placed.as_ref().is_err_and(|e| e.kind() == ErrorKind::NotFound) {
            private::create_dir_all(parent)?;
            placed = place(tmp, path);
        }
        placed?;
        Ok(File::open(parent)?.sync_all()?)
    }

    /// Writes `body` to a temporary file, syncs it, and renames it over `path`.
    fn replace(&self, path: &Path, body: &[u8]) -> Result<ETag> {
        let tmp = self.write_tmp(body)?;
        if let Err(e) = self.place(&tmp, path, |t, p| fs::rename(t, p)) {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(etag_of(body))
    }

    fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match fs::read(self.path(key)?) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) if e.kind() == ErrorKind::IsADirectory => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn walk(&self, dir: &Path, rel: &str, out: &mut Vec<String>) -> Result<()> {
        let entries = match fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        for entry in entries {
            let entry = entry?;
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if rel.is_empty() && name.starts_with(".arbor-") {
                continue;
            }
            let key = if rel.is_empty() { name } else { format!("{rel}/{name}") };
            if entry.file_type()?.is_dir() {
                self.walk(&entry.path(), &key, out)?;
            } else {
                out.push(key);
            }
        }
        Ok(())
    }
}

impl ObjectStore for LocalFolderStore {
    fn put(&self, key: &str, body: &[u8]) -> Result<ETag> {
        let path = self.path(key)?;
        let _g = self.lock(key)?;
        self.replace(&path, body)
    }

    /// A hard link is the create-once: `link` fails if the name exists, so
    /// no lock is needed (and no lock file is left per key). A folder that
    /// refuses hard links falls back to the lock, a check and a rename.
    fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<ETag> {
        let path = self.path(key)?;
        let tmp = self.write_tmp(body)?;
        let linked = self.place(&tmp, &path, |t, p| fs::hard_link(t, p));
        let linked = match linked {
            Err(Error::Io(e)) if link_unsupported(&e) => {
                let _g = self.lock(key)?;
                if path.exists() {
                    Err(Error::AlreadyExists(key.to_string()))
                } else {
                    self.place(&tmp, &path, |t, p| fs::rename(t, p))
                }
            }
            Err(Error::Io(e)) if e.kind() == ErrorKind::AlreadyExists => Err(Error::AlreadyExists(key.to_string())),
            other => other,
        };
        let _ = fs::remove_file(&tmp);
        linked.map(|()| etag_of(body))
    }

    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<ETag> {
        let path = self.path(key)?;
        let _g = self.lock(key)?;
        let current = self.read(key)?.ok_or_else(|| not_found(key))?;
        if etag_of(&current) != etag {
            return Err(Error::PreconditionFailed(key.to_string()));
        }
        self.replace(&path, body)
    }

    fn get(&self, key: &str) -> Result<(Vec<u8>, ETag)> {
        let body = self.read(key)?.ok_or_else(|| not_found(key))?;
        let tag = etag_of(&body);
        Ok((body, tag))
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        let f = match File::open(self.path(key)?) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Err(not_found(key)),
            Err(e) => return Err(e.into()),
        };
        let len = f.metadata()?.len();
        if range.start > range.end || range.start >= len && !(range.start == 0 && len == 0) {
            return Err(Error::Invalid("range outside the object"));
        }
        let end = range.end.min(len);
        let mut buf = vec![0u8; (end - range.start) as usize];
        f.read_exact_at(&mut buf, range.start)?;
        Ok(buf)
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        // Walk only the deepest folder the prefix names.
        let (dir, rel) = match prefix.rfind('/') {
            Some(i) => (self.root.join(&prefix[..i]), prefix[..i].to_string()),
            None => (self.root.clone(), String::new()),
        };
        if !rel.is_empty() {
            check_key(&rel)?;
        }
        let mut out = Vec::new();
        self.walk(&dir, &rel, &mut out)?;
        out.retain(|k| k.starts_with(prefix));
        out.sort();
        Ok(out)
    }

    fn size(&self, key: &str) -> Result<u64> {
        match fs::metadata(self.path(key)?) {
            Ok(m) if m.is_file() => Ok(m.len()),
            Ok(_) => Err(not_found(key)),
            Err(e) if e.kind() == ErrorKind::NotFound => Err(not_found(key)),
            Err(e) => Err(e.into()),
        }
    }

    fn delete(&self, key: &str) -> Result<()> {
        let path = self.path(key)?;
        let _g = self.lock(key)?;
        match fs::remove_file(&path) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }
}
