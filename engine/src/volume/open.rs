//! Opening a volume: load the newest commit, replay the intents after it,
//! cut a torn tail, start a new writer epoch, and commit.

use super::commit::{features, read_commit, Superblock};
use super::nodes::Nodes;
use super::ops::{self, Op};
use super::txn::{Reads, Txn};
use super::{keys, Config, State, Volume, ROOT_INO};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::format::RecordKind;
use crate::log::{Cursor, Log, Next, Record};
use crate::tree::Tree;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, Weak};

/// What recovery found.
#[derive(Debug, Default, Clone)]
pub struct Recovery {
    pub replayed: u64,
    pub torn_at: Option<String>,
    /// The segments replayed, all of one writer that is gone.
    pub segments: Vec<crate::format::SegId>,
    /// Of those, how many lived only as WAL pieces and became segment
    /// objects, and how many WAL pieces went.
    pub sealed: u64,
    pub wal_pieces_deleted: u64,
}

impl Volume {
    /// Opens (or, on an empty device, creates) a volume.
    pub fn open(device: Arc<dyn Device>, cfg: Config) -> Result<Arc<Volume>> {
        Self::open_with_report(device, cfg).map(|(v, _)| v)
    }

    pub fn open_with_report(device: Arc<dyn Device>, cfg: Config) -> Result<(Arc<Volume>, Recovery)> {
        let nodes = Nodes::new(device.clone(), cfg.node_cache_bytes);
        // A tree made from empty keeps every promise this build knows.
        let mut st = State {
            tree: Tree::new(),
            next_ino: ROOT_INO + 1,
            ops_since_commit: 0,
            last_commit: None,
            features: features::PROMISES,
        };
        let mut report = Recovery::default();
        let superblock = device.read_superblock()?.map(|b| Superblock::decode(&b)).transpose()?;
        let mut last_seq = 0;
        if let Some(sb) = &superblock {
            last_seq = replay(&nodes, &mut st, sb, cfg.read_only, &mut report)?;
        } else if cfg.read_only {
            return Err(Error::NotFound);
        }
        let vol = Volume {
            state: RwLock::new(st),
            nodes,
            sources: crate::source::SourceReader::new(
                cfg.sources.clone(),
                cfg.source_servers.clone(),
                cfg.source_files.clone(),
            ),
            cfg,
            opens: Mutex::new(HashMap::new()),
            poisoned: AtomicBool::new(false),
            stop_committer: Mutex::new(None),
            recovery: Mutex::new(Recovery::default()),
            room: Mutex::default(),
            compacting: Mutex::new(()),
        };
        if !vol.cfg.read_only {
            let writer = fresh_writer(device.as_ref(), vol.cfg.env.as_ref())?;
            let log =
                Log::create_with(device.clone(), writer, last_seq + 1, vol.cfg.segment_size, vol.cfg.write_behind)?;
            let _ = vol.nodes.log.set(Arc::new(log));
            let mut st = vol.state.write();
            if superblock.is_none() {
                let op = Op::InitRoot { perm: 0o755, uid: vol.cfg.root_uid, gid: vol.cfg.root_gid, time: vol.now() };
                vol.run(&mut st, op, &[])?;
            }
            // The replayed records may sit in the page cache only (their
            // writer was killed, the node kept running): made durable
            // before this writer commits on top of them, or a later fsync
            // here would answer for bytes a power loss still takes.
            for seg in &report.segments {
                if let Some(f) = device.open_segment(*seg)? {
                    f.sync()?;
                }
            }
            let orphans = Txn { tree: &mut st.tree, store: &vol.nodes }.keys_with_prefix(&[keys::ORPHAN])?;
            for k in orphans {
                vol.run(&mut st, Op::DropOrphan { ino: keys::leading_u64(&k) }, &[])?;
            }
            vol.commit_locked(&mut st)?;
            drop(st);
            // This volume holds the branch now (its commit claimed it), so
            // the writer whose log was replayed is gone for good.
            if !report.segments.is_empty() {
                match device.replica().map_or(Ok((0, 0)), |r| r.seal_recovered(&report.segments)) {
                    Ok((sealed, deleted)) => {
                        report.sealed = sealed;
                        report.wal_pieces_deleted = deleted;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot seal the segments recovery replayed; they stay as WAL pieces")
                    }
                }
            }
        }
        *vol.recovery.lock() = report.clone();
        let vol = Arc::new(vol);
        if let (Some(every), false) = (vol.cfg.commit_interval, vol.cfg.read_only) {
            let (tx, rx) = mpsc::channel();
            *vol.stop_committer.lock() = Some(tx);
            spawn_committer(Arc::downgrade(&vol), rx, every)?;
        }
        Ok((vol, report))
    }
}

