//! Exactly-once requests, the owner's side: a reply cache by client and
//! slot (NFSv4.1 sessions' slot table, in small).
//!
//! A client mount tags every operation that changes the branch with
//! `(client, slot, seq)`: a client id it picked at start, one of its
//! slots, and the slot's next sequence number. An ordinary slot carries
//! one request at a time; a pipelined slot ([`PIPELINED_SLOT`], a write
//! lane) carries many, applied in the order they were sent. A request
//! sent again after a lost reply keeps its tag, so the owner answers it
//! from here instead of applying it twice, or waits while the first copy
//! is still being applied on another connection.
//!
//! The cache lives in memory and dies with the owner. What survives is the
//! tag recorded in the tree with each operation it tagged
//! ([`arbor_engine::volume::RequestTag`]): the first time a client is seen
//! in this owner's life its slots' newest sequences are read from the tree
//! (the floor), and a request at or below its slot's floor was applied by
//! an earlier owner — it is answered, not applied again.

use arbor_engine::volume::RequestTag;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::branch::owner::Reply;

/// The bit that marks a pipelined slot (a write lane): many requests in
/// flight, applied in order.
pub const PIPELINED_SLOT: u32 = 1 << 31;
/// Replies kept per ordinary slot: the client sends the next request only
/// after the previous answer, so the newest is all a retry can ask for.
const ORDINARY_WINDOW: usize = 2;
/// Replies kept per pipelined slot: more than a lane has in flight in
/// writes of 2 KiB (8 MiB); an older request asked again is known applied,
/// since a lane's requests are applied in order.
const PIPELINED_WINDOW: usize = 4096;
/// Refusals kept per slot past its window: a request sent again long after
/// is known applied only if it succeeded, so a refusal (a write to a
/// folder, a full disk) is kept longer than answers of success.
const REFUSALS_KEPT: usize = 1024;
/// How long a copy of a request waits for the first copy to finish.
const RUNNING_WAIT: Duration = Duration::from_secs(30);
/// How long a client's replies are kept after it was last heard from.
pub const CLIENT_IDLE: Duration = Duration::from_secs(600);

/// What to do with a tagged request.
#[derive(Debug)]
pub enum Begin {
    /// Apply it (and call [`Replies::finish`]).
    Run,
    /// It was answered already: this is the answer.
    Answered(Reply),
    /// An earlier owner applied it (or this one, too long ago to keep the
    /// answer): answer it from the state, do not apply it again.
    AppliedBefore,
}

#[derive(Default)]
struct Slot {
    running: Option<u64>,
    /// (seq, reply), oldest first.
    done: VecDeque<(u64, Reply)>,
    /// Refusals that left `done`, oldest first.
    refused: VecDeque<(u64, Reply)>,
    /// The newest sequence the state included when the client was first
    /// seen in this owner's life.
    floor: u64,
}

struct Client {
    slots: HashMap<u32, Slot>,
    last_seen: Instant,
}

/// The reply cache of one branch's owner.
#[derive(Default)]
pub struct Replies {
    clients: Mutex<HashMap<u64, Client>>,
    finished: Condvar,
}

impl Replies {
    /// Decides what to do with request `tag`. `floors` reads the slots'
    /// newest sequences from the state, the first time `tag.client` is seen.
    pub fn begin(&self, tag: RequestTag, floors: impl FnOnce() -> Result<Vec<(u32, u64)>, i32>) -> Result<Begin, i32> {
        let mut clients = self.clients.lock();
        if let std::collections::hash_map::Entry::Vacant(v) = clients.entry(tag.client) {
            let mut slots: HashMap<u32, Slot> = HashMap::new();
            for (slot, seq) in floors()? {
                slots.entry(slot).or_default().floor = seq;
            }
            v.insert(Client { slots, last_seen: Instant::now() });
        }
        let deadline = Instant::now() + RUNNING_WAIT;
        // Bounded by RUNNING_WAIT: each turn waits for a finish or times out.
        loop {
            let client = clients.get_mut(&tag.client).ok_or(libc::EIO)?;
            client.last_seen = Instant::now();
            let slot = client.slots.entry(tag.slot).or_default();
            if let Some((_, reply)) = slot.done.iter().chain(&slot.refused).find(|(seq, _)| *seq == tag.seq) {
                return Ok(Begin::Answered(reply.clone()));
            }
            if slot.running != Some(tag.seq) {
                let newest_done = slot.done.back().map_or(0, |d| d.0);
                if tag.seq <= slot.floor || tag.seq < newest_done {
                    return Ok(Begin::AppliedBefore);
                }
                slot.running = Some(tag.seq);
                return Ok(Begin::Run);
            }
            if self.finished.wait_until(&mut clients, deadline).timed_out() {
                return Err(libc::EAGAIN);
            }
        }
    }

