//! The [`Files`] a client mount serves: each operation sent to the owner
//! (writes on their lanes), its answer returned as the owner's volume
//! gave it.

use super::*;

fn attr(r: Result<Out>) -> Result<Attr> {
    match r? {
        Out::Attr(a) => Ok(a),
        _ => Err(errno_error(libc::EPROTO)),
    }
}

fn unit(r: Result<Out>) -> Result<()> {
    match r? {
        Out::Unit => Ok(()),
        _ => Err(errno_error(libc::EPROTO)),
    }
}

fn bytes(r: Result<Out>) -> Result<Vec<u8>> {
    match r? {
        Out::Bytes(b) => Ok(b),
        _ => Err(errno_error(libc::EPROTO)),
    }
}

impl Files for BranchClient {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        attr(self.call(FileOp::Lookup { parent, name: name.to_vec() }))
    }
    fn getattr(&self, ino: u64) -> Result<Attr> {
        attr(self.call(FileOp::GetAttr { ino }))
    }
    /// A change with no caller is made as root would make it (which an
    /// owner squashing root makes nobody's).
    fn setattr(&self, ino: u64, change: SetAttr) -> Result<Attr> {
        self.setattr_by(ino, change, Caller::ROOT, false)
    }
    /// One request: the owner checks `caller` and clears what the change
    /// takes from the file as it applies it.
    fn setattr_by(&self, ino: u64, change: SetAttr, caller: Caller, kill_suidgid: bool) -> Result<Attr> {
        self.forget(ino);
        attr(self.call(FileOp::SetAttr { ino, change, caller, kill_suidgid }))
    }
    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        bytes(self.call(FileOp::ReadLink { ino }))
    }
    fn create(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32, rdev: u32) -> Result<Attr> {
        attr(self.call(FileOp::Create { parent, name: name.to_vec(), mode, uid, gid, rdev }))
    }
    fn create_open(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        let a = attr(self.call(FileOp::CreateOpen { parent, name: name.to_vec(), mode, uid, gid }))?;
        self.opened(&a);
        Ok(a)
    }
    fn mkdir(&self, parent: u64, name: &[u8], perm: u16, uid: u32, gid: u32) -> Result<Attr> {
        attr(self.call(FileOp::Mkdir { parent, name: name.to_vec(), perm, uid, gid }))
    }
    fn symlink(&self, parent: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<Attr> {
        attr(self.call(FileOp::Symlink { parent, name: name.to_vec(), target: target.to_vec(), uid, gid }))
    }
    fn link(&self, ino: u64, new_parent: u64, new_name: &[u8]) -> Result<Attr> {
        attr(self.call(FileOp::Link { ino, new_parent, new_name: new_name.to_vec() }))
    }
    fn unlink(&self, parent: u64, name: &[u8]) -> Result<()> {
        unit(self.call(FileOp::Unlink { parent, name: name.to_vec() }))
    }
    fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()> {
        unit(self.call(FileOp::Rmdir { parent, name: name.to_vec() }))
    }
    fn rename(&self, parent: u64, name: &[u8], new_parent: u64, new_name: &[u8], mode: RenameMode) -> Result<()> {
        unit(self.call(FileOp::Rename { parent, name: name.to_vec(), new_parent, new_name: new_name.to_vec(), mode }))
    }
    fn open(&self, ino: u64) -> Result<Attr> {
        let a = attr(self.call(FileOp::Open { ino, count: 1 }))?;
        self.opened(&a);
        Ok(a)
    }
    fn release(&self, ino: u64) -> Result<()> {
        {
            let mut open = self.inner.open.lock();
            match open.get_mut(&ino) {
                Some(f) if f.count > 1 => f.count -= 1,
                _ => {
                    open.remove(&ino);
                }
            }
        }
        unit(self.call(FileOp::Release { ino }))
    }
    fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        // Bounded like a FUSE read; a larger one is a short read.
        let mut buf = vec![0u8; len.min(u32::MAX as usize)];
        let n = self.read_into(ino, off, &mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }
    fn read_into(&self, ino: u64, off: u64, buf: &mut [u8]) -> Result<usize> {
        self.check_alive(ino)?;
        if let Some(d) = &self.inner.direct {
            let locate = |ino, off, len| match self.call(FileOp::Locate { ino, off, len })? {
                Out::Located(l) => Ok(l),
                _ => Err(errno_error(libc::EPROTO)),
            };
            match d.read_into(ino, off, buf, locate) {
                Ok(Some(n)) => return Ok(n),
                Ok(None) => {}
                Err(crate::branch::reads::Failed::Owner(e)) => return Err(e),
                Err(crate::branch::reads::Failed::Here(e)) => {
                    d.forget(ino);
                    d.counters.direct_failed.inc();
                    tracing::debug!(ino, off, error = %e, "a read from the segments failed; the owner reads it");
                }
            }
        }
        // A read larger than an owner answers at once goes in pieces;
        // bounded: each round fills more of `buf` or ends.
        let mut n = 0;
        while n < buf.len() {
            let len = (buf.len() - n).min(MAX_READ as usize) as u32;
            let b = bytes(self.call(FileOp::Read { ino, off: off + n as u64, len }))?;
            self.inner.counts.owner_reads.inc();
            self.inner.counts.owner_bytes.add(b.len() as u64);
            let got = b.len().min(len as usize);
            buf[n..n + got].copy_from_slice(&b[..got]);
            n += got;
            if got < len as usize {
                break;
            }
        }
        Ok(n)
    }
    fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<usize> {
        self.write_as(Written { ino, off, unprivileged: false, append: false }, data)
    }
    /// One request: the owner clears the file's privileges as it applies
    /// the write, answered later like any write. The kernel's cached mode
    /// is dropped whatever it was (the answer comes later).
    fn write_unprivileged(&self, ino: u64, off: u64, data: &[u8]) -> Result<(usize, bool)> {
        Ok((self.write_as(Written { ino, off, unprivileged: true, append: false }, data)?, true))
    }
    /// At the owner's end of the file, in flight like any write.
    fn write_appending(&self, ino: u64, off: u64, data: &[u8], unprivileged: bool) -> Result<(usize, bool)> {
        Ok((self.write_as(Written { ino, off, unprivileged, append: true }, data)?, unprivileged))
    }
    fn fsync(&self, ino: u64) -> Result<()> {
        self.inner.settle_all();
        let upto = self.inner.journal.lock().position();
        unit(self.inner.call_raw(FileOp::Fsync { ino }))?;
        // The owner's fsync covers its whole log: every request answered
        // before it was sent is durable now. What an earlier owner lost
        // (found when this one was met) fails this fsync.
        let mut j = self.inner.journal.lock();
        j.synced(upto);
        let failed = j.failed.remove(&ino);
        let lost = j.lost.remove(&ino);
        if j.take_lost_change(ino, calling_process()) || lost {
            return Err(errno_error(libc::EIO));
        }
        match failed {
            Some(errno) => Err(errno_error(errno)),
            None => Ok(()),
        }
    }
    fn flush(&self, ino: u64) -> Result<()> {
        // Close-to-open: what was written is at the owner before close
        // returns, and a write it refused or lost is reported here. Writes
        // the owner did not answer are given up, not left to land later.
        if !self.inner.settle_reachable(ino) {
            return Err(errno_error(libc::EIO));
        }
        self.inner.take_failed(ino)?;
        // Reported, and kept for the file's next fsync: a close by one
        // process does not hide the loss from another's fsync.
        if self.inner.journal.lock().lost.contains(&ino) {
            return Err(errno_error(libc::EIO));
        }
        Ok(())
    }
    fn readdir(&self, ino: u64, mut offset: u64, f: &mut dyn FnMut(DirEntryOut) -> bool) -> Result<()> {
        // Bounded by the directory: each batch moves the offset forward.
        loop {
            let Out::Entries(batch) = self.call(FileOp::ReadDir { ino, offset, max: READDIR_BATCH })? else {
                return Err(errno_error(libc::EPROTO));
            };
            let full = batch.len() as u32 >= READDIR_BATCH;
            for e in batch {
                offset = e.offset;
                if !f(e) {
                    return Ok(());
                }
            }
            if !full {
                return Ok(());
            }
        }
    }
    fn statfs(&self) -> Result<StatFs> {
        match self.call(FileOp::StatFs)? {
            Out::StatFs(s) => Ok(s),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }
    fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: XattrFlags) -> Result<()> {
        unit(self.call(FileOp::SetXattr { ino, name: name.to_vec(), value: value.to_vec(), flags }))
    }
    fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        bytes(self.call(FileOp::GetXattr { ino, name: name.to_vec() }))
    }
    fn listxattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        match self.call(FileOp::ListXattr { ino })? {
            Out::Names(n) => Ok(n),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }
    fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()> {
        unit(self.call(FileOp::RemoveXattr { ino, name: name.to_vec() }))
    }
    /// Delivers the writes in flight and stops following the owner. The
    /// owner commits.
    fn close(&self) -> Result<()> {
        self.inner.settle_all();
        if let Some((stop, t)) = self.events.lock().take() {
            let _ = stop.send(());
            let _ = t.join();
        }
        if let Some(d) = &self.inner.direct {
            d.close();
        }
        Ok(())
    }
    fn is_read_only(&self) -> bool {
        false
    }
    fn is_shared(&self) -> bool {
        true
    }
    fn getlk(&self, ino: u64, owner: u64, lock: Lock) -> Result<Option<Lock>> {
        match self.inner.lock_call(FileOp::GetLk { ino, owner, lock })?.0 {
            Out::Lock(l) => Ok(l),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }
    fn setlk(&self, ino: u64, owner: u64, lock: Lock, wait: bool) -> Result<()> {
        let inner = &self.inner;
        if lock.typ == libc::F_UNLCK {
            // Believed dropped before it is: holding less is safe to believe.
            inner.locks.lock().apply(ino, owner, lock);
            inner.locks.lock().take_lost(ino, owner);
            return unit(inner.call(FileOp::SetLk { ino, owner, lock, wait, reclaim: false }));
        }
        if inner.locks.lock().take_lost(ino, owner) {
            return Err(errno_error(libc::ENOLCK));
        }
        let (_, epoch, session) = inner.lock_call(FileOp::SetLk { ino, owner, lock, wait, reclaim: false })?;
        let mut locks = inner.locks.lock();
        if locks.epoch != epoch || locks.session != session {
            // Granted by an owner that is gone (its answer read late): the
            // owner now has no such lock.
            return Err(errno_error(libc::ENOLCK));
        }
        locks.apply(ino, owner, lock);
        // A loss found while this lock was asked for is over: the lock is
        // held anew (and the kernel's cache of the file dropped); what was
        // written under the lost one fails its fsync.
        locks.take_lost(ino, owner);
        Ok(())
    }
    fn unlock_all(&self, ino: u64, owner: u64) -> Result<()> {
        {
            let mut locks = self.inner.locks.lock();
            locks.unlock_all(ino, owner);
            // Its close (flush) reported the loss already, with EIO.
            locks.take_lost(ino, owner);
        }
        unit(self.inner.call(FileOp::UnlockAll { ino, owner }))
    }

    fn clone_range(&self, src: u64, src_off: u64, dst: u64, dst_off: u64, len: u64) -> Result<u64> {
        self.check_alive(src)?;
        self.check_alive(dst)?;
        // The owner clones exact ranges (so a copy sent again is answered
        // with its true count): the range is cut at the source's end here,
        // after every write in flight to it has been answered.
        let len = len.min(self.getattr(src)?.size.saturating_sub(src_off));
        if len == 0 {
            return Ok(0);
        }
        let out = self.call(FileOp::CloneRange { src, src_off, dst, dst_off, len });
        self.forget(dst);
        match out? {
            Out::Written(n) => Ok(n),
            _ => Err(errno_error(libc::EPROTO)),
        }
    }
}
