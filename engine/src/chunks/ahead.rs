//! Read-ahead, the part both readers of immutable chunks share: how far
//! ahead of a stream of reads to fetch ([`Window`], [`Stream`]), and the
//! pool of fetch workers the runs fetched ahead go to ([`Workers`]).
//!
//! What a fetch is, which chunks a window covers, and which runs a reader
//! fetches itself stay with the reader (`tier/remote`, `source`). A
//! reader's own misses never wait for this pool: each reader fetches them
//! itself, on the caller's thread (or threads of the read's own), so a
//! full read-ahead queue delays nobody; and where no worker can be
//! started, a run fetched ahead is given back to the reader, who fetches
//! it after its own ([`Workers::offer`]).

use crossbeam::channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicIsize, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Work for a fetch worker: one run of chunks (one GET), not one chunk.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// A lazily started pool of at most `max` named fetch worker threads, fed
/// by a channel of [`Job`]s, each numbered as it is submitted. A job that
/// panics is caught there: the worker goes on, and the job itself must
/// have finished its chunks' waiters (each reader's job does). Its locks,
/// `crew` and `state.jobs`, are each taken alone.
pub(crate) struct Workers {
    name: &'static str,
    max: usize,
    /// The channel and its workers while the pool runs; `None` before the
    /// first job and after [`Workers::stop`].
    crew: Mutex<Option<Crew>>,
    /// What every worker shares with the pool.
    state: Arc<State>,
}

/// One channel and the workers that take from it.
struct Crew {
    send: Sender<(u64, Job)>,
    recv: Receiver<(u64, Job)>,
    counts: Arc<CrewCounts>,
}

/// A crew's workers running, and its spare ones: workers that came for a
/// job less jobs queued (below 0, jobs wait for a worker).
#[derive(Default)]
struct CrewCounts {
    live: AtomicUsize,
    spare: AtomicIsize,
}

/// Jobs submitted and not yet finished (and its change), and worker
/// threads running, of any crew.
struct State {
    jobs: Mutex<Jobs>,
    idle_cv: Condvar,
    live: AtomicUsize,
}

/// The number the next job submitted gets, and those of the jobs not yet
/// finished: a drain waits for the ones below the number it began at,
/// not for jobs readers go on submitting meanwhile.
#[derive(Default)]
struct Jobs {
    next: u64,
    open: BTreeSet<u64>,
}

impl Workers {
    /// A pool of at most `max` (at least one) threads named `name-<n>`,
    /// none started yet.
    pub(crate) fn new(name: &'static str, max: usize) -> Workers {
        let state = State { jobs: Mutex::default(), idle_cv: Condvar::new(), live: AtomicUsize::new(0) };
        Workers { name, max: max.max(1), crew: Mutex::new(None), state: Arc::new(state) }
    }

    /// Queues `job`. A worker is started when none is spare for it and
    /// fewer than `max` run; a job no worker can take (none could be
    /// started) runs on the caller's thread, so every job runs.
    pub(crate) fn submit(&self, job: Job) {
        if let Some(job) = self.offer(job) {
            self.run_here(job);
        }
    }

    /// As [`Workers::submit`], but a job no worker can take is given
    /// back, for the caller to run ([`Workers::run_here`]) once its own
    /// work is done: read-ahead after the read it is ahead of.
    pub(crate) fn offer(&self, job: Job) -> Option<Job> {
        let ticket = self.state.opened();
        let rejected = {
            let mut crew = self.crew.lock();
            let crew = crew.get_or_insert_with(|| {
                let (send, recv) = crossbeam::channel::unbounded();
                Crew { send, recv, counts: Arc::default() }
            });
            if crew.counts.spare.fetch_sub(1, Ordering::AcqRel) <= 0 {
                self.start_worker(crew);
            }
            if crew.counts.live.load(Ordering::Acquire) == 0 {
                crew.counts.spare.fetch_add(1, Ordering::AcqRel);
                Err(job)
            } else {
                crew.send.send((ticket, job)).map_err(|e| e.into_inner().1)
            }
        };
        match rejected {
            Ok(()) => None,
            Err(job) => {
                // Still this pool's job until it has run (or is dropped):
                // a drain begun before the caller runs it waits for it.
                let open = Open { state: self.state.clone(), ticket };
                Some(Box::new(move || {
                    let _open = open;
                    job()
                }))
            }
        }
    }

