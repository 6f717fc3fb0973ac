use super::{Device, SegmentFile};
use crate::error::{Error, Result};
use crate::format::SegId;
use crate::io::{backend, IoBackend, IoMode};
use crate::private;
use parking_lot::RwLock;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const SUPERBLOCK: &str = "superblock";
/// Segment files kept open for reading at most (each is a descriptor).
const MAX_OPEN_SEGMENTS: usize = 512;

/// Segment files in a local directory.
pub struct FileDevice {
    dir: PathBuf,
    io: Arc<dyn IoBackend>,
    open: RwLock<HashMap<SegId, Arc<dyn SegmentFile>>>,
    /// Held while this device is the directory's one writer.
    _writer_lock: Option<File>,
}

struct FileSegment {
    file: File,
    io: Arc<dyn IoBackend>,
}

impl FileDevice {
    pub fn open(dir: impl AsRef<Path>, mode: IoMode) -> Result<Arc<Self>> {
        let dir = dir.as_ref().to_path_buf();
        private::create_dir_all(&dir)?;
        Ok(Arc::new(FileDevice { dir, io: backend(mode)?, open: RwLock::new(HashMap::new()), _writer_lock: None }))
    }

    /// Opens the directory as its only writer: a second exclusive open (in
    /// this process or another) fails with [`Error::Busy`] naming the
    /// holder's pid, until the first device is dropped.
    pub fn open_exclusive(dir: impl AsRef<Path>, mode: IoMode) -> Result<Arc<Self>> {
        let dir = dir.as_ref().to_path_buf();
        private::create_dir_all(&dir)?;
        let mut lock = private::options().read(true).write(true).create(true).truncate(false).open(dir.join("lock"))?;
        // SAFETY: plain syscall on a descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let holder = fs::read_to_string(dir.join("lock")).unwrap_or_default();
            return Err(Error::Busy(format!("{} is in use by pid {}", dir.display(), holder.trim())));
        }
        lock.set_len(0)?;
        lock.write_all(std::process::id().to_string().as_bytes())?;
        Ok(Arc::new(FileDevice {
            dir,
            io: backend(mode)?,
            open: RwLock::new(HashMap::new()),
            _writer_lock: Some(lock),
        }))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn sync_dir(&self) -> Result<()> {
        File::open(&self.dir)?.sync_all()?;
        Ok(())
    }

    fn remember(&self, id: SegId, file: File) -> Arc<dyn SegmentFile> {
        let seg: Arc<dyn SegmentFile> = Arc::new(FileSegment { file, io: self.io.clone() });
        let mut open = self.open.write();
        super::bound_handles(&mut open, MAX_OPEN_SEGMENTS);
        open.entry(id).or_insert(seg).clone()
    }

    /// Where segment `id` lives.
    pub fn path_of(&self, id: SegId) -> PathBuf {
        self.dir.join(id.file_name())
    }

    /// Drops the handle kept for `id` (handles already given out still work).
    pub fn forget(&self, id: SegId) {
        self.open.write().remove(&id);
    }

    /// How many segment files this device holds open right now.
    pub fn open_segments(&self) -> usize {
        self.open.read().len()
    }
}

impl Device for FileDevice {
    fn create_segment(&self, id: SegId) -> Result<Arc<dyn SegmentFile>> {
        let path = self.dir.join(id.file_name());
        let file = private::options().read(true).write(true).create_new(true).open(path)?;
        self.sync_dir()?;
        Ok(self.remember(id, file))
    }

    fn open_segment(&self, id: SegId) -> Result<Option<Arc<dyn SegmentFile>>> {
        if let Some(s) = self.open.read().get(&id) {
            return Ok(Some(s.clone()));
        }
        match File::options().read(true).write(true).open(self.dir.join(id.file_name())) {
            Ok(file) => Ok(Some(self.remember(id, file))),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn list_segments(&self) -> Result<Vec<SegId>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            if let Some(id) = entry?.file_name().to_str().and_then(SegId::parse_file_name) {
                out.push(id);
            }
        }
        out.sort();
        Ok(out)
    }

