//! A volume: one branch's tree opened for POSIX-shaped file operations.
//!
//! Every change is validated first (so bad input changes nothing), then
//! logged as an intent, then applied to the in-memory tree by
//! `ops::apply`. `fsync` waits until the log is durable past the caller's
//! intents; commits write the dirty tree and a commit record and bound how
//! much recovery must replay.

mod commit;
mod compact;
mod inspect;
mod keys;
mod namespace;
mod nodes;
mod open;
pub use open::Recovery;
mod ops;
mod read;
mod requests;
pub use requests::{RequestTag, Takes, INODES_RESERVED_CLIENT};
mod txn;
mod types;

pub use commit::{features, read_commit, Commit, CommitRecord, Superblock};
pub use compact::{CompactReport, MAX_LIVE};
pub use inspect::{
    diff_commits, live_table_of, reachable_segments, recount_live_bytes, root_of, Change, ChangeKind, Inspector,
};
pub use nodes::load_record;
pub use ops::Op;
pub use read::{fill_in_order, read_extent, Located, Place};
pub use types::*;

use crate::device::Device;
use crate::env::{Env, SystemEnv, Timestamp};
use crate::error::{Error, Result};
use crate::format::{decode_value, Addr, BLOCK_SIZE};
use crate::log::Log;
use crate::tree::Tree;
use nodes::Nodes;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;
use txn::{Reads, View};

/// A segment is sealed once it would grow past this, by default.
pub const SEGMENT_SIZE: u64 = 64 << 20;

/// How long a reading of the free space counts, far from the reserve.
const ROOM_RECHECK: Duration = Duration::from_secs(1);
/// Within this of the reserve, the free space is read before every change.
const ROOM_MARGIN: u64 = 64 << 20;

/// The free space of the log's file system, as last read, less what was
/// accepted since.
#[derive(Default)]
struct Room {
    checked: Option<std::time::Instant>,
    free: u64,
}

/// Free bytes the log's file system keeps back from new operations (see
/// `Volume::check_room`): what the log may still write for operations it
/// already accepted.
pub const SPACE_RESERVE: u64 = 16 << 20;

#[derive(Clone)]
pub struct Config {
    /// A segment is sealed once it would grow past this.
    pub segment_size: u64,
    /// Memory for clean tree nodes.
    pub node_cache_bytes: u64,
    /// Commit after this many intents, to bound replay after a crash.
    pub commit_every_ops: u64,
    /// Commit in the background this often when anything changed.
    pub commit_interval: Option<Duration>,
    /// Refuse every change with EROFS.
    pub read_only: bool,
    /// Write appended records to the segment file on a thread of their own,
    /// so a writer does not wait for the copy into the page cache (the
    /// next write overlaps it). Durability is unchanged: fsync waits.
    pub write_behind: bool,
    /// Owner of the root directory of a new volume.
    pub root_uid: u32,
    pub root_gid: u32,
    pub env: Arc<dyn Env>,
    /// Where imported files' objects are read from.
    pub sources: Arc<dyn crate::source::Sources>,
    /// Cache servers asked for an imported file's chunks before its bucket.
    pub source_servers: Option<Arc<dyn crate::chunks::ChunkSource>>,
    /// Where an imported file's chunks are kept on local disk.
    pub source_files: Option<Arc<crate::chunks::ChunkFiles>>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            segment_size: SEGMENT_SIZE,
            node_cache_bytes: 256 << 20,
            commit_every_ops: 16_384,
            commit_interval: Some(Duration::from_secs(1)),
            read_only: false,
            write_behind: true,
            root_uid: 0,
            root_gid: 0,
            env: Arc::new(SystemEnv),
            sources: Arc::new(crate::source::S3Sources::default()),
            source_servers: None,
            source_files: None,
        }
    }
}

/// A snapshot of a volume's counters.
#[derive(Clone, Debug)]
pub struct VolumeStats {
    pub read_only: bool,
    pub poisoned: bool,
    pub io_backend: &'static str,
    /// Bytes of the log written past the page cache (`O_DIRECT`).
    pub direct_bytes: u64,
    pub writer: u64,
    pub last_seq: u64,
    pub durable_seq: u64,
    pub log_position: Option<(crate::format::SegId, u64)>,
    pub ops_since_commit: u64,
    pub inodes_allocated: u64,
    pub node_cache_bytes: u64,
    pub last_commit: Option<Addr>,
}

