//! A memory-bounded cache of clean nodes, keyed by their address.

use super::node::Node;
use crate::format::Addr;
use quick_cache::sync::Cache;
use quick_cache::Weighter;
use std::sync::Arc;

#[derive(Clone)]
struct NodeWeight;

impl Weighter<Addr, Arc<Node>> for NodeWeight {
    fn weight(&self, _key: &Addr, node: &Arc<Node>) -> u64 {
        node.weight()
    }
}

pub struct NodeCache {
    cache: Cache<Addr, Arc<Node>, NodeWeight>,
}

impl NodeCache {
    pub fn new(bytes: u64) -> Self {
        let estimated_items = (bytes / 8192).clamp(16, 1 << 20) as usize;
        NodeCache { cache: Cache::with_weighter(estimated_items, bytes, NodeWeight) }
    }

    pub fn get(&self, addr: &Addr) -> Option<Arc<Node>> {
        self.cache.get(addr)
    }

    pub fn insert(&self, addr: Addr, node: Arc<Node>) {
        self.cache.insert(addr, node);
    }

    pub fn weight(&self) -> u64 {
        self.cache.weight()
    }
}
