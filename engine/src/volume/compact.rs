//! Compaction: moving what a branch still holds out of segments that are
//! mostly dead, so that the branch no longer keeps those segments.
//!
//! A copy-on-write tree leaves the nodes of parts that did not change, and
//! file bytes nobody overwrote, in the segments where they were first
//! written. Once the rest of a segment is rewritten or deleted, it can be
//! almost all dead bytes and still be kept whole by a few live ones.
//! Compaction copies those: each live extent's bytes with a `Relocate`
//! intent (applied only if the extent is still the one read, and replayed
//! like any write), and each live node, with the path above it, by copying
//! it into memory for the next commit to write. The segments are then
//! unreachable from this branch, and `gc` deletes them once no checkpoint
//! or other branch reaches them either. No file's bytes, size or times
//! change, so a crash at any point leaves the volume as it was or as it
//! would be after any other commit.

use super::keys;
use super::types::Extent;
use super::Volume;
use crate::error::Result;
use crate::format::{Addr, SegId};
use crate::tree::{Child, Node, NodeStore, Tree};
use std::collections::{HashMap, HashSet};

/// Segments holding at most this share of a segment's size of live bytes
/// are compacted by default.
pub const MAX_LIVE: f64 = 0.25;

/// What one compaction did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompactReport {
    /// Segments this branch no longer reaches.
    pub segments: Vec<SegId>,
    /// Tree nodes copied out of them.
    pub nodes: u64,
    /// Their bytes.
    pub bytes: u64,
    /// File bytes copied out of them.
    pub data_bytes: u64,
}

impl Volume {
    /// The sealed segments this branch holds at most `max_live` of a
    /// segment's size in, with the bytes it holds there: what
    /// [`Volume::compact`] would empty.
    pub fn compactable(&self, max_live: f64) -> Result<Vec<(SegId, u64)>> {
        let (current, _) = self.log()?.position();
        let limit = (self.cfg.segment_size as f64 * max_live.clamp(0.0, 1.0)) as u64;
        Ok(self
            .nodes
            .live_table()
            .into_iter()
            .filter(|&(seg, live)| seg != current && live > 0 && live <= limit)
            .collect())
    }

    /// Moves the live tree nodes and file bytes out of every sealed segment
    /// in which this branch's live bytes are at most `max_live` of a
    /// segment's size, and commits. With no such segment it does nothing,
    /// not even a commit; nor on a volume already closed, which takes no
    /// more writes. [`Volume::close`] waits for a compaction under way.
    pub fn compact(&self, max_live: f64) -> Result<CompactReport> {
        if self.cfg.read_only {
            return Err(crate::error::Error::ReadOnly);
        }
        let _one = self.compacting.lock();
        if self.log()?.is_finished() {
            return Ok(CompactReport::default());
        }
        // Nothing to move: no commit (a periodic caller would sync for nothing).
        if self.compactable(max_live)?.is_empty() {
            return Ok(CompactReport::default());
        }
        // The walk below reads the last commit's tree: make it the current one.
        self.commit()?;
        let candidates: HashSet<SegId> = self.compactable(max_live)?.into_iter().map(|(seg, _)| seg).collect();
        if candidates.is_empty() {
            return Ok(CompactReport::default());
        }
        // The last commit's tree: a consistent snapshot, walked without
        // holding the volume's lock while writes go on.
        let Some(commit) = self.state.read().last_commit else { return Ok(CompactReport::default()) };
        let root = super::inspect::root_of(self.nodes.device.as_ref(), commit)?;
        let mut found = Found::default();
        found.visit(&self.nodes, root, None, &candidates, &mut Vec::new())?;
        // File bytes first: each copy is an intent of its own, applied only
        // if the extent is still the one read (the file may change meanwhile).
        let mut report = CompactReport::default();
        for (ino, end, e) in &found.extents {
            let mut bytes = vec![0u8; e.len as usize];
            self.read_extent(e, 0, &mut bytes)?;
            let op = super::ops::Op::Relocate { ino: *ino, end: *end, from: e.data, rec_off: e.rec_off, len: e.len };
            self.run(&mut self.state.write(), op, &bytes)?;
            report.data_bytes += e.len as u64;
        }
        // Every node to move, and every node above one.
        let mut on_path: HashSet<Addr> = HashSet::new();
        for (addr, parents) in &found.nodes {
            on_path.insert(*addr);
            on_path.extend(parents.iter().copied());
            report.nodes += 1;
            report.bytes += addr.len as u64;
        }
        if report.nodes == 0 && report.data_bytes == 0 {
            return Ok(report);
        }
        {
            let mut st = self.state.write();
            rewrite(&self.nodes, &mut st.tree, &on_path)?;
        }
        self.commit()?;
        let live: HashMap<SegId, u64> = self.nodes.live_table().into_iter().collect();
        report.segments = candidates.into_iter().filter(|s| !live.contains_key(s)).collect();
        report.segments.sort();
        tracing::info!(segments = report.segments.len(), nodes = report.nodes, "compacted");
        Ok(report)
    }
}

