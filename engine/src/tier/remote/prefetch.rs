//! Read-ahead of segments: a sequential reader's window (the shared
//! `chunks::ahead::Window`, here fourfold per read up to
//! `MAX_READ_AHEAD`) covers chunks that are queued as runs of up to
//! [`RUN_CHUNKS`] neighbours, each one job and one GET for the remote's
//! pool of fetch workers (`chunks::ahead::Workers`), and the window runs
//! on into the writer's next segments.

use super::segment::{Backing, RemoteSeg};
use super::{ChunkKey, Remote, RUN_CHUNKS, SPILL_SEGMENTS};
use crate::chunks::ahead::{Job, Window, Workers};
use crate::chunks::fetch::{self, Fetch, InFlight};
use crate::format::SegId;
use parking_lot::{Mutex, MutexGuard};
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A chunk (by number in its segment) this thread claimed, and the claim:
/// what ends it, and only it.
pub(super) type Claimed = (usize, Arc<Fetch<()>>);

/// What a [`Remote`] is fetching and means to: chunk fetches in flight
/// (on demand or ahead), the chunks queued for the fetch workers, the
/// workers, and what streaming readers carry from segment to segment.
/// Lock order: `inflight` → `queued`; the others alone.
pub(super) struct Fetches {
    /// Chunk fetches in flight (`chunks::fetch`): a reader that finds its
    /// chunk on its way waits for it, then reads it from the cache.
    inflight: Mutex<InFlight<ChunkKey, ()>>,
    /// Chunks queued for read-ahead and not yet taken by a worker.
    queued: Mutex<HashSet<ChunkKey>>,
    /// The fetch workers read-ahead's runs go to, started on first use.
    workers: Workers,
    /// Segments read-ahead looked for and did not find (it looks once).
    absent: Mutex<HashSet<SegId>>,
    /// The segment a streaming reader is about to enter, and its window.
    stream: Mutex<Option<(SegId, u64)>>,
    /// The read-ahead window after a random read.
    base_window: u64,
    /// Fetch workers, and GETs one read sends at once.
    parallel: usize,
}

impl Fetches {
    pub(super) fn new(base_window: u64, parallel: usize) -> Fetches {
        Fetches {
            inflight: Mutex::new(InFlight::new()),
            queued: Mutex::new(HashSet::new()),
            workers: Workers::new("arbor-fetch", parallel.max(1)),
            absent: Mutex::new(HashSet::new()),
            stream: Mutex::new(None),
            base_window,
            parallel: parallel.max(1),
        }
    }

    /// The table of fetches in flight, locked (before `queued`).
    pub(super) fn inflight(&self) -> MutexGuard<'_, InFlight<ChunkKey, ()>> {
        self.inflight.lock()
    }

    /// Whether chunk `key` is being fetched.
    pub(super) fn in_flight(&self, key: ChunkKey) -> bool {
        self.inflight.lock().contains(&key)
    }

    /// Ends `claims` (their chunks landed or not) and wakes their
    /// waiters, who look in the cache again (and fetch a chunk that did
    /// not land). A claim ended already is left alone, and so is a later
    /// claim of its chunk by another reader.
    pub(super) fn release<'a>(&self, seg: SegId, claims: impl IntoIterator<Item = &'a Claimed>) {
        let done: Vec<_> = {
            let mut inflight = self.inflight.lock();
            claims.into_iter().filter(|(i, f)| inflight.finish_fetch(&(seg, *i as u32), f)).collect()
        };
        for (_, fetch) in done {
            fetch.done(());
        }
    }

    /// Whether chunk `key` waits in read-ahead's queue.
    pub(super) fn is_queued(&self, key: ChunkKey) -> bool {
        self.queued.lock().contains(&key)
    }

    /// Takes chunk `key` out of read-ahead's queue (a reader fetches it).
    pub(super) fn unqueue(&self, key: ChunkKey) {
        self.queued.lock().remove(&key);
    }

    pub(super) fn base_window(&self) -> u64 {
        self.base_window
    }

    /// How a reader of a segment with chunks of `chunk_size` sizes its
    /// window: from the configured one, fourfold per read up to `max`; a
    /// read up to a chunk past the last one's end goes on from it.
    pub(super) fn window(&self, max: u64, chunk_size: u64) -> Window {
        Window::growing(self.base_window, max, chunk_size)
    }

    pub(super) fn parallel(&self) -> usize {
        self.parallel
    }

    /// The window a streaming reader brought from the segment before
    /// `id`, if it is entering `id` (taken: it is carried once).
    pub(super) fn take_stream(&self, id: SegId) -> Option<u64> {
        let mut stream = self.stream.lock();
        match *stream {
            Some((next, w)) if next == id => {
                *stream = None;
                Some(w)
            }
            _ => None,
        }
    }

    /// A streaming reader is about to enter segment `id` with `window`.
    pub(super) fn stream_into(&self, id: SegId, window: u64) {
        *self.stream.lock() = Some((id, window));
    }

    /// Runs `jobs`, read-ahead no fetch worker could take, on the
    /// caller's thread: after the read they are ahead of.
    pub(super) fn run_here(&self, jobs: Vec<Job>) {
        for job in jobs {
            self.workers.run_here(job);
        }
    }

    /// Lets the fetch workers end once their queue is empty.
    pub(super) fn stop_workers(&self) {
        self.workers.stop();
    }
}

