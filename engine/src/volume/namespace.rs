//! Namespace changes: create, mkdir, symlink, link, unlink, rmdir and
//! rename, each validated under the volume's write lock (bad input changes
//! nothing), then logged as one intent and applied.

use super::*;

impl Volume {
    /// Creates a file, device, FIFO or socket; `mode` carries the type bits.
    pub fn create(&self, parent: u64, name: &[u8], mode: u32, uid: u32, gid: u32, rdev: u32) -> Result<Attr> {
        let kind = FileKind::from_mode(mode).ok_or(Error::Invalid("file type"))?;
        if matches!(kind, FileKind::Directory | FileKind::Symlink) {
            return Err(Error::Invalid("use mkdir or symlink"));
        }
        self.make(parent, name, kind, (mode & 0o7777) as u16, uid, gid, rdev, None)
    }

    pub fn mkdir(&self, parent: u64, name: &[u8], perm: u16, uid: u32, gid: u32) -> Result<Attr> {
        self.make(parent, name, FileKind::Directory, perm & 0o7777, uid, gid, 0, None)
    }

    pub fn symlink(&self, parent: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<Attr> {
        if target.is_empty() || target.len() > 4095 || target.contains(&0) {
            return Err(if target.len() > 4095 { Error::NameTooLong } else { Error::Invalid("symlink target") });
        }
        self.make(parent, name, FileKind::Symlink, 0o777, uid, gid, 0, Some(target.to_vec()))
    }

    #[allow(clippy::too_many_arguments)]
    fn make(
        &self,
        parent: u64,
        name: &[u8],
        kind: FileKind,
        mut perm: u16,
        uid: u32,
        mut gid: u32,
        rdev: u32,
        target: Option<Vec<u8>>,
    ) -> Result<Attr> {
        check_name(name)?;
        self.log()?;
        let mut st = self.state.write();
        let p = free_name(&self.view(&st), parent, name)?;
        if kind == FileKind::Directory && p.nlink >= LINK_MAX {
            return Err(Error::TooManyLinks);
        }
        // A set-group-ID directory hands its group (and, to directories, the bit) down.
        if p.perm & libc::S_ISGID as u16 != 0 {
            gid = p.gid;
            if kind == FileKind::Directory {
                perm |= libc::S_ISGID as u16;
            }
        }
        let ino = st.next_ino;
        let op =
            ops::Op::Create { parent, name: name.to_vec(), ino, kind, perm, uid, gid, rdev, target, time: self.now() };
        self.run(&mut st, op, &[])?;
        Ok(Attr::from_inode(ino, &self.view(&st).inode(ino)?))
    }

    /// Creates a regular file whose bytes are the object `source`, copying
    /// none of them: reads fetch them from the object while it keeps the
    /// recorded ETag. `mtime` is the object's.
    pub fn import(
        &self,
        parent: u64,
        name: &[u8],
        perm: u16,
        owner: (u32, u32),
        source: crate::source::Source,
        mtime: Timestamp,
    ) -> Result<Attr> {
        check_name(name)?;
        check_source(&source)?;
        self.log()?;
        let mut st = self.state.write();
        let p = free_name(&self.view(&st), parent, name)?;
        let gid = if p.perm & libc::S_ISGID as u16 != 0 { p.gid } else { owner.1 };
        let ino = st.next_ino;
        let op = ops::Op::Import {
            parent,
            name: name.to_vec(),
            ino,
            perm: perm & 0o7777,
            uid: owner.0,
            gid,
            source,
            mtime,
            time: self.now(),
        };
        self.run(&mut st, op, &[])?;
        Ok(Attr::from_inode(ino, &self.view(&st).inode(ino)?))
    }

    /// Makes regular file `ino` the object `source` (its bytes, size and
    /// `mtime`), whatever it held: one intent, so readers see the old file
    /// or the new one.
    pub fn reimport(&self, ino: u64, source: crate::source::Source, mtime: Timestamp) -> Result<Attr> {
        check_source(&source)?;
        self.log()?;
        let mut st = self.state.write();
        match self.view(&st).inode(ino)?.kind {
            FileKind::Regular => {}
            FileKind::Directory => return Err(Error::IsDir),
            _ => return Err(Error::Invalid("not a regular file")),
        }
        self.run(&mut st, ops::Op::Reimport { ino, source, mtime, time: self.now() }, &[])?;
        Ok(Attr::from_inode(ino, &self.view(&st).inode(ino)?))
    }

    /// What reads of imported files' objects did so far.
    pub fn source_stats(&self) -> crate::source::SourceStats {
        self.sources.stats()
    }

    /// The object an imported file reads from, if it is one.
    pub fn source(&self, ino: u64) -> Result<Option<crate::source::Source>> {
        let st = self.state.read();
        self.view(&st).source(ino)
    }

    /// The object of an imported file that still reads exactly it (nothing
    /// written on top, not truncated); `None` for any other file.
    pub fn pristine_source(&self, ino: u64) -> Result<Option<crate::source::Source>> {
        let st = self.state.read();
        let v = self.view(&st);
        let Some(src) = v.source(ino)? else { return Ok(None) };
        let i = v.inode(ino)?;
        if i.kind != FileKind::Regular || i.size != src.size {
            return Ok(None);
        }
        let extents = v.extents(ino, 0, u64::MAX)?;
        let whole = match extents.as_slice() {
            [] => src.size == 0,
            [(0, Piece::Object(e))] => e.off == 0 && e.len == src.size,
            _ => false,
        };
        Ok(whole.then_some(src))
    }

    pub fn link(&self, ino: u64, new_parent: u64, new_name: &[u8]) -> Result<Attr> {
        check_name(new_name)?;
        self.log()?;
        let mut st = self.state.write();
        let v = self.view(&st);
        let i = v.inode(ino)?;
        v.dir_inode(new_parent)?;
        if i.kind == FileKind::Directory {
            return Err(Error::NotPermitted);
        }
        if is_dot(new_name) || v.entry(new_parent, new_name)?.is_some() {
            return Err(Error::Exists);
        }
        if i.nlink >= LINK_MAX {
            return Err(Error::TooManyLinks);
        }
        if i.nlink == 0 {
            return Err(Error::NotFound);
        }
        self.run(&mut st, ops::Op::Link { ino, parent: new_parent, name: new_name.to_vec(), time: self.now() }, &[])?;
        Ok(Attr::from_inode(ino, &self.view(&st).inode(ino)?))
    }

    pub fn unlink(&self, parent: u64, name: &[u8]) -> Result<()> {
        self.remove(parent, name, false)
    }

    pub fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()> {
        self.remove(parent, name, true)
    }

    fn remove(&self, parent: u64, name: &[u8], dir: bool) -> Result<()> {
        check_name(name)?;
        self.log()?;
        let mut st = self.state.write();
        let v = self.view(&st);
        v.dir_inode(parent)?;
        match (name, dir) {
            (b".", true) => return Err(Error::Invalid("rmdir of .")),
            (b"..", true) => return Err(Error::NotEmpty),
            (b"." | b"..", false) => return Err(Error::IsDir),
            _ => {}
        }
        let e = v.entry(parent, name)?.ok_or(Error::NotFound)?;
        let is_dir = e.kind == FileKind::Directory;
        if dir && !is_dir {
            return Err(Error::NotDir);
        }
        if !dir && is_dir {
            return Err(Error::IsDir);
        }
        if is_dir && !v.is_empty_dir(e.ino)? {
            return Err(Error::NotEmpty);
        }
        let last_link = !is_dir && v.inode(e.ino)?.nlink <= 1;
        let keep_orphan = last_link && self.opens.lock().get(&e.ino).is_some_and(|n| *n > 0);
        self.run(&mut st, ops::Op::Unlink { parent, name: name.to_vec(), keep_orphan, time: self.now() }, &[])
    }

    pub fn rename(&self, parent: u64, name: &[u8], new_parent: u64, new_name: &[u8], mode: RenameMode) -> Result<()> {
        check_name(name)?;
        check_name(new_name)?;
        self.log()?;
        let mut st = self.state.write();
        let v = self.view(&st);
        v.dir_inode(parent)?;
        v.dir_inode(new_parent)?;
        if is_dot(name) || is_dot(new_name) {
            return Err(Error::Invalid("rename of . or .."));
        }
        let src = v.entry(parent, name)?.ok_or(Error::NotFound)?;
        let dst = v.entry(new_parent, new_name)?;
        if src.kind == FileKind::Directory {
            self.refuse_move_into_itself(&v, src.ino, new_parent)?;
        }
        match (&dst, mode) {
            (None, RenameMode::Exchange) => return Err(Error::NotFound),
            (Some(_), RenameMode::NoReplace) => return Err(Error::Exists),
            (Some(d), RenameMode::Exchange) => {
                if d.kind == FileKind::Directory {
                    self.refuse_move_into_itself(&v, d.ino, parent)?;
                }
                if d.ino == src.ino {
                    return Ok(());
                }
            }
            (Some(d), RenameMode::Plain) => {
                if d.ino == src.ino {
                    return Ok(());
                }
                match (src.kind == FileKind::Directory, d.kind == FileKind::Directory) {
                    (true, false) => return Err(Error::NotDir),
                    (false, true) => return Err(Error::IsDir),
                    (true, true) if !v.is_empty_dir(d.ino)? => return Err(Error::NotEmpty),
                    _ => {}
                }
            }
            (None, _) => {}
        }
        if src.kind == FileKind::Directory
            && parent != new_parent
            && dst.is_none()
            && v.inode(new_parent)?.nlink >= LINK_MAX
        {
            return Err(Error::TooManyLinks);
        }
        // A file whose last name the rename replaces while it is open
        // stays, unnamed, until its last close: its readers keep reading
        // what it held, as after an unlink.
        let replaced_open = match (&dst, mode) {
            (Some(d), RenameMode::Plain) if d.kind != FileKind::Directory => {
                v.inode(d.ino)?.nlink <= 1 && self.opens.lock().get(&d.ino).is_some_and(|n| *n > 0)
            }
            _ => false,
        };
        let (name, new_name, time) = (name.to_vec(), new_name.to_vec(), self.now());
        let op = if replaced_open {
            ops::Op::RenameOverOpen { parent, name, new_parent, new_name, time }
        } else {
            ops::Op::Rename { parent, name, new_parent, new_name, mode, time }
        };
        self.run(&mut st, op, &[])
    }

    /// EINVAL if `dir` is `target` or one of its ancestors.
    fn refuse_move_into_itself(&self, v: &View, dir: u64, target: u64) -> Result<()> {
        let mut at = target;
        for _ in 0..100_000 {
            if at == dir {
                return Err(Error::Invalid("directory moved into itself"));
            }
            if at == ROOT_INO {
                return Ok(());
            }
            at = v.inode(at)?.parent;
        }
        Err(Error::corrupted("directory parent chain", target))
    }
}

/// A source object a file can be: a bucket and key, and no larger than a file.
fn check_source(source: &crate::source::Source) -> Result<()> {
    if source.size > MAX_FILE_SIZE {
        return Err(Error::TooBig);
    }
    if source.bucket.is_empty() || source.key.is_empty() {
        return Err(Error::Invalid("source object"));
    }
    Ok(())
}

/// Directory `parent`, where `name` is free for a new entry.
fn free_name(v: &View, parent: u64, name: &[u8]) -> Result<Inode> {
    let p = v.dir_inode(parent)?;
    if is_dot(name) || v.entry(parent, name)?.is_some() {
        return Err(Error::Exists);
    }
    Ok(p)
}