/// What a walk of the tree found in the candidate segments.
#[derive(Default)]
struct Found {
    /// Nodes in candidate segments, each with the addresses above it.
    nodes: Vec<(Addr, Vec<Addr>)>,
    /// Extents whose bytes are in candidate segments: (inode, end, extent).
    extents: Vec<(u64, u64, Extent)>,
}

impl Found {
    /// Walks the subtree at `addr` (of `level`, if known); `above` holds
    /// the addresses on the way down to it.
    fn visit(
        &mut self,
        store: &dyn NodeStore,
        addr: Addr,
        level: Option<u8>,
        candidates: &HashSet<SegId>,
        above: &mut Vec<Addr>,
    ) -> Result<()> {
        let node = store.load(addr)?;
        if level.is_some_and(|l| l != node.level()) {
            return Err(crate::error::Error::corrupted("tree node (wrong level)", addr));
        }
        if candidates.contains(&addr.seg) {
            self.nodes.push((addr, above.clone()));
        }
        match &*node {
            Node::Leaf(l) => {
                for e in super::inspect::leaf_extents(l) {
                    let (k, e) = e?;
                    if candidates.contains(&e.data.seg) {
                        self.extents.push((keys::leading_u64(k), keys::trailing_u64(k), e));
                    }
                }
            }
            Node::Branch(b) => {
                above.push(addr);
                for c in &b.children {
                    if let Child::Disk(a) = c {
                        self.visit(store, *a, Some(b.level - 1), candidates, above)?;
                    }
                }
                above.pop();
            }
        }
        Ok(())
    }
}