impl RemoteSeg {
    /// Read-ahead: fetches chunks `first..first + count` (those no other
    /// thread has or brings) with one ranged GET, checking each chunk on
    /// its own. A chunk that fails its check is left for an on-demand
    /// fetch; so is every chunk of a fetch that panicked (its claims are
    /// released, and the waiters look again).
    fn fetch_run(&self, first: usize, count: usize) {
        let r = &self.remote;
        // Claim the chunks nobody else has or is fetching.
        let mut claimed: Vec<Claimed> = Vec::new();
        {
            let mut inflight = r.fetches.inflight();
            for i in first..first + count {
                let key = (self.id, i as u32);
                if r.chunks.contains(key) {
                    continue;
                }
                if let Some(claim) = inflight.claim(key) {
                    claimed.push((i, claim));
                }
            }
        }
        let fetch = std::panic::AssertUnwindSafe(|| self.fetch_claimed(&claimed));
        if std::panic::catch_unwind(fetch).is_err() {
            tracing::error!(seg = %self.id, first, count, "a read-ahead fetch panicked");
            r.fetches.release(self.id, &claimed);
        }
    }

    /// Fetches `claimed` (ascending chunk numbers the caller claimed in
    /// `inflight`): from the cache servers, and the rest with one GET from
    /// the first to the last of them; lands those that pass their check
    /// and releases the claims.
    pub(super) fn fetch_claimed(&self, claimed: &[Claimed]) {
        let r = &self.remote;
        if claimed.is_empty() {
            return;
        }
        if matches!(self.backing, Backing::Object { .. }) {
            // Cache servers first, all of the run asked at once, each chunk
            // landed (and the readers waiting for it woken) as it comes: a
            // reader right behind read-ahead waits for its chunk, not for
            // the run. What they did not give comes from the bucket in one
            // GET spanning it.
            let wanted: Vec<usize> = claimed.iter().map(|(i, _)| *i).collect();
            let mut given = Vec::new();
            r.ask_peers_each(self.id, &self.footer, &wanted, &mut |i, bytes| {
                let key = (self.id, i as u32);
                r.land(self, &[(key, bytes.as_slice(), self.footer.chunk_range(i).0)]);
                r.fetches.release(self.id, claimed.iter().filter(|(c, _)| *c == i));
                given.push(i);
            });
            // A chunk a server gave was released as it landed: by the time
            // the run ends another reader may have claimed it again.
            let rest: Vec<&Claimed> = claimed.iter().filter(|(i, _)| !given.contains(i)).collect();
            let mut good: Vec<(ChunkKey, &[u8], u64)> = Vec::new();
            let fetched = match (rest.first(), rest.last()) {
                (Some(&&(lo, _)), Some(&&(hi, _))) => {
                    let (start, _) = self.footer.chunk_range(lo);
                    let (_, end) = self.footer.chunk_range(hi);
                    r.counts.gets.inc();
                    match r.store.get_range(&self.key, start..end) {
                        Ok(bytes) => Some((start, bytes)),
                        Err(e) => {
                            tracing::debug!(error = %e, "read-ahead GET failed; the reader fetches on demand");
                            None
                        }
                    }
                }
                _ => None,
            };
            if let Some((start, bytes)) = &fetched {
                for &&(i, _) in &rest {
                    let (s, e) = self.footer.chunk_range(i);
                    match bytes.get((s - start) as usize..(e - start) as usize) {
                        Some(part) if self.footer.verify(i, part) => {
                            r.counts.fetched_bytes.add(part.len() as u64);
                            good.push(((self.id, i as u32), part, s));
                        }
                        _ => {
                            r.counts.checksum_retries.inc();
                        }
                    }
                }
            }
            // One large write per run: the page cache keeps it in large
            // pages (a write per network piece would leave small ones, and
            // re-reads from the cache run slower).
            good.sort_by_key(|g| g.2);
            r.land(self, &good);
            r.fetches.release(self.id, rest);
            return;
        }
        r.fetches.release(self.id, claimed);
    }