    /// Keeps the answer to request `tag`, which [`Replies::begin`] said to run.
    pub fn finish(&self, tag: RequestTag, reply: &Reply) {
        let mut clients = self.clients.lock();
        if let Some(client) = clients.get_mut(&tag.client) {
            let slot = client.slots.entry(tag.slot).or_default();
            if slot.running == Some(tag.seq) {
                slot.running = None;
            }
            slot.done.push_back((tag.seq, reply.clone()));
            let window = if tag.slot & PIPELINED_SLOT != 0 { PIPELINED_WINDOW } else { ORDINARY_WINDOW };
            while slot.done.len() > window {
                if let Some(old @ (_, Err(_))) = slot.done.pop_front() {
                    slot.refused.push_back(old);
                    if slot.refused.len() > REFUSALS_KEPT {
                        slot.refused.pop_front();
                    }
                }
            }
        }
        drop(clients);
        self.finished.notify_all();
    }

    /// Drops the replies of clients not heard from for [`CLIENT_IDLE`]:
    /// a retry after that is answered from the tags in the state.
    pub fn reap(&self) {
        let now = Instant::now();
        self.clients.lock().retain(|_, c| now.duration_since(c.last_seen) <= CLIENT_IDLE);
    }

    /// Clients with replies kept.
    pub fn clients(&self) -> usize {
        self.clients.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::branch::owner::Out;
    use std::sync::Arc;

    fn tag(slot: u32, seq: u64) -> RequestTag {
        RequestTag { client: 7, slot, seq }
    }

    #[test]
    fn a_request_runs_once_and_its_copies_get_its_answer() {
        let r = Replies::default();
        assert!(matches!(r.begin(tag(0, 1), || Ok(vec![])), Ok(Begin::Run)));
        r.finish(tag(0, 1), &Ok(Out::Unit));
        assert!(matches!(r.begin(tag(0, 1), || unreachable!()), Ok(Begin::Answered(Ok(Out::Unit)))));
        assert!(matches!(r.begin(tag(0, 2), || unreachable!()), Ok(Begin::Run)));
        r.finish(tag(0, 2), &Err(libc::ENOENT));
        assert!(matches!(r.begin(tag(0, 2), || unreachable!()), Ok(Begin::Answered(Err(libc::ENOENT)))));
    }

    #[test]
    fn what_an_earlier_owner_applied_is_not_applied_again() {
        let r = Replies::default();
        let floors = || Ok(vec![(0, 5), (PIPELINED_SLOT, 40)]);
        assert!(matches!(r.begin(tag(0, 5), floors), Ok(Begin::AppliedBefore)));
        assert!(matches!(r.begin(tag(0, 6), || unreachable!()), Ok(Begin::Run)));
        assert!(matches!(r.begin(tag(PIPELINED_SLOT, 39), || unreachable!()), Ok(Begin::AppliedBefore)));
        assert!(matches!(r.begin(tag(PIPELINED_SLOT, 41), || unreachable!()), Ok(Begin::Run)));
        // A state that cannot be read refuses the request rather than guess.
        let other = RequestTag { client: 8, slot: 0, seq: 1 };
        assert!(matches!(r.begin(other, || Err(libc::EIO)), Err(libc::EIO)));
    }

    #[test]
    fn a_copy_waits_for_the_first_to_finish() {
        let r = Arc::new(Replies::default());
        assert!(matches!(r.begin(tag(1, 1), || Ok(vec![])), Ok(Begin::Run)));
        let r2 = r.clone();
        let copy = std::thread::spawn(move || r2.begin(tag(1, 1), || unreachable!()));
        std::thread::sleep(Duration::from_millis(50));
        r.finish(tag(1, 1), &Ok(Out::Written(3)));
        assert!(matches!(copy.join().expect("join"), Ok(Begin::Answered(Ok(Out::Written(3))))));
    }

    #[test]
    fn a_pipelined_slot_keeps_its_window_and_knows_older_requests_applied() {
        let r = Replies::default();
        let lane = PIPELINED_SLOT | 1;
        for seq in 1..=(PIPELINED_WINDOW as u64 + 10) {
            assert!(matches!(r.begin(tag(lane, seq), || Ok(vec![])), Ok(Begin::Run)));
            r.finish(tag(lane, seq), &Ok(Out::Written(seq)));
        }
        assert!(matches!(r.begin(tag(lane, 3), || unreachable!()), Ok(Begin::AppliedBefore)));
        let last = PIPELINED_WINDOW as u64 + 10;
        assert!(
            matches!(r.begin(tag(lane, last), || unreachable!()), Ok(Begin::Answered(Ok(Out::Written(n)))) if n == last)
        );
    }
}
