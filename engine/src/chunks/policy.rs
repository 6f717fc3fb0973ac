//! The eviction policy of every chunk cache, and the one place to change it.
//!
//! Each cache keeps its chunks in a [`Ledger`]: per chunk a rank (its
//! place in the order of leaving), a weight (bytes, or 1 for a cache
//! bounded by a count) and the cache's own value. The ledger ranks chunks
//! as the cache's [`Policy`] says, and a cache over its capacity asks it
//! for the victims ([`Ledger::trim`]); it never picks them itself.
//!
//! Today's policies, one per cache:
//! - [`CHUNK_STORE`] (the node's one budget of chunks on disk,
//!   `ChunkStore`: segment chunks in sparse files and imported objects'
//!   chunk files, ranked together): least recently used first, whatever
//!   the kind; once over its capacity, down to 90 % of it (holes are
//!   punched in batches, under the eviction lock, and a batch frees room
//!   for more than one insert of either kind);
//! - [`OBJECT_MEMORY`] (imported objects' chunks in memory, `MemoryChunks`):
//!   first in, first out (a hit moves nothing: streaming readers read a
//!   chunk once, and the chunks of one GET leave together), down to its
//!   count.
//!
//! Chunks found on disk from an earlier process are inserted `cold`: at
//! the cold end (rank 0), before every chunk used in this process, and
//! among themselves in the order they were inserted (the oldest found
//! first leaves first).

use std::collections::{BTreeSet, HashMap};
use std::hash::Hash;

/// Which chunk leaves first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// The one used longest ago: every use moves a chunk to the hot end.
    LeastRecentlyUsed,
    /// The one inserted longest ago: a use moves nothing.
    FirstIn,
}

/// A cache's eviction policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub order: Order,
    /// A cache over its capacity is trimmed to this many tenths of it.
    pub trim_to_tenths: u64,
}

impl Policy {
    /// What a cache of `capacity` over it is trimmed down to.
    pub fn low_water(&self, capacity: u64) -> u64 {
        if self.trim_to_tenths >= 10 {
            capacity
        } else {
            capacity / 10 * self.trim_to_tenths
        }
    }
}

/// The node's chunks on disk, of both kinds ([`super::ChunkStore`]).
pub const CHUNK_STORE: Policy = Policy { order: Order::LeastRecentlyUsed, trim_to_tenths: 9 };
/// Imported objects' chunks in memory (`MemoryChunks`).
pub const OBJECT_MEMORY: Policy = Policy { order: Order::FirstIn, trim_to_tenths: 10 };

struct Entry<V> {
    rank: u64,
    /// The order of leaving among chunks of one rank: 0 for a used one
    /// (its tick is its own), the count of cold inserts for a cold one.
    seq: u64,
    weight: u64,
    value: V,
}

/// The chunks a cache holds, in the order they leave.
pub struct Ledger<K, V> {
    policy: Policy,
    /// The clock: advanced by every insert and every use.
    tick: u64,
    /// Cold inserts so far.
    cold: u64,
    entries: HashMap<K, Entry<V>>,
    /// (rank, seq, key), the next to leave first.
    order: BTreeSet<(u64, u64, K)>,
    weight: u64,
}

impl<K: Clone + Eq + Hash + Ord, V> Ledger<K, V> {
    pub fn new(policy: Policy) -> Ledger<K, V> {
        Ledger { policy, tick: 0, cold: 0, entries: HashMap::new(), order: BTreeSet::new(), weight: 0 }
    }

    /// The tick of the newest insert or use so far.
    pub fn tick(&self) -> u64 {
        self.tick
    }