    /// Keeps the `read_ahead` bytes after `end` coming: every chunk there
    /// that is neither present nor on its way is queued for the fetch
    /// workers, so a sequential reader finds a full pipeline of GETs ahead
    /// of it. Past the segment's end the window continues into the next
    /// segment of the same writer, where a file written in one go goes on.
    /// Returns the runs no fetch worker could take, for the caller to
    /// fetch after its own chunks ([`Fetches::run_here`]).
    #[must_use]
    pub(super) fn read_ahead(&self, end: u64, window: u64) -> Vec<Job> {
        let r = &self.remote;
        let mut later = Vec::new();
        if window == 0 {
            return later;
        }
        let Some(me) = self.me.upgrade() else { return later };
        let window_end = end + window;
        if end < self.footer.data_len {
            let first = (end / self.chunk_size()) as usize;
            later = r.enqueue_chunks(&me, first, self.run_end(window_end));
        }
        if !matches!(self.backing, Backing::Object { .. }) {
            return later;
        }
        // Past this segment's end the window goes on through the writer's
        // next segments. The next one is opened as soon as a reader streams
        // through this one, so its footer is at hand before the reader is.
        let mut spill = window_end.saturating_sub(self.footer.data_len.max(end));
        let mut id = self.id;
        for _ in 0..SPILL_SEGMENTS {
            id = id.next();
            let known = r.seg(id);
            match known {
                Some(seg) if matches!(seg.backing, Backing::Object { .. }) => {
                    later.extend(r.enqueue_first(&seg, spill));
                    spill = spill.saturating_sub(seg.footer.data_len);
                    if spill == 0 {
                        break;
                    }
                }
                Some(_) => break,
                None => {
                    r.open_ahead(id, spill);
                    break;
                }
            }
        }
        later
    }
}

impl Remote {
    /// Opens segment `id` (once) on a thread of its own, not behind the
    /// queued chunk fetches, then queues its first `spill` bytes. Only a
    /// sealed segment's object: a segment its writer has not sealed yet is
    /// read by whoever reads it (the writer from its own file, a client of
    /// a shared branch through the owner), and fetching its WAL pieces
    /// ahead of them would pull bytes from the bucket nobody reads.
    fn open_ahead(self: &Arc<Self>, id: SegId, spill: u64) {
        if !self.fetches.absent.lock().insert(id) {
            return;
        }
        let remote = self.clone();
        let spawned = std::thread::Builder::new().name("arbor-open".into()).spawn(move || {
            if let Ok(Some(seg)) = remote.open_object(id) {
                remote.fetches.absent.lock().remove(&id);
                let later = remote.enqueue_first(&seg, spill);
                remote.fetches.run_here(later);
            }
        });
        if let Err(e) = spawned {
            // Read-ahead stops at this segment's end; the reader opens the next itself.
            tracing::warn!(error = %e, "cannot start a thread to open the next segment");
            self.fetches.absent.lock().remove(&id);
        }
    }

