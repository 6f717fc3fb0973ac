//! Write-behind for the log: appended bytes go to the segment file on a
//! thread of their own, so the caller of a write (a FUSE request, a client
//! waiting on it) does not wait for the copy into the kernel's page cache.
//!
//! One thread writes the buffers in the order they were handed over, so the
//! file only ever grows by a prefix of the log, and a crash still leaves a
//! prefix of the operations. Nothing here makes bytes durable: a sync first
//! waits for every buffer handed over before it (`WriteBehind::wait_for`),
//! then syncs the files. A reader of bytes not yet written waits for them
//! ([`Behind::wait_written`]). Dropping the [`WriteBehind`] writes what is
//! queued and ends the thread.

use super::buf::LogBuf;
use crate::device::SegmentFile;
use crate::error::{Error, Result};
use crate::format::SegId;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Bytes handed over but not yet written, at most; an append past it waits.
/// Enough for the next megabyte write to overlap the one being written.
const MAX_QUEUED: usize = 8 << 20;
/// Spare buffers kept for reuse (a fresh megabyte costs page faults).
const MAX_SPARE: usize = 4;

struct Job {
    file: Arc<dyn SegmentFile>,
    seg: SegId,
    at: u64,
    buf: LogBuf,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    queued_bytes: usize,
    /// Jobs handed over and jobs written, counted from the start.
    handed: u64,
    done: u64,
    /// The first write error; later waiters see [`Error::Poisoned`].
    failed: Option<Error>,
    spare: Vec<LogBuf>,
    stop: bool,
}

/// The running write-behind: the state it shares with its thread, and the
/// thread.
pub struct WriteBehind {
    shared: Arc<Behind>,
    thread: Option<JoinHandle<()>>,
}

/// What the appending side and the writing thread share.
pub struct Behind {
    queue: Mutex<Queue>,
    /// Signalled when a job is handed over, when one is written, and at stop.
    changed: Condvar,
    /// Every byte before this position of this writer's log is in its file:
    /// `segment seq << 32 | offset`.
    written: AtomicU64,
    writer: u64,
    poisoned: Arc<AtomicBool>,
}

fn pack(seg: SegId, off: u64) -> u64 {
    debug_assert!(off < 1 << 32);
    (u64::from(seg.seq) << 32) | off
}

