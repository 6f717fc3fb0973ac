//! The classic transport: fuser reads each request from `/dev/fuse`, calls
//! these methods on one of its threads, and writes the reply back. Each
//! method decodes fuser's arguments, calls [`ArborFs`] and encodes its
//! answer; nothing else happens here.

use crate::adapter::{time_set, ArborFs, Entry, Xattr};
use crate::ring::Transport;
use arbor_engine::files::{Caller, Files, Lock};
use arbor_engine::volume::SetAttr;
use fuser::{
    CopyFileRangeFlags, Errno, FileHandle, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags,
    KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
    Request, TimeOrNow, WriteFlags,
};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

thread_local! {
    /// Each loop thread's buffer for READ answers (up to `max_pages`, 1 MiB).
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// fuser's view of the file system: the shared core, and what the mount
/// asked of the kernel's INIT.
pub struct Classic<F: Files + ?Sized> {
    pub fs: Arc<ArborFs<F>>,
    pub transport: Arc<Transport>,
}

fn caller(req: &Request) -> Caller {
    Caller { uid: req.uid(), gid: req.gid() }
}

fn entry(reply: ReplyEntry, r: Result<Entry, Errno>) {
    match r {
        Ok(e) => reply.entry(&e.ttl, &e.attr, Generation(0)),
        Err(e) => reply.error(e),
    }
}

fn empty(reply: ReplyEmpty, r: Result<(), Errno>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

fn xattr(reply: ReplyXattr, r: Result<Xattr, Errno>) {
    match r {
        Ok(Xattr::Size(n)) => reply.size(n),
        Ok(Xattr::Data(d)) => reply.data(&d),
        Err(e) => reply.error(e),
    }
}

fn opened(reply: ReplyOpen, fh: u64, r: Result<FopenFlags, Errno>) {
    match r {
        Ok(flags) => reply.opened(FileHandle(fh), flags),
        Err(e) => reply.error(e),
    }
}

impl<F: Files + ?Sized> Filesystem for Classic<F> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // 1 MiB writes: one engine record per kernel write request.
        let _ = config.set_max_write(crate::ring::MAX_WRITE);
        if let Err(max) = config.set_max_readahead(self.fs.read_ahead()) {
            let _ = config.set_max_readahead(max);
        }
        // Lookups and creates in different directories need not queue.
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS | InitFlags::FUSE_CACHE_SYMLINKS);
        // Set-user-ID bits and capabilities are cleared here on a write or
        // truncate (ArborFs::setattr says why).
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        if self.fs.wants_readdirplus() {
            // Listings carry attributes when the kernel sees them used
            // (`ls -l`, `os.scandir` + `stat`), plain names otherwise.
            let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO);
        }
        if self.fs.is_shared() {
            // Locks go to the owner so that they exclude other nodes; cached
            // pages are dropped when a refreshed mtime or size says another
            // node changed the file.
            let _ = config.add_capabilities(
                InitFlags::FUSE_POSIX_LOCKS | InitFlags::FUSE_FLOCK_LOCKS | InitFlags::FUSE_AUTO_INVAL_DATA,
            );
        }
        self.transport.negotiate(config);
        Ok(())
    }

    fn destroy(&mut self) {
        // The ring's threads may still be answering; none may touch the
        // volume after its final commit.
        self.transport.stop();
        self.fs.close();
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        entry(reply, self.fs.lookup(parent.0, name.as_bytes()))
    }

    fn forget(&self, _req: &Request, ino: INodeNo, _nlookup: u64) {
        self.fs.forget(ino.0)
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(ino.0) {
            Ok(a) => reply.attr(&self.fs.attr_ttl(), &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        req: &Request,
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
        arbor_engine::files::serving(req.pid());
        let change = SetAttr {
            perm: mode.map(|m| (m & 0o7777) as u16),
            uid,
            gid,
            size,
            atime: time_set(atime),
            mtime: time_set(mtime),
        };
        // fuser does not pass FATTR_KILL_SUIDGID on; the kernel sets it
        // for a truncate by a caller without CAP_FSETID, which for this
        // transport means: not root.
        let kill = size.is_some() && req.uid() != 0;
        match self.fs.setattr(ino.0, change, caller(req), kill) {
            Ok(a) => reply.attr(&self.fs.attr_ttl(), &a),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.fs.readlink(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        arbor_engine::files::serving(req.pid());
        entry(reply, self.fs.mknod(parent.0, name.as_bytes(), mode, umask, rdev, req.uid(), req.gid()))
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        arbor_engine::files::serving(req.pid());
        entry(reply, self.fs.mkdir(parent.0, name.as_bytes(), mode, umask, req.uid(), req.gid()))
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        arbor_engine::files::serving(req.pid());
        empty(reply, self.fs.unlink(parent.0, name.as_bytes()))
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        arbor_engine::files::serving(req.pid());
        empty(reply, self.fs.rmdir(parent.0, name.as_bytes()))
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        arbor_engine::files::serving(req.pid());
        let target = target.as_os_str().as_bytes();
        entry(reply, self.fs.symlink(parent.0, link_name.as_bytes(), target, req.uid(), req.gid()))
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        arbor_engine::files::serving(req.pid());
        empty(reply, self.fs.rename(parent.0, name.as_bytes(), newparent.0, newname.as_bytes(), flags.bits()))
    }

    fn link(&self, req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        arbor_engine::files::serving(req.pid());
        entry(reply, self.fs.link(ino.0, newparent.0, newname.as_bytes()))
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        opened(reply, self.fs.new_handle(), self.fs.open(ino.0, flags.0))
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        opened(reply, 0, self.fs.opendir(ino.0))
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
        READ_BUF.with_borrow_mut(|buf| {
            // Zeroed once as it grows; every answer overwrites what it sends.
            if buf.len() < size as usize {
                buf.resize(size as usize, 0);
            }
            match self.fs.read(ino.0, offset, &mut buf[..size as usize]) {
                Ok(n) => reply.data(&buf[..n]),
                Err(e) => reply.error(e),
            }
        })
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        arbor_engine::files::serving(req.pid());
        let kill = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        let append = flags.0 & libc::O_APPEND != 0;
        match self.fs.write(ino.0, offset, data, kill, append) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn copy_file_range(
        &self,
        req: &Request,
        ino_in: INodeNo,
        _fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        _fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        arbor_engine::files::serving(req.pid());
        match self.fs.copy_file_range(ino_in.0, offset_in, ino_out.0, offset_out, len) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(&self, req: &Request, ino: INodeNo, _fh: FileHandle, lock_owner: LockOwner, reply: ReplyEmpty) {
        arbor_engine::files::serving(req.pid());
        empty(reply, self.fs.flush(ino.0, lock_owner.0))
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        empty(reply, self.fs.release(ino.0, fh.0, flags.0, lock_owner.map(|o| o.0)))
    }

    fn fsync(&self, req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        arbor_engine::files::serving(req.pid());
        empty(reply, self.fs.fsync(ino.0))
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let r = self.fs.readdir(ino.0, offset, &mut |e| {
            reply.add(INodeNo(e.ino), e.offset, crate::adapter::file_type(e.kind), OsStr::from_bytes(&e.name))
        });
        empty_dir(reply, r)
    }

    fn readdirplus(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectoryPlus) {
        // fuser does not say how large the kernel's buffer is; it fills at
        // most the 4 KiB the kernel asks for a directory page.
        let r = self.fs.readdirplus(ino.0, offset, 4096, crate::ring::direntplus_size, &mut |e, entry| {
            reply.add(INodeNo(e.ino), e.offset, OsStr::from_bytes(&e.name), &entry.ttl, &entry.attr, Generation(0))
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(&self, req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        arbor_engine::files::serving(req.pid());
        empty(reply, self.fs.fsync(ino.0))
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.fs.statfs() {
            Ok(s) => reply.statfs(s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.bsize),
            Err(e) => reply.error(e),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        arbor_engine::files::serving(req.pid());
        empty(reply, self.fs.setxattr(ino.0, name.as_bytes(), value, flags))
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        xattr(reply, self.fs.getxattr(ino.0, name.as_bytes(), size))
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        xattr(reply, self.fs.listxattr(ino.0, size))
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        arbor_engine::files::serving(req.pid());
        empty(reply, self.fs.removexattr(ino.0, name.as_bytes()))
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        arbor_engine::files::serving(req.pid());
        match self.fs.create(parent.0, name.as_bytes(), mode, umask, flags, req.uid(), req.gid()) {
            Ok((e, flags)) => reply.created(&e.ttl, &e.attr, Generation(0), FileHandle(self.fs.new_handle()), flags),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        empty(reply, self.fs.fallocate(ino.0, offset, length, mode, caller(req)))
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
        match self.fs.getlk(ino.0, lock_owner.0, Lock { start, end, typ, pid }) {
            Ok(l) => reply.locked(l.start, l.end, l.typ, l.pid),
            Err(e) => reply.error(e),
        }
    }

    fn setlk(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        empty(reply, self.fs.setlk(ino.0, fh.0, lock_owner.0, Lock { start, end, typ, pid }, sleep))
    }

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
        match self.fs.ioctl() {
            Ok(()) => reply.ioctl(0, &[]),
            Err(e) => reply.error(e),
        }
    }
}

fn empty_dir(reply: ReplyDirectory, r: Result<(), Errno>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}
