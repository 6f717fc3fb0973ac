//! The file operations of one branch or checkpoint, whatever carries them:
//! the [`Files`] trait, who asks ([`Caller`]), byte-range locks ([`Lock`]),
//! what a change takes from a file's privileges ([`clear_privileges`]), and
//! how a tree other nodes change tells a kernel's caches what went stale
//! ([`Invalidate`]).
//!
//! The trait lives in the engine, not beside the FUSE adapter, because
//! both sides of it are outside FUSE: the engine's [`Volume`] implements
//! it, and so does `arbor-net`'s client of a branch another node owns;
//! the FUSE adapter (`arbor-fs`), the network owner of a branch and any
//! library that serves files without a kernel mount all use it, and none
//! of them should have to link FUSE for that. Nothing here knows FUSE: a
//! transport maps requests to these calls and [`Invalidate`] to its kernel.

use crate::volume::{Attr, DirEntryOut, FileKind, RenameMode, SetAttr, StatFs, Volume, XattrFlags};
use crate::{Error, Result};

/// A POSIX byte-range lock (`fcntl`), or a whole-file `flock` (the range
/// 0..=u64::MAX), as the kernel gives it: `typ` is `F_RDLCK`, `F_WRLCK` or
/// `F_UNLCK`, `end` is inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Lock {
    pub start: u64,
    pub end: u64,
    pub typ: i32,
    pub pid: u32,
}

/// Who asks for a change: the FUSE request's user and primary group (the
/// kernel tells a FUSE file system nothing of the caller's other groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

impl Caller {
    pub const ROOT: Caller = Caller { uid: 0, gid: 0 };

    pub fn is_root(self) -> bool {
        self.uid == 0
    }
}

