//! The durable steps of an `s3://` disk, named, and a store that dies at
//! one of them: the bucket tier's failpoints. Every durable step of the
//! tier is one write to the bucket, so the step is named by the write and
//! the tier's code needs no hook: the store lets the chosen write land
//! (or not), then refuses every later call, as a process killed there
//! would make none. The bucket is kept exactly as the dead process left it,
//! for a new process to open with an empty cache.

use super::{ETag, ObjectStore};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::ops::Range;
use std::sync::Arc;

/// A durable step of the bucket tier: which write makes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// A sealed segment's object stored.
    SegmentUploaded,
    /// A WAL piece stored (bucket durability: an fsync's bytes).
    WalPut,
    /// A branch head written: a commit published, a lease taken, renewed
    /// or released.
    HeadWritten,
    /// A checkpoint object created.
    CheckpointCreated,
    /// A segment deleted by gc.
    GcDelete,
    /// WAL pieces deleted once their segment is stored (or sealed by
    /// recovery).
    WalRetired,
}

impl Step {
    pub const ALL: [Step; 6] = [
        Step::SegmentUploaded,
        Step::WalPut,
        Step::HeadWritten,
        Step::CheckpointCreated,
        Step::GcDelete,
        Step::WalRetired,
    ];

    fn of_put(key: &str) -> Option<Step> {
        match key.split('/').next()? {
            "segments" => Some(Step::SegmentUploaded),
            "wal" => Some(Step::WalPut),
            "branches" => Some(Step::HeadWritten),
            "checkpoints" => Some(Step::CheckpointCreated),
            _ => None,
        }
    }

    fn of_delete(key: &str) -> Option<Step> {
        match key.split('/').next()? {
            "segments" => Some(Step::GcDelete),
            "wal" => Some(Step::WalRetired),
            _ => None,
        }
    }
}

#[derive(Default)]
struct Plan {
    /// The step to die at, the how-manieth time it comes, and whether that
    /// write lands first.
    at: Option<(Step, u64, bool)>,
    seen: u64,
    dead: bool,
}

/// A store that dies at a chosen step (see the module comment).
pub struct CrashStore {
    inner: Arc<dyn ObjectStore>,
    plan: Mutex<Plan>,
}

impl CrashStore {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Arc<CrashStore> {
        Arc::new(CrashStore { inner, plan: Mutex::new(Plan::default()) })
    }

    /// Dies at the `nth` (from 1) write that makes `step`; `lands`: that
    /// write reaches the bucket before the process dies.
    pub fn crash_at(&self, step: Step, nth: u64, lands: bool) {
        *self.plan.lock() = Plan { at: Some((step, nth, lands)), seen: 0, dead: false };
    }

    /// Whether the process this store stands for has died.
    pub fn is_dead(&self) -> bool {
        self.plan.lock().dead
    }

    fn check_alive(&self) -> Result<()> {
        match self.plan.lock().dead {
            true => Err(Error::Crashed("the bucket tier died at a failpoint")),
            false => Ok(()),
        }
    }

    /// Runs write `call` making `step` (if it is one), dying where planned.
    fn write<T>(&self, step: Option<Step>, call: impl FnOnce() -> Result<T>) -> Result<T> {
        let lands = {
            let mut plan = self.plan.lock();
            if plan.dead {
                return Err(Error::Crashed("the bucket tier died at a failpoint"));
            }
            match (plan.at, step) {
                (Some((at, nth, lands)), Some(s)) if at == s => {
                    plan.seen += 1;
                    if plan.seen == nth {
                        plan.dead = true;
                        Some(lands)
                    } else {
                        None
                    }
                }
                _ => None,
            }
        };
        match lands {
            None => call(),
            Some(true) => {
                let _ = call();
                Err(Error::Crashed("the bucket tier died at a failpoint"))
            }
            Some(false) => Err(Error::Crashed("the bucket tier died at a failpoint")),
        }
    }
}

impl ObjectStore for CrashStore {
    fn put(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.write(Step::of_put(key), || self.inner.put(key, body))
    }
    fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.write(Step::of_put(key), || self.inner.put_if_absent(key, body))
    }
    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<ETag> {
        self.write(Step::of_put(key), || self.inner.put_if_match(key, body, etag))
    }
    fn put_large(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.write(Step::of_put(key), || self.inner.put_large(key, body))
    }
    fn get(&self, key: &str) -> Result<(Vec<u8>, ETag)> {
        self.check_alive()?;
        self.inner.get(key)
    }
    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        self.check_alive()?;
        self.inner.get_range(key, range)
    }
    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        self.check_alive()?;
        self.inner.list(prefix)
    }
    fn size(&self, key: &str) -> Result<u64> {
        self.check_alive()?;
        self.inner.size(key)
    }
    fn delete(&self, key: &str) -> Result<()> {
        self.write(Step::of_delete(key), || self.inner.delete(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::MemObjectStore;

    #[test]
    fn dies_at_the_nth_write_of_a_step_and_refuses_everything_after() {
        let inner: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
        let store = CrashStore::new(inner.clone());
        store.crash_at(Step::WalPut, 2, true);
        store.put("wal/aa/seg-1/0", b"a").expect("first piece");
        store.put("segments/aa/seg-1", b"s").expect("another step");
        assert!(matches!(store.put("wal/aa/seg-1/1", b"b"), Err(Error::Crashed(_))));
        assert!(store.is_dead());
        assert_eq!(inner.get("wal/aa/seg-1/1").expect("landed").0, b"b", "the fatal write landed");
        assert!(matches!(store.get("wal/aa/seg-1/0"), Err(Error::Crashed(_))));
        assert!(matches!(store.delete("segments/aa/seg-1"), Err(Error::Crashed(_))));
        assert!(inner.get("segments/aa/seg-1").is_ok(), "nothing after the crash reached the bucket");

        store.crash_at(Step::CheckpointCreated, 1, false);
        assert!(matches!(store.put_if_absent("checkpoints/v1", b"c"), Err(Error::Crashed(_))));
        assert!(inner.get("checkpoints/v1").is_err(), "a write that does not land leaves nothing");
    }
}
