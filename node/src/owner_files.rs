//! A branch this process owns, as a front end in the owner's own process
//! changes it (the S3 endpoint of `arbor serve --s3`): [`OwnerFiles`].
//!
//! Its changes take the path a client mount's do once they reach the
//! owner ([`SharedBranch::apply_request`]), minus the wire: the owner's
//! policy, its inode reservations, and the events that tell every client
//! mount what changed, so that a file put here shows on the mounts at
//! their next open (close-to-open), as a file another mount wrote does.
//! Reads, which change nothing, go to the branch's volume directly.

use arbor_engine::files::Files;
use arbor_engine::volume::{Attr, DirEntryOut, RenameMode, SetAttr, StatFs, XattrFlags};
use arbor_engine::{Caller, Error, Result};
use arbor_net::branch::owner::{FileOp, Out};
use arbor_net::SharedBranch;
use std::sync::Arc;

/// The session the owner's own front ends change the branch under: 0,
/// which the branch never gives a client (its session ids are never 0),
/// so every client mount hears of these changes. It holds no open files
/// and no locks: opens are taken on the volume itself.
const OWN_SESSION: u64 = 0;

/// An owned branch's [`Files`] for a front end in the owner's process.
pub struct OwnerFiles {
    shared: Arc<SharedBranch>,
}

impl OwnerFiles {
    pub fn new(shared: Arc<SharedBranch>) -> Arc<OwnerFiles> {
        Arc::new(OwnerFiles { shared })
    }

    fn change(&self, op: FileOp) -> Result<Out> {
        self.shared.apply_request(OWN_SESSION, None, op).map_err(|n| Error::Io(std::io::Error::from_raw_os_error(n)))
    }

    fn attr(&self, op: FileOp) -> Result<Attr> {
        match self.change(op)? {
            Out::Attr(a) => Ok(a),
            _ => Err(Error::Invalid("the owner gave no attributes")),
        }
    }

    fn unit(&self, op: FileOp) -> Result<()> {
        self.change(op).map(|_| ())
    }
}

impl Files for OwnerFiles {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        self.shared.volume().lookup(parent, name)
    }
    fn getattr(&self, ino: u64) -> Result<Attr> {
        self.shared.volume().getattr(ino)
    }
    fn setattr(&self, ino: u64, change: SetAttr) -> Result<Attr> {
        self.attr(FileOp::SetAttr { ino, change, caller: Caller::ROOT, kill_suidgid: false })
    }
    fn setattr_by(&self, ino: u64, change: SetAttr, caller: Caller, kill_suidgid: bool) -> Result<Attr> {
        self.attr(FileOp::SetAttr { ino, change, caller, kill_suidgid })
    }
    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        self.shared.volume().readlink(ino)
    }
    fn create(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32, rdev: u32) -> Result<Attr> {
        self.attr(FileOp::Create { parent, name: name.to_vec(), mode, uid, gid, rdev })
    }
    fn create_open(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        let a = self.create(parent, name, mode, uid, gid, 0)?;
        self.open(a.ino)
    }
    fn mkdir(&self, parent: u64, name: &[u8], perm: u16, uid: u32, gid: u32) -> Result<Attr> {
        self.attr(FileOp::Mkdir { parent, name: name.to_vec(), perm, uid, gid })
    }
    fn symlink(&self, parent: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<Attr> {
        self.attr(FileOp::Symlink { parent, name: name.to_vec(), target: target.to_vec(), uid, gid })
    }
    fn link(&self, ino: u64, new_parent: u64, new_name: &[u8]) -> Result<Attr> {
        self.attr(FileOp::Link { ino, new_parent, new_name: new_name.to_vec() })
    }
    fn unlink(&self, parent: u64, name: &[u8]) -> Result<()> {
        self.unit(FileOp::Unlink { parent, name: name.to_vec() })
    }
    fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()> {
        self.unit(FileOp::Rmdir { parent, name: name.to_vec() })
    }
    fn rename(&self, parent: u64, name: &[u8], new_parent: u64, new_name: &[u8], mode: RenameMode) -> Result<()> {
        self.unit(FileOp::Rename { parent, name: name.to_vec(), new_parent, new_name: new_name.to_vec(), mode })
    }
    fn open(&self, ino: u64) -> Result<Attr> {
        self.shared.volume().acquire(ino)
    }
    fn release(&self, ino: u64) -> Result<()> {
        self.shared.volume().release(ino)
    }
    fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        self.shared.volume().read(ino, off, len)
    }
    fn read_into(&self, ino: u64, off: u64, buf: &mut [u8]) -> Result<usize> {
        self.shared.volume().read_into(ino, off, buf)
    }
    fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<usize> {
        match self.change(FileOp::Write { ino, off, data: data.to_vec(), unprivileged: false, append: false })? {
            Out::Written(n) => Ok(n as usize),
            _ => Err(Error::Invalid("the owner gave no count")),
        }
    }
    fn fsync(&self, ino: u64) -> Result<()> {
        self.shared.volume().fsync(ino)
    }
    fn readdir(&self, ino: u64, offset: u64, f: &mut dyn FnMut(DirEntryOut) -> bool) -> Result<()> {
        self.shared.volume().readdir(ino, offset, f)
    }
    fn statfs(&self) -> Result<StatFs> {
        Ok(self.shared.volume().statfs())
    }
    fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: XattrFlags) -> Result<()> {
        self.unit(FileOp::SetXattr { ino, name: name.to_vec(), value: value.to_vec(), flags })
    }
    fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        self.shared.volume().getxattr(ino, name)
    }
    fn listxattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        self.shared.volume().listxattr(ino)
    }
    fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()> {
        self.unit(FileOp::RemoveXattr { ino, name: name.to_vec() })
    }
    fn clone_range(&self, src: u64, src_off: u64, dst: u64, dst_off: u64, len: u64) -> Result<u64> {
        // The owner clones exact ranges: cut at the source's end here.
        let len = len.min(self.shared.volume().getattr(src)?.size.saturating_sub(src_off));
        if len == 0 {
            return Ok(0);
        }
        match self.change(FileOp::CloneRange { src, src_off, dst, dst_off, len })? {
            Out::Written(n) => Ok(n),
            _ => Err(Error::Invalid("the owner gave no count")),
        }
    }
    /// The owner closes the branch when it stops, not a front end.
    fn close(&self) -> Result<()> {
        Ok(())
    }
    fn is_read_only(&self) -> bool {
        false
    }
    fn is_shared(&self) -> bool {
        true
    }
}