    /// Queues the chunks holding the first `bytes` of `seg`, in whole
    /// runs; the runs no worker could take.
    #[must_use]
    fn enqueue_first(self: &Arc<Self>, seg: &Arc<RemoteSeg>, bytes: u64) -> Vec<Job> {
        self.enqueue_chunks(seg, 0, seg.run_end(bytes))
    }

    /// Queues chunks `first..last` of `seg` that are neither present, on
    /// their way nor queued, as jobs of up to [`RUN_CHUNKS`] neighbours
    /// (split at multiples of it), each fetched with one GET; the runs no
    /// worker could take.
    #[must_use]
    fn enqueue_chunks(self: &Arc<Self>, seg: &Arc<RemoteSeg>, first: usize, last: usize) -> Vec<Job> {
        // Chunks before `ahead` were looked at by an earlier read's window.
        let first = first.max(seg.ahead.fetch_max(last as u64, Ordering::Relaxed) as usize);
        if first >= last {
            return Vec::new();
        }
        let mut wanted: Vec<(u64, ())> = Vec::new();
        {
            let inflight = self.fetches.inflight.lock();
            let mut queued = self.fetches.queued.lock();
            for i in first..last {
                let key = (seg.id, i as u32);
                if self.chunks.contains(key) || inflight.contains(&key) || !queued.insert(key) {
                    continue;
                }
                wanted.push((i as u64, ()));
            }
        }
        let runs = fetch::runs(wanted, RUN_CHUNKS, true).into_iter().filter_map(|run| {
            let (seg, first, count) = (seg.clone(), run[0].0 as usize, run.len());
            self.fetches.workers.offer(Box::new(move || seg.fetch_queued(first, count)))
        });
        runs.collect()
    }
}

