//! Locks across an owner restart: a grace period in which clients take
//! back the locks they held, and what each side keeps to make that safe.
//!
//! An owner keeps `flock`/`fcntl` locks in memory. When it restarts (or
//! another takes the branch over), its clients still believe they hold
//! theirs. The new owner therefore begins with a **grace period**
//! ([`LOCK_GRACE`]) when the branch may have locks from before: only
//! *reclaims* are granted in it; every other lock request waits for its
//! end. After it, a reclaim is refused. A client reclaims every lock it
//! holds as soon as it meets the new owner, before anything else it does.
//!
//! Two facts make a reclaim safe, so that no two clients ever hold
//! conflicting locks:
//!
//! - **The old owner had not dropped the client's session.** An owner
//!   drops a session (and its locks, which then go to others) only after
//!   [`SESSION_IDLE`](crate::branch::owner::SESSION_IDLE) without a word from it.
//!   A client reclaims only if it was answered, under its old session, by
//!   a request it sent less than [`RECLAIM_WINDOW`] ago by its own
//!   monotonic clock: the owner heard that request after it was sent, so
//!   it cannot have dropped the session yet. No two clocks are compared.
//!   A client past the window, or whose session the same owner dropped,
//!   loses its locks and says so (below).
//! - **No lock is granted before the reclaims are in.** A client sends
//!   its reclaims within [`RECLAIM_WINDOW`] of its last answer from the
//!   old owner, which came before the new owner started, so with the
//!   default grace period every reclaim arrives within it, and the grace
//!   period grants nothing else.
//! - **Nobody held the lock in between.** Every owner counts itself in the
//!   branch (a durable *generation*, before it answers anyone) and tells
//!   clients its number with each session. A client takes back only locks
//!   granted by the owner just before the one it meets: if an owner came
//!   and went in between (its grace period may have been short, or ended
//!   before this client came back, and another client may have taken the
//!   lock from it), the locks are lost instead. A grant is kept only if it
//!   came from the owner *and session* the client's locks are held under,
//!   so a grant read late — from an owner that is gone, or under a session
//!   the same owner already dropped — is refused (ENOLCK).
//!
//! Whether a branch may have locks from before is kept in the branch
//! itself, so that a branch that never used a lock (or whose last grace
//! period ended with none taken back, and no lock granted since) starts
//! without a grace period: the first lock an
//! owner grants makes a durable mark first (two request slots of a
//! reserved client id, [`LOCKS_CLIENT`]: slot 0 counts owners that granted
//! a lock, slot 1 how many of those were cleared, slot 2 is the
//! generation), and an owner whose grace period ended with no lock granted
//! clears it. With `--durability local` the mark is durable on the owner's
//! node only until it is uploaded; an owner started elsewhere before that
//! may start without a grace period (a reclaim then fails and is reported).
//!
//! An owner taken over with `--take-over` while still alive may grant locks
//! until it learns it was replaced (its next lease renewal): `--take-over`
//! is for an owner known to be dead.
//!
//! A lost lock is reported, never silent: the file's next fsync on that
//! client fails with EIO (what it wrote under the lock may have met
//! another writer's), its reads and writes there fail with EIO, and the
//! lock owner's next lock request on that file fails with ENOLCK once
//! (after which the file works again: the holder knows; so does a close of
//! the file by that holder). A truncate there fails with EIO too.

use arbor_engine::files::Lock;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// How long a new owner grants only reclaims, when the branch may have
/// locks from before. It must be at least [`RECLAIM_WINDOW`].
pub const LOCK_GRACE: Duration = Duration::from_secs(15);

/// The longest grace period an owner may be given: how long a client asks
/// again while an owner says it is in one.
pub const MAX_LOCK_GRACE: Duration = Duration::from_secs(600);

/// How recent a client's last answer from the old owner must be (by the
/// client's own clock) for it to reclaim its locks: comfortably inside
/// [`SESSION_IDLE`](crate::branch::owner::SESSION_IDLE), so that the old owner
/// cannot have dropped its session, whatever the two clocks' rates.
pub const RECLAIM_WINDOW: Duration = Duration::from_secs(12);

/// The answer (in place of an errno) to a lock request other than a
/// reclaim during the grace period: try again shortly. Negative, so it is
/// never a real errno; a client never hands it to the kernel.
pub const IN_GRACE: i32 = -1001;

/// The client id whose request slots record whether the branch may have
/// locks from before; no client may speak for it.
pub const LOCKS_CLIENT: u64 = u64::MAX;

/// The client id whose request slot 0 records how far inode numbers are
/// reserved (see `SharedBranch`'s inode reservation); no client may speak
/// for it either.
pub const INODES_CLIENT: u64 = arbor_engine::volume::INODES_RESERVED_CLIENT;

/// Whether `client` is one of the ids the owner keeps for itself.
pub fn reserved_client(client: u64) -> bool {
    client >= INODES_CLIENT
}

/// [`LOCKS_CLIENT`]'s slot counting owners that granted a lock.
pub const GRANTED_SLOT: u32 = 0;
/// [`LOCKS_CLIENT`]'s slot counting how many of those were cleared.
pub const CLEARED_SLOT: u32 = 1;
/// [`LOCKS_CLIENT`]'s slot counting the branch's owners.
pub const GENERATION_SLOT: u32 = 2;

pub fn overlaps(a: &Lock, b: &Lock) -> bool {
    a.start <= b.end && b.start <= a.end
}

pub fn conflicts(a: &Lock, b: &Lock) -> bool {
    overlaps(a, b) && (a.typ == libc::F_WRLCK || b.typ == libc::F_WRLCK)
}

