//! Chunks in memory: an imported object's chunks as a volume (or a cache
//! server) last fetched them, bounded by a count of chunks. What leaves
//! first is for [`super::policy`] to say.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

pub struct MemoryChunks<K, V> {
    /// Chunks kept at most.
    capacity: usize,
    chunks: HashMap<K, V>,
    /// Oldest first; a hit moves nothing (a clock would be fairer, this
    /// is enough for streaming readers).
    order: VecDeque<K>,
}

impl<K: Clone + Eq + Hash, V> MemoryChunks<K, V> {
    pub fn new(capacity: usize) -> MemoryChunks<K, V> {
        MemoryChunks { capacity, chunks: HashMap::new(), order: VecDeque::new() }
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        self.chunks.get(key)
    }

    pub fn insert(&mut self, key: K, value: V) {
        if self.chunks.insert(key.clone(), value).is_none() {
            self.order.push_back(key);
        }
        while self.chunks.len() > self.capacity {
            let Some(old) = self.order.pop_front() else { break };
            self.chunks.remove(&old);
        }
    }
}
