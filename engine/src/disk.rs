//! A disk: one set of segments shared by every branch (segment names are
//! globally unique), and a catalog of named roots in an object store.
//!
//! A branch's superblock is its head object `branches/<name>`, replaced
//! only by compare-and-swap on the tag the writer last saw, so a second
//! writer of the same branch is fenced off instead of corrupting it.

use crate::bucket::{ETag, ObjectStore};
use crate::device::{Device, SegmentFile};
use crate::error::{Error, Result};
use crate::format::{Addr, SegId};
use crate::volume::Superblock;
use parking_lot::Mutex;
use std::sync::Arc;

pub fn branch_key(name: &str) -> String {
    format!("branches/{name}")
}

pub fn checkpoint_key(name: &str) -> String {
    format!("checkpoints/{name}")
}

/// Segments from `segments`, superblock from the branch's head object.
///
/// On a bucket-backed device the head never names a commit whose bytes are
/// not all in the bucket: the first write (the writer's claim at open)
/// waits for them, later ones are published when the uploads catch up.
/// Recovery replays the log from whichever commit the head names, so a
/// lagging head loses nothing the log holds.
pub struct HeadDevice {
    segments: Arc<dyn Device>,
    catalog: Arc<dyn ObjectStore>,
    key: String,
    /// The tag this writer last saw or wrote; `None` before its first
    /// head write.
    seen: Mutex<Option<ETag>>,
    claimed: std::sync::atomic::AtomicBool,
    me: std::sync::Weak<HeadDevice>,
}

impl HeadDevice {
    pub fn new(segments: Arc<dyn Device>, catalog: Arc<dyn ObjectStore>, branch: &str) -> Arc<Self> {
        Arc::new_cyclic(|me| HeadDevice {
            segments,
            catalog,
            key: branch_key(branch),
            seen: Mutex::new(None),
            claimed: std::sync::atomic::AtomicBool::new(false),
            me: me.clone(),
        })
    }

    /// Replaces the head object if nobody else did since we last saw it.
    fn compare_and_swap(&self, bytes: &[u8]) -> Result<()> {
        let mut seen = self.seen.lock();
        let written = match seen.as_deref() {
            Some(tag) => self.catalog.put_if_match(&self.key, bytes, tag),
            None => self.catalog.put_if_absent(&self.key, bytes),
        };
        match written {
            Ok(tag) => {
                *seen = Some(tag);
                Ok(())
            }
            Err(Error::PreconditionFailed(_) | Error::AlreadyExists(_) | Error::NoSuchObject(_)) => {
                Err(Error::Busy(format!("{} was changed by another writer; this one stops", self.key)))
            }
            Err(e) => Err(e),
        }
    }
}

macro_rules! delegate_segments {
    () => {
        fn create_segment(&self, id: SegId) -> Result<Arc<dyn SegmentFile>> {
            self.segments.create_segment(id)
        }
        fn open_segment(&self, id: SegId) -> Result<Option<Arc<dyn SegmentFile>>> {
            self.segments.open_segment(id)
        }
        fn list_segments(&self) -> Result<Vec<SegId>> {
            self.segments.list_segments()
        }
        fn remove_segment(&self, id: SegId) -> Result<()> {
            self.segments.remove_segment(id)
        }
        fn failpoint(&self, name: &'static str) -> Result<()> {
            self.segments.failpoint(name)
        }
        fn io_name(&self) -> &'static str {
            self.segments.io_name()
        }
        fn segment_modified(&self, id: SegId) -> Result<Option<std::time::SystemTime>> {
            self.segments.segment_modified(id)
        }
        fn segment_sealed(&self, id: SegId, len: u64) {
            self.segments.segment_sealed(id, len)
        }
        fn log_synced(&self, id: SegId, len: u64) -> Result<()> {
            self.segments.log_synced(id, len)
        }
        fn publish_when_stored(&self, upto: Addr, publish: Box<dyn FnOnce() -> Result<()> + Send>) -> Result<()> {
            self.segments.publish_when_stored(upto, publish)
        }
        fn flush_to_bucket(&self, upto: Addr) -> Result<()> {
            self.segments.flush_to_bucket(upto)
        }
        fn drain(&self) -> Result<()> {
            self.segments.drain()
        }
        fn pending_upload_bytes(&self) -> u64 {
            self.segments.pending_upload_bytes()
        }
    };
}