    /// Runs `job` on the caller's thread, as a job of this pool (a drain
    /// begun meanwhile waits for it).
    pub(crate) fn run_here(&self, job: Job) {
        let ticket = self.state.opened();
        run(job);
        self.state.finished(ticket);
    }

    #[cfg(test)]
    /// A pool that can start no thread, as where the system refuses one.
    pub(crate) fn threadless(name: &'static str) -> Workers {
        Workers { max: 0, ..Workers::new(name, 1) }
    }

    /// Starts one more worker in `crew`, if fewer than `max` run there.
    fn start_worker(&self, crew: &Crew) {
        let n = crew.counts.live.fetch_add(1, Ordering::AcqRel);
        if n >= self.max {
            crew.counts.live.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        self.state.live.fetch_add(1, Ordering::AcqRel);
        let (recv, counts, state) = (crew.recv.clone(), crew.counts.clone(), self.state.clone());
        let spawned =
            std::thread::Builder::new().name(format!("{}-{n}", self.name)).spawn(move || state.work(&recv, &counts));
        if let Err(e) = spawned {
            crew.counts.live.fetch_sub(1, Ordering::AcqRel);
            self.state.live.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(error = %e, "cannot start a fetch worker");
        }
    }

    /// Waits until every job submitted so far has finished (not those
    /// submitted meanwhile: readers going on cannot hold a drain up).
    /// A job [`Workers::offer`] gave back counts until it has run or is
    /// dropped, so a thread holding one must not wait for a drain.
    pub(crate) fn drain(&self) {
        self.drain_to(self.submitted(), None);
    }

    /// The jobs submitted so far, counted: what a drain begun now waits for.
    fn submitted(&self) -> u64 {
        self.state.jobs.lock().next
    }

    /// Waits until the first `submitted` jobs have finished, until
    /// `deadline` at most: whether they have.
    fn drain_to(&self, submitted: u64, deadline: Option<std::time::Instant>) -> bool {
        let done = |jobs: &Jobs| jobs.open.first().is_none_or(|&t| t >= submitted);
        let mut jobs = self.state.jobs.lock();
        while !done(&jobs) {
            match deadline {
                Some(d) => {
                    if self.state.idle_cv.wait_until(&mut jobs, d).timed_out() {
                        return done(&jobs);
                    }
                }
                None => self.state.idle_cv.wait(&mut jobs),
            }
        }
        true
    }

    #[cfg(test)]
    /// As [`Workers::drain`], for at most `timeout`: whether the jobs
    /// submitted so far have finished.
    pub(crate) fn drain_within(&self, timeout: std::time::Duration) -> bool {
        self.drain_to(self.submitted(), Some(std::time::Instant::now() + timeout))
    }

    /// Lets the workers end once the jobs queued are done. A later
    /// [`Workers::submit`] starts a new crew.
    pub(crate) fn stop(&self) {
        self.crew.lock().take();
    }

    #[cfg(test)]
    /// Worker threads running.
    pub(crate) fn live(&self) -> usize {
        self.state.live.load(Ordering::Acquire)
    }
}

impl State {
    /// A worker's life: jobs until its crew's channel closes.
    fn work(&self, recv: &Receiver<(u64, Job)>, crew: &CrewCounts) {
        // Spare until a job submitted counts it taken; spare again before
        // its job counts as finished, so the next job after a drain finds it.
        crew.spare.fetch_add(1, Ordering::AcqRel);
        while let Ok((ticket, job)) = recv.recv() {
            run(job);
            crew.spare.fetch_add(1, Ordering::AcqRel);
            self.finished(ticket);
        }
        crew.live.fetch_sub(1, Ordering::AcqRel);
        self.live.fetch_sub(1, Ordering::AcqRel);
    }

