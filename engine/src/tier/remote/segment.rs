//! One segment in the bucket: its footer, on-demand chunk fetches (one
//! per chunk, or the run read-ahead queued right after it), and reads
//! through the chunk cache.

use super::{Remote, GET_TRIES, PART_MAX, RUN_CHUNKS};
use crate::chunks::ahead::{Step, Stream, Window};
use crate::chunks::fetch::Claim;
use crate::device::{Checked, SegmentFile};
use crate::error::{Error, Result};
use crate::format::SegId;
use crate::tier::object::Footer;
use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

pub(super) enum Backing {
    /// A sealed segment object, read chunk by chunk through the cache.
    Object { file: File },
    /// The WAL pieces of a segment that was never sealed: small, read whole.
    Wal(Vec<u8>),
}

pub(crate) struct RemoteSeg {
    pub(super) remote: Arc<Remote>,
    pub(super) id: SegId,
    pub(super) key: String,
    pub(crate) footer: Footer,
    pub(super) backing: Backing,
    /// Where the last read ended and the read-ahead window
    /// (`chunks::ahead`): the configured size after a random read, growing
    /// fourfold with each sequential one up to `Remote::max_window`.
    pub(super) stream: Stream,
    /// Where the reads answered with parts of chunks since the last other
    /// read began (`u64::MAX`: none), to tell the rest of a small read (the
    /// next record's blocks) from a reader going on.
    pub(super) part_run: AtomicU64,
    /// The chunk read-ahead has looked at up to (exclusive) since the
    /// reader last streamed into this segment: every chunk before it was
    /// present, on its way or queued then, so the next read's window is
    /// looked at from here, not again from the reader's position (a
    /// 64 MiB window would otherwise cost a lookup per chunk per read).
    pub(super) ahead: AtomicU64,
    /// Fetch workers land chunks in the cache file one at a time. ext4
    /// serializes buffered writes to a file on its inode lock anyway, and
    /// a writer waiting there spins on its CPU while the holder copies a
    /// whole chunk (9 % of eight workers' samples, streaming one segment
    /// through a cache server, in a profile); here a waiter sleeps.
    pub(super) landing: Mutex<()>,
    pub(super) me: Weak<RemoteSeg>,
}

impl RemoteSeg {
    /// The chunk after the last one holding bytes before `end`, rounded up
    /// to a whole run (so each worker GET is a large one).
    pub(super) fn run_end(&self, end: u64) -> usize {
        (end.min(self.footer.data_len).div_ceil(self.chunk_size()) as usize)
            .next_multiple_of(RUN_CHUNKS)
            .min(self.footer.crcs.len())
    }

    /// How this segment's readers size their read-ahead window.
    pub(super) fn window(&self) -> Window {
        self.remote.fetches.window(self.remote.max_window(), self.chunk_size())
    }

    pub(super) fn chunk_size(&self) -> u64 {
        self.footer.chunk_size as u64
    }