impl RemoteSeg {
    /// A fetch worker's job: the run of `count` chunks from `first`
    /// queued for read-ahead.
    fn fetch_queued(&self, first: usize, count: usize) {
        let r = &self.remote;
        // Chunks a reader took for itself meanwhile are no longer queued;
        // fetch_run skips them.
        {
            let mut queued = r.fetches.queued.lock();
            for i in first..first + count {
                queued.remove(&(self.id, i as u32));
            }
        }
        self.fetch_run(first, count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{MemObjectStore, ObjectStore};
    use crate::chunks::{ChunkRequest, ChunkSource, ChunkStore};
    use crate::tier::object::{segment_key, with_footer};

    const CHUNK: u32 = 4096;

    /// A cache server that gives every chunk asked for, and after the
    /// first one runs `between` (what other readers do while the rest of
    /// a run is on its way).
    struct Server {
        data: Vec<u8>,
        between: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    }

    impl ChunkSource for Server {
        fn fetch(&self, _seg: SegId, wanted: &[ChunkRequest]) -> Vec<Option<Vec<u8>>> {
            wanted.iter().map(|w| Some(self.data[w.range.start as usize..w.range.end as usize].to_vec())).collect()
        }
        fn fetch_each(&self, seg: SegId, wanted: &[ChunkRequest], got: &mut dyn FnMut(usize, Option<Vec<u8>>)) {
            for (k, bytes) in self.fetch(seg, wanted).into_iter().enumerate() {
                got(k, bytes);
                let between = self.between.lock().take();
                if let Some(between) = between {
                    between();
                }
            }
        }
        fn rejected(&self, _seg: SegId, _index: u32) {}
    }

    /// A memory-only remote whose bucket holds one segment of `chunks`
    /// chunks, given by `server` too; that segment, open.
    fn one_segment(chunks: usize, server: &Arc<Server>) -> (Arc<Remote>, Arc<RemoteSeg>) {
        let id = SegId { writer: 1, seq: 1 };
        let store = Arc::new(MemObjectStore::new());
        let (object, _) = with_footer(server.data[..chunks * CHUNK as usize].to_vec(), CHUNK);
        store.put(&segment_key(id), &object).expect("put");
        let peers: Arc<dyn ChunkSource> = server.clone();
        let dir = std::env::temp_dir().join("arbor-unused");
        let remote = Remote::new(store, dir, ChunkStore::new(1 << 20), 0, 2, true, Some(peers)).expect("remote");
        let seg = remote.open(id).expect("open").expect("there");
        (remote, seg)
    }

    /// Where each ranged GET of a bucket starts, in chunks.
    #[derive(Default)]
    struct Starts {
        starts: Mutex<Vec<u64>>,
    }

    impl crate::bucket::BeforeGet for Starts {
        fn before_get(&self, _key: &str, range: &std::ops::Range<u64>, conditional: bool) {
            if !conditional {
                self.starts.lock().push(range.start / CHUNK as u64);
            }
        }
    }

    /// A bucket that records where each ranged GET starts.
    type Recorded = crate::bucket::Watched<Starts>;

    #[test]
    fn without_fetch_workers_a_read_fetches_its_own_chunk_before_the_runs_it_queued() {
        let id = SegId { writer: 1, seq: 1 };
        let store = Arc::new(Recorded::default());
        let data: Vec<u8> = (0..32 * CHUNK).map(|i| (i * 11 % 253) as u8).collect();
        store.put(&segment_key(id), &with_footer(data.clone(), CHUNK).0).expect("put");
        // A remote whose fetch workers cannot start, as where the system
        // refuses threads.
        let remote = Arc::new(Remote {
            store: store.clone(),
            dir: std::env::temp_dir().join("arbor-unused"),
            memory: true,
            chunks: ChunkStore::new(1 << 20),
            segs: Default::default(),
            let_go: Mutex::default(),
            adopted: Mutex::default(),
            opening: Mutex::new(()),
            peers: None,
            fetches: Fetches { workers: Workers::threadless("test-fetch"), ..Fetches::new(8 * CHUNK as u64, 2) },
            counts: Default::default(),
        });
        let punches: Arc<dyn crate::chunks::SegmentFiles> = remote.clone();
        remote.chunks.register_segments(Arc::downgrade(&punches));
        let seg = remote.open(id).expect("open").expect("there");
        let mut buf = vec![0u8; CHUNK as usize];
        crate::device::SegmentFile::read_at(&*seg, &mut buf, 0).expect("first read");
        store.starts.lock().clear();
        // Sequential: chunks 2-31 are queued ahead, in runs 2-7, 8-15,
        // 16-23 and 24-31; the reader's own GET (chunk 1, with the seven
        // queued chunks after it) goes first.
        crate::device::SegmentFile::read_at(&*seg, &mut buf, CHUNK as u64).expect("sequential read");
        assert!(buf == data[CHUNK as usize..2 * CHUNK as usize]);
        assert_eq!(*store.starts.lock(), [1, 9, 16, 24]);
        remote.shutdown();
    }

    #[test]
    fn a_runs_release_leaves_a_later_claim_of_a_chunk_it_finished_alone() {
        let data: Vec<u8> = (0..4 * CHUNK).map(|i| (i * 7 % 251) as u8).collect();
        let server = Arc::new(Server { data, between: Mutex::new(None) });
        let (remote, seg) = one_segment(2, &server);
        let key = (seg.id, 0);
        // Chunk 0 comes from the server and lands; then, while chunk 1 is
        // on its way, it is evicted and another reader claims it again.
        let later = Arc::new(Mutex::new(None));
        let (r, l) = (remote.clone(), later.clone());
        *server.between.lock() = Some(Box::new(move || {
            assert!(r.chunks.contains(key), "chunk 0 landed");
            r.chunks.forget(key);
            *l.lock() = Some(r.fetches.inflight().claim(key).expect("chunk 0 free to claim"));
        }));
        seg.fetch_run(0, 2);
        let later = later.lock().take().expect("claimed meanwhile");
        assert!(remote.fetches.in_flight(key), "the run's release ended another reader's claim");
        assert!(later.wait_for(std::time::Duration::ZERO).is_none(), "its waiters were woken");
        assert!(remote.chunks.contains((seg.id, 1)) && !remote.fetches.in_flight((seg.id, 1)));
        remote.shutdown();
    }
}