/// The file operations of one mounted tree, in the engine's terms (inode
/// numbers, byte names, engine errors whose `errno()` the adapter returns).
pub trait Files: Send + Sync + 'static {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr>;
    fn getattr(&self, ino: u64) -> Result<Attr>;
    fn setattr(&self, ino: u64, change: SetAttr) -> Result<Attr>;
    /// A SETATTR `caller` asked for: [`setattr`](Files::setattr), then
    /// what a local kernel takes from a file along with such a change — a
    /// change of owner clears its set-ID bits and capabilities
    /// ([`clear_privileges`]) whoever makes it, and so does a truncation
    /// with `kill_suidgid` (a caller without CAP_FSETID). Gives the
    /// attributes after.
    ///
    /// A mount's own kernel has checked `caller`'s rights already; a
    /// client of an owner sends `caller` along, and the owner checks it
    /// again by its own rules (the owner's policy in `arbor-net`).
    fn setattr_by(&self, ino: u64, change: SetAttr, caller: Caller, kill_suidgid: bool) -> Result<Attr> {
        let _ = caller;
        let chown = change.uid.is_some() || change.gid.is_some();
        let a = self.setattr(ino, change)?;
        if (kill_suidgid || chown) && a.kind != FileKind::Directory {
            return Ok(clear_privileges(self, a)?.0);
        }
        Ok(a)
    }
    fn readlink(&self, ino: u64) -> Result<Vec<u8>>;
    fn create(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32, rdev: u32) -> Result<Attr>;
    /// `create` then `open`, in one step where that saves a round trip.
    fn create_open(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        let a = self.create(parent, name, mode, uid, gid, 0)?;
        self.open(a.ino)
    }
    fn mkdir(&self, parent: u64, name: &[u8], perm: u16, uid: u32, gid: u32) -> Result<Attr>;
    fn symlink(&self, parent: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<Attr>;
    fn link(&self, ino: u64, new_parent: u64, new_name: &[u8]) -> Result<Attr>;
    fn unlink(&self, parent: u64, name: &[u8]) -> Result<()>;
    fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()>;
    fn rename(&self, parent: u64, name: &[u8], new_parent: u64, new_name: &[u8], mode: RenameMode) -> Result<()>;
    /// Keeps the inode alive (even once unlinked) until the matching
    /// [`release`](Files::release); returns its attributes now.
    fn open(&self, ino: u64) -> Result<Attr>;
    fn release(&self, ino: u64) -> Result<()>;
    /// Returns once what was done so far outlives this process (not the
    /// node: that is [`fsync`](Files::fsync)'s): a mount whose serving
    /// process may be killed and replaced calls it before it answers a
    /// change. Nothing by default (a change is then already elsewhere).
    fn write_out(&self) -> Result<()> {
        Ok(())
    }
    fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>>;
    /// [`read`](Files::read) into `buf` (whatever it held); returns how
    /// many bytes of it are the file's, short at end of file.
    fn read_into(&self, ino: u64, off: u64, buf: &mut [u8]) -> Result<usize> {
        let bytes = self.read(ino, off, buf.len())?;
        let n = bytes.len().min(buf.len());
        buf[..n].copy_from_slice(&bytes[..n]);
        Ok(n)
    }
    fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<usize>;
    /// [`write`](Files::write) by a caller without CAP_FSETID (the
    /// kernel's FUSE_WRITE_KILL_SUIDGID): the file first loses what
    /// [`clear_privileges`] takes. Also gives whether a mode the kernel
    /// cached may be stale now. A client of an owner sends the two as one
    /// request, answered later like any write.
    fn write_unprivileged(&self, ino: u64, off: u64, data: &[u8]) -> Result<(usize, bool)> {
        let (_, changed) = clear_privileges(self, self.getattr(ino)?)?;
        Ok((self.write(ino, off, data)?, changed))
    }
    /// A write by an `O_APPEND` descriptor, which the kernel placed at
    /// `off`: the end of the file as it last saw it. A tree only this node
    /// changes writes there; one other nodes change too appends at the end
    /// of the file as it is. `unprivileged`: as in
    /// [`write_unprivileged`](Files::write_unprivileged), whose answer this
    /// gives.
    fn write_appending(&self, ino: u64, off: u64, data: &[u8], unprivileged: bool) -> Result<(usize, bool)> {
        if unprivileged {
            self.write_unprivileged(ino, off, data)
        } else {
            Ok((self.write(ino, off, data)?, false))
        }
    }
    fn fsync(&self, ino: u64) -> Result<()>;
    /// Entries from `offset` on, until `f` returns false.
    fn readdir(&self, ino: u64, offset: u64, f: &mut dyn FnMut(DirEntryOut) -> bool) -> Result<()>;
    fn statfs(&self) -> Result<StatFs>;
    fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: XattrFlags) -> Result<()>;
    fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>>;
    fn listxattr(&self, ino: u64) -> Result<Vec<Vec<u8>>>;
    fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()>;
    /// The last commit, at unmount.
    fn close(&self) -> Result<()>;
    fn is_read_only(&self) -> bool;

    /// Whether other nodes change these files too. A shared tree is served
    /// with short kernel cache timeouts and cached pages checked at every
    /// open (close-to-open), and its locks are taken through
    /// [`getlk`](Files::getlk) / [`setlk`](Files::setlk) so that they
    /// exclude other nodes; an unshared one is cached for long and the
    /// kernel keeps its locks itself.
    fn is_shared(&self) -> bool {
        false
    }

    /// The first lock held by someone other than `owner` that conflicts
    /// with `lock`, if any.
    fn getlk(&self, _ino: u64, _owner: u64, _lock: Lock) -> Result<Option<Lock>> {
        Err(Error::Io(std::io::Error::from_raw_os_error(libc::ENOSYS)))
    }

    /// Takes (or with `F_UNLCK` drops) `lock` for `owner`; with `wait`,
    /// until it can be had, else EAGAIN at once.
    fn setlk(&self, _ino: u64, _owner: u64, _lock: Lock, _wait: bool) -> Result<()> {
        Err(Error::Io(std::io::Error::from_raw_os_error(libc::ENOSYS)))
    }

    /// A descriptor of `ino` is being closed: anything buffered for the
    /// file is delivered, and an error met doing so is returned. Nothing is
    /// buffered by default.
    fn flush(&self, _ino: u64) -> Result<()> {
        Ok(())
    }

    /// Drops every lock `owner` holds on `ino` (its descriptor was closed).
    fn unlock_all(&self, _ino: u64, _owner: u64) -> Result<()> {
        Ok(())
    }

    /// Makes `len` bytes of `dst` from `dst_off` the bytes of `src` from
    /// `src_off` without copying them (see [`Volume::clone_range`]);
    /// `EOPNOTSUPP` where they cannot be shared, and the caller copies.
    fn clone_range(&self, _src: u64, _src_off: u64, _dst: u64, _dst_off: u64, _len: u64) -> Result<u64> {
        Err(Error::Io(std::io::Error::from_raw_os_error(libc::EOPNOTSUPP)))
    }
}

