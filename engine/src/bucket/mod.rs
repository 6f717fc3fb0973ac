//! The object-store seam: what the engine needs from a bucket. The local
//! folder here is the embedded default; S3 implements the same trait.

mod crash;
mod fault;
mod local;
mod mem;
mod observed;
mod retry;
mod s3;

pub use crash::{CrashStore, Step};
pub use fault::{Fault, FaultStore};
pub use local::LocalFolderStore;
pub use mem::MemObjectStore;
#[cfg(test)]
pub(crate) use mem::{BeforeGet, Watched};
pub use observed::{BucketMetrics, ObservedStore};
pub use retry::{RetryPolicy, RetryStore};
pub use s3::{S3Config, S3Store};

/// An S3 bucket (or prefix of one) as a store with retries (`policy`).
pub fn open_s3(cfg: &S3Config, policy: RetryPolicy) -> Result<std::sync::Arc<dyn ObjectStore>> {
    let s3: std::sync::Arc<dyn ObjectStore> = std::sync::Arc::new(S3Store::open(cfg)?);
    Ok(RetryStore::new(s3, policy))
}

use crate::error::{Error, Result};
use std::ops::Range;

/// An opaque version tag of one object's content.
pub type ETag = String;

/// One object of a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: String,
    pub size: u64,
    pub etag: ETag,
    /// When it was last written, where the store says.
    pub modified: Option<std::time::SystemTime>,
    /// Its current version id, in a bucket that keeps versions.
    pub version: Option<String>,
}

pub trait ObjectStore: Send + Sync {
    /// Creates or replaces `key`.
    fn put(&self, key: &str, body: &[u8]) -> Result<ETag>;
    /// Creates `key` only if it does not exist ([`Error::AlreadyExists`] otherwise).
    fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<ETag>;
    /// Replaces `key` only if its current tag is `etag`
    /// ([`Error::PreconditionFailed`] otherwise, [`Error::NoSuchObject`] if gone).
    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<ETag>;
    fn get(&self, key: &str) -> Result<(Vec<u8>, ETag)>;
    /// Bytes `range` of `key`, clipped at its end.
    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>>;
    /// Bytes `range` of `key`, clipped at its end, only while the object's
    /// tag is still `etag` ([`Error::PreconditionFailed`] otherwise,
    /// [`Error::NoSuchObject`] if gone). With `version`, of that version of
    /// the object, whatever the key holds now ([`Error::NoSuchObject`] once
    /// that version is deleted); stores that keep no versions have one, and
    /// compare its tag. Stores without conditional reads read the whole
    /// object to compare its tag.
    fn get_range_if(&self, key: &str, range: Range<u64>, etag: &str, version: Option<&str>) -> Result<Vec<u8>> {
        let _ = version;
        let (body, tag) = self.get(key)?;
        if tag != etag {
            return Err(Error::PreconditionFailed(key.into()));
        }
        let end = range.end.min(body.len() as u64);
        if range.start >= end {
            return Err(Error::Invalid("range outside the object"));
        }
        Ok(body[range.start as usize..end as usize].to_vec())
    }
    /// Every key starting with `prefix`, in order.
    fn list(&self, prefix: &str) -> Result<Vec<String>>;
    /// Every object starting with `prefix` with its size and tag, in key
    /// order. Stores without such a listing read each object once.
    fn list_objects(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let mut out = Vec::new();
        for key in self.list(prefix)? {
            match self.get(&key) {
                Ok((body, etag)) => {
                    out.push(ObjectInfo { key, size: body.len() as u64, etag, modified: None, version: None })
                }
                // Deleted since it was listed.
                Err(Error::NoSuchObject(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
    /// The length of `key` in bytes.
    fn size(&self, key: &str) -> Result<u64>;
    /// The last `len` bytes of `key` (all of it when shorter) and the
    /// object's length: one request where the store takes a suffix range
    /// (S3), the length and then the bytes elsewhere.
    fn get_tail(&self, key: &str, len: u64) -> Result<(Vec<u8>, u64)> {
        let size = self.size(key)?;
        if size == 0 || len == 0 {
            return Ok((Vec::new(), size));
        }
        Ok((self.get_range(key, size.saturating_sub(len)..size)?, size))
    }
    /// Creates or replaces `key` with a body too large for one request;
    /// the object appears whole or not at all. Stores without a multipart
    /// API upload it in one piece.
    fn put_large(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.put(key, body)
    }
    /// Creates or replaces `key` with `len` bytes that `fill(offset, buf)`
    /// provides, in order, without holding them all where the store can
    /// take them in parts (S3 multipart); the object appears whole or not
    /// at all. Others read the whole body first.
    fn put_from(&self, key: &str, len: u64, fill: &mut dyn FnMut(u64, &mut [u8]) -> Result<()>) -> Result<ETag> {
        let mut body = vec![0u8; usize::try_from(len).map_err(|_| Error::Invalid("object too large"))?];
        fill(0, &mut body)?;
        self.put_large(key, &body)
    }
    /// Removes `key`; removing a missing key succeeds.
    fn delete(&self, key: &str) -> Result<()>;
}

/// Keys are `/`-separated names: no empty, `.` or `..` parts, no NUL, and
/// nothing under the store's own `.arbor-*` folders.
pub fn check_key(key: &str) -> Result<()> {
    let ok = !key.is_empty()
        && key.len() <= 1024
        && !key.contains('\0')
        && key.split('/').all(|p| !p.is_empty() && p != "." && p != "..")
        && !key.starts_with(".arbor-");
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid("object key"))
    }
}