    /// Numbers a job submitted, not yet finished.
    fn opened(&self) -> u64 {
        let mut jobs = self.jobs.lock();
        let ticket = jobs.next;
        jobs.next += 1;
        jobs.open.insert(ticket);
        ticket
    }

    /// Job `ticket` has finished: a drain waiting for it may end.
    fn finished(&self, ticket: u64) {
        let mut jobs = self.jobs.lock();
        let oldest = jobs.open.first() == Some(&ticket);
        jobs.open.remove(&ticket);
        if oldest {
            self.idle_cv.notify_all();
        }
    }
}

/// A job's number, finished when this goes (after the job ran, or with
/// the job if it is dropped unrun).
struct Open {
    state: Arc<State>,
    ticket: u64,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.state.finished(self.ticket);
    }
}

/// Runs `job`, catching a panic (its worker goes on; the job has finished
/// its waiters itself).
fn run(job: Job) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
        tracing::error!("a fetch job panicked; its worker goes on");
    }
}

/// How a reader sizes its read-ahead window, in bytes: `base` after a
/// read that does not go on from the last one (and nothing fetched
/// ahead), times `growth` with each read that does, up to `max`. A read
/// goes on from the last one if it ends past where that one ended and
/// starts at most `slack` bytes after it, or anywhere before it where
/// `rereads`. `base` 0 is no read-ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    pub(crate) base: u64,
    pub(crate) max: u64,
    pub(crate) growth: u64,
    pub(crate) slack: u64,
    pub(crate) rereads: bool,
}

impl Window {
    /// The same `size` after every sequential read: a read must start
    /// where the last one ended.
    pub(crate) const fn fixed(size: u64) -> Window {
        Window { base: size, max: size, growth: 1, slack: 0, rereads: false }
    }

    /// Fourfold per sequential read from `base` up to `max`; a read may
    /// start `slack` bytes after the last one's end, or before it.
    pub(crate) const fn growing(base: u64, max: u64, slack: u64) -> Window {
        Window { base, max, growth: 4, slack, rereads: true }
    }

    /// Whether a read of `off..end` goes on from one that ended at `last`.
    pub(crate) fn follows(&self, last: Option<u64>, off: u64, end: u64) -> bool {
        last.is_some_and(|last| off <= last.saturating_add(self.slack) && end > last && (self.rereads || off >= last))
    }

    /// The window after a sequential read, the last one's being `w`.
    pub(crate) fn grown(&self, w: u64) -> u64 {
        if self.base == 0 {
            return 0;
        }
        w.saturating_mul(self.growth).clamp(self.base, self.max.max(self.base))
    }
}

/// One stream of reads (a file, a segment): where its last read ended
/// and its window. Reads of one stream may race; the last one's end
/// and window win, as a stream's reads come in order anyway.
pub(crate) struct Stream {
    end: AtomicU64,
    window: AtomicU64,
}

/// What a read did to its [`Stream`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// The stream's first read, going on with a window carried in from
    /// elsewhere (the previous segment a reader streamed through).
    Carried(u64),
    /// A read that goes on from the last one: fetch this far ahead.
    Sequential(u64),
    /// Any other read: nothing is fetched ahead, the window starts over.
    Random,
}

impl Step {
    /// How far ahead of the read's end to fetch.
    pub(crate) fn ahead(self) -> u64 {
        match self {
            Step::Carried(w) | Step::Sequential(w) => w,
            Step::Random => 0,
        }
    }
}

impl Stream {
    /// A stream not read yet, its window `base`.
    pub(crate) fn new(base: u64) -> Stream {
        Stream { end: AtomicU64::new(u64::MAX), window: AtomicU64::new(base) }
    }

    /// Where the last read ended.
    pub(crate) fn last_end(&self) -> Option<u64> {
        Some(self.end.load(Ordering::Relaxed)).filter(|&e| e != u64::MAX)
    }