    /// Fetches chunk `i` from the bucket unless it is present or another
    /// thread brings it; returns its bytes when this call fetched them.
    pub(crate) fn fetch(&self, i: usize) -> Result<Option<Vec<u8>>> {
        let Backing::Object { .. } = &self.backing else { return Ok(None) };
        let r = &self.remote;
        let key = (self.id, i as u32);
        // The claim on chunk `i`, and on those queued right after it.
        let mut claimed = Vec::new();
        {
            let mut inflight = r.fetches.inflight();
            // Bounded: a fetch ends in at most GET_TRIES retried calls.
            // Still waiting after that, this reader fetches the chunk
            // without a claim (and ends none).
            for _ in 0..10_000 {
                if r.chunks.contains(key) {
                    return Ok(None);
                }
                match inflight.join(key) {
                    Claim::Mine(mine) => {
                        claimed.push((i, mine));
                        break;
                    }
                    Claim::Theirs(theirs) => {
                        MutexGuard::unlocked(&mut inflight, || theirs.wait_for(Duration::from_millis(100)));
                    }
                }
            }
            // A reader that caught up with read-ahead takes the chunks
            // queued right after its own, for one larger GET. Nothing is
            // queued meanwhile: chunks are queued under `inflight`.
            while !claimed.is_empty() && claimed.len() < RUN_CHUNKS && i + claimed.len() < self.footer.crcs.len() {
                let next = (self.id, (i + claimed.len()) as u32);
                if !r.fetches.is_queued(next) || r.chunks.contains(next) {
                    break;
                }
                let Some(claim) = inflight.claim(next) else { break };
                r.fetches.unqueue(next);
                claimed.push((i + claimed.len(), claim));
            }
        }
        if claimed.len() > 1 {
            // Lands what passes its check; the caller reads it from the
            // cache (or comes back for a chunk that failed).
            self.fetch_claimed(&claimed);
            return Ok(None);
        }
        // A chunk another cache of this process gave is not copied into
        // this one: it is on this node already.
        let mut local = false;
        let res = (|| {
            if let Some((_, bytes)) = r.ask_peers(self.id, &self.footer, &[i]).pop() {
                local = r.peers.as_ref().is_some_and(|p| p.is_local());
                return Ok(bytes);
            }
            let (s, e) = self.footer.chunk_range(i);
            for attempt in 0..GET_TRIES {
                r.counts.gets.inc();
                let bytes = r.store.get_range(&self.key, s..e)?;
                if self.footer.verify(i, &bytes) {
                    r.counts.fetched_bytes.add(bytes.len() as u64);
                    return Ok(bytes);
                }
                r.counts.checksum_retries.inc();
                tracing::warn!(seg = %self.id, chunk = i, attempt, got = bytes.len(), "chunk from the bucket failed its checksum; fetching again");
            }
            Err(Error::corrupted("segment chunk from the bucket", format!("{}#{i}", self.id)))
        })();
        match &res {
            Ok(bytes) if !local => r.land(self, &[(key, bytes, self.footer.chunk_range(i).0)]),
            _ => {}
        }
        r.fetches.release(self.id, &claimed);
        res.map(Some)
    }

