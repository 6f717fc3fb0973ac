use super::behind::WriteBehind;
use super::buf::LogBuf;
use crate::device::{failpoints, Device, SegmentFile};
use crate::error::{Error, Result};
use crate::format::{block_crcs, Addr, RecordHeader, RecordKind, SegId, ALIGN_DATA_MIN, BLOCK_SIZE, HEADER_LEN};
use crate::metrics::Counter;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use zerocopy::IntoBytes;

/// Where an appended record landed.
#[derive(Clone, Debug)]
pub struct Appended {
    /// The whole record.
    pub addr: Addr,
    /// Its data bytes (empty if it carries none).
    pub data: Addr,
    pub seq: u64,
    /// crc32c of each 4 KiB block of the data bytes.
    pub crcs: Vec<u32>,
}

pub struct Log {
    device: Arc<dyn Device>,
    segment_size: u64,
    tail: Mutex<Tail>,
    /// Held by the one thread running an fdatasync; the others wait here and
    /// usually find their record already durable when they get it.
    sync_lock: Mutex<()>,
    durable_seq: AtomicU64,
    /// Shared with the write-behind thread, which sets it when a write fails.
    poisoned: Arc<AtomicBool>,
    syncs: Counter,
    /// Where appended bytes go to the file on a thread of their own; `None`
    /// writes them in the appending call.
    behind: Option<WriteBehind>,
}

/// Records without data (metadata intents, tree nodes, commits) wait in
/// `pending` until the next data record, seal or sync writes them in the
/// same call: nothing reads them back before a sync, and a small file's
/// create + write + fsync then costs two system calls, not four. With
/// write-behind, a large buffer is handed to its thread instead.
struct Tail {
    seg: SegId,
    file: Arc<dyn SegmentFile>,
    /// The end of the log, pending bytes included.
    off: u64,
    next_seq: u64,
    pending: LogBuf,
    /// Where the first pending byte goes in the file.
    pending_at: u64,
    /// Sealed segments not yet synced, oldest first. Every sync syncs them,
    /// in order, before the open segment, so no fsync can make a later
    /// segment durable before an earlier one.
    unsynced: Vec<Arc<dyn SegmentFile>>,
    /// Set by [`Log::finish`].
    finished: bool,
}

/// Past this, pending records are written without waiting for company.
const PENDING_MAX: usize = 1 << 20;
/// With write-behind, buffers up to this size are written by the appending
/// thread itself when nothing is queued ahead of them.
const WRITE_IN_CALLER_MAX: usize = 64 << 10;

impl Log {
    /// Starts a new writer epoch: segment `(writer, 0)`, first record
    /// `first_seq`. Appends write their bytes before they return.
    pub fn create(device: Arc<dyn Device>, writer: u64, first_seq: u64, segment_size: u64) -> Result<Log> {
        Self::create_with(device, writer, first_seq, segment_size, false)
    }