    /// The weight of every chunk held.
    pub fn weight(&self) -> u64 {
        self.weight
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|e| &e.value)
    }

    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.entries.get_mut(key).map(|e| &mut e.value)
    }

    /// Where chunk `key` is in the order of leaving (0: the cold end).
    pub fn rank(&self, key: &K) -> Option<u64> {
        self.entries.get(key).map(|e| e.rank)
    }

    /// Chunk `key`'s rank and value.
    pub fn ranked(&self, key: &K) -> Option<(u64, &V)> {
        self.entries.get(key).map(|e| (e.rank, &e.value))
    }

    /// Holds `value` as chunk `key` of `weight`, at the cold end if `cold`
    /// (after the chunks inserted cold before it). A chunk held already
    /// takes the new value and weight; it moves as a use would move it, or
    /// to the cold end if `cold`.
    pub fn insert(&mut self, key: K, weight: u64, value: V, cold: bool) {
        self.tick += 1;
        let fresh = if cold {
            self.cold += 1;
            (0, self.cold)
        } else {
            (self.tick, 0)
        };
        let (rank, seq) = match self.entries.get(&key) {
            Some(e) if !cold && self.policy.order == Order::FirstIn => (e.rank, e.seq),
            Some(e) => {
                self.order.remove(&(e.rank, e.seq, key.clone()));
                fresh
            }
            None => fresh,
        };
        self.order.insert((rank, seq, key.clone()));
        if let Some(old) = self.entries.insert(key, Entry { rank, seq, weight, value }) {
            self.weight -= old.weight;
        }
        self.weight += weight;
    }

    /// A use of chunk `key` (present or not: the clock advances either way).
    pub fn touch(&mut self, key: &K) {
        self.tick += 1;
        if self.policy.order != Order::LeastRecentlyUsed {
            return;
        }
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(key) {
            self.order.remove(&(e.rank, e.seq, key.clone()));
            (e.rank, e.seq) = (tick, 0);
            self.order.insert((tick, 0, key.clone()));
        }
    }

    /// Drops chunk `key`: its weight and value.
    pub fn remove(&mut self, key: &K) -> Option<(u64, V)> {
        let e = self.entries.remove(key)?;
        self.order.remove(&(e.rank, e.seq, key.clone()));
        self.weight -= e.weight;
        Some((e.weight, e.value))
    }

    /// Drops every chunk whose key `pred` picks.
    pub fn remove_where(&mut self, pred: impl Fn(&K) -> bool) {
        let keys: Vec<K> = self.entries.keys().filter(|k| pred(k)).cloned().collect();
        for k in keys {
            self.remove(&k);
        }
    }

    /// When the chunks weigh more than `capacity`, drops them in the
    /// policy's order down to its low water mark; the victims (key, weight,
    /// value), in that order.
    pub fn trim(&mut self, capacity: u64) -> Vec<(K, u64, V)> {
        let mut out = Vec::new();
        if self.weight <= capacity {
            return out;
        }
        let target = self.policy.low_water(capacity);
        while self.weight > target {
            let Some((_, _, key)) = self.order.pop_first() else { break };
            if let Some(e) = self.entries.remove(&key) {
                self.weight -= e.weight;
                out.push((key, e.weight, e.value));
            }
        }
        out
    }

    /// The chunks [`Ledger::trim`] would drop now (key, value), in the
    /// order it would drop them, left in place.
    pub fn trimmed(&self, capacity: u64) -> impl Iterator<Item = (&K, &V)> {
        let target = if self.weight <= capacity { self.weight } else { self.policy.low_water(capacity) };
        let mut left = self.weight;
        self.order
            .iter()
            .map(|(_, _, key)| (key, &self.entries[key]))
            .take_while(move |(_, e)| {
                let take = left > target;
                left = left.saturating_sub(e.weight);
                take
            })
            .map(|(key, e)| (key, &e.value))
    }

    /// The chunks [`Ledger::unused_since`] would drop now (key, value),
    /// in order, left in place.
    pub fn unused(&self, before: u64) -> impl Iterator<Item = (&K, &V)> {
        self.order
            .iter()
            .take_while(move |(rank, _, _)| *rank < before)
            .map(|(_, _, key)| (key, &self.entries[key].value))
    }

    /// Drops every chunk ranked before `before` (for least recently used:
    /// not used since the clock read `before`), whatever the room.
    pub fn unused_since(&mut self, before: u64) -> Vec<(K, u64, V)> {
        let mut out = Vec::new();
        while self.order.first().is_some_and(|(rank, _, _)| *rank < before) {
            let Some((_, _, key)) = self.order.pop_first() else { break };
            if let Some(e) = self.entries.remove(&key) {
                self.weight -= e.weight;
                out.push((key, e.weight, e.value));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_leaves_first_down_to_the_low_water_mark() {
        let mut l: Ledger<u32, ()> = Ledger::new(CHUNK_STORE);
        for k in 1..=4 {
            l.insert(k, 300, (), false);
        }
        l.touch(&1);
        assert_eq!(l.trimmed(1000).map(|v| *v.0).collect::<Vec<_>>(), vec![2], "what trim would drop");
        assert_eq!(l.trimmed(1200).count(), 0, "nothing: not over");
        let out: Vec<u32> = l.trim(1000).into_iter().map(|v| v.0).collect();
        assert_eq!(out, vec![2], "1200 > 1000: down to 900, 1 was used since");
        assert_eq!(l.weight(), 900);
        assert!(l.trim(1000).is_empty());
    }

    #[test]
    fn first_in_leaves_first_and_a_use_moves_nothing() {
        let mut l: Ledger<u32, &str> = Ledger::new(OBJECT_MEMORY);
        l.insert(1, 1, "a", false);
        l.insert(2, 1, "b", false);
        l.touch(&1);
        l.insert(1, 1, "a again", false);
        l.insert(3, 1, "c", false);
        let out: Vec<u32> = l.trim(2).into_iter().map(|v| v.0).collect();
        assert_eq!(out, vec![1]);
        assert_eq!((l.get(&2), l.get(&3)), (Some(&"b"), Some(&"c")));
    }

    #[test]
    fn cold_chunks_leave_before_any_other_and_unused_ones_go_by_tick() {
        let mut l: Ledger<u32, ()> = Ledger::new(CHUNK_STORE);
        l.insert(5, 10, (), false);
        l.insert(7, 10, (), true);
        assert_eq!(l.rank(&7), Some(0));
        let mark = l.tick() + 1;
        l.insert(9, 10, (), false);
        assert_eq!(l.unused(mark).map(|v| *v.0).collect::<Vec<_>>(), vec![7, 5], "what unused_since would drop");
        let out: Vec<u32> = l.unused_since(mark).into_iter().map(|v| v.0).collect();
        assert_eq!(out, vec![7, 5]);
        assert_eq!((l.len(), l.weight()), (1, 10));
    }

    #[test]
    fn cold_chunks_leave_in_the_order_they_were_inserted() {
        let mut l: Ledger<u32, ()> = Ledger::new(CHUNK_STORE);
        l.insert(1, 10, (), false);
        for k in [9, 3, 6] {
            l.insert(k, 10, (), true);
        }
        let out: Vec<u32> = l.trim(30).into_iter().map(|v| v.0).collect();
        assert_eq!(out, vec![9, 3], "the first found leaves first, whatever its key");
        l.touch(&6);
        let out: Vec<u32> = l.unused_since(l.tick()).into_iter().map(|v| v.0).collect();
        assert_eq!(out, vec![1], "a used chunk is no longer cold");
    }
}
