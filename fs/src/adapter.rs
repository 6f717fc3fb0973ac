use crate::direct::DirectWrites;
use crate::ops::{FuseOp, OpMetrics};
use arbor_engine::files::{Caller, Files, Lock};
use arbor_engine::metrics::{Counter, Exposition, Gauge};
use arbor_engine::volume::{Attr, DirEntryOut, FileKind, RenameMode, SetAttr, StatFs, TimeSet, XattrFlags};
use arbor_engine::{env::Timestamp, Error};
use fuser::{Errno, FileAttr, FileType, FopenFlags, INodeNo, TimeOrNow};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The one place engine errors become errnos.
pub fn to_errno(e: &Error) -> Errno {
    if let Error::Corrupted { what, addr } = e {
        tracing::error!(what, addr, "returning EIO for corrupt data");
    }
    Errno::from_i32(e.errno())
}

/// How long the kernel may cache attributes and names. Each branch has a
/// single writer (a second read-write mount is refused) and a checkpoint
/// never changes, so every change goes through this mount and the kernel,
/// which updates or drops its own entries as it forwards the change: its
/// caches cannot go stale behind our back, and a short timeout would only
/// turn `stat` and `unlink` of a file seen a second ago into extra LOOKUP
/// round trips (a third of the small-file benchmark's time at 1 s).
const TTL: Duration = Duration::from_secs(3600);

/// The same for a tree other nodes change too ([`Files::is_shared`]): the
/// owner's invalidations usually arrive first; this bounds how stale a
/// name or an attribute can be if one is lost.
const SHARED_TTL: Duration = Duration::from_secs(1);

pub type Answer<T> = Result<T, Errno>;

fn answer<T>(r: Result<T, Error>) -> Answer<T> {
    r.map_err(|e| to_errno(&e))
}

/// What a `getxattr` or `listxattr` answers: the size the caller must
/// allow for (when it asked with size 0), or the bytes.
#[derive(Debug, PartialEq, Eq)]
pub enum Xattr {
    Size(u32),
    Data(Vec<u8>),
}

/// A file's attributes as they go to the kernel, with how long it may keep
/// them; `attr.ino == 0` is a negative entry.
pub struct Entry {
    pub attr: FileAttr,
    pub ttl: Duration,
}

/// The file system every kernel transport calls: each FUSE request becomes
/// one method here, an answer or an errno back. The transports (the
/// classic `/dev/fuse` loop in `classic.rs`, FUSE over io_uring in
/// [`crate::ring`]) only decode requests and encode these answers, so both
/// run the same code for every operation.
/// One (file, lock owner)'s gate: see `ArborFs::gates`.
type Gate = std::sync::Arc<parking_lot::Mutex<()>>;

pub struct ArborFs<F: Files + ?Sized = arbor_engine::Volume> {
    vol: Arc<F>,
    read_ahead: u32,
    ttl: Duration,
    /// Shared trees: each open file's (mtime, size) when this node last
    /// opened it. An open that finds them unchanged keeps the kernel's
    /// cached pages; any other open drops them (close-to-open).
    opened: parking_lot::Mutex<HashMap<u64, (Timestamp, u64)>>,
    /// Shared trees: files this node ever took a lock on, whose closes must
    /// drop the closer's locks at the owner.
    locked: parking_lot::Mutex<std::collections::HashSet<u64>>,
    /// The open file (its handle) each (file, lock owner) last took a lock
    /// through: a release drops the owner's locks only if it is that
    /// open's (see [`Self::release`]).
    lockers: parking_lot::Mutex<std::collections::HashMap<(u64, u64), u64>>,
    /// One gate per (file, lock owner) while a lock is asked for or a
    /// release drops locks: the release of an earlier open with the same
    /// owner id cannot reach the owner after this open's lock and drop it.
    gates: parking_lot::Mutex<std::collections::HashMap<(u64, u64), Gate>>,
    /// The next open file's handle.
    next_handle: std::sync::atomic::AtomicU64,
    /// The high half of the handles this process hands out (see
    /// [`ArborFs::skip_handles`]).
    own_handles: std::sync::atomic::AtomicU64,
    counters: Arc<Counters>,
    /// Where a change the kernel cannot know of is pushed into its caches.
    notifier: std::sync::OnceLock<crate::Notify>,
    direct: DirectWrites,
    /// Every change is in the engine's files before it is answered (see
    /// [`Self::outlive_process`]).
    write_out: std::sync::atomic::AtomicBool,
}

