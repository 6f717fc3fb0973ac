//! Chunks in memory: an imported object's chunks as a volume (or a cache
//! server) last fetched them, bounded by a count of chunks, evicted as
//! [`super::policy::OBJECT_MEMORY`] says (first in, first out: the chunks
//! of one GET leave together).

use super::policy::{Ledger, OBJECT_MEMORY};
use std::hash::Hash;

pub struct MemoryChunks<K, V> {
    /// Chunks kept at most.
    capacity: usize,
    chunks: Ledger<K, V>,
}

impl<K: Clone + Eq + Hash + Ord, V> MemoryChunks<K, V> {
    pub fn new(capacity: usize) -> MemoryChunks<K, V> {
        MemoryChunks { capacity, chunks: Ledger::new(OBJECT_MEMORY) }
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        self.chunks.get(key)
    }

    pub fn insert(&mut self, key: K, value: V) {
        self.chunks.insert(key, 1, value, false);
        self.chunks.trim(self.capacity as u64);
    }
}
