use super::{Device, SegmentFile};
use crate::error::{Error, Result};
use crate::format::SegId;
use crate::io::{backend, IoBackend, IoMode};
use crate::log::PAGE;
use crate::metrics::Counter;
use crate::private;
use parking_lot::RwLock;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
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
    /// Whether new segment files write large runs with O_DIRECT.
    direct: bool,
    /// Bytes its segment files wrote with O_DIRECT.
    direct_bytes: Arc<Counter>,
    /// Held while this device is the directory's one writer.
    _writer_lock: Option<File>,
}

struct FileSegment {
    file: File,
    io: Arc<dyn IoBackend>,
    /// The same file opened with O_DIRECT, for the page-aligned middle of a
    /// large write (see [`FileSegment::write_at`]). `None` for a file opened
    /// to read, where the file system refuses O_DIRECT (at open or on a
    /// write), and once sealed (a writer's segments stay open for reading:
    /// one descriptor each).
    direct: RwLock<Option<File>>,
    /// The device's count of bytes written through `direct`.
    direct_bytes: Arc<Counter>,
}

/// The smallest aligned middle worth a direct write: below it, waiting for
/// the disk costs more than the copy into the page cache.
const DIRECT_MIN: u64 = 256 << 10;

impl FileDevice {
    pub fn open(dir: impl AsRef<Path>, mode: IoMode) -> Result<Arc<Self>> {
        let dir = dir.as_ref().to_path_buf();
        private::create_dir_all(&dir)?;
        Self::new(dir, mode, None)
    }

    fn new(dir: PathBuf, mode: IoMode, writer_lock: Option<File>) -> Result<Arc<Self>> {
        Ok(Arc::new(FileDevice {
            dir,
            io: backend(mode)?,
            open: RwLock::new(HashMap::new()),
            direct: mode.direct(),
            direct_bytes: Arc::default(),
            _writer_lock: writer_lock,
        }))
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
        Self::new(dir, mode, Some(lock))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn sync_dir(&self) -> Result<()> {
        File::open(&self.dir)?.sync_all()?;
        Ok(())
    }

    fn remember(&self, id: SegId, file: File, direct: Option<File>) -> Arc<dyn SegmentFile> {
        let seg: Arc<dyn SegmentFile> = Arc::new(FileSegment {
            file,
            io: self.io.clone(),
            direct: RwLock::new(direct),
            direct_bytes: self.direct_bytes.clone(),
        });
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
        let file = private::options().read(true).write(true).create_new(true).open(&path)?;
        self.sync_dir()?;
        // Only the log writes segments, always at its end: large writes
        // skip the page cache (see `FileSegment::write_at`).
        let direct = if !self.direct {
            None
        } else {
            match File::options().write(true).custom_flags(libc::O_DIRECT).open(&path) {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::debug!(path = %path.display(), error = %e, "no O_DIRECT here; the log writes through the page cache");
                    None
                }
            }
        };
        Ok(self.remember(id, file, direct))
    }