    /// Records a read of `off..end` shaped by `shape`; `carried` is asked,
    /// on the stream's first read only, for a window brought from elsewhere.
    pub(crate) fn read(&self, shape: &Window, off: u64, end: u64, carried: impl FnOnce() -> Option<u64>) -> Step {
        let last = Some(self.end.swap(end, Ordering::Relaxed)).filter(|&e| e != u64::MAX);
        if last.is_none() {
            if let Some(w) = carried() {
                self.window.store(w, Ordering::Relaxed);
                return Step::Carried(w);
            }
        }
        if shape.follows(last, off, end) {
            let w = shape.grown(self.window.load(Ordering::Relaxed));
            self.window.store(w, Ordering::Relaxed);
            return Step::Sequential(w);
        }
        self.window.store(shape.base, Ordering::Relaxed);
        Step::Random
    }

    /// A read of the stream ending at `end` that fetched nothing ahead
    /// and starts the window over (a part of a chunk from a cache server).
    pub(crate) fn restart(&self, shape: &Window, end: u64) {
        self.end.store(end, Ordering::Relaxed);
        self.window.store(shape.base, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    const LONG: Duration = Duration::from_secs(10);

    #[test]
    fn every_job_runs_and_drain_waits_for_all() {
        let pool = Workers::new("test-fetch", 3);
        let done = Arc::new(AtomicUsize::new(0));
        // One job at a time needs one worker.
        for _ in 0..5 {
            let done = done.clone();
            pool.submit(Box::new(move || {
                done.fetch_add(1, Ordering::SeqCst);
            }));
            pool.drain();
        }
        assert_eq!((done.swap(0, Ordering::SeqCst), pool.live()), (5, 1), "jobs done, workers started");
        for _ in 0..20 {
            let done = done.clone();
            pool.submit(Box::new(move || {
                std::thread::sleep(Duration::from_millis(5));
                done.fetch_add(1, Ordering::SeqCst);
            }));
        }
        pool.drain();
        assert_eq!(done.load(Ordering::SeqCst), 20, "drain returned before every job finished");
        assert!(pool.live() <= 3, "at most max workers: {}", pool.live());
    }

    #[test]
    fn drain_waits_for_a_job_still_running() {
        let pool = Workers::new("test-fetch", 2);
        let gate = Arc::new(AtomicBool::new(false));
        let g = gate.clone();
        pool.submit(Box::new(move || {
            while !g.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }));
        assert!(!pool.drain_within(Duration::from_millis(50)), "idle while a job runs");
        gate.store(true, Ordering::SeqCst);
        assert!(pool.drain_within(LONG));
    }

    #[test]
    fn a_drain_waits_for_the_jobs_submitted_before_it_only() {
        let pool = Workers::new("test-fetch", 2);
        let gates = [Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false))];
        let gated = |gate: &Arc<AtomicBool>| -> Job {
            let gate = gate.clone();
            Box::new(move || {
                while !gate.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        pool.submit(gated(&gates[0]));
        let before = pool.submitted();
        // Submitted once the drain began, and still running when it ends.
        pool.submit(gated(&gates[1]));
        gates[0].store(true, Ordering::SeqCst);
        assert!(
            pool.drain_to(before, Some(Instant::now() + LONG)),
            "a drain waited for a job submitted after it began"
        );
        assert!(!pool.drain_within(Duration::from_millis(20)), "idle while the later job runs");
        gates[1].store(true, Ordering::SeqCst);
        assert!(pool.drain_within(LONG));
    }

    #[test]
    fn a_job_given_back_is_waited_for_until_it_has_run_or_is_dropped() {
        let pool = Workers::threadless("test-fetch");
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        let job = pool.offer(Box::new(move || r.store(true, Ordering::SeqCst))).expect("no worker: given back");
        assert!(!pool.drain_within(Duration::from_millis(20)), "a drain ended before the job given back ran");
        pool.run_here(job);
        assert!(ran.load(Ordering::SeqCst));
        assert!(pool.drain_within(LONG));
        let dropped = pool.offer(Box::new(|| {})).expect("given back");
        drop(dropped);
        assert!(pool.drain_within(LONG), "a job dropped unrun kept the drain waiting");
    }

    #[test]
    fn a_panicking_job_keeps_its_worker_and_the_drain() {
        let pool = Workers::new("test-fetch", 1);
        let threads = Arc::new(Mutex::new(Vec::new()));
        let t = threads.clone();
        pool.submit(Box::new(move || {
            t.lock().push(std::thread::current().id());
            panic!("a fetch job panics");
        }));
        assert!(pool.drain_within(LONG), "a panicked job was never counted as finished");
        let t = threads.clone();
        pool.submit(Box::new(move || t.lock().push(std::thread::current().id())));
        assert!(pool.drain_within(LONG));
        let threads = threads.lock();
        assert_eq!(threads.len(), 2, "the job after the panic ran");
        assert_eq!(threads[0], threads[1], "the same worker ran both: it survived the panic");
        assert_eq!(pool.live(), 1);
    }

    #[test]
    fn stop_lets_the_workers_end_and_a_later_job_starts_them_again() {
        let pool = Workers::new("test-fetch", 2);
        let gate = Arc::new(AtomicBool::new(false));
        for _ in 0..2 {
            let g = gate.clone();
            pool.submit(Box::new(move || {
                while !g.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }));
        }
        assert_eq!(pool.live(), 2);
        pool.stop();
        // The queued jobs still run after the stop.
        gate.store(true, Ordering::SeqCst);
        assert!(pool.drain_within(LONG));
        let deadline = Instant::now() + LONG;
        while pool.live() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(pool.live(), 0, "workers outlived the stop");
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        pool.submit(Box::new(move || r.store(true, Ordering::SeqCst)));
        assert!(pool.drain_within(LONG) && ran.load(Ordering::SeqCst));
    }

    #[test]
    fn a_read_that_goes_on_from_the_last_is_sequential() {
        let exact = Window::fixed(64);
        assert!(!exact.follows(None, 0, 10));
        assert!(exact.follows(Some(10), 10, 20));
        assert!(!exact.follows(Some(10), 11, 20), "a gap");
        assert!(!exact.follows(Some(10), 0, 10), "a read again, not further");
        assert!(!exact.follows(Some(10), 5, 15), "overlapping the last one");
        let slack = Window::growing(4, 64, 8);
        assert!(slack.follows(Some(10), 18, 20), "within the slack");
        assert!(!slack.follows(Some(10), 19, 30));
        assert!(slack.follows(Some(10), 5, 11), "overlapping, ending further on");
    }

    #[test]
    fn a_window_grows_fourfold_to_its_cap_and_a_random_read_resets_it() {
        let shape = Window::growing(4, 100, 0);
        let s = Stream::new(shape.base);
        assert_eq!(s.read(&shape, 0, 10, || None), Step::Random, "a first read");
        let steps: Vec<u64> = (1..5).map(|k| s.read(&shape, 10 * k, 10 * (k + 1), || None).ahead()).collect();
        assert_eq!(steps, [16, 64, 100, 100]);
        assert_eq!(s.last_end(), Some(50));
        assert_eq!(s.read(&shape, 500, 510, || None), Step::Random);
        assert_eq!(s.read(&shape, 510, 520, || None), Step::Sequential(16), "grown again from the base");
        s.restart(&shape, 600);
        assert_eq!(s.read(&shape, 600, 610, || None), Step::Sequential(16));
        // A fixed window stays; no base, no read-ahead.
        let fixed = Window::fixed(64);
        let f = Stream::new(fixed.base);
        f.read(&fixed, 0, 1, || None);
        assert_eq!(
            (f.read(&fixed, 1, 2, || None), f.read(&fixed, 2, 3, || None)),
            (Step::Sequential(64), Step::Sequential(64))
        );
        let none = Window::growing(0, 100, 0);
        let n = Stream::new(none.base);
        n.read(&none, 0, 1, || None);
        assert_eq!(n.read(&none, 1, 2, || None).ahead(), 0);
    }

    #[test]
    fn a_carried_window_is_taken_on_the_first_read_only() {
        let shape = Window::growing(4, 100, 0);
        let s = Stream::new(shape.base);
        assert_eq!(s.read(&shape, 0, 10, || Some(64)), Step::Carried(64));
        assert_eq!(s.read(&shape, 10, 20, || panic!("asked again")), Step::Sequential(100));
    }
}