    /// Like [`Log::create`]; with `write_behind`, appended bytes reach the
    /// file on a thread of their own (see `WriteBehind`).
    pub fn create_with(
        device: Arc<dyn Device>,
        writer: u64,
        first_seq: u64,
        segment_size: u64,
        write_behind: bool,
    ) -> Result<Log> {
        let seg = SegId { writer, seq: 0 };
        let file = device.create_segment(seg)?;
        let poisoned = Arc::new(AtomicBool::new(false));
        let behind = if write_behind { Some(WriteBehind::start(writer, poisoned.clone())?) } else { None };
        Ok(Log {
            device,
            segment_size,
            tail: Mutex::new(Tail {
                seg,
                file,
                off: 0,
                next_seq: first_seq,
                pending: LogBuf::default(),
                pending_at: 0,
                unsynced: Vec::new(),
                finished: false,
            }),
            sync_lock: Mutex::new(()),
            durable_seq: AtomicU64::new(first_seq.saturating_sub(1)),
            poisoned,
            syncs: Counter::new(),
            behind,
        })
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    pub fn writer(&self) -> u64 {
        self.tail.lock().seg.writer
    }

    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// How many fdatasync calls the log has made (for tests of group commit).
    pub fn sync_count(&self) -> u64 {
        self.syncs.get()
    }

    pub fn last_seq(&self) -> u64 {
        self.tail.lock().next_seq - 1
    }

    pub fn durable_seq(&self) -> u64 {
        self.durable_seq.load(Ordering::Acquire)
    }

    /// The segment being written and how many bytes it holds.
    pub fn position(&self) -> (SegId, u64) {
        let t = self.tail.lock();
        (t.seg, t.off)
    }

    fn poison(&self, e: Error) -> Error {
        self.poisoned.store(true, Ordering::Release);
        tracing::error!(error = %e, "log write or sync failed; refusing further writes");
        e
    }

    /// Appends one record: `meta` and a crc table are checksummed by the
    /// header, `data` block by block. Not durable until [`Log::sync`].
    pub fn append(&self, kind: RecordKind, meta: &[u8], data: &[u8], failpoint: &'static str) -> Result<Appended> {
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let crcs = block_crcs(data);
        let unpadded = HEADER_LEN + meta.len() + crcs.len() * 4;
        let may_pad = if data.len() >= ALIGN_DATA_MIN { BLOCK_SIZE - 1 } else { 0 };
        if (unpadded + may_pad + data.len()) as u64 > self.segment_size {
            return Err(Error::Invalid("record larger than a segment"));
        }
        let mut tail = self.tail.lock();
        if tail.finished {
            return Err(Error::Invalid("the log is closed"));
        }
        if tail.off + (unpadded + may_pad + data.len()) as u64 > self.segment_size {
            self.seal(&mut tail)?;
        }
        let pad = if may_pad > 0 { (BLOCK_SIZE - (tail.off as usize + unpadded) % BLOCK_SIZE) % BLOCK_SIZE } else { 0 };
        let mut meta_region = Vec::with_capacity(meta.len() + pad + crcs.len() * 4);
        meta_region.extend_from_slice(meta);
        meta_region.resize(meta.len() + pad, 0);
        for c in &crcs {
            meta_region.extend_from_slice(&c.to_le_bytes());
        }
        let total = (HEADER_LEN + meta_region.len() + data.len()) as u64;
        let header = RecordHeader::with_pad(kind, tail.next_seq, &meta_region, data.len(), pad as u32);
        crate::device::durable_step(self.device.as_ref(), failpoint)?;
        if tail.pending.is_empty() {
            tail.pending_at = tail.off;
            let at = tail.off;
            tail.pending.start(at);
        }
        tail.pending.extend(header.as_bytes());
        tail.pending.extend(&meta_region);
        tail.pending.extend(data);
        if !data.is_empty() || tail.pending.len() >= PENDING_MAX {
            self.flush(&mut tail, false)?;
        }
        let addr = Addr { seg: tail.seg, off: tail.off as u32, len: total as u32 };
        let data_off = tail.off + (HEADER_LEN + meta_region.len()) as u64;
        let appended = Appended {
            addr,
            data: Addr { seg: tail.seg, off: data_off as u32, len: data.len() as u32 },
            seq: tail.next_seq,
            crcs,
        };
        tail.off += total;
        tail.next_seq += 1;
        Ok(appended)
    }

    /// Syncs the full segment and starts the next one. Sealed segments are
    /// durable before anything is written after them, so the log on disk is
    /// always a prefix.
    fn seal(&self, tail: &mut Tail) -> Result<()> {
        crate::device::durable_step(self.device.as_ref(), failpoints::SEGMENT_SEAL)?;
        self.flush(tail, true)?;
        // The sealed file is complete before anyone is told it is sealed.
        if let Some(wb) = &self.behind {
            wb.wait_all()?;
        }
        // No fdatasync here: a writer must not stall on it. Writeback of
        // the sealed segment starts now without waiting, and the next sync
        // makes it durable before anything after it.
        let next = tail.seg.next();
        let sealed = std::mem::replace(&mut tail.file, self.device.create_segment(next)?);
        sealed.sealed();
        sealed.start_writeback();
        if let Some(r) = self.device.replica() {
            r.segment_sealed(tail.seg, tail.off);
        }
        tail.unsynced.push(sealed);
        tail.seg = next;
        tail.off = 0;
        Ok(())
    }

    /// Writes the pending records, or hands them to the write-behind thread.
    /// `waiting`: the caller waits for the bytes anyway (a sync or a seal).
    fn flush(&self, tail: &mut Tail, waiting: bool) -> Result<()> {
        if tail.pending.is_empty() {
            return Ok(());
        }
        if let Some(wb) = &self.behind {
            let idle = wb.is_idle();
            // While the thread is busy, records gather here into one large
            // write (which can then skip the page cache, see
            // `FileSegment::write_at`) instead of queueing one by one.
            // A reader or sync that needs them flushes them (`waiting`).
            if !waiting && !idle && tail.pending.len() < PENDING_MAX {
                return Ok(());
            }
            // With nothing queued ahead, a caller that will wait anyway, or
            // one with a small buffer, writes it here: waking the thread
            // (and being woken by it) costs more than the copy. Only the
            // holder of the tail lock hands over, so the queue stays idle.
            if !((waiting || tail.pending.len() <= WRITE_IN_CALLER_MAX) && idle) {
                let buf = std::mem::replace(&mut tail.pending, wb.spare());
                wb.hand_over(tail.file.clone(), tail.seg, tail.pending_at, buf)?;
                return Ok(());
            }
        }
        if let Err(e) = tail.file.write_at(tail.pending.bytes(), tail.pending_at) {
            tail.pending.clear();
            return Err(self.poison(e));
        }
        if let Some(wb) = &self.behind {
            wb.note_written(tail.seg, tail.pending_at + tail.pending.len() as u64);
        }
        // Keep the allocation: the next megabyte write reuses it.
        tail.pending.clear();
        tail.pending.shrink(PENDING_MAX);
        Ok(())
    }

    /// Returns once the log's bytes before `end` of `seg` can be read from
    /// the segment file (at once unless write-behind still holds them).
    pub fn wait_written(&self, seg: SegId, end: u64) -> Result<()> {
        let Some(wb) = &self.behind else { return Ok(()) };
        if wb.has_written(seg, end) {
            return Ok(());
        }
        {
            // Still in the pending buffer: send it on its way first.
            let mut t = self.tail.lock();
            if t.seg == seg && !t.pending.is_empty() && t.pending_at < end {
                self.flush(&mut t, true)?;
            }
        }
        wb.wait_written(seg, end)
    }

    /// Returns once every record appended so far is in its segment file
    /// (the kernel's page cache, not synced): a kill of this process then
    /// loses none of them, only a crash of the node can.
    pub fn write_out(&self) -> Result<()> {
        {
            let mut t = self.tail.lock();
            self.flush(&mut t, true)?;
        }
        match &self.behind {
            Some(wb) => wb.wait_all(),
            None => Ok(()),
        }
    }

    /// Returns once every record up to `seq` is durable. Concurrent callers
    /// share one fdatasync (group commit).
    pub fn sync(&self, seq: u64) -> Result<()> {
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        if self.durable_seq() >= seq {
            return Ok(());
        }
        let _leader = self.sync_lock.lock();
        if self.durable_seq() >= seq {
            return Ok(());
        }
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let mut handed = 0;
        let (files, upto, open) = {
            let mut t = self.tail.lock();
            if t.finished {
                return Err(Error::Invalid("the log is closed"));
            }
            self.flush(&mut t, true)?;
            let mut files = std::mem::take(&mut t.unsynced);
            files.push(t.file.clone());
            if let Some(wb) = &self.behind {
                handed = wb.last_handed();
            }
            (files, t.next_seq - 1, (t.seg, t.off))
        };
        // Bytes still on their way to the file first (the write-behind
        // thread poisons the log itself if one fails).
        if let Some(wb) = &self.behind {
            wb.wait_for(handed)?;
        }
        crate::device::durable_step(self.device.as_ref(), failpoints::FSYNC)?;
        self.syncs.inc();
        for file in files {
            if let Err(e) = file.sync() {
                return Err(self.poison(e));
            }
        }
        // Where fsync means "in the bucket", wait for it there too. A
        // failure here leaves the local log intact: no poison, and the next
        // sync tries again.
        if let Some(r) = self.device.replica() {
            r.log_synced(open.0, open.1)?;
        }
        self.durable_seq.fetch_max(upto, Ordering::AcqRel);
        Ok(())
    }

    pub fn is_finished(&self) -> bool {
        self.tail.lock().finished
    }

    /// Syncs everything and ends this writer's log: its open segment is
    /// final (and may go to the bucket). Appends after this fail.
    pub fn finish(&self) -> Result<()> {
        self.sync_all()?;
        let mut t = self.tail.lock();
        if !t.finished {
            t.finished = true;
            if let Some(r) = self.device.replica() {
                r.segment_sealed(t.seg, t.off);
            }
        }
        Ok(())
    }

    /// Syncs everything appended so far.
    pub fn sync_all(&self) -> Result<()> {
        self.sync(self.last_seq())
    }
}