/// Copies into memory every written node of `tree` in `on_path` (and so
/// the path above it), for the next commit to write afresh.
fn rewrite(store: &dyn NodeStore, tree: &mut Tree, on_path: &HashSet<Addr>) -> Result<()> {
    tree.rewrite_where(store, &|a| on_path.contains(&a))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Device, SimDevice};
    use crate::env::TestEnv;
    use crate::volume::{live_table_of, reachable_segments, recount_live_bytes, Config, ROOT_INO};
    use std::sync::Arc;

    fn contents(vol: &Volume, files: &[u64]) -> Vec<Vec<u8>> {
        files.iter().map(|&f| vol.read(f, 0, 1 << 20).expect("read")).collect()
    }

    /// A volume whose first segments are dead but for the leaves of small
    /// files written once, and a file whose data stays live. Returns the
    /// device, the config, the volume and its files.
    fn scenario() -> (SimDevice, Config, Arc<Volume>, Vec<u64>, u64) {
        let dev = SimDevice::new();
        let cfg = Config { commit_interval: None, segment_size: 256 << 10, env: TestEnv::new(3), ..Config::default() };
        let vol = Volume::open(Arc::new(dev.clone()), cfg.clone()).expect("open");
        // A file whose data stays live, written first, and a big one that
        // fills the rest of that segment and goes later.
        let pinned = vol.create(ROOT_INO, b"pinned.bin", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        vol.write(pinned, 0, &[7; 8192]).expect("write");
        let filler = vol.create(ROOT_INO, b"filler", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        vol.write(filler, 0, &[1; 300 << 10]).expect("write");
        vol.commit().expect("commit");
        // Small files that never change again: their leaves stay where
        // they were first written.
        let keep = vol.mkdir(ROOT_INO, b"keep", 0o755, 0, 0).expect("mkdir").ino;
        let mut files = vec![pinned];
        for i in 0..300 {
            let f = vol.create(keep, format!("f{i}").as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
            vol.write(f, 0, format!("small {i}").as_bytes()).expect("write");
            files.push(f);
        }
        vol.commit().expect("commit");
        vol.unlink(ROOT_INO, b"filler").expect("unlink");
        // Checkpoint-sized files written and deleted, round after round:
        // their segments die but for the nodes written beside them.
        for round in 0..6 {
            let f = vol.create(ROOT_INO, b"ckpt.pt", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
            for chunk in 0..8 {
                vol.write(f, chunk * 65536, &[round as u8; 65536]).expect("write");
                vol.commit().expect("commit");
            }
            vol.unlink(ROOT_INO, b"ckpt.pt").expect("unlink");
            vol.commit().expect("commit");
        }
        (dev, cfg, vol, files, pinned)
    }

    #[test]
    fn live_nodes_and_bytes_move_out_of_mostly_dead_segments_and_nothing_changes() {
        let (dev, cfg, vol, files, pinned) = scenario();
        let shared: Arc<dyn Device> = Arc::new(dev.clone());
        let before = contents(&vol, &files);
        let old_head = vol.last_commit().expect("commit");
        let mut reached = HashSet::new();
        reachable_segments(shared.clone(), old_head, &mut HashSet::new(), &mut reached).expect("reach");
        let data_seg = |vol: &Volume| {
            let st = vol.state.read();
            let k = crate::volume::keys::extent(pinned, 8192);
            Extent::decode(&st.tree.get(&vol.nodes, &k).expect("get").expect("extent")).expect("extent").data.seg
        };
        let pinned_at = data_seg(&vol);

        let report = vol.compact(0.5).expect("compact");
        assert!(report.segments.contains(&pinned_at), "{report:?}");
        assert!(report.nodes > 0 && report.bytes > 0 && report.data_bytes >= 8192, "{report:?}");
        let head = vol.last_commit().expect("commit");
        let mut now = HashSet::new();
        reachable_segments(shared.clone(), head, &mut HashSet::new(), &mut now).expect("reach");
        for seg in &report.segments {
            assert!(reached.contains(seg), "{seg} was not reachable before");
            assert!(!now.contains(seg), "{seg} is still reachable");
        }
        // The pinned file's bytes moved to the segment being written.
        assert_eq!(data_seg(&vol), vol.log().expect("log").position().0);
        // Nothing a user sees changed: diff reports nothing.
        assert_eq!(crate::volume::diff_commits(shared.clone(), old_head, head).expect("diff"), vec![]);
        // The live table is exact, and says the same.
        let mut table = live_table_of(shared.as_ref(), head).expect("table");
        let mut recount = recount_live_bytes(shared.clone(), head).expect("recount");
        table.sort();
        recount.sort();
        assert_eq!(table, recount);
        assert!(report.segments.iter().all(|s| table.iter().all(|(t, _)| t != s)));
        // Same bytes, now and after reopening.
        assert_eq!(contents(&vol, &files), before);
        assert_eq!(vol.compact(0.5).expect("again"), CompactReport::default(), "nothing left to move");
        vol.close().expect("close");
        drop(vol);
        let vol = Volume::open(shared, cfg).expect("reopen");
        assert_eq!(contents(&vol, &files), before);
    }

    /// A mount's background compaction and its unmount meet: the close
    /// waits for the compaction under way, and a compaction that comes
    /// after the close finds nothing to do. Neither fails, and nothing a
    /// user sees changes.
    #[test]
    fn a_compaction_and_the_close_take_turns() {
        // After the close: nothing to do, though there was before it.
        let (_, _, vol, _, _) = scenario();
        assert!(!vol.compactable(0.5).expect("compactable").is_empty());
        vol.close().expect("close");
        assert_eq!(vol.compact(0.5).expect("a compaction after the close"), CompactReport::default());
        // During it: the close waits, whenever it comes.
        let mut ran = 0;
        for delay_us in (0..400).step_by(40) {
            let (dev, cfg, vol, files, _) = scenario();
            let before = contents(&vol, &files);
            let started = Arc::new(std::sync::Barrier::new(2));
            let compactor = {
                let (vol, started) = (vol.clone(), started.clone());
                std::thread::spawn(move || {
                    started.wait();
                    vol.compact(0.5)
                })
            };
            started.wait();
            std::thread::sleep(std::time::Duration::from_micros(delay_us));
            vol.close().expect("close beside a compaction");
            let report = compactor.join().expect("compaction thread").expect("compaction beside a close");
            ran += usize::from(report != CompactReport::default());
            assert_eq!(vol.compact(0.5).expect("after the close"), CompactReport::default());
            drop(vol);
            let vol = Volume::open(Arc::new(dev.clone()), cfg).expect("reopen");
            assert_eq!(contents(&vol, &files), before, "delay {delay_us} µs");
        }
        assert!(ran > 0, "no compaction ran before its close");
    }

    /// A crash at any durable step of a compaction leaves every byte as it was.
    #[test]
    fn a_crash_anywhere_in_a_compaction_changes_nothing() {
        let mut crashed = 0;
        for nth in 0..40 {
            let (dev, cfg, vol, files, _) = scenario();
            let before = contents(&vol, &files);
            dev.crash_at_failpoint(None, nth);
            let done = vol.compact(0.5);
            dev.crash(crate::device::CrashMode::DropUnsynced);
            drop(vol);
            if done.is_err() {
                crashed += 1;
            }
            let vol = Volume::open(Arc::new(dev.clone()), cfg).expect("recovery");
            assert_eq!(contents(&vol, &files), before, "crash at failpoint {nth}");
        }
        assert!(crashed > 0, "no failpoint was reached inside compaction");
    }
}
