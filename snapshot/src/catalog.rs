//! The catalog of one disk: `branches/<name>` heads and
//! `checkpoints/<name>` records in the disk's object store.

use crate::error::{Error, Result};
use arbor_engine::bucket::ObjectStore;
use arbor_engine::device::Device;
use arbor_engine::env::{Env, SystemEnv, Timestamp};
use arbor_engine::format::{decode_value, encode_value, Addr};
use arbor_engine::head::{decode_head, FixedRootDevice, HeadDevice, Lease, LeaseConfig};
use arbor_engine::layout::{self, branch_key, checkpoint_key};
use arbor_engine::volume::{Change, Config, Inspector, Superblock, Volume};
use arbor_engine::Error as EngineError;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;

const CHECKPOINT_MAGIC: u32 = u32::from_le_bytes(*b"ARCP");

/// Names of branches and checkpoints: `[A-Za-z0-9._-]{1,128}`, not `.` or `..`.
pub fn check_name(name: &str) -> Result<()> {
    let ok = (1..=128).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && name != "."
        && name != "..";
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidName(name.to_string()))
    }
}

#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
struct CheckpointRecord {
    magic: u32,
    version: u16,
    commit: Addr,
    branch: String,
    created: Timestamp,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointInfo {
    pub name: String,
    pub commit: Addr,
    /// The branch it was taken from.
    pub branch: String,
    pub created: Timestamp,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BranchInfo {
    pub name: String,
    pub commit: Addr,
}

/// Where a branch is served to other nodes: the owner's `HOST:PORT`, and
/// which process it is. Stored as text, one field a line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub addr: String,
    pub host: String,
    pub pid: u32,
}

impl Owner {
    const MAGIC: &'static str = "arbor-owner v1";

    fn encode(&self) -> Vec<u8> {
        format!("{}\n{}\n{}\n{}\n", Owner::MAGIC, self.addr, self.host, self.pid).into_bytes()
    }

    fn decode(bytes: &[u8]) -> Option<Owner> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut lines = text.lines();
        if lines.next()? != Owner::MAGIC {
            return None;
        }
        let (addr, host, pid) = (lines.next()?, lines.next()?, lines.next()?.parse().ok()?);
        Some(Owner { addr: addr.into(), host: host.into(), pid })
    }
}

/// A root to diff or mount: a branch's newest commit, or a checkpoint.
#[derive(Clone, Debug)]
pub enum Root {
    Branch(String),
    Checkpoint(String),
}

/// An exclusive, node-local claim on a branch for writing.
pub struct BranchLock {
    file: Option<File>,
}

impl BranchLock {
    /// Notes who holds the branch (a mount writes its mountpoint), so other
    /// commands on this node can find it.
    pub fn record_holder(&mut self, note: &str) -> Result<()> {
        use std::io::Write;
        if let Some(f) = &mut self.file {
            f.set_len(0).map_err(EngineError::from)?;
            f.write_all(note.as_bytes()).map_err(EngineError::from)?;
        }
        Ok(())
    }
}

pub struct Catalog {
    store: Arc<dyn ObjectStore>,
    segments: Arc<dyn Device>,
    locks: Option<PathBuf>,
    env: Arc<dyn Env>,
    inspector: Inspector,
    lease: Option<LeaseConfig>,
}

