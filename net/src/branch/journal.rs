//! Exactly-once requests, the client's side: the slots a client mount
//! tags its requests with, and the journal of requests the owner answered
//! that no fsync has covered yet.
//!
//! The journal keeps tags, not bytes: a client never sends a write again
//! once the owner that answered it is gone, because by then another
//! client may have written over the same bytes, and sending it again would
//! bring back what was overwritten. Instead, after the owner changes, the
//! client asks the new owner which of its slots' requests the branch
//! includes ([`crate::branch::owner::FileOp::Slots`]): those were made durable before
//! the old owner went (the new owner recovered them from the log), the
//! rest were lost with it. A lost write fails its file's next `fsync` and
//! `close` with EIO; a lost change of names (a rename, an unlink, …) fails
//! the mount's next `fsync` of anything with EIO. Nothing is applied late,
//! and nothing answered is lost silently.

use arbor_engine::volume::RequestTag;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet, VecDeque};

/// Ordinary slots a mount has: as many requests at once as it has FUSE
/// threads and more; a request waits for a free one.
pub const SLOTS: u32 = 64;
/// Answered requests a mount keeps before it syncs on its own.
pub const JOURNAL_MAX: usize = 1 << 20;

/// The ordinary slots and each one's last sequence.
pub struct SlotTable {
    free: Mutex<Vec<(u32, u64)>>,
    returned: Condvar,
}

impl Default for SlotTable {
    fn default() -> Self {
        SlotTable { free: Mutex::new((0..SLOTS).rev().map(|s| (s, 0)).collect()), returned: Condvar::new() }
    }
}

impl SlotTable {
    /// A free slot and the next sequence on it, waiting for one if all are
    /// in use (each holder gives its slot back when its request ends).
    pub fn take(&self, client: u64) -> RequestTag {
        let mut free = self.free.lock();
        loop {
            if let Some((slot, seq)) = free.pop() {
                return RequestTag { client, slot, seq: seq + 1 };
            }
            self.returned.wait(&mut free);
        }
    }

    pub fn give(&self, tag: RequestTag) {
        self.free.lock().push((tag.slot, tag.seq));
        self.returned.notify_one();
    }
}

struct Entry {
    pos: u64,
    tag: RequestTag,
    /// The file a write went to; `None` for a change of names or attributes.
    ino: Option<u64>,
    /// For another change: the files and folders it altered.
    touched: Vec<u64>,
    /// Who made it.
    by: Who,
}

/// A caller as the kernel names it: its process and its thread (0, 0:
/// unknown).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Who {
    pub process: u32,
    pub thread: u32,
}

/// A lost change of one file or folder, and the threads told of it.
#[derive(Debug)]
pub struct Loss {
    by: Who,
    told: HashSet<u32>,
}

/// The process (thread group) of thread `tid` as FUSE names it, from
/// `/proc`; 0 (unknown: every caller hears of the loss) if it cannot be
/// read — a thread that exited, or one of another PID namespace.
fn process_of(tid: u32) -> u32 {
    if tid == 0 {
        return 0;
    }
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()
        .and_then(|st| st.lines().find_map(|l| l.strip_prefix("Tgid:").and_then(|v| v.trim().parse().ok())))
        .unwrap_or(0)
}

/// Lost changes kept per file or folder, oldest dropped first.
const LOSSES_KEPT: usize = 64;

/// What the owner answered and no fsync has covered, and what was lost.
#[derive(Default)]
pub struct Journal {
    entries: VecDeque<Entry>,
    next_pos: u64,
    /// Files whose answered writes the owner lost: their next fsync fails.
    pub lost: HashSet<u64>,
    /// Files and folders an answered change other than a write altered
    /// (a folder for its names) that was lost, with who made it: the next
    /// fsync of each by every thread of that process fails, once per
    /// thread (by anyone's, for an unknown caller).
    pub lost_changes: HashMap<u64, Vec<Loss>>,
    /// Files this mount had open that did not survive an owner restart:
    /// reads and writes through those open files fail with EIO (their
    /// inode number may name another file now) until the file is opened
    /// anew.
    pub gone: HashSet<u64>,
    /// Files a write in flight to failed at the owner, and its errno: the
    /// file's next write, fsync or close reports it.
    pub failed: HashMap<u64, i32>,
    /// The owner (its epoch) the entries were answered by: 0 before the
    /// first, then the one last reconciled with.
    epoch: u64,
    /// What that owner held of each slot when it was met.
    floors: HashMap<u32, u64>,
}

impl Journal {
    /// Notes the first owner this mount met.
    pub fn met(&mut self, epoch: u64) {
        if self.epoch == 0 {
            self.epoch = epoch;
        }
    }

    /// Notes that the owner of `epoch` answered request `tag` (a write to
    /// `ino`, or another change when `ino` is `None`) with success. An
    /// answer from an owner before the one reconciled with (read late,
    /// from a socket, after another thread met the new owner) counts only
    /// if the new owner had the request; else it is lost at once.
    pub fn answered(&mut self, tag: RequestTag, ino: Option<u64>, touched: Vec<u64>, by: Who, epoch: u64) {
        if self.epoch != 0 && epoch != self.epoch {
            if self.floors.get(&tag.slot).is_none_or(|&f| tag.seq > f) {
                self.mark_lost(ino, touched, by);
            }
            return;
        }
        self.entries.push_back(Entry { pos: self.next_pos, tag, ino, touched, by });
        self.next_pos += 1;
    }

