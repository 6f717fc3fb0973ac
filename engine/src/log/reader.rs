use crate::device::{Device, SegmentFile};
use crate::error::{Error, Result};
use crate::format::{Addr, RecordHeader, RecordKind, SegId, BLOCK_SIZE, HEADER_LEN};
use std::sync::Arc;

/// One verified record.
#[derive(Debug)]
pub struct Record {
    pub addr: Addr,
    pub kind: RecordKind,
    pub seq: u64,
    /// The metadata, without the crc table.
    pub meta: Vec<u8>,
    pub data: Vec<u8>,
    pub data_addr: Addr,
    pub crcs: Vec<u32>,
}

/// Why a record could not be read: the log ends (or is torn) there.
fn torn(why: &'static str, seg: SegId, off: u64) -> Error {
    Error::Corrupted { what: why, addr: format!("{seg}@{off}") }
}

/// Reads and fully verifies the record at `(seg, off)`, which must lie
/// within the first `limit` bytes of the file.
pub fn read_record_at_offset(file: &dyn SegmentFile, seg: SegId, off: u64, limit: u64) -> Result<Record> {
    if off + HEADER_LEN as u64 > limit {
        return Err(torn("record header past end of segment", seg, off));
    }
    let mut hbuf = [0u8; HEADER_LEN];
    file.read_at(&mut hbuf, off)?;
    let h = RecordHeader::parse(&hbuf).ok_or_else(|| torn("record header", seg, off))?;
    let total = h.total_len();
    if off + total > limit || total > u32::MAX as u64 {
        return Err(torn("record length past end of segment", seg, off));
    }
    let mut payload = vec![0u8; h.payload_len.get() as usize];
    file.read_at(&mut payload, off + HEADER_LEN as u64)?;
    verify(&h, payload, seg, off)
}

/// Reads the record at `addr` with one read of its known length, verified
/// as [`read_record_at_offset`] does.
pub fn read_record_at_addr(file: &dyn SegmentFile, addr: Addr) -> Result<Record> {
    let (seg, off) = (addr.seg, addr.off as u64);
    if (addr.len as usize) < HEADER_LEN {
        return Err(torn("record length", seg, off));
    }
    let mut buf = vec![0u8; addr.len as usize];
    // Records read by address are metadata (tree nodes, commits).
    file.read_unstreamed(&mut buf, off)?;
    let h = RecordHeader::parse(&buf[..HEADER_LEN]).ok_or_else(|| torn("record header", seg, off))?;
    if h.total_len() != addr.len as u64 {
        return Err(torn("record length", seg, off));
    }
    buf.drain(..HEADER_LEN);
    verify(&h, buf, seg, off)
}

/// Checks a record's payload against its header and splits it up.
fn verify(h: &RecordHeader, mut payload: Vec<u8>, seg: SegId, off: u64) -> Result<Record> {
    let total = h.total_len();
    let meta_len = h.meta_len.get() as usize;
    if h.compute_crc(&payload[..meta_len]) != h.crc.get() {
        return Err(torn("record checksum", seg, off));
    }
    let data_len = h.data_len();
    let nblocks = data_len.div_ceil(BLOCK_SIZE);
    if nblocks * 4 > meta_len {
        return Err(torn("record crc table", seg, off));
    }
    let table_at = meta_len - nblocks * 4;
    let crcs: Vec<u32> =
        payload[table_at..meta_len].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let data = payload.split_off(meta_len);
    for (block, want) in data.chunks(BLOCK_SIZE).zip(&crcs) {
        if crate::crc::crc32c(block) != *want {
            return Err(torn("data block checksum", seg, off));
        }
    }
    let pad = h.pad.get() as usize;
    if pad > table_at {
        return Err(torn("record padding", seg, off));
    }
    payload.truncate(table_at - pad);
    let data_off = off + HEADER_LEN as u64 + meta_len as u64;
    Ok(Record {
        addr: Addr { seg, off: off as u32, len: total as u32 },
        kind: h.kind().ok_or_else(|| torn("record kind", seg, off))?,
        seq: h.seq.get(),
        meta: payload,
        data,
        data_addr: Addr { seg, off: data_off as u32, len: data_len as u32 },
        crcs,
    })
}

/// What a cursor found next.
pub enum Next {
    Record(Record),
    /// The log ends cleanly here.
    End,
    /// The log ends at a record that fails its checks (a torn tail, or
    /// corruption): `(segment, offset, reason)`.
    Torn(SegId, u64, String),
}

/// Walks one writer's segments in order, from a position, verifying each
/// record and that sequence numbers follow one another.
pub struct Cursor {
    device: Arc<dyn Device>,
    seg: SegId,
    file: Arc<dyn SegmentFile>,
    len: u64,
    off: u64,
    expect_seq: Option<u64>,
}

impl Cursor {
    pub fn new(device: Arc<dyn Device>, seg: SegId, off: u64) -> Result<Cursor> {
        let file = device.open_segment(seg)?.ok_or_else(|| torn("missing segment", seg, off))?;
        let len = file.size()?;
        Ok(Cursor { device, seg, file, len, off, expect_seq: None })
    }

    /// Refuses any first record but number `seq`: a cursor started after a
    /// known record must not skip over records a crash removed.
    pub fn expecting(mut self, seq: u64) -> Cursor {
        self.expect_seq = Some(seq);
        self
    }

    pub fn position(&self) -> (SegId, u64) {
        (self.seg, self.off)
    }

