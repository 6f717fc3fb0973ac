use crate::files::{Files, Lock};
use arbor_engine::volume::{Attr, FileKind, RenameMode, SetAttr, TimeSet, XattrFlags};
use arbor_engine::{env::Timestamp, Error};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags,
    KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
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
}

impl<F: Files + ?Sized> ArborFs<F> {
    pub fn new(vol: Arc<F>, read_ahead: u32) -> Self {
        let ttl = if vol.is_shared() { SHARED_TTL } else { TTL };
        ArborFs {
            vol,
            read_ahead,
            ttl,
            opened: parking_lot::Mutex::new(HashMap::new()),
            locked: parking_lot::Mutex::new(Default::default()),
        }
    }

    pub fn volume(&self) -> &Arc<F> {
        &self.vol
    }

    /// How an open of a file with attributes `a` may use the kernel's cache.
    fn open_flags(&self, a: &Attr) -> FopenFlags {
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
}

fn file_type(k: FileKind) -> FileType {
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

fn time_set(t: Option<TimeOrNow>) -> Option<TimeSet> {
    t.map(|t| match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(s) => TimeSet::At(Timestamp::from_system(s)),
    })
}

fn entry(reply: ReplyEntry, ttl: Duration, r: Result<Attr, Error>) {
    match r {
        Ok(a) => reply.entry(&ttl, &file_attr(&a), Generation(0)),
        Err(e) => reply.error(to_errno(&e)),
    }
}

/// The kernel's `fcntl` lock, checked.
fn lock(start: u64, end: u64, typ: i32, pid: u32) -> Result<Lock, Errno> {
    if ![libc::F_RDLCK, libc::F_WRLCK, libc::F_UNLCK].contains(&typ) || end < start {
        return Err(Errno::from_i32(libc::EINVAL));
    }
    Ok(Lock { start, end, typ, pid })
}

fn empty(reply: ReplyEmpty, r: Result<(), Error>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(to_errno(&e)),
    }
}

fn xattr_reply(reply: ReplyXattr, bytes: &[u8], size: u32) {
    if size == 0 {
        reply.size(bytes.len() as u32);
    } else if bytes.len() > size as usize {
        reply.error(Errno::from_i32(libc::ERANGE));
    } else {
        reply.data(bytes);
    }
}