/// What reached the file system, for `arbor status`, a mount's
/// `/metrics` and the tests: a READ counted here is one the kernel's page
/// cache did not answer (and a GETXATTR one the kernel did not spare: it
/// asks for `security.capability` before a write unless it marked the
/// file as needing no check).
#[derive(Default, Debug)]
pub struct Counters {
    /// Every operation's count, errors and latency.
    pub ops: OpMetrics,
    /// Bytes READs answered and WRITEs took.
    pub read_bytes: Counter,
    pub written_bytes: Counter,
    /// Opens answered with direct I/O (write-only ones, see `direct.rs`).
    pub direct_opens: Counter,
    /// The kernel's read-ahead for the mount in bytes (0: not known).
    pub kernel_read_ahead: Gauge,
}

impl Counters {
    pub fn render(&self, page: &mut Exposition) {
        self.ops.render(page);
        page.counter("arbor_fuse_read_bytes_total", "Bytes FUSE reads answered.", &[], self.read_bytes.get());
        page.counter("arbor_fuse_written_bytes_total", "Bytes FUSE writes took.", &[], self.written_bytes.get());
        page.counter(
            "arbor_fuse_direct_write_opens_total",
            "Opens answered with direct I/O (write-only ones).",
            &[],
            self.direct_opens.get(),
        );
        page.gauge(
            "arbor_fuse_kernel_read_ahead_bytes",
            "The kernel's read-ahead for the mount (0: not known).",
            &[],
            self.kernel_read_ahead.get() as f64,
        );
    }
}