    pub fn next_record(&mut self) -> Result<Next> {
        if self.off == self.len {
            match self.device.open_segment(self.seg.next())? {
                Some(file) => {
                    self.seg = self.seg.next();
                    self.len = file.size()?;
                    self.file = file;
                    self.off = 0;
                    if self.len == 0 {
                        return Ok(Next::End);
                    }
                }
                None => return Ok(Next::End),
            }
        }
        let rec = match read_record_at_offset(self.file.as_ref(), self.seg, self.off, self.len) {
            Ok(r) => r,
            Err(Error::Corrupted { what, .. }) => return Ok(Next::Torn(self.seg, self.off, what.to_string())),
            Err(e) => return Err(e),
        };
        if self.expect_seq.is_some_and(|s| s != rec.seq) {
            return Ok(Next::Torn(self.seg, self.off, "sequence gap".into()));
        }
        self.expect_seq = Some(rec.seq + 1);
        self.off += rec.addr.len as u64;
        Ok(Next::Record(rec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CrashMode, SimDevice};
    use crate::log::Log;

    fn collect(dev: &Arc<dyn Device>, writer: u64) -> (Vec<Record>, Option<String>) {
        let mut c = Cursor::new(dev.clone(), SegId { writer, seq: 0 }, 0).expect("cursor");
        let mut out = Vec::new();
        loop {
            match c.next_record().expect("io") {
                Next::Record(r) => out.push(r),
                Next::End => return (out, None),
                Next::Torn(_, _, why) => return (out, Some(why)),
            }
        }
    }

    #[test]
    fn records_round_trip_across_sealed_segments() {
        let sim = SimDevice::new();
        let dev: Arc<dyn Device> = Arc::new(sim.clone());
        let log = Log::create(dev.clone(), 5, 1, 16 << 10).expect("log");
        let mut written = Vec::new();
        for i in 0..20u8 {
            let data = vec![i; 3000 + i as usize * 100];
            let a = log.append(RecordKind::Intent, &[i], &data, "t").expect("append");
            written.push((a, data));
        }
        log.sync_all().expect("sync");
        assert!(log.position().0.seq > 0, "small segments must have been sealed");
        let (recs, torn) = collect(&dev, 5);
        assert!(torn.is_none());
        assert_eq!(recs.len(), 20);
        for (r, (a, data)) in recs.iter().zip(&written) {
            assert_eq!(r.addr, a.addr);
            assert_eq!(r.data_addr, a.data);
            assert_eq!(&r.data, data);
            assert_eq!(r.crcs, a.crcs);
            assert_eq!(r.meta.len(), 1);
        }
    }

    #[test]
    fn a_flipped_byte_anywhere_ends_the_log_at_that_record() {
        let sim = SimDevice::new();
        let dev: Arc<dyn Device> = Arc::new(sim.clone());
        let log = Log::create(dev.clone(), 9, 1, 1 << 20).expect("log");
        let mut ends = Vec::new();
        for i in 0..4u8 {
            let a = log.append(RecordKind::Intent, &[i; 10], &vec![i; 5000], "t").expect("append");
            ends.push(a.addr);
        }
        log.sync_all().expect("sync");
        let seg = SegId { writer: 9, seq: 0 };
        let len = sim.segment_len(seg);
        for off in (0..len).step_by(97) {
            sim.corrupt(seg, off);
            let (recs, torn) = collect(&dev, 9);
            let hit = ends.iter().position(|a| (a.off as usize..a.end() as usize).contains(&off)).expect("in a record");
            assert_eq!(recs.len(), hit, "flip at {off}");
            assert!(torn.is_some());
            sim.corrupt(seg, off);
        }
    }

    #[test]
    fn only_whole_records_survive_a_scrambled_crash() {
        for seed in 1..40 {
            let sim = SimDevice::new();
            let dev: Arc<dyn Device> = Arc::new(sim.clone());
            let log = Log::create(dev.clone(), 3, 1, 1 << 20).expect("log");
            log.append(RecordKind::Intent, b"a", &[1; 9000], "t").expect("append");
            log.sync_all().expect("sync");
            for _ in 0..5 {
                log.append(RecordKind::Intent, b"b", &[2; 9000], "t").expect("append");
            }
            sim.crash(CrashMode::Scramble { seed });
            let (recs, _) = collect(&dev, 3);
            assert!(!recs.is_empty(), "the synced record must survive");
            assert!(recs.iter().skip(1).all(|r| r.data == vec![2; 9000]));
        }
    }
}

#[cfg(test)]
mod align_tests {
    use super::*;
    use crate::device::SimDevice;
    use crate::format::{ALIGN_DATA_MIN, BLOCK_SIZE};
    use crate::log::Log;

    #[test]
    fn large_writes_start_their_data_on_a_block_boundary() {
        let dev: Arc<dyn Device> = Arc::new(SimDevice::new());
        let log = Log::create(dev.clone(), 1, 1, 4 << 20).expect("log");
        log.append(RecordKind::Intent, b"small", &[1; 100], "t").expect("append");
        for len in [ALIGN_DATA_MIN, ALIGN_DATA_MIN + 123, 1 << 20] {
            let a = log.append(RecordKind::Intent, b"meta", &vec![2; len], "t").expect("append");
            assert_eq!(a.data.off as usize % BLOCK_SIZE, 0, "{len}");
        }
        log.sync_all().expect("sync");
        let mut c = Cursor::new(dev, SegId { writer: 1, seq: 0 }, 0).expect("cursor");
        let mut n = 0;
        while let Next::Record(r) = c.next_record().expect("io") {
            assert!(r.meta == b"meta" || r.meta == b"small", "padding must not leak into the metadata");
            n += 1;
        }
        assert_eq!(n, 4);
    }
}