    /// Fetches the missing chunks of `chunks`, up to `parallel` at a time.
    fn fetch_all(&self, chunks: &[usize]) -> Result<HashMap<usize, Vec<u8>>> {
        let missing: Vec<usize> =
            chunks.iter().copied().filter(|&i| !self.remote.chunks.contains((self.id, i as u32))).collect();
        let mut got = HashMap::new();
        // Chunks already on their way (read-ahead) are waited for in turn:
        // threads only help where GETs are still to be sent.
        let unclaimed = {
            let inflight = self.remote.fetches.inflight();
            missing.iter().filter(|&&i| !inflight.contains(&(self.id, i as u32))).count()
        };
        if unclaimed <= 1 {
            for &i in &missing {
                if let Some(b) = self.fetch(i)? {
                    got.insert(i, b);
                }
            }
            return Ok(got);
        }
        let next = AtomicU64::new(0);
        let results = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..self.remote.fetches.parallel().min(missing.len()) {
                s.spawn(|| loop {
                    let k = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some(&i) = missing.get(k) else { break };
                    let r = self.fetch(i);
                    let failed = r.is_err();
                    results.lock().push((i, r));
                    if failed {
                        break;
                    }
                });
            }
        });
        for (i, r) in results.into_inner() {
            if let Some(b) = r? {
                got.insert(i, b);
            }
        }
        Ok(got)
    }

    /// A small read of a chunk this node does not have, by a reader that
    /// is not streaming, asks the chunk's cache server for just those
    /// bytes: a few KiB cross the wire instead of the whole chunk, and the
    /// caller checks them against its block crcs. True when `buf` was
    /// filled that way. Such a read is not cached here (a random reader
    /// would pull whole chunks for a few KiB of each); the server keeps
    /// the whole chunk, and a reader that goes on sequentially gets whole
    /// chunks and read-ahead.
    fn part_from_peers(&self, buf: &mut [u8], off: u64) -> bool {
        let r = &self.remote;
        let (Backing::Object { .. }, Some(peers)) = (&self.backing, &r.peers) else { return false };
        let end = off + buf.len() as u64;
        let cs = self.chunk_size();
        if buf.is_empty() || buf.len() as u64 > PART_MAX || end > self.footer.data_len || off / cs != (end - 1) / cs {
            return false;
        }
        let i = (off / cs) as usize;
        let key = (self.id, i as u32);
        // A read that goes on from about where the last one ended is the
        // rest of a small read (its next record, a header further on) while
        // the run of parts stays small, and a streaming reader after that:
        // whole chunks and read-ahead serve it better. (This is stricter
        // than `read_at`'s test, which takes a read up to a chunk further
        // on as streaming: for random readers of files that share a
        // segment, one read in 64 would start read-ahead.)
        let prev = self.stream.last_end();
        let run = self.part_run.load(Ordering::Relaxed);
        let run = if prev.is_some_and(|prev| off >= prev && off <= prev + PART_MAX) {
            if run == u64::MAX || end - run.min(off) > PART_MAX {
                self.part_run.store(u64::MAX, Ordering::Relaxed);
                return false;
            }
            run
        } else {
            off
        };
        if r.chunks.contains(key) || r.fetches.in_flight(key) || r.fetches.is_queued(key) {
            return false;
        }
        let cstart = self.footer.chunk_range(i).0;
        let within = off - cstart..end - cstart;
        let bytes = if self.footer.hashed() {
            // Whole leaves and the chunk's leaf hashes, checked here against
            // the digest from the bucket: a server cannot forge them.
            let leaves = self.footer.leaf_range(i, within.clone());
            let Some(payload) = peers.fetch_proved_part(self.id, i as u32, leaves.clone()) else { return false };
            let Some(data) = self.footer.check_proved_part(i, leaves.clone(), &payload) else {
                tracing::warn!(seg = %self.id, chunk = i, "a cache server sent a part of a chunk that fails its digest; reading the chunk");
                peers.rejected(self.id, i as u32);
                r.counts.part_rejected.inc();
                return false;
            };
            let from = (within.start - leaves.start) as usize;
            data[from..from + buf.len()].to_vec()
        } else {
            let Some(bytes) = peers.fetch_part(self.id, i as u32, within) else { return false };
            bytes
        };
        if bytes.len() != buf.len() {
            tracing::warn!(seg = %self.id, chunk = i, got = bytes.len(), want = buf.len(), "a cache server sent a part of a chunk of the wrong length; reading the chunk");
            peers.rejected(self.id, i as u32);
            return false;
        }
        buf.copy_from_slice(&bytes);
        self.part_run.store(run, Ordering::Relaxed);
        self.stream.restart(&self.window(), end);
        r.counts.peer_parts.inc();
        r.counts.peer_part_bytes.add(bytes.len() as u64);
        true
    }

    /// Fills `buf` from `off` through the chunk cache; a `streaming` read
    /// also feeds the detection of sequential readers and read-ahead.
    fn read(&self, buf: &mut [u8], off: u64, streaming: bool) -> Result<()> {
        let end = off + buf.len() as u64;
        if end > self.footer.data_len {
            if matches!(self.backing, Backing::Wal(_)) {
                // Read as its WAL pieces while its writer went on: the bytes
                // asked for came later. Look again, once.
                if let Some(fresh) = self.remote.reopen(self)? {
                    if end <= fresh.footer.data_len {
                        return fresh.read(buf, off, streaming);
                    }
                }
            }
            return Err(Error::corrupted("segment (short read)", off));
        }
        if buf.is_empty() {
            return Ok(());
        }
        let file = match &self.backing {
            Backing::Wal(data) => {
                buf.copy_from_slice(&data[off as usize..end as usize]);
                return Ok(());
            }
            Backing::Object { file } => file,
        };
        let cs = self.chunk_size();
        let chunks: Vec<usize> = ((off / cs) as usize..=((end - 1) / cs) as usize).collect();
        // Read-ahead no fetch worker could take, fetched after this read's chunks.
        let mut later = Vec::new();
        if streaming {
            self.part_run.store(u64::MAX, Ordering::Relaxed);
            // A reader that streamed to the end of the previous segment goes on
            // at the start of this one with the window it had there.
            let carried = || if off < cs { self.remote.fetches.take_stream(self.id) } else { None };
            match self.stream.read(&self.window(), off, end, carried) {
                Step::Carried(w) => later = self.read_ahead(end, w),
                Step::Sequential(w) => {
                    later = self.read_ahead(end, w);
                    if end + cs >= self.footer.data_len {
                        self.remote.fetches.stream_into(self.id.next(), w);
                    }
                }
                Step::Random => self.ahead.store(0, Ordering::Relaxed),
            }
        }
        let fetched = self.fetch_all(&chunks);
        // Run whether or not this read's fetches worked: their chunks are
        // queued, and read-ahead queues a chunk once.
        self.remote.fetches.run_here(later);
        let mut fetched = fetched?;
        for &i in &chunks {
            let (cstart, cend) = self.footer.chunk_range(i);
            let (from, to) = (off.max(cstart), end.min(cend));
            let dst = &mut buf[(from - off) as usize..(to - off) as usize];
            // Bounded: a chunk evicted between the fetch and the read is
            // fetched again, and kept in hand the second time.
            let mut filled = false;
            for _ in 0..GET_TRIES {
                if let Some(bytes) = fetched.get(&i) {
                    dst.copy_from_slice(&bytes[(from - cstart) as usize..(to - cstart) as usize]);
                    filled = true;
                    break;
                }
                {
                    let _x = self.remote.chunks.hold();
                    let key = (self.id, i as u32);
                    match self.remote.chunks.verified(key) {
                        Some(true) => {
                            file.read_exact_at(dst, from)?;
                            self.remote.chunks.touch(key);
                            self.remote.counts.hits.inc();
                            filled = true;
                            break;
                        }
                        Some(false) => {
                            // Cached by an earlier process: check it once.
                            let mut whole = vec![0u8; (cend - cstart) as usize];
                            file.read_exact_at(&mut whole, cstart)?;
                            if self.footer.verify(i, &whole) {
                                self.remote.chunks.mark_verified(key);
                                dst.copy_from_slice(&whole[(from - cstart) as usize..(to - cstart) as usize]);
                                self.remote.chunks.touch(key);
                                self.remote.counts.hits.inc();
                                filled = true;
                                break;
                            }
                            tracing::debug!(seg = %self.id, chunk = i, "a cached chunk failed its check; fetching it again");
                            self.remote.chunks.forget(key);
                        }
                        None => {}
                    }
                }
                if let Some(b) = self.fetch(i)? {
                    fetched.insert(i, b);
                }
            }
            if !filled {
                return Err(Error::Io(std::io::Error::other(format!(
                    "chunk {i} of segment {} kept leaving the cache before it could be read; the cache is too small",
                    self.id
                ))));
            }
        }
        Ok(())
    }
}

