//! Fetches in flight: each chunk fetched at most once however many readers
//! ask for it, its waiters woken when it lands or fails, and the chunks a
//! reader's read-ahead asks for grouped in runs, one GET each.
//!
//! What a fetch is (a segment chunk checked against its object's footer, a
//! conditional GET of a source object) stays with its reader; so does
//! where a chunk is kept. [`InFlight`] has no lock of its own: it lives
//! under the lock of the reader's record of what is present, so "present
//! or on its way" is one look and a chunk that lands leaves the table in
//! the same step as it becomes present.

use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

/// The fetches in flight, by chunk. `T` is what a fetch's waiters are
/// told: the chunk or why it failed (every waiter gets the failure), or
/// nothing where they find the chunk in their cache afterwards.
pub(crate) struct InFlight<K, T> {
    pending: HashMap<K, Arc<Fetch<T>>>,
}

/// One chunk's fetch: its waiters sleep until it is [`Fetch::done`].
pub(crate) struct Fetch<T> {
    outcome: Mutex<Option<T>>,
    cv: Condvar,
}

/// What [`InFlight::join`] found.
pub(crate) enum Claim<T> {
    /// Nobody was fetching the chunk: the caller now is, and must finish
    /// it ([`InFlight::finish_fetch`], then [`Fetch::done`]), failed or not.
    Mine(Arc<Fetch<T>>),
    /// Another thread is fetching it: wait for that.
    Theirs(Arc<Fetch<T>>),
}

impl<K: Eq + Hash + Clone, T: Clone> InFlight<K, T> {
    pub(crate) fn new() -> InFlight<K, T> {
        InFlight { pending: HashMap::new() }
    }

    /// Fetches in flight.
    pub(crate) fn len(&self) -> usize {
        self.pending.len()
    }

    pub(crate) fn contains(&self, key: &K) -> bool {
        self.pending.contains_key(key)
    }

    /// Claims the fetch of `key`: `None` if another thread has it.
    pub(crate) fn claim(&mut self, key: K) -> Option<Arc<Fetch<T>>> {
        match self.join(key) {
            Claim::Mine(f) => Some(f),
            Claim::Theirs(_) => None,
        }
    }

    /// The fetch of `key`: the one in flight, or a new one the caller claims.
    pub(crate) fn join(&mut self, key: K) -> Claim<T> {
        match self.pending.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => Claim::Theirs(e.get().clone()),
            std::collections::hash_map::Entry::Vacant(e) => Claim::Mine(e.insert(Arc::new(Fetch::new())).clone()),
        }
    }

    /// Ends the claim on `key` (whose chunk the caller has made present,
    /// or not) if `fetch` is the fetch in flight there: whether it was. A
    /// later reader claims the chunk again, so a failed fetch can be
    /// retried; a claim is ended by its own fetch only, so one ended
    /// twice leaves a later claim alone. Its waiters are woken by
    /// [`Fetch::done`].
    pub(crate) fn finish_fetch(&mut self, key: &K, fetch: &Fetch<T>) -> bool {
        let mine = self.pending.get(key).is_some_and(|f| std::ptr::eq(Arc::as_ptr(f), fetch));
        if mine {
            self.pending.remove(key);
        }
        mine
    }
}

impl<T: Clone> Fetch<T> {
    fn new() -> Fetch<T> {
        Fetch { outcome: Mutex::new(None), cv: Condvar::new() }
    }

    /// Records the outcome and wakes every waiter. Called without the
    /// lock [`InFlight`] lives under: waiters take none of it.
    pub(crate) fn done(&self, outcome: T) {
        *self.outcome.lock() = Some(outcome);
        self.cv.notify_all();
    }

    /// As [`Fetch::done`], unless an outcome was recorded already (which
    /// stays): how a fetch whose claim ended without one is finished.
    pub(crate) fn done_if_unset(&self, outcome: T) {
        let mut first = self.outcome.lock();
        if first.is_none() {
            *first = Some(outcome);
            drop(first);
            self.cv.notify_all();
        }
    }

    /// Waits for the outcome.
    pub(crate) fn wait(&self) -> T {
        let mut outcome = self.outcome.lock();
        loop {
            if let Some(o) = outcome.as_ref() {
                return o.clone();
            }
            self.cv.wait(&mut outcome);
        }
    }

    /// Waits for the outcome at most `timeout`: `None` if it has not come.
    pub(crate) fn wait_for(&self, timeout: Duration) -> Option<T> {
        let mut outcome = self.outcome.lock();
        if outcome.is_none() {
            self.cv.wait_for(&mut outcome, timeout);
        }
        outcome.clone()
    }
}