/// Loads the superblock's commit and replays every intent after it.
/// Returns the last sequence number seen.
fn replay(nodes: &Nodes, st: &mut State, sb: &Superblock, read_only: bool, report: &mut Recovery) -> Result<u64> {
    let device = nodes.device.clone();
    let commit = read_commit(device.as_ref(), sb.commit)?;
    st.tree = Tree::from_root(commit.record.root);
    st.next_ino = commit.record.next_ino;
    st.features = commit.features;
    nodes.set_live_table(&commit.record.live);
    st.last_commit = Some(sb.commit);
    let mut last_seq = commit.seq;
    if !sb.replay {
        skip_reserved_inodes(nodes, st)?;
        return Ok(last_seq);
    }
    report.segments.push(sb.commit.seg);
    let mut cursor = Cursor::new(device.clone(), sb.commit.seg, sb.commit.end())?.expecting(commit.seq + 1);
    // The pieces of a large write seen so far: applied with its last piece.
    let mut parts: Vec<(Op, Record)> = Vec::new();
    loop {
        match cursor.next_record()? {
            Next::Record(r) => {
                last_seq = r.seq;
                if report.segments.last() != Some(&r.addr.seg) {
                    report.segments.push(r.addr.seg);
                }
                if r.kind != RecordKind::Intent {
                    continue;
                }
                let (op, tag) =
                    super::requests::decode_intent(&r.meta).map_err(|_| Error::corrupted("intent", r.addr))?;
                if let Op::WritePart { .. } = op {
                    parts.push((op, r));
                    continue;
                }
                // A write's pieces are logged back to back under the
                // volume's lock: anything but their last piece after them
                // means the write never finished.
                let finished = matches!((parts.first(), &op), (Some((Op::WritePart { ino: a, .. }, _)), Op::Write { ino: b, .. }) if a == b);
                if !parts.is_empty() && !finished {
                    tracing::warn!(
                        pieces = parts.len(),
                        "dropping the pieces of a write whose last piece was never logged"
                    );
                    parts.clear();
                }
                for (op, r) in parts.drain(..).chain([(op, r)]) {
                    let data = ops::Data { addr: r.data_addr, crcs: &r.crcs, bytes: &r.data };
                    let mut tx = Txn { tree: &mut st.tree, store: nodes };
                    ops::apply(&mut tx, &op, &data, &mut st.next_ino, &mut st.features)?;
                    st.ops_since_commit += 1;
                    report.replayed += 1;
                }
                // The tag was logged with the write's last piece (or the
                // operation itself), which was applied last.
                if let Some(tag) = tag {
                    let mut tx = Txn { tree: &mut st.tree, store: nodes };
                    super::requests::record(&mut tx, &tag, &mut st.features)?;
                }
            }
            Next::End => break,
            Next::Torn(seg, off, why) => {
                tracing::warn!(%seg, off, %why, "log ends in a torn or corrupt record; cutting it off");
                report.torn_at = Some(format!("{seg}@{off}: {why}"));
                if !read_only {
                    if let Some(f) = device.open_segment(seg)? {
                        f.truncate(off)?;
                    }
                }
                break;
            }
        }
    }
    if !parts.is_empty() {
        tracing::warn!(pieces = parts.len(), "the log ends inside a write: dropping its pieces");
    }
    skip_reserved_inodes(nodes, st)?;
    Ok(last_seq)
}

/// Numbers an owner reserved may be held by its clients for files a crash
/// took: no writer of this branch (owner or not) gives them out again.
fn skip_reserved_inodes(nodes: &Nodes, st: &mut State) -> Result<()> {
    let key = super::keys::request(super::requests::INODES_RESERVED_CLIENT, 0);
    let reserved =
        st.tree.get(nodes, &key)?.and_then(|v| v.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes));
    if let Some(r) = reserved {
        st.next_ino = st.next_ino.max(r);
    }
    Ok(())
}

/// A writer id no segment on this device uses yet.
fn fresh_writer(device: &dyn Device, env: &dyn crate::env::Env) -> Result<u64> {
    let taken: std::collections::HashSet<u64> = device.list_segments()?.into_iter().map(|s| s.writer).collect();
    for _ in 0..64 {
        let w = env.random_u64();
        if w != 0 && !taken.contains(&w) {
            return Ok(w);
        }
    }
    Err(Error::Invalid("could not pick a fresh writer id"))
}

fn spawn_committer(vol: Weak<Volume>, stop: mpsc::Receiver<()>, every: std::time::Duration) -> Result<()> {
    std::thread::Builder::new()
        .name("arbor-commit".into())
        .spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(every) {
                let Some(vol) = vol.upgrade() else { return };
                let dirty = vol.state.read().ops_since_commit > 0;
                if dirty && !vol.is_poisoned() {
                    if let Err(e) = vol.commit() {
                        tracing::error!(error = %e, "background commit failed");
                    }
                }
            }
        })
        .map(|_| ())
        .map_err(Error::Io)
}