impl SegmentFile for RemoteSeg {
    fn write_at(&self, _buf: &[u8], _off: u64) -> Result<()> {
        Err(Error::ReadOnly)
    }

    fn read_for_check(&self, buf: &mut [u8], off: u64) -> Result<Checked> {
        if self.part_from_peers(buf, off) {
            return Ok(Checked::Unchecked);
        }
        self.read_at(buf, off).map(|()| Checked::Here)
    }

    fn unchecked_failed(&self, off: u64) {
        let i = off / self.chunk_size();
        tracing::warn!(seg = %self.id, chunk = i, off, "a part of a chunk from a cache server failed its checksum; reading the chunk");
        self.remote.counts.part_rejected.inc();
        if let Some(peers) = &self.remote.peers {
            peers.rejected(self.id, i as u32);
        }
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()> {
        self.read(buf, off, true)
    }

    fn read_unstreamed(&self, buf: &mut [u8], off: u64) -> Result<()> {
        self.read(buf, off, false)
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn size(&self) -> Result<u64> {
        Ok(self.footer.data_len)
    }

    /// The bucket's copy is immutable; a torn tail is cut by every reader
    /// the same way, so there is nothing to truncate.
    fn truncate(&self, _len: u64) -> Result<()> {
        Ok(())
    }
}