/// What a write or truncate by a caller without CAP_FSETID, or a change
/// of owner, takes from the file `a` describes: its set-user-ID bit, its
/// set-group-ID bit when it is group-executable (as the VFS does), and its
/// file capabilities. Gives the attributes after, and whether the mode
/// changed.
pub fn clear_privileges<F: Files + ?Sized>(f: &F, a: Attr) -> Result<(Attr, bool)> {
    let mut perm = a.perm & !(libc::S_ISUID as u16);
    if perm & libc::S_IXGRP as u16 != 0 {
        perm &= !(libc::S_ISGID as u16);
    }
    let changed = perm != a.perm;
    let a = if changed { f.setattr(a.ino, SetAttr { perm: Some(perm), ..Default::default() })? } else { a };
    drop_capabilities(f, a.ino)?;
    Ok((a, changed))
}

/// Removes `ino`'s file capabilities (`security.capability`), which any
/// write takes from a file, whoever makes it; a file without them is
/// left as it is.
pub fn drop_capabilities<F: Files + ?Sized>(f: &F, ino: u64) -> Result<()> {
    // Files seldom have any: a look (under a volume's read lock) spares
    // most writes a change.
    if f.getxattr(ino, CAPABILITIES).is_err() {
        return Ok(());
    }
    match f.removexattr(ino, CAPABILITIES) {
        // A client of an owner gets the errno back, not the variant.
        Err(e) if e.errno() != libc::ENODATA => Err(e),
        _ => Ok(()),
    }
}

/// The extended attribute that holds a file's capabilities.
pub const CAPABILITIES: &[u8] = b"security.capability";