    fn open_segment(&self, id: SegId) -> Result<Option<Arc<dyn SegmentFile>>> {
        if let Some(s) = self.open.read().get(&id) {
            return Ok(Some(s.clone()));
        }
        match File::options().read(true).write(true).open(self.dir.join(id.file_name())) {
            Ok(file) => Ok(Some(self.remember(id, file, None))),
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

    fn direct_bytes(&self) -> u64 {
        self.direct_bytes.get()
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

impl FileSegment {
    /// The page-aligned middle `[a, b)` of a write of `buf` at `off`, when
    /// it is large enough and page-aligned in memory too (the log's buffer
    /// is laid out so it is) to go to the disk with O_DIRECT.
    fn direct_span(buf: &[u8], off: u64) -> Option<(u64, u64)> {
        let page = PAGE as u64;
        let a = off.next_multiple_of(page);
        let b = (off + buf.len() as u64) / page * page;
        let aligned = (buf.as_ptr() as usize).wrapping_add((a - off) as usize).is_multiple_of(PAGE);
        (b >= a + DIRECT_MIN && aligned).then_some((a, b))
    }
}

impl SegmentFile for FileSegment {
    /// A large write's page-aligned middle goes to the disk with O_DIRECT;
    /// its ends, and every smaller write, through the page cache. The log
    /// only ever appends, so no page is written both ways, and the middle
    /// costs no copy into the page cache, nor the cache's memory. It is
    /// durable, like the rest, only after [`SegmentFile::sync`]
    /// (fdatasync of the file flushes what either descriptor wrote).
    fn write_at(&self, buf: &[u8], off: u64) -> Result<()> {
        let fd = self.file.as_raw_fd();
        let guard = self.direct.read();
        let (Some((a, b)), Some(direct)) = (Self::direct_span(buf, off), guard.as_ref()) else {
            return Ok(self.io.write_at(fd, buf, off)?);
        };
        let (head, rest) = buf.split_at((a - off) as usize);
        let (middle, tail) = rest.split_at((b - a) as usize);
        self.io.write_at(fd, head, off)?;
        let wrote = self.io.write_at(direct.as_raw_fd(), middle, a);
        drop(guard);
        match wrote {
            Ok(()) => {
                self.direct_bytes.add(middle.len() as u64);
            }
            // A file system that opens O_DIRECT but refuses these writes
            // (or a short write that left an unaligned rest): the page
            // cache takes it, and every write after it.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::debug!(error = %e, "O_DIRECT write refused; the log writes through the page cache");
                self.direct.write().take();
                self.io.write_at(fd, middle, a)?;
            }
            Err(e) => return Err(e.into()),
        }
        self.io.write_at(fd, tail, b)?;
        Ok(())
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

    fn sealed(&self) {
        self.direct.write().take();
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
    fn large_records_go_past_the_page_cache_and_read_back_whole_through_the_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let direct = crate::testkit::takes_direct_writes(dir.path());
        // With `ARBOR_IO=buffered`, never past it; io_uring where the
        // kernel allows it.
        for mode in [IoMode::Syscall, IoMode::Buffered, IoMode::Uring] {
            if mode == IoMode::Uring && crate::io::UringIo::new().is_err() {
                eprintln!("io_uring refused here: its pass is skipped");
                continue;
            }
            let went = log_large_records(&dir.path().join(format!("{mode:?}")), mode);
            if direct && mode.direct() {
                // Ten records of 300 KB or more, their aligned middles at
                // least 256 KiB each.
                assert!(went >= 10 * (256 << 10), "only {went} bytes went past the page cache");
            } else {
                assert_eq!(went, 0, "{mode:?}, O_DIRECT taken here: {direct}");
            }
        }
    }

    #[test]
    fn a_sealed_segment_keeps_one_descriptor_and_writes_through_the_page_cache() {
        use crate::format::RecordKind;
        use crate::log::Log;
        let dir = tempfile::tempdir().expect("tempdir");
        let direct = crate::testkit::takes_direct_writes(dir.path());
        let dev = FileDevice::open(dir.path().join("segments"), IoMode::Syscall).expect("device");
        let log = Log::create_with(dev.clone(), 4, 1, 4 << 20, true).expect("log");
        for n in 0..12u8 {
            log.append(RecordKind::Intent, b"m", &[n; 1 << 20], "t").expect("append");
        }
        log.sync_all().expect("sync");
        let first = dev.path_of(SegId { writer: 4, seq: 0 });
        let open_on = |path: &Path| {
            std::fs::read_dir("/proc/self/fd")
                .expect("fds")
                .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter(|target| target == path)
                .count()
        };
        assert!(dev.path_of(SegId { writer: 4, seq: 2 }).exists(), "the log sealed segments");
        assert_eq!(open_on(&first), 1, "a sealed segment holds one descriptor");
        // Were it written again, it would go through the page cache.
        let seg = dev.open_segment(SegId { writer: 4, seq: 0 }).expect("open").expect("segment");
        let before = dev.direct_bytes();
        assert!(!direct || before > 0, "the log wrote nothing past the page cache");
        seg.write_at(&vec![7; 1 << 20], 64 << 20).expect("write");
        assert_eq!(dev.direct_bytes(), before);
    }

    /// Logs records of many sizes on a device in `dir`, reads each back
    /// from the file and by a scan of the log; returns the bytes written
    /// past the page cache.
    fn log_large_records(dir: &Path, mode: IoMode) -> u64 {
        use crate::format::RecordKind;
        use crate::log::{Cursor, Log, Next};
        let dev = FileDevice::open(dir, mode).expect("device");
        let log = Log::create_with(dev.clone(), 9, 1, 64 << 20, true).expect("log");
        // Records without data and records of every size between them move
        // the log's end off page boundaries; the large ones' data is aligned.
        let mut want = Vec::new();
        for n in 0..24usize {
            let len = [0, 10, 4096, 300_000, 1 << 20, (1 << 20) + 17, 777_777][n % 7];
            let data: Vec<u8> = (0..len).map(|i| (i * 31 + n) as u8).collect();
            let a = log.append(RecordKind::Intent, format!("m{n}").as_bytes(), &data, "t").expect("append");
            want.push((a, data));
        }
        log.sync_all().expect("sync");
        let seg = SegId { writer: 9, seq: 0 };
        let file = dev.open_segment(seg).expect("open").expect("segment");
        for (a, data) in &want {
            let mut back = vec![0; data.len()];
            file.read_at(&mut back, a.data.off as u64).expect("read");
            assert!(back == *data, "record {} read back other bytes", a.seq);
        }
        let mut c = Cursor::new(dev.clone(), seg, 0).expect("cursor");
        let mut n = 0;
        while let Next::Record(r) = c.next_record().expect("scan") {
            assert!(r.data == want[n].1, "record {n} scanned back other bytes");
            n += 1;
        }
        assert_eq!(n, want.len(), "every record scans back, in order");
        dev.direct_bytes()
    }

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
