//! An object store that misbehaves on request, for tests of the bucket
//! tier: failed calls, writes that land but report an error, slow calls,
//! short and corrupted GET bodies, and a bucket that is unreachable.

use super::{ETag, ObjectStore};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The next N calls fail with an I/O error and change nothing.
    Fail(u32),
    /// The next N writes (puts and deletes) take effect, then report an
    /// I/O error, as when a response is lost on the way back.
    ApplyThenFail(u32),
    /// The next N GETs return a body cut short by one byte or more.
    TruncateGets(u32),
    /// The next N GETs return a body with one bit flipped.
    CorruptGets(u32),
    /// Every call waits this long before it runs.
    Delay(Duration),
    /// While true, every call fails with an I/O error.
    Offline(bool),
}

#[derive(Default)]
struct Faults {
    fail: u32,
    apply_then_fail: u32,
    truncate: u32,
    corrupt: u32,
    delay: Duration,
    offline: bool,
}

pub struct FaultStore {
    inner: Arc<dyn ObjectStore>,
    faults: Mutex<Faults>,
    calls: AtomicU64,
    injected: AtomicU64,
}

fn unreachable_error(what: &str) -> Error {
    Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, format!("injected fault: {what}")))
}

impl FaultStore {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Arc<FaultStore> {
        Arc::new(FaultStore {
            inner,
            faults: Mutex::new(Faults::default()),
            calls: AtomicU64::new(0),
            injected: AtomicU64::new(0),
        })
    }

    pub fn inject(&self, fault: Fault) {
        let mut f = self.faults.lock();
        match fault {
            Fault::Fail(n) => f.fail = n,
            Fault::ApplyThenFail(n) => f.apply_then_fail = n,
            Fault::TruncateGets(n) => f.truncate = n,
            Fault::CorruptGets(n) => f.corrupt = n,
            Fault::Delay(d) => f.delay = d,
            Fault::Offline(on) => f.offline = on,
        }
    }

    /// Calls made, failed or not.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Calls that a fault changed.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// Runs before every call: waits, then fails if a fault says so.
    fn before(&self, what: &str) -> Result<()> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let delay = self.faults.lock().delay;
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let mut f = self.faults.lock();
        if f.offline || f.fail > 0 {
            f.fail = f.fail.saturating_sub(1);
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(unreachable_error(what));
        }
        Ok(())
    }

    /// Runs after a write that took effect.
    fn after_write<T>(&self, what: &str, r: Result<T>) -> Result<T> {
        let mut f = self.faults.lock();
        if r.is_ok() && f.apply_then_fail > 0 {
            f.apply_then_fail -= 1;
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(unreachable_error(what));
        }
        r
    }

    /// Runs after a read: may cut or flip the body.
    fn after_read(&self, mut body: Vec<u8>) -> Vec<u8> {
        let mut f = self.faults.lock();
        if f.truncate > 0 && !body.is_empty() {
            f.truncate -= 1;
            self.injected.fetch_add(1, Ordering::Relaxed);
            body.truncate(body.len() / 2);
        } else if f.corrupt > 0 && !body.is_empty() {
            f.corrupt -= 1;
            self.injected.fetch_add(1, Ordering::Relaxed);
            let i = body.len() / 3;
            body[i] ^= 0x10;
        }
        body
    }
}

impl ObjectStore for FaultStore {
    fn put(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.before("put")?;
        self.after_write("put", self.inner.put(key, body))
    }

    fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.before("put")?;
        self.after_write("put", self.inner.put_if_absent(key, body))
    }

    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<ETag> {
        self.before("put")?;
        self.after_write("put", self.inner.put_if_match(key, body, etag))
    }

    fn put_large(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.before("multipart put")?;
        self.after_write("multipart put", self.inner.put_large(key, body))
    }

    fn get(&self, key: &str) -> Result<(Vec<u8>, ETag)> {
        self.before("get")?;
        let (body, tag) = self.inner.get(key)?;
        Ok((self.after_read(body), tag))
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        self.before("ranged get")?;
        let body = self.inner.get_range(key, range)?;
        Ok(self.after_read(body))
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        self.before("list")?;
        self.inner.list(prefix)
    }

    fn size(&self, key: &str) -> Result<u64> {
        self.before("head")?;
        self.inner.size(key)
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.before("delete")?;
        self.after_write("delete", self.inner.delete(key))
    }
}