    fn remove_segment(&self, id: SegId) -> Result<()> {
        self.open.write().remove(&id);
        match fs::remove_file(self.dir.join(id.file_name())) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }

    fn read_superblock(&self) -> Result<Option<Vec<u8>>> {
        match fs::read(self.dir.join(SUPERBLOCK)) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn write_superblock(&self, sb: &crate::format::Superblock) -> Result<()> {
        let tmp = self.dir.join("superblock.tmp");
        let mut f = private::create(&tmp)?;
        f.write_all(&sb.encode())?;
        f.sync_all()?;
        fs::rename(&tmp, self.dir.join(SUPERBLOCK))?;
        self.sync_dir()
    }

    fn io_name(&self) -> &'static str {
        self.io.name()
    }

    fn segment_modified(&self, id: SegId) -> Result<Option<std::time::SystemTime>> {
        match fs::metadata(self.dir.join(id.file_name())) {
            Ok(m) => Ok(Some(m.modified()?)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn free_bytes(&self) -> Option<u64> {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(self.dir.as_os_str().as_bytes()).ok()?;
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: a valid C string and a buffer statvfs fills.
        if unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) } != 0 {
            return None;
        }
        // SAFETY: statvfs succeeded, so it filled the buffer.
        let st = unsafe { st.assume_init() };
        Some(st.f_bavail.saturating_mul(st.f_frsize))
    }
}

impl SegmentFile for FileSegment {
    fn write_at(&self, buf: &[u8], off: u64) -> Result<()> {
        Ok(self.io.write_at(self.file.as_raw_fd(), buf, off)?)
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()> {
        self.file.read_exact_at(buf, off).map_err(|e| match e.kind() {
            ErrorKind::UnexpectedEof => Error::corrupted("segment (short read)", off),
            _ => e.into(),
        })
    }

    fn sync(&self) -> Result<()> {
        Ok(self.io.fdatasync(self.file.as_raw_fd())?)
    }

    fn size(&self) -> Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn truncate(&self, len: u64) -> Result<()> {
        self.file.set_len(len)?;
        Ok(self.file.sync_all()?)
    }

    fn start_writeback(&self) {
        // SAFETY: plain syscall on a descriptor we own; a failure only
        // means the later fdatasync does all the work.
        unsafe { libc::sync_file_range(self.file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_exclusive_open_is_refused_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = FileDevice::open_exclusive(dir.path(), IoMode::Syscall).expect("first");
        match FileDevice::open_exclusive(dir.path(), IoMode::Syscall) {
            Err(Error::Busy(msg)) => assert!(msg.contains(&std::process::id().to_string()), "{msg}"),
            other => panic!("expected Busy, got {:?}", other.map(|_| ())),
        }
        drop(first);
        FileDevice::open_exclusive(dir.path(), IoMode::Syscall).expect("after drop");
    }

    #[test]
    fn open_segment_handles_stay_bounded_and_evicted_ones_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dev = FileDevice::open(dir.path(), IoMode::Syscall).expect("device");
        let held = dev.create_segment(SegId { writer: 1, seq: 0 }).expect("create");
        held.write_at(b"kept", 0).expect("write");
        for seq in 1..(MAX_OPEN_SEGMENTS as u32 * 2) {
            dev.create_segment(SegId { writer: 1, seq }).expect("create");
            assert!(dev.open_segments() <= MAX_OPEN_SEGMENTS);
        }
        // The first handle may have left the map, but it still works, and
        // the segment opens again by name.
        held.write_at(b"more", 4).expect("write through a held handle");
        let again = dev.open_segment(SegId { writer: 1, seq: 0 }).expect("open").expect("exists");
        let mut buf = [0u8; 8];
        again.read_at(&mut buf, 0).expect("read");
        assert_eq!(&buf, b"keptmore");
    }
}
