use super::{Device, SegmentFile};
use crate::error::{Error, Result};
use crate::format::SegId;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

/// What a crash does to bytes that were written but not synced.
#[derive(Clone, Copy, Debug)]
pub enum CrashMode {
    /// Every unsynced write is lost.
    DropUnsynced,
    /// Each unsynced write independently survives, is lost, or is torn
    /// (only a prefix of it lands), chosen by the seeded generator.
    Scramble { seed: u64 },
}

/// An in-memory device for crash tests: durable and volatile bytes are kept
/// apart, and it can crash at the n-th failpoint or at any moment.
#[derive(Clone, Default)]
pub struct SimDevice {
    state: Arc<Mutex<SimState>>,
}

#[derive(Default)]
struct SimState {
    files: BTreeMap<SegId, SimFile>,
    superblock: Option<Vec<u8>>,
    crashed: Option<&'static str>,
    crash_at: Option<(Option<&'static str>, u64)>,
    failpoint_hits: u64,
    failing_syncs: u32,
    /// What [`Device::free_bytes`] reports, when a test sets it.
    free: Option<u64>,
    /// Counts crashes: a segment handle from before the last one belongs to
    /// a process that is gone, and writes through it fail.
    generation: u64,
}

#[derive(Default, Clone)]
struct SimFile {
    live: Vec<u8>,
    durable: Vec<u8>,
    unsynced: Vec<(u64, Vec<u8>)>,
}

struct SimSegment {
    state: Arc<Mutex<SimState>>,
    id: SegId,
    generation: u64,
}

fn write_into(buf: &mut Vec<u8>, off: u64, data: &[u8]) {
    let end = off as usize + data.len();
    if buf.len() < end {
        buf.resize(end, 0);
    }
    buf[off as usize..end].copy_from_slice(data);
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

impl SimState {
    fn check(&self) -> Result<()> {
        match self.crashed {
            Some(at) => Err(Error::Crashed(at)),
            None => Ok(()),
        }
    }

    fn file(&mut self, id: SegId) -> Result<&mut SimFile> {
        self.check()?;
        self.files.get_mut(&id).ok_or_else(|| Error::Io(std::io::Error::from_raw_os_error(libc::ENOENT)))
    }
}

impl SimDevice {
    pub fn new() -> Self {
        Self::default()
    }

    /// Crash when the `nth` failpoint (0-based) named `name` (or any, if
    /// `None`) is reached: that step and everything after it fails.
    pub fn crash_at_failpoint(&self, name: Option<&'static str>, nth: u64) {
        self.state.lock().crash_at = Some((name, nth));
    }

    /// How many failpoints have been passed so far.
    pub fn failpoint_hits(&self) -> u64 {
        self.state.lock().failpoint_hits
    }

    pub fn has_crashed(&self) -> bool {
        self.state.lock().crashed.is_some()
    }

    /// Makes the next `n` syncs fail with EIO (and lose their data).
    /// Reports `free` bytes free for new segments (`None`: unknown).
    pub fn set_free_bytes(&self, free: Option<u64>) {
        self.state.lock().free = free;
    }

    pub fn fail_next_syncs(&self, n: u32) {
        self.state.lock().failing_syncs = n;
    }

    /// Power loss: volatile bytes go as `mode` says; the device then works
    /// again with only what survived.
    pub fn crash(&self, mode: CrashMode) {
        let mut st = self.state.lock();
        let mut rng = match mode {
            CrashMode::DropUnsynced => 0,
            CrashMode::Scramble { seed } => seed | 1,
        };
        for f in st.files.values_mut() {
            let mut image = f.durable.clone();
            if rng != 0 {
                for (off, data) in &f.unsynced {
                    match xorshift(&mut rng) % 3 {
                        0 => {}
                        1 => write_into(&mut image, *off, data),
                        _ => {
                            let keep = (xorshift(&mut rng) % (data.len() as u64 + 1)) as usize;
                            write_into(&mut image, *off, &data[..keep]);
                        }
                    }
                }
            }
            f.live = image.clone();
            f.durable = image;
            f.unsynced.clear();
        }
        st.crashed = None;
        st.crash_at = None;
        st.generation += 1;
        st.failing_syncs = 0;
    }

    /// Flips one byte of a segment, durably: for corruption tests.
    pub fn corrupt(&self, id: SegId, off: usize) {
        let mut st = self.state.lock();
        if let Some(f) = st.files.get_mut(&id) {
            for image in [&mut f.live, &mut f.durable] {
                if let Some(b) = image.get_mut(off) {
                    *b ^= 0x40;
                }
            }
        }
    }

    pub fn segment_len(&self, id: SegId) -> usize {
        self.state.lock().files.get(&id).map_or(0, |f| f.live.len())
    }
}

impl Device for SimDevice {
    fn create_segment(&self, id: SegId) -> Result<Arc<dyn SegmentFile>> {
        let mut st = self.state.lock();
        st.check()?;
        if st.files.contains_key(&id) {
            return Err(Error::Io(std::io::Error::from_raw_os_error(libc::EEXIST)));
        }
        st.files.insert(id, SimFile::default());
        Ok(Arc::new(SimSegment { state: self.state.clone(), id, generation: st.generation }))
    }

    fn open_segment(&self, id: SegId) -> Result<Option<Arc<dyn SegmentFile>>> {
        let st = self.state.lock();
        st.check()?;
        let generation = st.generation;
        Ok(st.files.contains_key(&id).then(|| Arc::new(SimSegment { state: self.state.clone(), id, generation }) as _))
    }

    fn list_segments(&self) -> Result<Vec<SegId>> {
        let st = self.state.lock();
        st.check()?;
        Ok(st.files.keys().copied().collect())
    }

    fn remove_segment(&self, id: SegId) -> Result<()> {
        let mut st = self.state.lock();
        st.check()?;
        st.files.remove(&id);
        Ok(())
    }

    fn read_superblock(&self) -> Result<Option<Vec<u8>>> {
        let st = self.state.lock();
        st.check()?;
        Ok(st.superblock.clone())
    }

    fn write_superblock(&self, sb: &crate::format::Superblock) -> Result<()> {
        let mut st = self.state.lock();
        st.check()?;
        st.superblock = Some(sb.encode());
        Ok(())
    }

    fn failpoint(&self, name: &'static str) -> Result<()> {
        let mut st = self.state.lock();
        st.check()?;
        st.failpoint_hits += 1;
        if let Some((want, n)) = st.crash_at {
            if want.is_none_or(|w| w == name) {
                if n == 0 {
                    st.crashed = Some(name);
                    return Err(Error::Crashed(name));
                }
                st.crash_at = Some((want, n - 1));
            }
        }
        Ok(())
    }

    fn io_name(&self) -> &'static str {
        "sim"
    }

    fn free_bytes(&self) -> Option<u64> {
        self.state.lock().free
    }
}

impl SegmentFile for SimSegment {
    fn write_at(&self, buf: &[u8], off: u64) -> Result<()> {
        let mut st = self.state.lock();
        if st.generation != self.generation {
            return Err(Error::Crashed("write through a handle from before the crash"));
        }
        let f = st.file(self.id)?;
        write_into(&mut f.live, off, buf);
        f.unsynced.push((off, buf.to_vec()));
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()> {
        let mut st = self.state.lock();
        let f = st.file(self.id)?;
        let end = off as usize + buf.len();
        if end > f.live.len() {
            return Err(Error::corrupted("segment (short read)", off));
        }
        buf.copy_from_slice(&f.live[off as usize..end]);
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        let mut st = self.state.lock();
        st.check()?;
        if st.generation != self.generation {
            return Err(Error::Crashed("sync through a handle from before the crash"));
        }
        if st.failing_syncs > 0 {
            st.failing_syncs -= 1;
            let f = st.file(self.id)?;
            // Like Linux after a writeback error: the dirty data is gone.
            f.live = f.durable.clone();
            f.unsynced.clear();
            return Err(Error::Io(std::io::Error::from_raw_os_error(libc::EIO)));
        }
        let f = st.file(self.id)?;
        f.durable = f.live.clone();
        f.unsynced.clear();
        Ok(())
    }

    fn size(&self) -> Result<u64> {
        let mut st = self.state.lock();
        Ok(st.file(self.id)?.live.len() as u64)
    }

    fn truncate(&self, len: u64) -> Result<()> {
        let mut st = self.state.lock();
        let f = st.file(self.id)?;
        f.live.truncate(len as usize);
        f.durable = f.live.clone();
        f.unsynced.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg() -> SegId {
        SegId { writer: 1, seq: 0 }
    }

    #[test]
    fn unsynced_writes_vanish_and_synced_ones_stay() {
        let dev = SimDevice::new();
        let f = dev.create_segment(seg()).expect("create");
        f.write_at(b"durable", 0).expect("write");
        f.sync().expect("sync");
        f.write_at(b"volatile", 7).expect("write");
        dev.crash(CrashMode::DropUnsynced);
        let f = dev.open_segment(seg()).expect("open").expect("exists");
        assert_eq!(f.size().expect("len"), 7);
    }

    #[test]
    fn a_failpoint_crash_stops_every_later_call() {
        let dev = SimDevice::new();
        let f = dev.create_segment(seg()).expect("create");
        dev.crash_at_failpoint(Some("b"), 1);
        assert!(dev.failpoint("a").is_ok());
        assert!(dev.failpoint("b").is_ok());
        assert!(matches!(dev.failpoint("b"), Err(Error::Crashed("b"))));
        assert!(f.write_at(b"x", 0).is_err());
        dev.crash(CrashMode::DropUnsynced);
        // The handle belonged to the process that crashed; a fresh one works.
        assert!(matches!(f.write_at(b"x", 0), Err(Error::Crashed(_))));
        assert!(f.sync().is_err());
        let f = dev.open_segment(seg()).expect("open").expect("exists");
        assert!(f.write_at(b"x", 0).is_ok());
    }

    #[test]
    fn scramble_keeps_durable_bytes_intact() {
        for seed in 1..50 {
            let dev = SimDevice::new();
            let f = dev.create_segment(seg()).expect("create");
            f.write_at(&[1; 100], 0).expect("write");
            f.sync().expect("sync");
            f.write_at(&[2; 100], 100).expect("write");
            f.write_at(&[3; 100], 200).expect("write");
            dev.crash(CrashMode::Scramble { seed });
            let mut head = [0u8; 100];
            f.read_at(&mut head, 0).expect("read");
            assert_eq!(head, [1; 100]);
        }
    }

    #[test]
    fn a_failed_sync_reports_eio_and_drops_the_dirty_bytes() {
        let dev = SimDevice::new();
        let f = dev.create_segment(seg()).expect("create");
        f.write_at(b"abc", 0).expect("write");
        dev.fail_next_syncs(1);
        assert!(f.sync().is_err());
        assert_eq!(f.size().expect("len"), 0);
    }
}
