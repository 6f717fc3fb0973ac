//! The object-store seam: what the engine needs from a bucket. The local
//! folder here is the embedded default; S3 implements the same trait.

mod crash;
mod fault;
mod local;
mod mem;
mod retry;
mod s3;

pub use crash::{CrashStore, Step};
pub use fault::{Fault, FaultStore};
pub use local::LocalFolderStore;
pub use mem::MemObjectStore;
pub use retry::{RetryPolicy, RetryStore};
pub use s3::{S3Config, S3Store};

use crate::error::{Error, Result};
use std::ops::Range;

/// An opaque version tag of one object's content.
pub type ETag = String;

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
    /// Every key starting with `prefix`, in order.
    fn list(&self, prefix: &str) -> Result<Vec<String>>;
    /// The length of `key` in bytes.
    fn size(&self, key: &str) -> Result<u64>;
    /// Creates or replaces `key` with a body too large for one request;
    /// the object appears whole or not at all. Stores without a multipart
    /// API upload it in one piece.
    fn put_large(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.put(key, body)
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