fn with_crc(mut body: Vec<u8>) -> Vec<u8> {
    let crc = arbor_engine::crc::crc32c(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    body
}

fn without_crc<'a>(bytes: &'a [u8], what: &'static str) -> Result<&'a [u8]> {
    let split = bytes.len().checked_sub(4).ok_or_else(|| EngineError::corrupted(what, "object"))?;
    let (body, crc) = bytes.split_at(split);
    if arbor_engine::crc::crc32c(body).to_le_bytes() != crc {
        return Err(EngineError::corrupted(what, "object").into());
    }
    Ok(body)
}

impl Catalog {
    /// `locks`: a node-local folder for branch locks (none in model tests).
    pub fn new(store: Arc<dyn ObjectStore>, segments: Arc<dyn Device>, locks: Option<PathBuf>) -> Catalog {
        Catalog {
            inspector: Inspector::new(segments.clone()),
            store,
            segments,
            locks,
            env: Arc::new(SystemEnv),
            lease: None,
        }
    }

    /// Writers of this catalog's branches hold leases in their heads, so a
    /// writer on another host is refused too, not only one on this node.
    pub fn with_lease(mut self, lease: LeaseConfig) -> Catalog {
        self.lease = Some(lease);
        self
    }

    /// The live lease on `name` held by another process, if any.
    pub fn lease_of(&self, name: &str) -> Result<Option<Lease>> {
        check_name(name)?;
        let me = self.lease.as_ref();
        match self.store.get(&branch_key(name)) {
            Ok((body, _)) => {
                let (_, _, lease) = decode_head(&body)?;
                // A holder this node cannot judge by its process counts
                // as live: only its own writer's open waits to see a
                // lease lapse (see HeadDevice).
                let mine = |l: &Lease| me.is_some_and(|c| l.is_mine(c));
                Ok(lease.filter(|l| l.judged_here(me) != Some(false) && !mine(l)))
            }
            Err(EngineError::NoSuchObject(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Refuses when another process holds a live lease on `name`.
    fn check_unleased(&self, name: &str) -> Result<()> {
        match self.lease_of(name)? {
            Some(l) => Err(Error::Refused(format!(
                "branch {name} is open read-write by pid {} on host {}; run this against its mount",
                l.pid, l.host
            ))),
            None => Ok(()),
        }
    }

    pub fn with_env(mut self, env: Arc<dyn Env>) -> Catalog {
        self.env = env;
        self
    }

    pub fn segments(&self) -> &Arc<dyn Device> {
        &self.segments
    }

    /// Reads committed roots through a node cache shared by every diff and GC of this catalog.
    pub fn inspector(&self) -> &Inspector {
        &self.inspector
    }

    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Claims `name` for writing on this node; [`Error::Open`] if another
    /// process (or another claim here) holds it.
    pub fn lock_branch(&self, name: &str) -> Result<BranchLock> {
        check_name(name)?;
        let Some(dir) = &self.locks else { return Ok(BranchLock { file: None }) };
        arbor_engine::private::create_dir_all(dir).map_err(EngineError::from)?;
        let f = arbor_engine::private::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(name))
            .map_err(EngineError::from)?;
        // SAFETY: plain syscall on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(Error::Open(name.to_string()));
        }
        Ok(BranchLock { file: Some(f) })
    }

    /// What the process holding `name` noted, if it is held on this node.
    pub fn holder_of(&self, name: &str) -> Option<String> {
        check_name(name).ok()?;
        match self.lock_branch(name) {
            Err(Error::Open(_)) => std::fs::read_to_string(self.locks.as_ref()?.join(name)).ok(),
            _ => None,
        }
    }

    // ---- branches ----

    pub fn branch_head(&self, name: &str) -> Result<Superblock> {
        check_name(name)?;
        match self.store.get(&branch_key(name)) {
            Ok((body, _)) => Ok(decode_head(&body)?.1),
            Err(EngineError::NoSuchObject(_)) => Err(Error::NotFound("branch", name.into())),
            Err(e) => Err(e.into()),
        }
    }

    pub fn list_branches(&self) -> Result<Vec<BranchInfo>> {
        let mut out = Vec::new();
        for key in self.store.list(layout::BRANCHES)? {
            let name = &key[layout::BRANCHES.len()..];
            match self.branch_head(name) {
                Ok(sb) => out.push(BranchInfo { name: name.to_string(), commit: sb.commit }),
                Err(Error::NotFound(..)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// A new branch whose first state is the commit `at`.
    pub fn create_branch(&self, name: &str, at: Addr) -> Result<()> {
        check_name(name)?;
        match self.store.put_if_absent(&branch_key(name), &Superblock::frozen(at).encode()) {
            Ok(_) => Ok(()),
            Err(EngineError::AlreadyExists(_)) => Err(Error::Exists("branch", name.into())),
            Err(e) => Err(e.into()),
        }
    }

    pub fn delete_branch(&self, name: &str) -> Result<()> {
        if name == "main" {
            return Err(Error::Refused("branch main cannot be deleted".into()));
        }
        self.branch_head(name)?;
        let _lock = self.lock_branch(name)?;
        self.check_unleased(name)?;
        Ok(self.store.delete(&branch_key(name))?)
    }

    /// Points branch `name` at the commit `to` (a checkpoint's), dropping
    /// whatever it had since.
    pub fn reset_branch(&self, name: &str, to: Addr) -> Result<()> {
        check_name(name)?;
        let _lock = self.lock_branch(name)?;
        self.check_unleased(name)?;
        let (_, tag) = match self.store.get(&branch_key(name)) {
            Ok(x) => x,
            Err(EngineError::NoSuchObject(_)) => return Err(Error::NotFound("branch", name.into())),
            Err(e) => return Err(e.into()),
        };
        match self.store.put_if_match(&branch_key(name), &Superblock::frozen(to).encode(), &tag) {
            Ok(_) => Ok(()),
            Err(EngineError::PreconditionFailed(_)) => Err(Error::Open(name.into())),
            Err(e) => Err(e.into()),
        }
    }

    pub fn rename_branch(&self, old: &str, new: &str) -> Result<()> {
        check_name(new)?;
        if old == "main" {
            return Err(Error::Refused("branch main cannot be renamed".into()));
        }
        let _lock = self.lock_branch(old)?;
        self.check_unleased(old)?;
        let (body, _) = match self.store.get(&branch_key(old)) {
            Ok(x) => x,
            Err(EngineError::NoSuchObject(_)) => return Err(Error::NotFound("branch", old.into())),
            Err(e) => return Err(e.into()),
        };
        // The new name starts unleased.
        let (superblock, _, _) = decode_head(&body)?;
        match self.store.put_if_absent(&branch_key(new), &superblock) {
            Ok(_) => {}
            Err(EngineError::AlreadyExists(_)) => return Err(Error::Exists("branch", new.into())),
            Err(e) => return Err(e.into()),
        }
        Ok(self.store.delete(&branch_key(old))?)
    }

    /// Opens a branch for writing (`main` is created on first open).
    pub fn open_branch(&self, name: &str, cfg: Config) -> Result<(Arc<Volume>, BranchLock)> {
        if name != "main" {
            self.branch_head(name)?;
        }
        let lock = self.lock_branch(name)?;
        // A reader claims nothing: only a writer takes the branch's lease.
        let lease = self.lease.clone().filter(|_| !cfg.read_only);
        let device = HeadDevice::with_lease(self.segments.clone(), self.store.clone(), name, lease);
        let vol = Volume::open(device, cfg).map_err(|e| match e {
            EngineError::Busy(why) if self.lease.is_some() => Error::Refused(why),
            e => e.into(),
        })?;
        Ok((vol, lock))
    }

    /// Records that `name` is served to other nodes at `addr` by this
    /// process (`arbor serve --branch`), for their mounts to find.
    pub fn record_owner(&self, name: &str, owner: &Owner) -> Result<()> {
        check_name(name)?;
        self.store.put(&arbor_engine::layout::owner_key(name), &owner.encode())?;
        Ok(())
    }

    /// Where `name` was last served from, if a serving process recorded it
    /// (it may be gone: its lease says whether it is alive).
    pub fn owner_of(&self, name: &str) -> Result<Option<Owner>> {
        check_name(name)?;
        match self.store.get(&arbor_engine::layout::owner_key(name)) {
            Ok((body, _)) => Ok(Owner::decode(&body)),
            Err(EngineError::NoSuchObject(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes the owner record of `name` if it is `owner`'s.
    pub fn clear_owner(&self, name: &str, owner: &Owner) -> Result<()> {
        if self.owner_of(name)?.as_ref() == Some(owner) {
            self.store.delete(&arbor_engine::layout::owner_key(name))?;
        }
        Ok(())
    }

    /// Opens a checkpoint read-only.
    pub fn open_checkpoint(&self, name: &str, cfg: Config) -> Result<Arc<Volume>> {
        let cp = self.checkpoint(name)?;
        let device = FixedRootDevice::new(self.segments.clone(), cp.commit);
        Ok(Volume::open(device, Config { read_only: true, commit_interval: None, ..cfg })?)
    }

    /// The newest commit of an unmounted branch, folding in any intents a
    /// crash left after its head (by opening and closing it once).
    pub fn settled_commit(&self, branch: &str) -> Result<Addr> {
        let head = self.branch_head(branch)?;
        if !head.replay {
            return Ok(head.commit);
        }
        let (vol, _lock) = self.open_branch(branch, Config { commit_interval: None, ..Config::default() })?;
        vol.close()?;
        Ok(self.branch_head(branch)?.commit)
    }

    // ---- checkpoints ----

    /// Records the commit `commit` of `branch` as checkpoint `name`.
    /// The commit's bytes are in the bucket before the checkpoint names
    /// it, so any node can open it.
    pub fn create_checkpoint(&self, name: &str, branch: &str, commit: Addr) -> Result<CheckpointInfo> {
        check_name(name)?;
        if let Some(r) = self.segments.replica() {
            r.flush_to_bucket(commit)?;
        }
        let rec = CheckpointRecord {
            magic: CHECKPOINT_MAGIC,
            version: 1,
            commit,
            branch: branch.into(),
            created: self.env.now(),
        };
        match self.store.put_if_absent(&checkpoint_key(name), &with_crc(encode_value(&rec))) {
            Ok(_) => Ok(CheckpointInfo { name: name.into(), commit, branch: branch.into(), created: rec.created }),
            Err(EngineError::AlreadyExists(_)) => Err(Error::Exists("checkpoint", name.into())),
            Err(e) => Err(e.into()),
        }
    }

    /// Commits `vol` (durably, with its unsynced writes) and records it.
    pub fn checkpoint_volume(&self, name: &str, branch: &str, vol: &Volume) -> Result<CheckpointInfo> {
        check_name(name)?;
        let commit = vol.commit_for_checkpoint()?;
        self.create_checkpoint(name, branch, commit)
    }

    pub fn checkpoint(&self, name: &str) -> Result<CheckpointInfo> {
        check_name(name)?;
        let body = match self.store.get(&checkpoint_key(name)) {
            Ok((b, _)) => b,
            Err(EngineError::NoSuchObject(_)) => return Err(Error::NotFound("checkpoint", name.into())),
            Err(e) => return Err(e.into()),
        };
        let rec: CheckpointRecord = decode_value(without_crc(&body, "checkpoint")?, "checkpoint")?;
        if rec.magic != CHECKPOINT_MAGIC || rec.version != 1 {
            return Err(EngineError::corrupted("checkpoint", name).into());
        }
        Ok(CheckpointInfo { name: name.into(), commit: rec.commit, branch: rec.branch, created: rec.created })
    }

    pub fn list_checkpoints(&self) -> Result<Vec<CheckpointInfo>> {
        let mut out = Vec::new();
        for key in self.store.list(layout::CHECKPOINTS)? {
            match self.checkpoint(&key[layout::CHECKPOINTS.len()..]) {
                Ok(c) => out.push(c),
                Err(Error::NotFound(..)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    pub fn delete_checkpoint(&self, name: &str) -> Result<()> {
        self.checkpoint(name)?;
        Ok(self.store.delete(&checkpoint_key(name))?)
    }

    // ---- diff ----

    pub fn commit_of(&self, root: &Root) -> Result<Addr> {
        match root {
            Root::Checkpoint(c) => Ok(self.checkpoint(c)?.commit),
            Root::Branch(b) => Ok(self.branch_head(b)?.commit),
        }
    }

    /// Paths added, removed and modified from `from` to `to`.
    pub fn diff(&self, from: &Root, to: &Root) -> Result<Vec<Change>> {
        self.diff_between(self.commit_of(from)?, self.commit_of(to)?)
    }

    pub fn diff_between(&self, from: Addr, to: Addr) -> Result<Vec<Change>> {
        Ok(self.inspector.diff(from, to)?)
    }
}