impl Device for HeadDevice {
    delegate_segments!();

    fn read_superblock(&self) -> Result<Option<Vec<u8>>> {
        // A body damaged on the way is read again; one damaged at rest is
        // reported as corrupt.
        let mut last = None;
        for _ in 0..4 {
            match self.catalog.get(&self.key) {
                Ok((body, tag)) => match Superblock::decode(&body) {
                    Ok(_) => {
                        *self.seen.lock() = Some(tag);
                        return Ok(Some(body));
                    }
                    Err(e) => last = Some(e),
                },
                Err(Error::NoSuchObject(_)) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::corrupted("branch head", &self.key)))
    }

    fn write_superblock(&self, bytes: &[u8]) -> Result<()> {
        let commit = Superblock::decode(bytes)?.commit;
        if !self.claimed.load(std::sync::atomic::Ordering::Acquire) {
            // The claim: synchronous, so a fenced writer learns at open.
            self.segments.flush_to_bucket(commit)?;
            self.compare_and_swap(bytes)?;
            self.claimed.store(true, std::sync::atomic::Ordering::Release);
            return Ok(());
        }
        let me = self.me.clone();
        let bytes = bytes.to_vec();
        self.segments.publish_when_stored(
            commit,
            Box::new(move || match me.upgrade() {
                Some(head) => head.compare_and_swap(&bytes),
                None => Ok(()),
            }),
        )
    }
}

/// A frozen root: opens read-only at `commit`, never writes a superblock.
pub struct FixedRootDevice {
    segments: Arc<dyn Device>,
    superblock: Vec<u8>,
}

impl FixedRootDevice {
    pub fn new(segments: Arc<dyn Device>, commit: crate::format::Addr) -> Arc<Self> {
        Arc::new(FixedRootDevice { segments, superblock: Superblock::frozen(commit).encode() })
    }
}

impl Device for FixedRootDevice {
    delegate_segments!();

    fn read_superblock(&self) -> Result<Option<Vec<u8>>> {
        Ok(Some(self.superblock.clone()))
    }

    fn write_superblock(&self, _bytes: &[u8]) -> Result<()> {
        Err(Error::ReadOnly)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::MemObjectStore;
    use crate::device::SimDevice;
    use crate::env::TestEnv;
    use crate::volume::{Config, Volume, ROOT_INO};

    fn cfg(read_only: bool) -> Config {
        Config { commit_interval: None, read_only, env: TestEnv::new(5), ..Config::default() }
    }

    #[test]
    fn a_second_writer_of_a_branch_is_fenced_off() {
        let segs: Arc<dyn Device> = Arc::new(SimDevice::new());
        let catalog: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
        let a = Volume::open(HeadDevice::new(segs.clone(), catalog.clone(), "main"), cfg(false)).expect("a");
        let b = Volume::open(HeadDevice::new(segs.clone(), catalog.clone(), "main"), cfg(false)).expect("b");
        a.create(ROOT_INO, b"from-a", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        assert!(matches!(a.commit(), Err(Error::Busy(_))), "a's head was replaced by b's open");
        assert!(a.is_poisoned());
        b.create(ROOT_INO, b"from-b", libc::S_IFREG | 0o644, 0, 0, 0).expect("b keeps working");
        b.commit().expect("commit");
    }

    #[test]
    fn a_fixed_root_opens_read_only_without_replaying_the_parent_log() {
        let segs: Arc<dyn Device> = Arc::new(SimDevice::new());
        let catalog: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
        let main = Volume::open(HeadDevice::new(segs.clone(), catalog.clone(), "main"), cfg(false)).expect("main");
        main.create(ROOT_INO, b"before", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        main.commit().expect("commit");
        let frozen = main.last_commit().expect("commit addr");
        main.create(ROOT_INO, b"after", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        main.sync_all().expect("sync");
        let snap = Volume::open(FixedRootDevice::new(segs, frozen), cfg(true)).expect("snapshot");
        assert!(snap.lookup(ROOT_INO, b"before").is_ok());
        assert_eq!(snap.lookup(ROOT_INO, b"after").expect_err("not in the snapshot").errno(), libc::ENOENT);
        assert_eq!(snap.create(ROOT_INO, b"x", libc::S_IFREG, 0, 0, 0).expect_err("ro").errno(), libc::EROFS);
    }
}