impl WriteBehind {
    /// Starts the writing thread. `poisoned` is the log's flag, set on the
    /// first failed write.
    pub fn start(writer: u64, poisoned: Arc<AtomicBool>) -> Result<WriteBehind> {
        let shared = Arc::new(Behind {
            queue: Mutex::new(Queue::default()),
            changed: Condvar::new(),
            written: AtomicU64::new(0),
            writer,
            poisoned,
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new().name("arbor-log-write".into()).spawn(move || worker.run())?;
        Ok(WriteBehind { shared, thread: Some(thread) })
    }
}

impl std::ops::Deref for WriteBehind {
    type Target = Behind;
    fn deref(&self) -> &Behind {
        &self.shared
    }
}

impl Drop for WriteBehind {
    /// Writes what is queued and ends the thread, so nothing reaches the
    /// device after its owner let go.
    fn drop(&mut self) {
        self.shared.queue.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Behind {
    /// A buffer for the next records (empty, maybe with capacity).
    pub fn spare(&self) -> LogBuf {
        self.queue.lock().spare.pop().unwrap_or_default()
    }

    /// Queues `buf` to be written at `at` in `file`, waiting first while too
    /// much is queued.
    pub fn hand_over(&self, file: Arc<dyn SegmentFile>, seg: SegId, at: u64, buf: LogBuf) -> Result<()> {
        let mut q = self.queue.lock();
        while q.queued_bytes > 0 && q.queued_bytes + buf.len() > MAX_QUEUED && q.failed.is_none() && !q.stop {
            self.changed.wait(&mut q);
        }
        if q.stop {
            return Err(Error::Invalid("the log is closed"));
        }
        if self.poisoned.load(Ordering::Acquire) {
            return Err(q.failed.take().unwrap_or(Error::Poisoned));
        }
        q.queued_bytes += buf.len();
        q.jobs.push_back(Job { file, seg, at, buf });
        q.handed += 1;
        drop(q);
        self.changed.notify_all();
        Ok(())
    }

    /// Whether every job handed over is written (none queued or running).
    pub fn is_idle(&self) -> bool {
        let q = self.queue.lock();
        q.done == q.handed
    }

    /// Records that the caller wrote bytes up to `end` of `seg` itself
    /// (only while idle, so the file still grows in log order).
    pub fn note_written(&self, seg: SegId, end: u64) {
        self.written.fetch_max(pack(seg, end), Ordering::AcqRel);
    }

    /// The number of the last job handed over.
    pub fn last_handed(&self) -> u64 {
        self.queue.lock().handed
    }

    /// Returns once everything handed over so far is written.
    pub fn wait_all(&self) -> Result<()> {
        self.wait_for(self.last_handed())
    }

    /// Returns once job `n` and every job before it is written.
    pub fn wait_for(&self, n: u64) -> Result<()> {
        let mut q = self.queue.lock();
        loop {
            // Before the count: a failed job counts as done.
            if self.poisoned.load(Ordering::Acquire) {
                return Err(q.failed.take().unwrap_or(Error::Poisoned));
            }
            if q.done >= n {
                return Ok(());
            }
            self.changed.wait(&mut q);
        }
    }

    /// Whether the log's bytes before `end` of `seg` are in its file.
    pub fn has_written(&self, seg: SegId, end: u64) -> bool {
        seg.writer != self.writer || self.written.load(Ordering::Acquire) >= pack(seg, end)
    }

    /// Returns once the log's bytes before `end` of `seg` that were handed
    /// over are in its file.
    pub fn wait_written(&self, seg: SegId, end: u64) -> Result<()> {
        if self.has_written(seg, end) {
            return Ok(());
        }
        let want = pack(seg, end);
        let mut q = self.queue.lock();
        loop {
            if self.written.load(Ordering::Acquire) >= want {
                return Ok(());
            }
            if self.poisoned.load(Ordering::Acquire) {
                return Err(Error::Poisoned);
            }
            if q.done == q.handed {
                return Ok(());
            }
            self.changed.wait(&mut q);
        }
    }

    fn run(&self) {
        loop {
            let job = {
                let mut q = self.queue.lock();
                loop {
                    if let Some(j) = q.jobs.pop_front() {
                        break j;
                    }
                    if q.stop {
                        return;
                    }
                    self.changed.wait(&mut q);
                }
            };
            // After a failure nothing more may reach the file: the log on
            // disk must stay a prefix.
            let result = if self.poisoned.load(Ordering::Acquire) {
                Err(Error::Poisoned)
            } else {
                job.file.write_at(job.buf.bytes(), job.at)
            };
            let mut q = self.queue.lock();
            q.queued_bytes -= job.buf.len();
            q.done += 1;
            match result {
                Ok(()) => {
                    self.written.fetch_max(pack(job.seg, job.at + job.buf.len() as u64), Ordering::AcqRel);
                    if q.spare.len() < MAX_SPARE {
                        let mut buf = job.buf;
                        buf.clear();
                        q.spare.push(buf);
                    }
                }
                Err(e) => {
                    if !self.poisoned.swap(true, Ordering::AcqRel) {
                        tracing::error!(error = %e, "log write failed; refusing further writes");
                        q.failed = Some(e);
                    }
                }
            }
            drop(q);
            self.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::device::{CrashMode, Device, SegmentFile, SimDevice};
    use crate::error::{Error, Result};
    use crate::format::{RecordKind, SegId};
    use crate::log::{Cursor, Log, Next};
    use parking_lot::{Condvar, Mutex};
    use std::sync::mpsc;
    use std::sync::Arc;
    use std::time::Duration;

    /// Holds every segment write until the test opens the gate; may fail them.
    #[derive(Default)]
    struct Gate {
        state: Mutex<(bool, bool)>, // (open, fail)
        moved: Condvar,
        /// Writes that passed.
        writes: std::sync::atomic::AtomicUsize,
    }

    impl Gate {
        fn set(&self, open: bool, fail: bool) {
            *self.state.lock() = (open, fail);
            self.moved.notify_all();
        }
        fn pass(&self) -> Result<()> {
            let mut s = self.state.lock();
            while !s.0 {
                self.moved.wait(&mut s);
            }
            if s.1 {
                return Err(Error::Io(std::io::Error::from_raw_os_error(libc::EIO)));
            }
            self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }
    }

    struct GatedFile(Arc<dyn SegmentFile>, Arc<Gate>);

    impl SegmentFile for GatedFile {
        fn write_at(&self, buf: &[u8], off: u64) -> Result<()> {
            self.1.pass()?;
            self.0.write_at(buf, off)
        }
        fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()> {
            self.0.read_at(buf, off)
        }
        fn sync(&self) -> Result<()> {
            self.0.sync()
        }
        fn size(&self) -> Result<u64> {
            self.0.size()
        }
        fn truncate(&self, len: u64) -> Result<()> {
            self.0.truncate(len)
        }
    }

    struct GatedDevice(SimDevice, Arc<Gate>);

    impl Device for GatedDevice {
        fn create_segment(&self, id: SegId) -> Result<Arc<dyn SegmentFile>> {
            Ok(Arc::new(GatedFile(self.0.create_segment(id)?, self.1.clone())))
        }
        fn open_segment(&self, id: SegId) -> Result<Option<Arc<dyn SegmentFile>>> {
            self.0.open_segment(id)
        }
        fn list_segments(&self) -> Result<Vec<SegId>> {
            self.0.list_segments()
        }
        fn remove_segment(&self, id: SegId) -> Result<()> {
            self.0.remove_segment(id)
        }
        fn read_superblock(&self) -> Result<Option<Vec<u8>>> {
            self.0.read_superblock()
        }
        fn write_superblock(&self, sb: &crate::format::Superblock) -> Result<()> {
            self.0.write_superblock(sb)
        }
        fn io_name(&self) -> &'static str {
            "gated"
        }
    }

    fn gated() -> (SimDevice, Arc<Gate>, Arc<dyn Device>) {
        let sim = SimDevice::new();
        let gate = Arc::new(Gate::default());
        let dev: Arc<dyn Device> = Arc::new(GatedDevice(sim.clone(), gate.clone()));
        (sim, gate, dev)
    }

    fn records(dev: &Arc<dyn Device>, writer: u64) -> Vec<Vec<u8>> {
        let mut c = Cursor::new(dev.clone(), SegId { writer, seq: 0 }, 0).expect("cursor");
        let mut out = Vec::new();
        while let Next::Record(r) = c.next_record().expect("io") {
            out.push(r.data);
        }
        out
    }

    #[test]
    fn appends_return_before_their_bytes_are_written_and_readers_and_syncs_wait_for_them() {
        let (sim, gate, dev) = gated();
        let log = Arc::new(Log::create_with(dev.clone(), 7, 1, 1 << 20, true).expect("log"));
        // The file is held shut, yet appends return (records large enough to
        // be handed over, under the bound on queued bytes).
        let a = log.append(RecordKind::Intent, b"m", &[1; 100_000], "t").expect("append");
        let b = log.append(RecordKind::Intent, b"m", &[2; 70_000], "t").expect("append");
        assert_eq!(sim.segment_len(a.addr.seg), 0, "nothing reached the file yet");

        let (read_tx, read_rx) = mpsc::channel();
        let reader = {
            let (log, dev) = (log.clone(), dev.clone());
            std::thread::spawn(move || {
                log.wait_written(b.data.seg, b.data.end()).expect("wait");
                let mut buf = vec![0; b.data.len as usize];
                let file = dev.open_segment(b.data.seg).expect("open").expect("segment");
                file.read_at(&mut buf, b.data.off as u64).expect("read");
                read_tx.send(buf).expect("send");
            })
        };
        let (sync_tx, sync_rx) = mpsc::channel();
        let syncer = {
            let log = log.clone();
            std::thread::spawn(move || sync_tx.send(log.sync_all()).expect("send"))
        };
        // Neither can finish while the gate is shut (a bounded wait: the
        // point is only that they have not returned).
        assert!(read_rx.recv_timeout(Duration::from_millis(100)).is_err(), "a reader got unwritten bytes");
        assert!(sync_rx.try_recv().is_err(), "a sync returned before the bytes were written");
        gate.set(true, false);
        assert_eq!(read_rx.recv_timeout(Duration::from_secs(10)).expect("reader"), vec![2; 70_000]);
        sync_rx.recv_timeout(Duration::from_secs(10)).expect("syncer").expect("sync");
        reader.join().expect("reader thread");
        syncer.join().expect("sync thread");
        drop(log);
        sim.crash(CrashMode::DropUnsynced);
        let dev: Arc<dyn Device> = Arc::new(sim);
        assert_eq!(records(&dev, 7), vec![vec![1; 100_000], vec![2; 70_000]], "synced records survive in order");
    }

    #[test]
    fn small_records_with_nothing_queued_are_written_in_the_call_and_large_ones_behind() {
        let (sim, gate, dev) = gated();
        gate.set(true, false);
        let log = Log::create_with(dev.clone(), 6, 1, 4 << 20, true).expect("log");
        let seg = SegId { writer: 6, seq: 0 };
        let small = log.append(RecordKind::Intent, b"m", &[1; 4096], "t").expect("append");
        assert_eq!(sim.segment_len(seg) as u64, small.addr.end(), "a small record is in the file at once");
        gate.set(false, false);
        let big = log.append(RecordKind::Intent, b"m", &[2; 200_000], "t").expect("append");
        assert_eq!(sim.segment_len(seg) as u64, small.addr.end(), "a large one is handed over");
        // A small record behind a queued one must queue too (log order).
        let after = log.append(RecordKind::Intent, b"m", &[3; 10], "t").expect("append");
        assert_eq!(sim.segment_len(seg) as u64, small.addr.end(), "nothing overtakes a queued write");
        gate.set(true, false);
        log.sync_all().expect("sync");
        assert_eq!(sim.segment_len(seg) as u64, after.addr.end());
        assert!(big.addr.end() <= after.addr.off as u64);
    }

    #[test]
    fn records_appended_while_the_thread_is_busy_gather_into_one_write() {
        let (sim, gate, dev) = gated();
        let log = Arc::new(Log::create_with(dev.clone(), 5, 1, 16 << 20, true).expect("log"));
        // The first large record is handed over and held at the gate.
        log.append(RecordKind::Intent, b"m", &[1; 200_000], "t").expect("append");
        // Meanwhile 128 KiB records (a program's smaller writes) gather in
        // the log's buffer instead of queueing one by one.
        let mut last = None;
        for n in 2..8u8 {
            last = Some(log.append(RecordKind::Intent, b"m", &[n; 128 << 10], "t").expect("append"));
        }
        let last = last.expect("appended");
        // A reader of the last one sends them on; it waits at the gate.
        let reader = {
            let log = log.clone();
            std::thread::spawn(move || log.wait_written(last.data.seg, last.data.end()))
        };
        gate.set(true, false);
        reader.join().expect("reader thread").expect("wait");
        log.sync_all().expect("sync");
        let writes = gate.writes.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(writes, 2, "the six small records took {} writes of their own", writes - 1);
        drop(log);
        sim.crash(CrashMode::DropUnsynced);
        let dev: Arc<dyn Device> = Arc::new(sim);
        let want: Vec<Vec<u8>> =
            std::iter::once(vec![1; 200_000]).chain((2..8u8).map(|n| vec![n; 128 << 10])).collect();
        assert_eq!(records(&dev, 5), want, "every record, in order");
    }

    #[test]
    fn a_reader_of_a_record_still_pending_sends_it_on_and_gets_it() {
        let (sim, gate, dev) = gated();
        gate.set(true, false);
        let log = Log::create_with(dev.clone(), 8, 1, 1 << 20, true).expect("log");
        // Records without data wait in the log's buffer for company.
        let a = log.append(RecordKind::Node, b"a node", &[], "t").expect("append");
        assert_eq!(sim.segment_len(a.addr.seg), 0);
        log.wait_written(a.addr.seg, a.addr.end()).expect("wait");
        assert_eq!(sim.segment_len(a.addr.seg) as u64, a.addr.end());
        let file = dev.open_segment(a.addr.seg).expect("open").expect("segment");
        let rec = crate::log::read_record_at_offset(file.as_ref(), a.addr.seg, a.addr.off as u64, a.addr.end())
            .expect("read");
        assert_eq!(rec.meta, b"a node");
    }

    #[test]
    fn bytes_queued_at_drop_are_written_and_sealed_segments_are_complete() {
        let (sim, gate, dev) = gated();
        gate.set(true, false);
        let log = Log::create_with(dev.clone(), 3, 1, 64 << 10, true).expect("log");
        let mut want = Vec::new();
        for i in 0..40u8 {
            let data = vec![i; 3000 + 211 * i as usize];
            log.append(RecordKind::Intent, &[i], &data, "t").expect("append");
            want.push(data);
        }
        assert!(log.position().0.seq > 2, "segments were sealed");
        drop(log);
        let dev: Arc<dyn Device> = Arc::new(sim);
        assert_eq!(records(&dev, 3), want);
    }

    #[test]
    fn a_failed_write_poisons_the_log_and_nothing_after_it_reaches_the_file() {
        let (sim, gate, dev) = gated();
        gate.set(true, false);
        let log = Log::create_with(dev.clone(), 4, 1, 1 << 20, true).expect("log");
        log.append(RecordKind::Intent, b"m", &[1; 100_000], "t").expect("append");
        log.sync_all().expect("sync");
        let seg = SegId { writer: 4, seq: 0 };
        let good = sim.segment_len(seg);
        gate.set(false, true);
        log.append(RecordKind::Intent, b"m", &[2; 100_000], "t").expect("queued");
        gate.set(true, true);
        assert!(log.sync_all().is_err(), "a sync after a failed write must fail");
        gate.set(true, false);
        assert!(log.is_poisoned());
        assert!(log.append(RecordKind::Intent, b"m", &[3; 100_000], "t").is_err());
        assert!(log.append(RecordKind::Intent, b"m", &[4; 10], "t").is_err(), "small records too");
        assert!(log.sync_all().is_err());
        drop(log);
        assert_eq!(sim.segment_len(seg), good, "nothing after the failed write reached the file");
    }
}
