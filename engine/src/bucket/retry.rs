//! Retries with exponential backoff and full jitter around any store.
//!
//! Only transient I/O errors (no answer, a server error, throttling) are retried; answers such as
//! "no such object" or "precondition failed" are returned at once. Every
//! retried call is idempotent: a plain put or delete may run twice, and a
//! conditional put whose first attempt landed but reported an error is
//! recognised on the retry (the object already holds our bytes) and
//! reported as the success it was.

use super::{ETag, ObjectInfo, ObjectStore};
use crate::error::{Error, Result};
use crate::metrics::Counter;
use std::io::ErrorKind::{InvalidInput, PermissionDenied};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Tries per bucket call by default, the first included.
pub const ATTEMPTS: u32 = 6;

#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Tries per call, the first included.
    pub attempts: u32,
    /// The first backoff; each later one doubles, up to `max_backoff`.
    pub base: Duration,
    pub max_backoff: Duration,
}

impl RetryPolicy {
    /// The default policy with `attempts` tries per call where given.
    pub fn with_attempts(attempts: Option<u32>) -> RetryPolicy {
        let default = RetryPolicy::default();
        RetryPolicy { attempts: attempts.unwrap_or(default.attempts), ..default }
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { attempts: ATTEMPTS, base: Duration::from_millis(50), max_backoff: Duration::from_secs(5) }
    }
}

pub struct RetryStore {
    inner: Arc<dyn ObjectStore>,
    policy: RetryPolicy,
    seed: AtomicU64,
    retries: Counter,
}

impl RetryStore {
    pub fn new(inner: Arc<dyn ObjectStore>, policy: RetryPolicy) -> Arc<RetryStore> {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        Arc::new(RetryStore { inner, policy, seed: AtomicU64::new(seed | 1), retries: Counter::new() })
    }

    /// Calls retried so far.
    pub fn retries(&self) -> u64 {
        self.retries.get()
    }

    /// A random backoff in `[0, min(max, base * 2^attempt))` (full jitter).
    fn backoff(&self, attempt: u32) -> Duration {
        let mut x = self.seed.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        let cap = self.policy.base.saturating_mul(1 << attempt.min(20)).min(self.policy.max_backoff);
        Duration::from_nanos(x % (cap.as_nanos() as u64).max(1))
    }

    /// Runs `call` until it succeeds, fails for good, or runs out of tries.
    /// `retried` tells `call` whether an earlier try failed in transit.
    fn run<T>(&self, what: &str, key: &str, mut call: impl FnMut(bool) -> Result<T>) -> Result<T> {
        let mut retried = false;
        let mut attempt = 0;
        loop {
            match call(retried) {
                // A refusal (bad credentials, a bad request) stays one.
                Err(Error::Io(e))
                    if attempt + 1 < self.policy.attempts && !matches!(e.kind(), PermissionDenied | InvalidInput) =>
                {
                    let wait = self.backoff(attempt);
                    tracing::info!(what, key, error = %e, attempt, ?wait, "bucket call failed; retrying");
                    self.retries.inc();
                    retried = true;
                    attempt += 1;
                    std::thread::sleep(wait);
                }
                other => return other,
            }
        }
    }

    /// After a refused conditional put that followed a failed try: did the
    /// failed try land? Then the object holds exactly our bytes.
    fn landed(&self, key: &str, body: &[u8]) -> Option<ETag> {
        match self.inner.get(key) {
            Ok((current, tag)) if current == body => Some(tag),
            _ => None,
        }
    }
}

impl ObjectStore for RetryStore {
    fn put(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.run("put", key, |_| self.inner.put(key, body))
    }

    fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.run("put", key, |retried| match self.inner.put_if_absent(key, body) {
            Err(Error::AlreadyExists(k)) if retried => self.landed(key, body).ok_or(Error::AlreadyExists(k)),
            other => other,
        })
    }

    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<ETag> {
        self.run("put", key, |retried| match self.inner.put_if_match(key, body, etag) {
            Err(Error::PreconditionFailed(k)) if retried => self.landed(key, body).ok_or(Error::PreconditionFailed(k)),
            other => other,
        })
    }

    fn put_large(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.run("multipart put", key, |_| self.inner.put_large(key, body))
    }

    /// Not retried as a whole (its source is read once); the parts are
    /// retried by the store.
    fn put_from(&self, key: &str, len: u64, fill: &mut dyn FnMut(u64, &mut [u8]) -> Result<()>) -> Result<ETag> {
        self.inner.put_from(key, len, fill)
    }

    fn get(&self, key: &str) -> Result<(Vec<u8>, ETag)> {
        self.run("get", key, |_| self.inner.get(key))
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        self.run("ranged get", key, |_| self.inner.get_range(key, range.clone()))
    }

    fn get_range_if(&self, key: &str, range: Range<u64>, etag: &str, version: Option<&str>) -> Result<Vec<u8>> {
        self.run("ranged get", key, |_| self.inner.get_range_if(key, range.clone(), etag, version))
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        self.run("list", prefix, |_| self.inner.list(prefix))
    }

    fn list_objects(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.run("list", prefix, |_| self.inner.list_objects(prefix))
    }

    fn size(&self, key: &str) -> Result<u64> {
        self.run("head", key, |_| self.inner.size(key))
    }

    fn get_tail(&self, key: &str, len: u64) -> Result<(Vec<u8>, u64)> {
        self.run("ranged get", key, |_| self.inner.get_tail(key, len))
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.run("delete", key, |_| self.inner.delete(key))
    }
}