    fn mark_lost(&mut self, ino: Option<u64>, touched: Vec<u64>, mut by: Who) {
        // Which process a thread belongs to is asked only now, when a
        // change was lost (rare), not for every request.
        if by.process == 0 {
            by.process = process_of(by.thread);
        }
        match ino {
            Some(ino) => {
                self.lost.insert(ino);
            }
            None => {
                for t in touched {
                    let losses = self.lost_changes.entry(t).or_default();
                    if losses.len() >= LOSSES_KEPT {
                        losses.remove(0);
                    }
                    losses.push(Loss { by, told: HashSet::new() });
                }
            }
        }
    }

    /// Whether the fsync of `ino` by `caller` must report a lost change:
    /// one its process made (or an unknown caller), not yet reported to
    /// this thread. It is reported now.
    pub fn take_lost_change(&mut self, ino: u64, mut caller: Who) -> bool {
        let Some(losses) = self.lost_changes.get_mut(&ino) else { return false };
        if caller.process == 0 {
            caller.process = process_of(caller.thread);
        }
        let mut hit = false;
        for l in losses.iter_mut() {
            let theirs = l.by.process == 0 || caller.process == 0 || l.by.process == caller.process;
            if theirs && l.told.insert(caller.thread) {
                hit = true;
            }
        }
        hit
    }

    /// Where the journal is now: an fsync sent after this covers every
    /// entry before it.
    pub fn position(&self) -> u64 {
        self.next_pos
    }

    /// The owner's fsync, sent at `upto`, returned: what was answered
    /// before is durable.
    pub fn synced(&mut self, upto: u64) {
        while self.entries.front().is_some_and(|e| e.pos < upto) {
            self.entries.pop_front();
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A new owner includes each slot's requests up to `floors[slot]`:
    /// those are durable; every other answered request was lost with the
    /// old owner and is marked so. Returns how many were lost.
    pub fn reconcile(&mut self, floors: &HashMap<u32, u64>, epoch: u64) -> usize {
        let mut lost = 0;
        for e in std::mem::take(&mut self.entries) {
            if floors.get(&e.tag.slot).is_some_and(|&f| e.tag.seq <= f) {
                continue;
            }
            lost += 1;
            self.mark_lost(e.ino, e.touched, e.by);
        }
        self.epoch = epoch;
        self.floors = floors.clone();
        lost
    }

    /// Forgets file `ino`: the owner no longer has it.
    pub fn forget_file(&mut self, ino: u64) {
        self.lost.insert(ino);
        self.gone.insert(ino);
        self.entries.retain(|e| e.ino != Some(ino));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(slot: u32, seq: u64) -> RequestTag {
        RequestTag { client: 1, slot, seq }
    }

    #[test]
    fn what_the_new_owner_lacks_is_lost_and_nothing_is_sent_again() {
        let mut j = Journal::default();
        j.met(1);
        j.answered(tag(0, 1), None, vec![1], Who::default(), 1);
        j.answered(tag(1, 4), Some(10), vec![], Who::default(), 1);
        j.answered(tag(1, 5), Some(11), vec![], Who::default(), 1);
        j.answered(tag(2, 9), None, vec![4, 5], Who { process: 7, thread: 70 }, 1);
        let floors = HashMap::from([(0, 1), (1, 4), (1 << 31, 7)]);
        assert_eq!(j.reconcile(&floors, 2), 2);
        assert!(j.is_empty());
        assert_eq!(j.lost, HashSet::from([11]));
        assert_eq!(
            j.lost_changes.keys().copied().collect::<HashSet<u64>>(),
            HashSet::from([4, 5]),
            "slot 2's change is lost"
        );
        // Reported to each thread of the process that made it, at each
        // folder it changed, once.
        let (other, maker, sibling) =
            (Who { process: 8, thread: 80 }, Who { process: 7, thread: 70 }, Who { process: 7, thread: 71 });
        assert!(!j.take_lost_change(4, other), "another process's fsync of the folder");
        assert!(j.take_lost_change(4, sibling), "a thread of the same process");
        assert!(j.take_lost_change(4, maker), "the maker, after its sibling was told");
        assert!(!j.take_lost_change(4, maker), "reported once to each thread");
        assert!(j.take_lost_change(5, Who::default()), "a caller the kernel did not name hears of it");
        // Answers of the old owner read after the new one was met: kept
        // only if the new owner had them, and never journalled.
        j.answered(tag(1 << 31, 7), Some(20), vec![], Who::default(), 1);
        j.answered(tag(1 << 31, 8), Some(21), vec![], Who::default(), 1);
        assert!(j.is_empty());
        assert_eq!(j.lost, HashSet::from([11, 21]));
        j.answered(tag(1 << 31, 9), Some(22), vec![], Who::default(), 2);
        assert_eq!(j.len(), 1);
    }

    #[test]
    fn an_fsync_covers_what_was_answered_before_it_was_sent() {
        let mut j = Journal::default();
        j.met(1);
        j.answered(tag(0, 1), None, vec![1], Who::default(), 1);
        let upto = j.position();
        j.answered(tag(0, 2), Some(3), vec![], Who::default(), 1);
        j.synced(upto);
        assert_eq!(j.len(), 1);
        // After an owner change with nothing of slot 0 past 1, the write is lost.
        assert_eq!(j.reconcile(&HashMap::from([(0, 1)]), 2), 1);
        assert!(j.lost.contains(&3) && j.lost_changes.is_empty());
    }

    #[test]
    fn slots_are_reused_with_growing_sequences() {
        let t = SlotTable::default();
        let a = t.take(9);
        let b = t.take(9);
        assert_ne!(a.slot, b.slot);
        t.give(a);
        let c = t.take(9);
        assert_eq!((c.slot, c.seq), (a.slot, a.seq + 1));
    }
}