impl<F: Files + ?Sized> ArborFs<F> {
    /// `direct_writes`: write-only opens write past the page cache where
    /// the kernel allows it (see `direct.rs`).
    pub fn new(vol: Arc<F>, read_ahead: u32, direct_writes: bool) -> Self {
        let ttl = if vol.is_shared() { SHARED_TTL } else { TTL };
        ArborFs {
            vol,
            read_ahead,
            ttl,
            opened: parking_lot::Mutex::new(HashMap::new()),
            locked: parking_lot::Mutex::new(Default::default()),
            lockers: parking_lot::Mutex::new(Default::default()),
            gates: parking_lot::Mutex::new(Default::default()),
            next_handle: std::sync::atomic::AtomicU64::new(1),
            own_handles: std::sync::atomic::AtomicU64::new(0),
            counters: Arc::default(),
            notifier: std::sync::OnceLock::new(),
            direct: DirectWrites::new(direct_writes),
            write_out: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Set once the session runs.
    pub fn set_notifier(&self, n: crate::Notify) {
        self.direct.start(n.clone());
        let _ = self.notifier.set(n);
    }

    /// Answers a change only once it outlives this process
    /// ([`Files::write_out`]): the mount's serving process may be killed
    /// and replaced, and a change it answered but kept in its memory would
    /// be lost without anyone told (the process that takes over knows
    /// nothing of it, and the writer's next fsync would succeed).
    pub fn outlive_process(&self) {
        self.write_out.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Runs operation `op` in its span and counts it; a change is written
    /// out first when [`Self::outlive_process`] asks for it.
    fn run<T>(&self, op: FuseOp, ino: u64, f: impl FnOnce() -> Answer<T>) -> Answer<T> {
        let r = self.counters.ops.run(op, ino, f)?;
        if self.write_out.load(std::sync::atomic::Ordering::Relaxed) && changes(op) {
            answer(self.vol.write_out())?;
        }
        Ok(r)
    }

    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    pub fn volume(&self) -> &Arc<F> {
        &self.vol
    }

    pub fn read_ahead(&self) -> u32 {
        self.read_ahead
    }

    pub fn is_shared(&self) -> bool {
        self.vol.is_shared()
    }

    /// How an open with `flags` of a file with attributes `a` may use the
    /// kernel's cache (write-only opens: not at all, see [`DirectWrites`]).
    fn open_flags(&self, a: &Attr, flags: i32) -> FopenFlags {
        if self.vol.is_shared() && flags & libc::O_APPEND != 0 {
            // Its writes land where the owner's end of file is, which the
            // kernel does not know: none of them may go into its pages.
            return FopenFlags::FOPEN_DIRECT_IO;
        }
        if self.direct.opened(a.ino, flags) {
            self.counters.direct_opens.inc();
            return FopenFlags::FOPEN_DIRECT_IO;
        }
        if !self.vol.is_shared() {
            // Every change to this tree goes through this mount, so cached
            // pages stay valid across opens.
            return FopenFlags::FOPEN_KEEP_CACHE;
        }
        let now = (a.mtime, a.size);
        match self.opened.lock().insert(a.ino, now) {
            Some(before) if before == now => FopenFlags::FOPEN_KEEP_CACHE,
            _ => FopenFlags::empty(),
        }
    }

    fn entry(&self, r: Result<Attr, Error>) -> Answer<Entry> {
        answer(r).map(|a| Entry { attr: file_attr(&a), ttl: self.ttl })
    }

    pub fn attr_ttl(&self) -> Duration {
        self.ttl
    }

    pub fn lookup(&self, parent: u64, name: &[u8]) -> Answer<Entry> {
        self.run(FuseOp::Lookup, parent, || {
            match self.vol.lookup(parent, name) {
                // Node 0 is "no such name, and remember that for TTL": the
                // kernel keeps a negative entry (and drops it itself when the
                // name is created through it), so a program probing for files
                // that are not there (module search paths, "exists?" checks)
                // asks us once.
                Err(Error::NotFound) => Ok(Entry { attr: negative_attr(), ttl: self.ttl }),
                r => self.entry(r),
            }
        })
    }

    pub fn forget(&self, ino: u64) {
        // The kernel forgets an inode (with all its lookups) when it evicts
        // it, and its cached pages with it.
        if self.vol.is_shared() {
            self.opened.lock().remove(&ino);
            self.locked.lock().remove(&ino);
        }
    }

    pub fn getattr(&self, ino: u64) -> Answer<FileAttr> {
        self.run(FuseOp::Getattr, ino, || answer(self.vol.getattr(ino)).map(|a| file_attr(&a)))
    }

    /// A SETATTR by `caller` (see [`Files::setattr_by`]). `kill_suidgid`:
    /// the kernel's FATTR_KILL_SUIDGID (a truncate by a caller without
    /// CAP_FSETID). A change of owner clears the bits of a file whoever
    /// makes it, as the VFS does.
    ///
    /// Every mount clears these bits itself (`FUSE_HANDLE_KILLPRIV_V2`):
    /// the kernel then marks a file it found without `security.capability`
    /// as needing no check, instead of asking for that attribute before
    /// every `write` (a GETXATTR each, which on a client mount was a round
    /// trip to the owner that also waited for every write in flight).
    /// The answer carries the attributes after: nothing cached to drop.
    pub fn setattr(&self, ino: u64, change: SetAttr, caller: Caller, kill_suidgid: bool) -> Answer<FileAttr> {
        self.run(FuseOp::Setattr, ino, || {
            answer(self.vol.setattr_by(ino, change, caller, kill_suidgid)).map(|a| file_attr(&a))
        })
    }

    /// Drops the attributes the kernel cached for `ino`: a WRITE's answer
    /// carries none, and the kernel keeps the mode it had, so `stat` (and
    /// exec) would still see bits a write cleared.
    fn drop_cached_attrs(&self, ino: u64) {
        self.drop_cached(ino, -1);
    }

    /// Drops what the kernel cached of `ino`: its attributes, and its pages
    /// from `from` on (-1: none; not from a READ or WRITE of that file,
    /// whose pages the kernel holds locked).
    fn drop_cached(&self, ino: u64, from: i64) {
        if let Some(n) = self.notifier.get() {
            if let Err(e) = n.inval_inode(ino, from, 0) {
                tracing::warn!(ino, error = %e, "dropping what the kernel cached of a file failed");
            }
        }
    }

    pub fn readlink(&self, ino: u64) -> Answer<Vec<u8>> {
        self.run(FuseOp::Readlink, ino, || answer(self.vol.readlink(ino)))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn mknod(
        &self,
        parent: u64,
        name: &[u8],
        mode: u32,
        umask: u32,
        rdev: u32,
        uid: u32,
        gid: u32,
    ) -> Answer<Entry> {
        self.run(FuseOp::Mknod, parent, || {
            let mode = (mode & libc::S_IFMT) | (mode & 0o7777 & !umask);
            self.entry(self.vol.create(parent, name, mode, uid, gid, rdev))
        })
    }

    pub fn mkdir(&self, parent: u64, name: &[u8], mode: u32, umask: u32, uid: u32, gid: u32) -> Answer<Entry> {
        self.run(FuseOp::Mkdir, parent, || {
            let perm = (mode & 0o7777 & !umask) as u16;
            self.entry(self.vol.mkdir(parent, name, perm, uid, gid))
        })
    }

    pub fn unlink(&self, parent: u64, name: &[u8]) -> Answer<()> {
        self.run(FuseOp::Unlink, parent, || answer(self.vol.unlink(parent, name)))
    }

    pub fn rmdir(&self, parent: u64, name: &[u8]) -> Answer<()> {
        self.run(FuseOp::Rmdir, parent, || answer(self.vol.rmdir(parent, name)))
    }

    pub fn symlink(&self, parent: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Answer<Entry> {
        self.run(FuseOp::Symlink, parent, || self.entry(self.vol.symlink(parent, name, target, uid, gid)))
    }

    /// `flags` are `renameat2`'s.
    pub fn rename(&self, parent: u64, name: &[u8], new_parent: u64, new_name: &[u8], flags: u32) -> Answer<()> {
        self.run(FuseOp::Rename, parent, || {
            let mode = match flags {
                0 => RenameMode::Plain,
                libc::RENAME_NOREPLACE => RenameMode::NoReplace,
                libc::RENAME_EXCHANGE => RenameMode::Exchange,
                _ => return Err(Errno::from_i32(libc::EINVAL)),
            };
            answer(self.vol.rename(parent, name, new_parent, new_name, mode))
        })
    }

    pub fn link(&self, ino: u64, new_parent: u64, new_name: &[u8]) -> Answer<Entry> {
        self.run(FuseOp::Link, ino, || self.entry(self.vol.link(ino, new_parent, new_name)))
    }

    pub fn open(&self, ino: u64, flags: i32) -> Answer<FopenFlags> {
        self.run(FuseOp::Open, ino, || {
            match self.vol.open(ino) {
                Ok(a) => Ok(self.open_flags(&a, flags)),
                // In a shared tree a name the kernel still caches can point at
                // a file the owner no longer has (another node removed it, or
                // the owner restarted without it). ESTALE makes the kernel
                // look the name up again and retry the open once, as for NFS;
                // ENOENT would fail `open(O_CREAT)` of a name that is free.
                Err(Error::NotFound) if self.vol.is_shared() => Err(Errno::from_i32(libc::ESTALE)),
                Err(e) => Err(to_errno(&e)),
            }
        })
    }

    /// Directories need no per-open state.
    pub fn opendir(&self, ino: u64) -> Answer<FopenFlags> {
        self.run(FuseOp::Opendir, ino, || Ok(FopenFlags::empty()))
    }

    /// Fills `buf` from `offset` (short at end of file) and says how much
    /// of it holds the file's bytes.
    pub fn read(&self, ino: u64, offset: u64, buf: &mut [u8]) -> Answer<usize> {
        self.run(FuseOp::Read, ino, || answer(self.vol.read_into(ino, offset, buf)))
            .inspect(|n| self.counters.read_bytes.add(*n as u64))
    }

    /// `kill_suidgid`: the kernel's FUSE_WRITE_KILL_SUIDGID (a write by a
    /// caller without CAP_FSETID; see [`Self::setattr`]). `append`: by an
    /// `O_APPEND` descriptor; on a shared tree it goes at the end of the
    /// file as the owner has it (the kernel placed it at the end it last
    /// saw), and the kernel's cached size is dropped.
    pub fn write(&self, ino: u64, offset: u64, data: &[u8], kill_suidgid: bool, append: bool) -> Answer<u32> {
        self.run(FuseOp::Write, ino, || {
            if append && self.vol.is_shared() {
                let (n, _) = answer(self.vol.write_appending(ino, offset, data, kill_suidgid))?;
                self.drop_cached_attrs(ino);
                return Ok(n as u32);
            }
            let n = if kill_suidgid {
                let (n, changed) = answer(self.vol.write_unprivileged(ino, offset, data))?;
                if changed {
                    self.drop_cached_attrs(ino);
                }
                n
            } else {
                answer(self.vol.write(ino, offset, data))?
            };
            self.direct.written(ino, offset, n as u64);
            Ok(n as u32)
        })
        .inspect(|n| self.counters.written_bytes.add(u64::from(*n)))
    }

    /// `copy_file_range(2)`: the bytes are shared, not copied (a clone of
    /// their extents, see `Files::clone_range`). Where they cannot be
    /// shared (an imported file's object), EOPNOTSUPP makes the kernel
    /// copy them itself (ENOSYS would turn the call off for the mount).
    pub fn copy_file_range(&self, ino_in: u64, off_in: u64, ino_out: u64, off_out: u64, len: u64) -> Answer<u32> {
        // The kernel takes a u32 count back: at most 1 GiB a call, as
        // Linux's own copies are cut.
        let len = len.min(1 << 30);
        self.run(FuseOp::CopyFileRange, ino_out, || {
            let n = answer(self.vol.clone_range(ino_in, off_in, ino_out, off_out, len))?;
            self.drop_cached_attrs(ino_out);
            Ok(n as u32)
        })
        .inspect(|n| self.counters.written_bytes.add(u64::from(*n)))
    }

    pub fn flush(&self, ino: u64, lock_owner: u64) -> Answer<()> {
        self.run(FuseOp::Flush, ino, || {
            if self.vol.is_shared() {
                // Writes still on their way reach the owner before close
                // returns (close-to-open).
                let flushed = answer(self.vol.flush(ino));
                // Closing a descriptor drops its process's fcntl locks on the
                // file, which the owner holds; a file never locked here costs
                // no round trip.
                if self.locked.lock().contains(&ino) {
                    answer(self.vol.unlock_all(ino, lock_owner))?;
                }
                return flushed;
            }
            // Nothing is buffered per handle. ENOSYS tells the kernel to stop
            // sending FLUSH on every close (it then reports success itself):
            // one round trip fewer per file.
            Err(Errno::ENOSYS)
        })
    }

    /// A handle for a new open file, unique in this mount.
    pub fn new_handle(&self) -> u64 {
        self.next_handle.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts handing out handles from `first` on (a process resuming a
    /// connection: the kernel still holds the dead process's handles).
    pub fn skip_handles(&self, first: u64) {
        self.next_handle.fetch_max(first, std::sync::atomic::Ordering::Relaxed);
        self.own_handles.store(first >> 32, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether this process handed out `fh` (a resumed process's handles
    /// carry its own high half; the dead process's opens were never
    /// counted here, so their releases must not be).
    fn handed_out(&self, fh: u64) -> bool {
        fh >> 32 == self.own_handles.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `flags`: those the file was opened with; `fh`: its handle.
    pub fn release(&self, ino: u64, fh: u64, flags: i32, lock_owner: Option<u64>) -> Answer<()> {
        self.run(FuseOp::Release, ino, || {
            self.direct.released(ino, flags);
            // The last close of an open file drops its flock. The kernel sends
            // this after close returned, and names the lock owner by the open
            // file's address, which a new open may already reuse: only the
            // open that took the lock lets go of it, never a newer one's.
            if let Some(owner) = lock_owner {
                let gate = self.gate(ino, owner);
                let _held = gate.lock();
                let ours = {
                    let mut lockers = self.lockers.lock();
                    let ours = lockers.get(&(ino, owner)) == Some(&fh);
                    if ours {
                        lockers.remove(&(ino, owner));
                    }
                    ours
                };
                if ours && self.locked.lock().contains(&ino) {
                    if let Err(e) = self.vol.unlock_all(ino, owner) {
                        tracing::warn!(ino, error = %e, "dropping a closed file's locks failed");
                    }
                }
                drop(_held);
                self.ungate(ino, owner, gate);
            }
            if !self.handed_out(fh) {
                return Ok(());
            }
            answer(self.vol.release(ino))
        })
    }

    /// The gate of (file, lock owner) (see `gates`).
    fn gate(&self, ino: u64, owner: u64) -> Gate {
        self.gates.lock().entry((ino, owner)).or_default().clone()
    }

    /// Forgets a gate nobody else holds.
    fn ungate(&self, ino: u64, owner: u64, gate: Gate) {
        let mut gates = self.gates.lock();
        // Ours and the map's: no other call waits on it.
        if std::sync::Arc::strong_count(&gate) == 2 {
            gates.remove(&(ino, owner));
        }
    }

    pub fn fsync(&self, ino: u64) -> Answer<()> {
        self.run(FuseOp::Fsync, ino, || answer(self.vol.fsync(ino)))
    }

    /// Calls `add(entry)` for each entry from `offset` until it returns
    /// true (the reply is full).
    pub fn readdir(&self, ino: u64, offset: u64, add: &mut dyn FnMut(DirEntryOut) -> bool) -> Answer<()> {
        self.run(FuseOp::Readdir, ino, || answer(self.vol.readdir(ino, offset, &mut |e| !add(e))))
    }

    /// Whether READDIRPLUS is worth offering: it costs a `getattr` per
    /// entry, free on this node and a round trip per entry to an owner.
    pub fn wants_readdirplus(&self) -> bool {
        !self.vol.is_shared()
    }

    /// READDIRPLUS: the entries from `offset` that fit in `size` bytes of
    /// the kernel's encoding (`entry_size` of each name), each with its
    /// attributes, so `ls -l` and `os.scandir` + `stat` need no LOOKUP
    /// each. An entry removed between the listing and its `getattr` is
    /// left out, as if listed a moment later.
    pub fn readdirplus(
        &self,
        ino: u64,
        offset: u64,
        size: usize,
        entry_size: fn(&[u8]) -> usize,
        add: &mut dyn FnMut(&DirEntryOut, &Entry) -> bool,
    ) -> Answer<()> {
        self.run(FuseOp::Readdirplus, ino, || {
            // The listing first, then the attributes: no volume call runs
            // inside another's callback.
            let mut listed = Vec::new();
            let mut used = 0;
            answer(self.vol.readdir(ino, offset, &mut |e| {
                used += entry_size(&e.name);
                listed.push(e);
                used < size
            }))?;
            for e in listed {
                let attr = match self.vol.getattr(e.ino) {
                    Ok(a) => a,
                    Err(Error::NotFound) => continue,
                    Err(err) => return Err(to_errno(&err)),
                };
                if add(&e, &Entry { attr: file_attr(&attr), ttl: self.ttl }) {
                    break;
                }
            }
            Ok(())
        })
    }

    pub fn statfs(&self) -> Answer<StatFs> {
        self.run(FuseOp::Statfs, 0, || answer(self.vol.statfs()))
    }

    pub fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: i32) -> Answer<()> {
        self.run(FuseOp::Setxattr, ino, || {
            let flags = match flags {
                0 => XattrFlags::Any,
                libc::XATTR_CREATE => XattrFlags::Create,
                libc::XATTR_REPLACE => XattrFlags::Replace,
                _ => return Err(Errno::from_i32(libc::EINVAL)),
            };
            answer(self.vol.setxattr(ino, name, value, flags))
        })
    }

    pub fn getxattr(&self, ino: u64, name: &[u8], size: u32) -> Answer<Xattr> {
        self.run(FuseOp::Getxattr, ino, || answer(self.vol.getxattr(ino, name)).and_then(|v| xattr_answer(v, size)))
    }

    pub fn listxattr(&self, ino: u64, size: u32) -> Answer<Xattr> {
        self.run(FuseOp::Listxattr, ino, || {
            let names = answer(self.vol.listxattr(ino))?;
            let mut buf = Vec::new();
            for n in names {
                buf.extend_from_slice(&n);
                buf.push(0);
            }
            xattr_answer(buf, size)
        })
    }

    pub fn removexattr(&self, ino: u64, name: &[u8]) -> Answer<()> {
        self.run(FuseOp::Removexattr, ino, || answer(self.vol.removexattr(ino, name)))
    }

    /// `flags`: the open's (`O_WRONLY`, `O_TRUNC`, ...).
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        &self,
        parent: u64,
        name: &[u8],
        mode: u32,
        umask: u32,
        flags: i32,
        uid: u32,
        gid: u32,
    ) -> Answer<(Entry, FopenFlags)> {
        self.run(FuseOp::Create, parent, || {
            let mode = (mode & libc::S_IFMT) | (mode & 0o7777 & !umask);
            let a = answer(self.vol.create_open(parent, name, mode, uid, gid))?;
            let flags = self.open_flags(&a, flags);
            Ok((Entry { attr: file_attr(&a), ttl: self.ttl }, flags))
        })
    }

    pub fn fallocate(&self, ino: u64, offset: u64, length: u64, mode: i32, caller: Caller) -> Answer<()> {
        self.run(FuseOp::Fallocate, ino, || {
            // Space is never reserved (holes cost nothing and the bucket has no
            // quota to run out of); plain fallocate only extends the size.
            if mode != 0 {
                return Err(Errno::from_i32(libc::EOPNOTSUPP));
            }
            answer(self.vol.getattr(ino).and_then(|a| {
                let end = offset.checked_add(length).ok_or(Error::TooBig)?;
                if end > a.size {
                    self.vol.setattr_by(ino, SetAttr { size: Some(end), ..Default::default() }, caller, false)?;
                }
                Ok(())
            }))
        })
    }

    /// The lock that would conflict with `asked`, or `asked` with type
    /// `F_UNLCK` when none would.
    pub fn getlk(&self, ino: u64, lock_owner: u64, asked: Lock) -> Answer<Lock> {
        self.run(FuseOp::Getlk, ino, || {
            let asked = checked_lock(asked)?;
            match answer(self.vol.getlk(ino, lock_owner, asked))? {
                Some(l) => Ok(l),
                None => Ok(Lock { typ: libc::F_UNLCK, pid: 0, ..asked }),
            }
        })
    }

    /// `fh`: the handle of the open file the lock is taken through.
    pub fn setlk(&self, ino: u64, fh: u64, lock_owner: u64, lock: Lock, sleep: bool) -> Answer<()> {
        self.run(FuseOp::Setlk, ino, || {
            let l = checked_lock(lock)?;
            if l.typ != libc::F_UNLCK {
                self.locked.lock().insert(ino);
                // Through the gate: a release of an earlier open with the same
                // owner id, running meanwhile on another thread, reaches the
                // owner before this lock or finds this open named and drops
                // nothing.
                let gate = self.gate(ino, lock_owner);
                let held = gate.lock();
                self.lockers.lock().insert((ino, lock_owner), fh);
                let r = answer(self.vol.setlk(ino, lock_owner, l, sleep));
                drop(held);
                self.ungate(ino, lock_owner, gate);
                r?;
            } else {
                answer(self.vol.setlk(ino, lock_owner, l, sleep))?;
            }
            if l.typ != libc::F_UNLCK && self.vol.is_shared() {
                // A lock taken on a tree other nodes change: what the kernel
                // cached of the file may predate the last holder's writes.
                // Read afresh, as an NFS client revalidates on a lock.
                self.drop_cached(ino, 0);
            }
            Ok(())
        })
    }

    /// No ioctl is supported. ENOTTY is what a file system without the
    /// request answers (Python asks on every `open()` whether a file is a
    /// terminal); the kernel does not remember it, so it is not logged.
    pub fn ioctl(&self) -> Answer<()> {
        self.run(FuseOp::Ioctl, 0, || Err(Errno::from_i32(libc::ENOTTY)))
    }

    /// The final commit, once no request can arrive any more.
    pub fn close(&self) {
        if let Err(e) = self.vol.close() {
            tracing::error!(error = %e, "final commit at unmount failed");
        }
    }
}

/// Whether an operation may change the tree (and so leave a record in the
/// engine's log).
fn changes(op: FuseOp) -> bool {
    matches!(
        op,
        FuseOp::Setattr
            | FuseOp::Mknod
            | FuseOp::Mkdir
            | FuseOp::Unlink
            | FuseOp::Rmdir
            | FuseOp::Symlink
            | FuseOp::Rename
            | FuseOp::Link
            | FuseOp::Write
            | FuseOp::Release
            | FuseOp::Setxattr
            | FuseOp::Removexattr
            | FuseOp::Create
            | FuseOp::Fallocate
    )
}

pub fn file_type(k: FileKind) -> FileType {
    match k {
        FileKind::Regular => FileType::RegularFile,
        FileKind::Directory => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
    }
}

fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: a.atime.to_system(),
        mtime: a.mtime.to_system(),
        ctime: a.ctime.to_system(),
        crtime: a.crtime.to_system(),
        kind: file_type(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: a.blksize,
        flags: 0,
    }
}

/// The attributes of a negative entry: only its node id (0) matters.
fn negative_attr() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: SystemTime::UNIX_EPOCH,
        mtime: SystemTime::UNIX_EPOCH,
        ctime: SystemTime::UNIX_EPOCH,
        crtime: SystemTime::UNIX_EPOCH,
        kind: FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    }
}

pub fn time_set(t: Option<TimeOrNow>) -> Option<TimeSet> {
    t.map(|t| match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(s) => TimeSet::At(Timestamp::from_system(s)),
    })
}

/// The kernel's `fcntl` lock, checked.
fn checked_lock(l: Lock) -> Answer<Lock> {
    if ![libc::F_RDLCK, libc::F_WRLCK, libc::F_UNLCK].contains(&l.typ) || l.end < l.start {
        return Err(Errno::from_i32(libc::EINVAL));
    }
    Ok(l)
}

fn xattr_answer(bytes: Vec<u8>, size: u32) -> Answer<Xattr> {
    if size == 0 {
        Ok(Xattr::Size(bytes.len() as u32))
    } else if bytes.len() > size as usize {
        Err(Errno::from_i32(libc::ERANGE))
    } else {
        Ok(Xattr::Data(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_the_errno_the_engine_names() {
        for (e, errno) in [
            (Error::NotFound, libc::ENOENT),
            (Error::ReadOnly, libc::EROFS),
            (Error::Poisoned, libc::EIO),
            (Error::NotEmpty, libc::ENOTEMPTY),
        ] {
            assert_eq!(i32::from(to_errno(&e)), errno);
        }
    }
}