struct State {
    tree: Tree,
    next_ino: u64,
    ops_since_commit: u64,
    last_commit: Option<Addr>,
    /// The tree's feature bits ([`commit::features`]), kept in each commit.
    features: u64,
}

pub struct Volume {
    state: RwLock<State>,
    nodes: Nodes,
    cfg: Config,
    /// Open handles per inode: an unlinked file lives on until its last close.
    opens: Mutex<HashMap<u64, u32>>,
    poisoned: AtomicBool,
    stop_committer: Mutex<Option<mpsc::Sender<()>>>,
    /// What recovery found and did when this volume was opened.
    recovery: Mutex<open::Recovery>,
    room: Mutex<Room>,
    /// Reads imported files' objects.
    sources: crate::source::SourceReader,
    /// Held by a compaction for its whole run and by [`Volume::close`]: a
    /// mount's background compaction and its unmount (the FUSE session's
    /// end, which closes the volume) take turns, so the final commit never
    /// cuts a compaction off halfway.
    compacting: Mutex<()>,
}

fn check_name(name: &[u8]) -> Result<()> {
    if name.len() > NAME_MAX {
        return Err(Error::NameTooLong);
    }
    if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
        return Err(Error::Invalid("file name"));
    }
    Ok(())
}

fn is_dot(name: &[u8]) -> bool {
    name == b"." || name == b".."
}

fn resolve(t: Option<TimeSet>, now: Timestamp) -> Option<Timestamp> {
    t.map(|t| match t {
        TimeSet::Now => now,
        TimeSet::At(ts) => ts,
    })
}

impl Volume {
    fn view<'a>(&'a self, st: &'a State) -> View<'a> {
        View { tree: &st.tree, store: &self.nodes }
    }

    fn log(&self) -> Result<&Arc<Log>> {
        if self.cfg.read_only {
            return Err(Error::ReadOnly);
        }
        if self.poisoned.load(Ordering::Acquire) {
            return Err(Error::Poisoned);
        }
        self.nodes.log.get().ok_or(Error::ReadOnly)
    }

    fn poison(&self, e: Error) -> Error {
        if !matches!(e, Error::Crashed(_)) {
            tracing::error!(error = %e, "volume stops accepting writes");
        }
        self.poisoned.store(true, Ordering::Release);
        e
    }

    fn now(&self) -> Timestamp {
        self.cfg.env.now()
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.nodes.device
    }

    pub fn is_read_only(&self) -> bool {
        self.cfg.read_only
    }

    /// What recovery found and did when this volume was opened.
    pub fn recovery(&self) -> Recovery {
        self.recovery.lock().clone()
    }