/// `held` with `range` taken out: a range cut in the middle leaves both
/// ends.
pub fn cut_ranges(held: &[Lock], range: &Lock) -> Vec<Lock> {
    let mut out = Vec::with_capacity(held.len() + 1);
    for h in held {
        if !overlaps(h, range) {
            out.push(*h);
            continue;
        }
        if h.start < range.start {
            out.push(Lock { end: range.start - 1, ..*h });
        }
        if h.end > range.end {
            out.push(Lock { start: range.end + 1, ..*h });
        }
    }
    out
}

/// The locks a client mount holds, as its owner granted them: what it
/// reclaims from a new owner.
#[derive(Default)]
pub struct HeldLocks {
    /// The owner (its epoch) that holds them for us: a grant from another
    /// is not kept.
    pub epoch: u64,
    /// The session (of that owner) under which they are held: a grant
    /// under an earlier session (which the same owner may have dropped,
    /// and with it the lock) is not kept either.
    pub session: u64,
    /// That owner's generation: only its successor takes them back.
    pub generation: u64,
    /// Ranges by (file, lock owner).
    held: HashMap<(u64, u64), Vec<Lock>>,
    /// (file, lock owner) whose locks were lost and not yet told.
    lost: HashSet<(u64, u64)>,
}

impl HeldLocks {
    /// The owner granted `lock` (or an unlock is about to be sent: an
    /// unlock is taken as done before it is, since holding less is always
    /// safe to believe).
    pub fn apply(&mut self, ino: u64, owner: u64, lock: Lock) {
        let key = (ino, owner);
        let mut ranges = cut_ranges(self.held.remove(&key).as_deref().unwrap_or_default(), &lock);
        if lock.typ != libc::F_UNLCK {
            ranges.push(lock);
        }
        if !ranges.is_empty() {
            self.held.insert(key, ranges);
        }
    }

    /// `owner` drops every lock it has on `ino`.
    pub fn unlock_all(&mut self, ino: u64, owner: u64) {
        self.held.remove(&(ino, owner));
    }

    /// Every lock held: (file, lock owner, range).
    pub fn all(&self) -> Vec<(u64, u64, Lock)> {
        let mut out: Vec<(u64, u64, Lock)> =
            self.held.iter().flat_map(|(&(ino, owner), v)| v.iter().map(move |l| (ino, owner, *l))).collect();
        out.sort_by_key(|&(ino, owner, l)| (ino, owner, l.start));
        out
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// `owner`'s locks on `ino` are gone: it hears so at its next lock
    /// request there.
    pub fn lose(&mut self, ino: u64, owner: u64) {
        self.held.remove(&(ino, owner));
        self.lost.insert((ino, owner));
    }

    /// Whether reads and writes of `ino` fail: a lock on it was lost and
    /// its holder has not asked for a lock since (what it writes could
    /// land over what the lock's next holder wrote).
    pub fn writes_refused(&self, ino: u64) -> bool {
        !self.lost.is_empty() && self.lost.iter().any(|&(i, _)| i == ino)
    }

    /// Whether `owner` lost its locks on `ino` and has not been told; it
    /// is told now.
    pub fn take_lost(&mut self, ino: u64, owner: u64) -> bool {
        self.lost.remove(&(ino, owner))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(start: u64, end: u64, typ: i32) -> Lock {
        Lock { start, end, typ, pid: 1 }
    }

    #[test]
    fn a_client_keeps_what_it_was_granted_less_what_it_unlocked() {
        let mut h = HeldLocks::default();
        h.apply(5, 1, l(0, 99, libc::F_WRLCK));
        h.apply(5, 1, l(10, 19, libc::F_UNLCK));
        h.apply(5, 2, l(200, 299, libc::F_RDLCK));
        h.apply(6, 1, l(0, u64::MAX, libc::F_WRLCK));
        h.unlock_all(6, 1);
        let all: Vec<(u64, u64, u64, u64)> = h.all().iter().map(|&(i, o, l)| (i, o, l.start, l.end)).collect();
        assert_eq!(all, vec![(5, 1, 0, 9), (5, 1, 20, 99), (5, 2, 200, 299)]);
        // A lock taken again over a range replaces it (a downgrade).
        h.apply(5, 2, l(200, 299, libc::F_WRLCK));
        assert_eq!(h.all().iter().filter(|&&(_, o, l)| o == 2 && l.typ == libc::F_WRLCK).count(), 1);
        assert_eq!(h.all().len(), 3);
    }

    #[test]
    fn a_lost_lock_is_told_once_and_no_longer_held() {
        let mut h = HeldLocks::default();
        h.apply(5, 1, l(0, 9, libc::F_WRLCK));
        h.lose(5, 1);
        assert!(h.is_empty());
        assert!(!h.take_lost(5, 2), "another lock owner lost nothing");
        assert!(h.writes_refused(5) && !h.writes_refused(6));
        assert!(h.take_lost(5, 1));
        assert!(!h.take_lost(5, 1), "told once");
        assert!(!h.writes_refused(5), "its holder knows now");
    }

    #[test]
    fn write_locks_conflict_and_read_locks_share() {
        assert!(conflicts(&l(0, 9, libc::F_WRLCK), &l(9, 20, libc::F_RDLCK)));
        assert!(!conflicts(&l(0, 9, libc::F_WRLCK), &l(10, 20, libc::F_WRLCK)));
        assert!(!conflicts(&l(0, 9, libc::F_RDLCK), &l(0, 9, libc::F_RDLCK)));
    }
}