thread_local! {
    static CALLING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Notes that this thread now serves a request of process (thread) `pid`,
/// as the kernel gave it; the FUSE adapters call it before a change or an
/// fsync, so that a [`Files`] may tell which caller a loss belongs to.
pub fn serving(pid: u32) {
    CALLING.with(|c| c.set(pid));
}

/// The pid (a thread id, as FUSE gives it) of the request this thread
/// serves, or 0 if unknown.
pub fn calling_pid() -> u32 {
    CALLING.with(|c| c.get())
}

/// Where a tree other nodes change too drops what they changed from the
/// caches of whoever serves it (a FUSE mount's kernel keeps names and
/// attributes, and pages of open files). Failures are the implementor's
/// to log: a cache answers that it does not hold what is dropped.
pub trait Invalidate: Send + Sync {
    /// Inode `ino`'s attributes and cached pages (its bytes changed).
    fn inode(&self, ino: u64);
    /// The name `name` in directory `parent` (added, removed or replaced).
    fn entry(&self, parent: u64, name: &[u8]);
}

impl Files for Volume {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        Volume::lookup(self, parent, name)
    }
    fn getattr(&self, ino: u64) -> Result<Attr> {
        Volume::getattr(self, ino)
    }
    fn setattr(&self, ino: u64, change: SetAttr) -> Result<Attr> {
        Volume::setattr(self, ino, change)
    }
    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        Volume::readlink(self, ino)
    }
    fn create(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32, rdev: u32) -> Result<Attr> {
        Volume::create(self, parent, name, mode, uid, gid, rdev)
    }
    fn mkdir(&self, parent: u64, name: &[u8], perm: u16, uid: u32, gid: u32) -> Result<Attr> {
        Volume::mkdir(self, parent, name, perm, uid, gid)
    }
    fn symlink(&self, parent: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<Attr> {
        Volume::symlink(self, parent, name, target, uid, gid)
    }
    fn link(&self, ino: u64, new_parent: u64, new_name: &[u8]) -> Result<Attr> {
        Volume::link(self, ino, new_parent, new_name)
    }
    fn unlink(&self, parent: u64, name: &[u8]) -> Result<()> {
        Volume::unlink(self, parent, name)
    }
    fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()> {
        Volume::rmdir(self, parent, name)
    }
    fn rename(&self, parent: u64, name: &[u8], new_parent: u64, new_name: &[u8], mode: RenameMode) -> Result<()> {
        Volume::rename(self, parent, name, new_parent, new_name, mode)
    }
    fn open(&self, ino: u64) -> Result<Attr> {
        Volume::acquire(self, ino)
    }
    fn release(&self, ino: u64) -> Result<()> {
        Volume::release(self, ino)
    }
    fn write_out(&self) -> Result<()> {
        Volume::write_out(self)
    }
    fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        Volume::read(self, ino, off, len)
    }
    fn read_into(&self, ino: u64, off: u64, buf: &mut [u8]) -> Result<usize> {
        Volume::read_into(self, ino, off, buf)
    }
    fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<usize> {
        Volume::write(self, ino, off, data)
    }
    fn fsync(&self, ino: u64) -> Result<()> {
        Volume::fsync(self, ino)
    }
    fn readdir(&self, ino: u64, offset: u64, f: &mut dyn FnMut(DirEntryOut) -> bool) -> Result<()> {
        Volume::readdir(self, ino, offset, f)
    }
    fn statfs(&self) -> Result<StatFs> {
        Ok(Volume::statfs(self))
    }
    fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: XattrFlags) -> Result<()> {
        Volume::setxattr(self, ino, name, value, flags)
    }
    fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        Volume::getxattr(self, ino, name)
    }
    fn listxattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        Volume::listxattr(self, ino)
    }
    fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()> {
        Volume::removexattr(self, ino, name)
    }
    fn close(&self) -> Result<()> {
        Volume::close(self)
    }
    fn is_read_only(&self) -> bool {
        Volume::is_read_only(self)
    }
    fn clone_range(&self, src: u64, src_off: u64, dst: u64, dst_off: u64, len: u64) -> Result<u64> {
        Volume::clone_range(self, src, src_off, dst, dst_off, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimDevice;
    use crate::env::TestEnv;
    use crate::volume::{Config, ROOT_INO};
    use std::sync::Arc;

    fn volume() -> Arc<Volume> {
        let cfg = Config { commit_interval: None, env: TestEnv::new(1), ..Config::default() };
        Volume::open(Arc::new(SimDevice::new()), cfg).expect("volume")
    }

    #[test]
    fn an_unprivileged_write_clears_set_id_bits_and_capabilities_and_says_so() {
        let v = volume();
        let v: &Volume = &v;
        let f = Files::create(v, ROOT_INO, b"tool", libc::S_IFREG | 0o6755, 0, 0, 0).expect("create");
        Files::setxattr(v, f.ino, CAPABILITIES, b"caps", XattrFlags::Any).expect("setxattr");
        let (n, changed) = v.write_unprivileged(f.ino, 0, b"abc").expect("write");
        assert_eq!((n, changed), (3, true));
        let a = Files::getattr(v, f.ino).expect("getattr");
        assert_eq!(a.perm, 0o0755, "set-user-ID and (group-executable) set-group-ID cleared");
        assert_eq!(a.size, 3);
        assert!(matches!(Files::getxattr(v, f.ino, CAPABILITIES), Err(Error::NoAttr)));
        // Nothing left to clear: the mode stays, and the caller is told so.
        assert_eq!(v.write_unprivileged(f.ino, 3, b"d").expect("write"), (1, false));
        // Set-group-ID without group execute is not an exec bit: it stays.
        let g = Files::setattr(v, f.ino, SetAttr { perm: Some(0o6745), ..Default::default() }).expect("chmod");
        let (g, changed) = clear_privileges(v, g).expect("clear");
        assert!(changed);
        assert_eq!(g.perm, 0o2745);
        // A file without capabilities is left as it is, and other
        // attributes stay.
        Files::setxattr(v, f.ino, b"user.keep", b"1", XattrFlags::Any).expect("setxattr");
        drop_capabilities(v, f.ino).expect("drop");
        assert_eq!(Files::getxattr(v, f.ino, b"user.keep").expect("kept"), b"1");
    }

    #[test]
    fn a_change_of_owner_or_a_killing_truncation_clears_set_id_bits_a_plain_change_does_not() {
        let v = volume();
        let v: &Volume = &v;
        let who = Caller { uid: 1000, gid: 1000 };
        let f = Files::create(v, ROOT_INO, b"tool", libc::S_IFREG | 0o6755, 0, 0, 0).expect("create");
        let touch = SetAttr { size: Some(1), ..Default::default() };
        assert_eq!(v.setattr_by(f.ino, touch.clone(), who, false).expect("truncate").perm, 0o6755);
        assert_eq!(v.setattr_by(f.ino, touch, who, true).expect("truncate").perm, 0o0755);
        Files::setattr(v, f.ino, SetAttr { perm: Some(0o6755), ..Default::default() }).expect("chmod");
        let give = SetAttr { uid: Some(1000), ..Default::default() };
        let a = v.setattr_by(f.ino, give, Caller::ROOT, false).expect("chown");
        assert_eq!((a.uid, a.perm), (1000, 0o0755), "a chown clears the bits, even root's");
        // A folder keeps its set-group-ID bit through a change of owner.
        let d = Files::mkdir(v, ROOT_INO, b"d", 0o2775, 0, 0).expect("mkdir");
        let give = SetAttr { gid: Some(1000), ..Default::default() };
        assert_eq!(v.setattr_by(d.ino, give, Caller::ROOT, false).expect("chgrp").perm, 0o2775);
    }
}