    /// Whether a failed sync or write has stopped this volume.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire) || self.nodes.log.get().is_some_and(|l| l.is_poisoned())
    }

    /// The inode number the next new file gets.
    pub fn next_inode(&self) -> u64 {
        self.state.read().next_ino
    }

    /// Whether another writer took this volume's branch (or this writer's
    /// lease could not be kept): it then refuses every write and fsync.
    pub fn is_fenced(&self) -> bool {
        !self.cfg.read_only && matches!(self.nodes.device.check_writable(), Err(crate::Error::Fenced(_)))
    }

    /// The log this volume writes, if it is writable.
    pub fn log_handle(&self) -> Option<&Arc<Log>> {
        self.nodes.log.get()
    }

    /// Counters for `arbor status`.
    pub fn stats(&self) -> VolumeStats {
        let log = self.nodes.log.get();
        let st = self.state.read();
        VolumeStats {
            read_only: self.cfg.read_only,
            poisoned: self.is_poisoned(),
            io_backend: self.nodes.device.io_name(),
            direct_bytes: self.nodes.device.direct_bytes(),
            writer: log.map_or(0, |l| l.writer()),
            last_seq: log.map_or(0, |l| l.last_seq()),
            durable_seq: log.map_or(0, |l| l.durable_seq()),
            log_position: log.map(|l| l.position()),
            ops_since_commit: st.ops_since_commit,
            inodes_allocated: st.next_ino - 1,
            node_cache_bytes: self.nodes.cache.weight(),
            last_commit: st.last_commit,
        }
    }

    /// Bytes per segment that this volume's tree references, as of now
    /// (written nodes and file data; dirty nodes count once written).
    pub fn live_bytes(&self) -> Vec<(crate::format::SegId, u64)> {
        let _st = self.state.read();
        self.nodes.live_table()
    }

    /// The tree's feature bits ([`features`]).
    pub fn features(&self) -> u64 {
        self.state.read().features
    }

    /// The directory and name `ino`'s inode records as its name.
    pub fn recorded_name(&self, ino: u64) -> Result<(u64, Vec<u8>)> {
        let st = self.state.read();
        let i = self.view(&st).inode(ino)?;
        Ok((i.parent, i.name))
    }

    /// The address of the newest durable commit.
    pub fn last_commit(&self) -> Option<Addr> {
        self.state.read().last_commit
    }

    /// Refuses with ENOSPC, changing nothing, when the log's file system
    /// has less than `need` bytes free beyond `reserve` (normally
    /// [`SPACE_RESERVE`]): what the log may still write for what it already
    /// accepted (the write-behind queue, a commit's nodes, a new segment).
    /// So a full disk stops new operations before a write already
    /// acknowledged can fail, and the volume works again once space is freed.
    ///
    /// The free space is asked of the device (a statvfs) at most once a
    /// second while it is far from the reserve, counting down what was
    /// accepted since; near it, before every change.
    fn check_room(&self, need: u64, reserve: u64) -> Result<()> {
        let mut room = self.room.lock();
        let fresh = room.checked.is_some_and(|t| t.elapsed() < ROOM_RECHECK);
        if !fresh || room.free < need.saturating_add(reserve).saturating_add(ROOM_MARGIN) {
            let Some(free) = self.nodes.device.free_bytes() else { return Ok(()) };
            *room = Room { checked: Some(std::time::Instant::now()), free };
        }
        if room.free < need.saturating_add(reserve) {
            tracing::warn!(
                free = room.free,
                need,
                "refusing a change: the log's file system is (nearly) full; deleted and rewritten files keep \
                 their segments until `arbor compact` and `arbor gc` free them (or a mount with --maintain-every)"
            );
            return Err(Error::Io(std::io::Error::from_raw_os_error(libc::ENOSPC)));
        }
        room.free -= need;
        Ok(())
    }

    /// Logs one intent and applies it.
    fn run(&self, st: &mut State, op: ops::Op, data: &[u8]) -> Result<()> {
        let log = self.log()?;
        match op {
            // A write's room is checked once for all its pieces, by `write`.
            ops::Op::Write { .. }
            | ops::Op::WritePart { .. }
            | ops::Op::Spill { .. }
            | ops::Op::InitRoot { .. }
            | ops::Op::Mark => {}
            // What frees names (and, after gc, space) may use half the
            // reserve, so a full disk can still be cleaned up.
            ops::Op::Unlink { .. } | ops::Op::RemoveXattr { .. } | ops::Op::DropOrphan { .. } => {
                self.check_room(0, SPACE_RESERVE / 2)?
            }
            _ => self.check_room(data.len() as u64, SPACE_RESERVE)?,
        }
        let tag = requests::take_for(&op);
        let meta = requests::encode_intent(&op, tag.as_ref());
        let app =
            log.append(crate::format::RecordKind::Intent, &meta, data, crate::device::failpoints::INTENT_APPEND)?;
        let d = ops::Data { addr: app.data, crcs: &app.crcs, bytes: data };
        let mut tx = txn::Txn { tree: &mut st.tree, store: &self.nodes };
        let applied = ops::apply(&mut tx, &op, &d, &mut st.next_ino, &mut st.features)
            .and_then(|()| tag.map_or(Ok(()), |t| requests::record(&mut tx, &t, &mut st.features)));
        if let Err(e) = applied {
            return Err(self.poison(e));
        }
        st.ops_since_commit += 1;
        // Never between the pieces of a write: a commit there would make
        // the first pieces durable without the last.
        let inside_a_write = matches!(op, ops::Op::WritePart { .. });
        if st.ops_since_commit >= self.cfg.commit_every_ops && !inside_a_write {
            self.commit_locked(st)?;
        }
        Ok(())
    }

    // ---- metadata reads ----

    pub fn getattr(&self, ino: u64) -> Result<Attr> {
        let st = self.state.read();
        Ok(Attr::from_inode(ino, &self.view(&st).inode(ino)?))
    }

    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        check_name(name)?;
        let st = self.state.read();
        let v = self.view(&st);
        let p = v.dir_inode(parent)?;
        let ino = match name {
            b"." => parent,
            b".." => p.parent,
            _ => v.entry(parent, name)?.ok_or(Error::NotFound)?.ino,
        };
        Ok(Attr::from_inode(ino, &v.inode(ino)?))
    }

    /// The attributes of `path` (`/`-separated, from the root; empty and
    /// `.` parts are skipped; symlinks are not followed).
    pub fn lookup_path(&self, path: &str) -> Result<Attr> {
        let mut a = self.getattr(ROOT_INO)?;
        for part in path.split('/').filter(|p| !p.is_empty() && *p != ".") {
            a = self.lookup(a.ino, part.as_bytes())?;
        }
        Ok(a)
    }

    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        let st = self.state.read();
        let i = self.view(&st).inode(ino)?;
        match (i.kind, i.inline) {
            (FileKind::Symlink, Some(t)) => Ok(t),
            _ => Err(Error::Invalid("not a symlink")),
        }
    }

    /// Lists `ino` from `offset` (0 to start; else an entry's `offset`),
    /// calling `f` until it returns false.
    pub fn readdir(&self, ino: u64, offset: u64, mut f: impl FnMut(DirEntryOut) -> bool) -> Result<()> {
        let st = self.state.read();
        let v = self.view(&st);
        let dir = v.dir_inode(ino)?;
        if offset < 1 && !f(DirEntryOut { ino, kind: FileKind::Directory, name: b".".to_vec(), offset: 1 }) {
            return Ok(());
        }
        if offset < 2 && !f(DirEntryOut { ino: dir.parent, kind: FileKind::Directory, name: b"..".to_vec(), offset: 2 })
        {
            return Ok(());
        }
        let prefix = keys::cookie_prefix(ino);
        let from = keys::cookie(ino, offset.max(FIRST_COOKIE - 1) + 1);
        st.tree.scan(&self.nodes, &from, &mut |k, val| {
            if !k.starts_with(&prefix) {
                return Ok(false);
            }
            let e: CookieEntry = decode_value(val, "directory listing entry")?;
            Ok(f(DirEntryOut { ino: e.ino, kind: e.kind, name: e.name, offset: keys::trailing_u64(k) }))
        })
    }

    /// Every entry of a directory except "." and "..".
    pub fn list_dir(&self, ino: u64) -> Result<Vec<DirEntryOut>> {
        let mut out = Vec::new();
        self.readdir(ino, 2, |e| {
            out.push(e);
            true
        })?;
        Ok(out)
    }

    pub fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        let st = self.state.read();
        self.view(&st).inode(ino)?;
        st.tree.get(&self.nodes, &keys::xattr(ino, name))?.ok_or(Error::NoAttr)
    }

    pub fn listxattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        let st = self.state.read();
        let v = self.view(&st);
        v.inode(ino)?;
        Ok(v.keys_with_prefix(&keys::xattr_prefix(ino))?.into_iter().map(|k| k[9..].to_vec()).collect())
    }

    pub fn statfs(&self) -> StatFs {
        let st = self.state.read();
        let total_blocks = (1u64 << 50) / BLOCK_SIZE as u64;
        let files = 1u64 << 40;
        StatFs {
            blocks: total_blocks,
            bfree: total_blocks,
            bavail: total_blocks,
            files,
            ffree: files - st.next_ino,
            bsize: BLOCK_SIZE as u32,
            namelen: NAME_MAX as u32,
        }
    }

    // ---- attributes ----

    pub fn setattr(&self, ino: u64, attr: SetAttr) -> Result<Attr> {
        self.log()?;
        let mut st = self.state.write();
        let i = self.view(&st).inode(ino)?;
        if let Some(size) = attr.size {
            match i.kind {
                FileKind::Directory => return Err(Error::IsDir),
                FileKind::Regular => {}
                _ => return Err(Error::Invalid("truncate of a special file")),
            }
            if size > MAX_FILE_SIZE {
                return Err(Error::TooBig);
            }
            if size > INLINE_DATA_MAX {
                self.spill(&mut st, ino)?;
            }
        }
        let now = self.now();
        let op = ops::Op::SetAttr {
            ino,
            perm: attr.perm.map(|p| p & 0o7777),
            uid: attr.uid,
            gid: attr.gid,
            size: attr.size,
            atime: resolve(attr.atime, now),
            mtime: resolve(attr.mtime, now),
            time: now,
        };
        self.run(&mut st, op, &[])?;
        Ok(Attr::from_inode(ino, &self.view(&st).inode(ino)?))
    }

    pub fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: XattrFlags) -> Result<()> {
        if name.is_empty() || name.contains(&0) {
            return Err(Error::Invalid("attribute name"));
        }
        if name.len() > XATTR_NAME_MAX {
            return Err(Error::AttrTooBig);
        }
        if value.len() > XATTR_VALUE_MAX {
            return Err(Error::AttrTooBig);
        }
        self.log()?;
        let mut st = self.state.write();
        self.view(&st).inode(ino)?;
        let exists = st.tree.get(&self.nodes, &keys::xattr(ino, name))?.is_some();
        match flags {
            XattrFlags::Create if exists => return Err(Error::Exists),
            XattrFlags::Replace if !exists => return Err(Error::NoAttr),
            _ => {}
        }
        self.run(&mut st, ops::Op::SetXattr { ino, name: name.to_vec(), value: value.to_vec(), time: self.now() }, &[])
    }

    pub fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()> {
        self.log()?;
        let mut st = self.state.write();
        self.view(&st).inode(ino)?;
        if st.tree.get(&self.nodes, &keys::xattr(ino, name))?.is_none() {
            return Err(Error::NoAttr);
        }
        self.run(&mut st, ops::Op::RemoveXattr { ino, name: name.to_vec(), time: self.now() }, &[])
    }

    // ---- data ----

    /// Writes `data` at `off`; returns the bytes written (all of them).
    pub fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<usize> {
        self.write_where(ino, Some(off), data)
    }

    /// Writes `data` at the end of file `ino` as it is when the write
    /// runs (`O_APPEND` as this volume sees it, whatever size a caller
    /// last saw): a number of bytes written, as [`Volume::write`].
    pub fn append(&self, ino: u64, data: &[u8]) -> Result<usize> {
        self.write_where(ino, None, data)
    }

    /// [`Volume::write`] at `off`, or at the end of the file (`None`).
    fn write_where(&self, ino: u64, off: Option<u64>, data: &[u8]) -> Result<usize> {
        if off.unwrap_or(0).checked_add(data.len() as u64).is_none_or(|end| end > MAX_FILE_SIZE) {
            return Err(Error::TooBig);
        }
        self.log()?;
        let mut st = self.state.write();
        let i = self.view(&st).inode(ino)?;
        let off = off.unwrap_or(i.size);
        if off.checked_add(data.len() as u64).is_none_or(|end| end > MAX_FILE_SIZE) {
            return Err(Error::TooBig);
        }
        match i.kind {
            FileKind::Regular => {}
            FileKind::Directory => return Err(Error::IsDir),
            _ => return Err(Error::Invalid("write to a special file")),
        }
        if data.is_empty() {
            return Ok(0);
        }
        self.check_room(data.len() as u64, SPACE_RESERVE)?;
        let end = off + data.len() as u64;
        if end > INLINE_DATA_MAX {
            self.spill(&mut st, ino)?;
        }
        // One record per piece; all but the last are parts, which recovery
        // applies only once the last is in the log too.
        let time = self.now();
        let pieces = data.chunks(self.max_write_chunk());
        let last = pieces.len() - 1;
        let mut at = off;
        for (n, piece) in pieces.enumerate() {
            let op = if n == last {
                ops::Op::Write { ino, off: at, time }
            } else {
                ops::Op::WritePart { ino, off: at, time }
            };
            self.run(&mut st, op, piece)?;
            at += piece.len() as u64;
        }
        Ok(data.len())
    }

    /// Makes `len` bytes of file `dst` from `dst_off` the bytes of file
    /// `src` from `src_off` without copying them: `dst`'s extents point at
    /// the log bytes `src`'s do (copy-on-write keeps both files apart from
    /// then on). One intent, so the clone is whole or absent after a crash.
    /// The range is cut at the end of `src`; returns the bytes cloned.
    /// An imported file's object bytes cannot be cloned (`EOPNOTSUPP`: the
    /// caller copies them).
    pub fn clone_range(&self, src: u64, src_off: u64, dst: u64, dst_off: u64, len: u64) -> Result<u64> {
        self.log()?;
        let mut st = self.state.write();
        let len = self.clone_checked(&st, src, src_off, dst, dst_off, len)?;
        if len == 0 {
            return Ok(0);
        }
        self.spill(&mut st, src)?;
        self.spill(&mut st, dst)?;
        self.run(&mut st, ops::Op::CloneRange { src, src_off, dst, dst_off, len, time: self.now() }, &[])?;
        Ok(len)
    }

    /// What [`Volume::clone_range`] would clone now (the range cut at the
    /// source's end), or why it would refuse, changing nothing.
    pub fn check_clone(&self, src: u64, src_off: u64, dst: u64, dst_off: u64, len: u64) -> Result<u64> {
        self.log()?;
        self.clone_checked(&self.state.read(), src, src_off, dst, dst_off, len)
    }

    fn clone_checked(&self, st: &State, src: u64, src_off: u64, dst: u64, dst_off: u64, len: u64) -> Result<u64> {
        let (s, d) = (self.view(st).inode(src)?, self.view(st).inode(dst)?);
        for kind in [s.kind, d.kind] {
            match kind {
                FileKind::Regular => {}
                FileKind::Directory => return Err(Error::IsDir),
                _ => return Err(Error::Invalid("a clone of a special file")),
            }
        }
        let len = len.min(s.size.saturating_sub(src_off));
        if len == 0 {
            return Ok(0);
        }
        if dst_off.checked_add(len).is_none_or(|end| end > MAX_FILE_SIZE) {
            return Err(Error::TooBig);
        }
        if src == dst && src_off < dst_off + len && dst_off < src_off + len {
            return Err(Error::Invalid("a clone onto an overlapping range of the same file"));
        }
        if self.view(st).source(src)?.is_some() {
            return Err(Error::Io(std::io::Error::from_raw_os_error(libc::EOPNOTSUPP)));
        }
        Ok(len)
    }

    /// The largest data payload one record carries.
    fn max_write_chunk(&self) -> usize {
        let by_segment = (self.cfg.segment_size / 2) as usize;
        (1usize << 20).min(by_segment.saturating_sub(BLOCK_SIZE)).max(BLOCK_SIZE)
    }

    /// Moves an inline file's bytes into an extent before it grows past the
    /// inline limit.
    fn spill(&self, st: &mut State, ino: u64) -> Result<()> {
        let i = self.view(st).inode(ino)?;
        match i.inline {
            Some(bytes) if i.kind == FileKind::Regular => self.run(st, ops::Op::Spill { ino }, &bytes),
            _ => Ok(()),
        }
    }

    // ---- handles and durability ----

    /// Notes an open handle on `ino`.
    pub fn acquire(&self, ino: u64) -> Result<Attr> {
        // Under the state lock: an unlink or a rename that drops the last
        // name decides from the open count whether the file stays, so it
        // must not fall between the check that the file is there and the
        // count.
        let st = self.state.read();
        let attr = Attr::from_inode(ino, &self.view(&st).inode(ino)?);
        *self.opens.lock().entry(ino).or_default() += 1;
        Ok(attr)
    }

    /// Drops an open handle; the last close of an unlinked file deletes it.
    pub fn release(&self, ino: u64) -> Result<()> {
        let last = {
            let mut opens = self.opens.lock();
            match opens.get_mut(&ino) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    false
                }
                Some(_) => {
                    opens.remove(&ino);
                    true
                }
                None => false,
            }
        };
        if !last || self.cfg.read_only {
            return Ok(());
        }
        // Every close passes here: look under the shared lock, and take the
        // exclusive one only for a file that really was unlinked.
        let orphan = |st: &State| -> Result<bool> { Ok(self.view(st).try_inode(ino)?.is_some_and(|i| i.nlink == 0)) };
        if !orphan(&self.state.read())? {
            return Ok(());
        }
        let mut st = self.state.write();
        if orphan(&st)? {
            self.run(&mut st, ops::Op::DropOrphan { ino }, &[])?;
        }
        Ok(())
    }

    /// Returns once everything done so far is in the log's files, not yet
    /// synced (see [`Log::write_out`]); nothing to do when read-only.
    pub fn write_out(&self) -> Result<()> {
        match self.log() {
            Ok(log) => log.write_out(),
            Err(Error::ReadOnly) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Returns once everything done so far is durable. (The log is one
    /// sequence, so syncing a file's intents syncs all before them too.)
    pub fn fsync(&self, _ino: u64) -> Result<()> {
        self.sync_all()
    }

    pub fn fdatasync(&self, ino: u64) -> Result<()> {
        self.fsync(ino)
    }

    pub fn sync_all(&self) -> Result<()> {
        if self.cfg.read_only {
            return Ok(());
        }
        self.log()?.sync_all()?;
        // A writer fenced off its branch acknowledges nothing, even an
        // fsync with nothing left to write: a newer writer does not read
        // what this one wrote.
        if let Err(e @ crate::Error::Fenced(_)) = self.nodes.device.check_writable() {
            return Err(e);
        }
        Ok(())
    }

    /// Writes the dirty tree and a durable commit record now.
    pub fn commit(&self) -> Result<()> {
        if self.cfg.read_only {
            return Ok(());
        }
        let mut st = self.state.write();
        self.commit_locked(&mut st)
    }

    fn commit_locked(&self, st: &mut State) -> Result<()> {
        self.commit_locked_with(st, true).map(|_| ())
    }

    /// Commits durably without replacing the branch head, and returns the
    /// commit: all a checkpoint needs. The head catches up at the next
    /// background commit; until then recovery replays from the older head,
    /// which reaches the same state.
    pub fn commit_for_checkpoint(&self) -> Result<Addr> {
        let mut st = self.state.write();
        let addr = self.commit_locked_with(&mut st, false)?;
        st.ops_since_commit = st.ops_since_commit.max(1);
        Ok(addr)
    }

    fn commit_locked_with(&self, st: &mut State, publish_head: bool) -> Result<Addr> {
        let log = self.log()?.clone();
        let res = (|| {
            let root = st.tree.flush(&self.nodes)?;
            let rec = CommitRecord {
                root,
                next_ino: st.next_ino,
                covers_seq: log.last_seq(),
                prev: st.last_commit,
                time: self.now(),
                live: self.nodes.live_table(),
            };
            let meta = crate::format::encode_value(&rec);
            let app = log.append(
                crate::format::RecordKind::Commit,
                &meta,
                &commit::encode_features(st.features),
                crate::device::failpoints::COMMIT_RECORD,
            )?;
            log.sync(app.seq)?;
            if publish_head {
                crate::device::durable_step(self.nodes.device.as_ref(), crate::device::failpoints::SUPERBLOCK)?;
                self.nodes.device.write_superblock(&Superblock::new(app.addr))?;
            }
            Ok(app.addr)
        })();
        match res {
            Ok(addr) => {
                st.last_commit = Some(addr);
                st.ops_since_commit = 0;
                Ok(addr)
            }
            Err(e) => Err(self.poison(e)),
        }
    }

    /// Commits, stops the background committer, ends this writer's log and
    /// waits until everything is in the bucket (where there is one). The
    /// volume takes no more writes.
    pub fn close(&self) -> Result<()> {
        let _no_compaction = self.compacting.lock();
        self.stop_committer.lock().take();
        // Imported chunks being fetched land in the chunk files first.
        self.sources.drain();
        if self.cfg.read_only {
            return Ok(());
        }
        if self.log()?.is_finished() {
            return Ok(());
        }
        self.commit()?;
        self.log()?.finish()?;
        self.nodes.device.replica().map_or(Ok(()), |r| r.drain())
    }

    /// Bytes written on this node and not yet in the bucket.
    pub fn pending_upload_bytes(&self) -> u64 {
        self.nodes.device.replica().map_or(0, |r| r.pending_upload_bytes())
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        self.stop_committer.lock().take();
    }
}