/// Groups ascending chunk numbers into runs of consecutive ones, each of
/// at most `max` chunks (one GET each); `aligned` also splits them at
/// multiples of `max`, so that runs of a window that slides on stay the
/// same runs.
pub(crate) fn runs<C>(chunks: impl IntoIterator<Item = (u64, C)>, max: usize, aligned: bool) -> Vec<Vec<(u64, C)>> {
    let mut runs: Vec<Vec<(u64, C)>> = Vec::new();
    for (i, c) in chunks {
        let split = aligned && max > 0 && i % max as u64 == 0;
        match runs.last_mut() {
            Some(run) if !split && run.len() < max && run.last().is_some_and(|(j, _)| j + 1 == i) => run.push((i, c)),
            _ => runs.push(vec![(i, c)]),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    type Table = Mutex<(HashMap<u64, u32>, InFlight<u64, Result<u32, String>>)>;

    /// A reader of chunk 7, as the readers of this crate read: from the
    /// table if present, else from the fetch in flight, else by fetching
    /// it (`fetch`) and finishing the claim. `joined` counts the readers
    /// who found it on its way.
    fn read(table: &Table, joined: &AtomicUsize, fetch: impl FnOnce() -> Result<u32, String>) -> Result<u32, String> {
        let claim = {
            let mut t = table.lock();
            if let Some(v) = t.0.get(&7) {
                return Ok(*v);
            }
            t.1.join(7)
        };
        // Waited for with the table's lock released: the fetch takes it to finish.
        let mine = match claim {
            Claim::Mine(mine) => mine,
            Claim::Theirs(theirs) => {
                joined.fetch_add(1, Ordering::SeqCst);
                return theirs.wait();
            }
        };
        let outcome = fetch();
        {
            let mut t = table.lock();
            if let Ok(v) = &outcome {
                t.0.insert(7, *v);
            }
            t.1.finish_fetch(&7, &mine);
        }
        mine.done(outcome.clone());
        outcome
    }

    #[test]
    fn a_chunk_many_readers_ask_for_is_fetched_once_and_its_failure_reaches_all() {
        for fail in [true, false] {
            let want = if fail { Err("no".to_string()) } else { Ok(42) };
            let table: Table = Mutex::new((HashMap::new(), InFlight::new()));
            let (joined, fetches) = (AtomicUsize::new(0), AtomicUsize::new(0));
            let got: Vec<_> = std::thread::scope(|s| {
                // The first reader's fetch ends only once the others wait for it.
                let first = s.spawn(|| {
                    read(&table, &joined, || {
                        fetches.fetch_add(1, Ordering::SeqCst);
                        while joined.load(Ordering::SeqCst) < 7 {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        want.clone()
                    })
                });
                while table.lock().1.len() == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let others: Vec<_> = (0..7)
                    .map(|_| s.spawn(|| read(&table, &joined, || panic!("fetched a chunk on its way"))))
                    .collect();
                std::iter::once(first).chain(others).map(|r| r.join().expect("reader")).collect()
            });
            assert!(got.iter().all(|g| *g == want), "{got:?}");
            assert_eq!(fetches.load(Ordering::SeqCst), 1);
            assert_eq!(table.lock().1.len(), 0, "no claim left behind");
            // A failed fetch is claimed again by the next reader; a landed chunk is not fetched again.
            let again = AtomicUsize::new(0);
            let got = read(&table, &joined, || {
                again.fetch_add(1, Ordering::SeqCst);
                Ok(42)
            });
            assert_eq!((got, again.load(Ordering::SeqCst)), (Ok(42), usize::from(fail)));
        }
    }

    #[test]
    fn a_claimed_chunk_is_not_claimed_twice_until_finished() {
        let mut f: InFlight<u32, ()> = InFlight::new();
        let mine = f.claim(1).expect("free");
        assert!(f.claim(1).is_none() && f.contains(&1));
        let Claim::Theirs(theirs) = f.join(1) else { panic!("claimed twice") };
        assert!(theirs.wait_for(Duration::from_millis(1)).is_none());
        assert!(f.finish_fetch(&1, &mine), "claimed");
        mine.done(());
        assert_eq!(theirs.wait(), ());
        assert!(mine.wait_for(Duration::ZERO).is_some());
        assert!(f.claim(1).is_some(), "claimed again after it finished");
        assert!(!f.finish_fetch(&1, &mine) && f.contains(&1), "an earlier fetch ended a later claim");
    }

    #[test]
    fn runs_are_consecutive_bounded_and_optionally_aligned() {
        let idx = |rs: Vec<Vec<(u64, ())>>| {
            rs.into_iter().map(|r| r.into_iter().map(|c| c.0).collect()).collect::<Vec<Vec<u64>>>()
        };
        let chunks = || [3, 4, 5, 6, 7, 8, 9, 11, 12].into_iter().map(|i| (i, ()));
        assert_eq!(idx(runs(chunks(), 4, false)), vec![vec![3, 4, 5, 6], vec![7, 8, 9], vec![11, 12]]);
        assert_eq!(idx(runs(chunks(), 4, true)), vec![vec![3], vec![4, 5, 6, 7], vec![8, 9], vec![11], vec![12]]);
    }
}