impl<F: Files + ?Sized> Filesystem for ArborFs<F> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // 1 MiB writes: one engine record per kernel write request.
        let _ = config.set_max_write(1 << 20);
        if let Err(max) = config.set_max_readahead(self.read_ahead) {
            let _ = config.set_max_readahead(max);
        }
        // Lookups and creates in different directories need not queue.
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS | InitFlags::FUSE_CACHE_SYMLINKS);
        if self.vol.is_shared() {
            // Locks go to the owner so that they exclude other nodes; cached
            // pages are dropped when a refreshed mtime or size says another
            // node changed the file.
            let _ = config.add_capabilities(
                InitFlags::FUSE_POSIX_LOCKS | InitFlags::FUSE_FLOCK_LOCKS | InitFlags::FUSE_AUTO_INVAL_DATA,
            );
        }
        Ok(())
    }

    fn destroy(&mut self) {
        if let Err(e) = self.vol.close() {
            tracing::error!(error = %e, "final commit at unmount failed");
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.vol.lookup(parent.0, name.as_bytes()) {
            // Node 0 is "no such name, and remember that for TTL": the
            // kernel keeps a negative entry (and drops it itself when the
            // name is created through it), so a program probing for files
            // that are not there (module search paths, "exists?" checks)
            // asks us once.
            Err(Error::NotFound) => reply.entry(&self.ttl, &negative_attr(), Generation(0)),
            r => entry(reply, self.ttl, r),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, _nlookup: u64) {
        // The kernel forgets an inode (with all its lookups) when it evicts
        // it, and its cached pages with it.
        if self.vol.is_shared() {
            self.opened.lock().remove(&ino.0);
            self.locked.lock().remove(&ino.0);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.vol.getattr(ino.0) {
            Ok(a) => reply.attr(&self.ttl, &file_attr(&a)),
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let change = SetAttr {
            perm: mode.map(|m| (m & 0o7777) as u16),
            uid,
            gid,
            size,
            atime: time_set(atime),
            mtime: time_set(mtime),
        };
        match self.vol.setattr(ino.0, change) {
            Ok(a) => reply.attr(&self.ttl, &file_attr(&a)),
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.vol.readlink(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        let mode = (mode & libc::S_IFMT) | (mode & 0o7777 & !umask);
        entry(reply, self.ttl, self.vol.create(parent.0, name.as_bytes(), mode, req.uid(), req.gid(), rdev));
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let perm = (mode & 0o7777 & !umask) as u16;
        entry(reply, self.ttl, self.vol.mkdir(parent.0, name.as_bytes(), perm, req.uid(), req.gid()));
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.vol.unlink(parent.0, name.as_bytes()));
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.vol.rmdir(parent.0, name.as_bytes()));
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        entry(
            reply,
            self.ttl,
            self.vol.symlink(parent.0, link_name.as_bytes(), target.as_os_str().as_bytes(), req.uid(), req.gid()),
        );
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mode = if flags.is_empty() {
            RenameMode::Plain
        } else if flags == RenameFlags::RENAME_NOREPLACE {
            RenameMode::NoReplace
        } else if flags == RenameFlags::RENAME_EXCHANGE {
            RenameMode::Exchange
        } else {
            return reply.error(Errno::from_i32(libc::EINVAL));
        };
        empty(reply, self.vol.rename(parent.0, name.as_bytes(), newparent.0, newname.as_bytes(), mode));
    }

    fn link(&self, _req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        entry(reply, self.ttl, self.vol.link(ino.0, newparent.0, newname.as_bytes()));
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.vol.open(ino.0) {
            Ok(a) => reply.opened(FileHandle(0), self.open_flags(&a)),
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.vol.read(ino.0, offset, size as usize) {
            Ok(b) => reply.data(&b),
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.vol.write(ino.0, offset, data) {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn flush(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, lock_owner: LockOwner, reply: ReplyEmpty) {
        if self.vol.is_shared() {
            // Closing a descriptor drops its process's fcntl locks on the
            // file, which the owner holds; a file never locked here costs
            // no round trip.
            if self.locked.lock().contains(&ino.0) {
                return empty(reply, self.vol.unlock_all(ino.0, lock_owner.0));
            }
            return reply.ok();
        }
        // Nothing is buffered per handle. ENOSYS tells the kernel to stop
        // sending FLUSH on every close (it then reports success itself):
        // one round trip fewer per file.
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // The last close of an open file drops its flock.
        if let Some(owner) = lock_owner.filter(|_| self.locked.lock().contains(&ino.0)) {
            if let Err(e) = self.vol.unlock_all(ino.0, owner.0) {
                tracing::warn!(ino = ino.0, error = %e, "dropping a closed file's locks failed");
            }
        }
        empty(reply, self.vol.release(ino.0));
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        empty(reply, self.vol.fsync(ino.0));
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let r = self.vol.readdir(ino.0, offset, &mut |e| {
            !reply.add(INodeNo(e.ino), e.offset, file_type(e.kind), OsStr::from_bytes(&e.name))
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        empty(reply, self.vol.fsync(ino.0));
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.vol.statfs() {
            Ok(s) => reply.statfs(s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.bsize),
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let flags = match flags {
            0 => XattrFlags::Any,
            libc::XATTR_CREATE => XattrFlags::Create,
            libc::XATTR_REPLACE => XattrFlags::Replace,
            _ => return reply.error(Errno::from_i32(libc::EINVAL)),
        };
        empty(reply, self.vol.setxattr(ino.0, name.as_bytes(), value, flags));
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self.vol.getxattr(ino.0, name.as_bytes()) {
            Ok(v) => xattr_reply(reply, &v, size),
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.vol.listxattr(ino.0) {
            Ok(names) => {
                let mut buf = Vec::new();
                for n in names {
                    buf.extend_from_slice(&n);
                    buf.push(0);
                }
                xattr_reply(reply, &buf, size);
            }
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.vol.removexattr(ino.0, name.as_bytes()));
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let mode = (mode & libc::S_IFMT) | (mode & 0o7777 & !umask);
        match self.vol.create_open(parent.0, name.as_bytes(), mode, req.uid(), req.gid()) {
            Ok(a) => {
                let flags = self.open_flags(&a);
                reply.created(&self.ttl, &file_attr(&a), Generation(0), FileHandle(0), flags)
            }
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        // Space is never reserved (holes cost nothing and the bucket has no
        // quota to run out of); plain fallocate only extends the size.
        if mode != 0 {
            return reply.error(Errno::from_i32(libc::EOPNOTSUPP));
        }
        let r = self.vol.getattr(ino.0).and_then(|a| {
            let end = offset.checked_add(length).ok_or(Error::TooBig)?;
            if end > a.size {
                self.vol.setattr(ino.0, SetAttr { size: Some(end), ..Default::default() })?;
            }
            Ok(())
        });
        empty(reply, r);
    }

    fn getlk(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: ReplyLock,
    ) {
        let asked = match lock(start, end, typ, pid) {
            Ok(l) => l,
            Err(e) => return reply.error(e),
        };
        match self.vol.getlk(ino.0, lock_owner.0, asked) {
            Ok(Some(l)) => reply.locked(l.start, l.end, l.typ, l.pid),
            Ok(None) => reply.locked(start, end, libc::F_UNLCK, 0),
            Err(e) => reply.error(to_errno(&e)),
        }
    }

    fn setlk(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        match lock(start, end, typ, pid) {
            Ok(l) => {
                if typ != libc::F_UNLCK {
                    self.locked.lock().insert(ino.0);
                }
                empty(reply, self.vol.setlk(ino.0, lock_owner.0, l, sleep))
            }
            Err(e) => reply.error(e),
        }
    }

    /// No ioctl is supported. ENOTTY is what a file system without the
    /// request answers (Python asks on every `open()` whether a file is a
    /// terminal); the kernel does not remember it, so it is not logged.
    #[allow(clippy::too_many_arguments)]
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::from_i32(libc::ENOTTY));
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
