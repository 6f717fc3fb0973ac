//! The tree's node store for a volume: clean nodes come from segments
//! through the node cache; dirty nodes are appended to the volume's log.

use crate::device::{failpoints, Device};
use crate::error::{Error, Result};
use crate::format::{Addr, RecordKind, SegId};
use crate::log::{read_record_at_addr, Log};
use crate::tree::{Node, NodeCache, NodeStore};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

pub struct Nodes {
    pub device: Arc<dyn Device>,
    pub cache: NodeCache,
    /// Set once recovery is done; a read-only volume never has one.
    pub log: OnceLock<Arc<Log>>,
    /// Bytes of written nodes and file data this tree references, per
    /// segment: kept in every commit record, for compaction to choose from.
    pub live: Mutex<BTreeMap<SegId, u64>>,
}

impl Nodes {
    pub fn new(device: Arc<dyn Device>, cache_bytes: u64) -> Nodes {
        Nodes { device, cache: NodeCache::new(cache_bytes), log: OnceLock::new(), live: Mutex::new(BTreeMap::new()) }
    }

    fn account(&self, seg: SegId, delta: i64) {
        let mut live = self.live.lock();
        let n = live.entry(seg).or_default();
        *n = n.saturating_add_signed(delta);
        if *n == 0 {
            live.remove(&seg);
        }
    }

    pub fn live_table(&self) -> Vec<(SegId, u64)> {
        self.live.lock().iter().map(|(s, n)| (*s, *n)).collect()
    }

    pub fn set_live_table(&self, table: &[(SegId, u64)]) {
        *self.live.lock() = table.iter().copied().collect();
    }
}

/// Reads and verifies the record at `addr`, which must be of `kind`.
pub fn load_record(device: &dyn Device, addr: Addr, kind: RecordKind) -> Result<crate::log::Record> {
    let file = device.open_segment(addr.seg)?.ok_or_else(|| Error::corrupted("missing segment", addr))?;
    let rec = read_record_at_addr(file.as_ref(), addr).map_err(|e| match e {
        Error::Corrupted { what, .. } => Error::corrupted(what, addr),
        e => e,
    })?;
    if rec.kind != kind || rec.addr != addr {
        return Err(Error::corrupted("record of the wrong kind", addr));
    }
    Ok(rec)
}

impl NodeStore for Nodes {
    fn load(&self, addr: Addr) -> Result<Arc<Node>> {
        if let Some(n) = self.cache.get(&addr) {
            return Ok(n);
        }
        // A node evicted from the cache before its bytes reached the file
        // (a commit holds the tree lock until its sync, so none is read
        // back today; this keeps reads right whatever the cache does).
        if let Some(log) = self.log.get() {
            log.wait_written(addr.seg, addr.end())?;
        }
        let rec = load_record(self.device.as_ref(), addr, RecordKind::Node)?;
        let node = Arc::new(Node::decode_owned(rec.meta).map_err(|_| Error::corrupted("tree node", addr))?);
        self.cache.insert(addr, node.clone());
        Ok(node)
    }

    fn write(&self, node: &Node) -> Result<Addr> {
        let log = self.log.get().ok_or(Error::ReadOnly)?;
        let addr = log.append(RecordKind::Node, &node.encode()?, &[], failpoints::NODE_WRITE)?.addr;
        self.account(addr.seg, addr.len as i64);
        Ok(addr)
    }

    fn released(&self, addr: Addr) {
        self.account(addr.seg, -(addr.len as i64));
    }

    fn account_data(&self, seg: SegId, delta: i64) {
        self.account(seg, delta);
    }

    fn cache(&self, addr: Addr, node: Arc<Node>) {
        self.cache.insert(addr, node);
    }
}
