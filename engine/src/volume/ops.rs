//! Intents: fully resolved operations, logged before they are applied.
//!
//! [`apply`] is the only code that changes a tree, and it runs both for a
//! live operation and when recovery replays the log, so the recovered state
//! is by construction the live state after the same prefix of intents.
//! Validation happens before an intent is logged; `apply` assumes it passed.

use super::keys;
use super::txn::{Reads, Txn};
use super::types::*;
use crate::env::Timestamp;
use crate::error::{Error, Result};
use crate::format::Addr;

#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub enum Op {
    InitRoot {
        perm: u16,
        uid: u32,
        gid: u32,
        time: Timestamp,
    },
    Create {
        parent: u64,
        name: Vec<u8>,
        ino: u64,
        kind: FileKind,
        perm: u16,
        uid: u32,
        gid: u32,
        rdev: u32,
        target: Option<Vec<u8>>,
        time: Timestamp,
    },
    Link {
        ino: u64,
        parent: u64,
        name: Vec<u8>,
        time: Timestamp,
    },
    /// Removes a name (of a file, or of an empty directory).
    Unlink {
        parent: u64,
        name: Vec<u8>,
        keep_orphan: bool,
        time: Timestamp,
    },
    Rename {
        parent: u64,
        name: Vec<u8>,
        new_parent: u64,
        new_name: Vec<u8>,
        mode: RenameMode,
        time: Timestamp,
    },
    SetAttr {
        ino: u64,
        perm: Option<u16>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<Timestamp>,
        mtime: Option<Timestamp>,
        time: Timestamp,
    },
    /// Writes the record's data bytes at `off`.
    Write {
        ino: u64,
        off: u64,
        time: Timestamp,
    },
    /// Moves an inline file's bytes (the record's data) into an extent.
    Spill {
        ino: u64,
    },
    SetXattr {
        ino: u64,
        name: Vec<u8>,
        value: Vec<u8>,
        time: Timestamp,
    },
    RemoveXattr {
        ino: u64,
        name: Vec<u8>,
        time: Timestamp,
    },
    /// Deletes an unlinked inode once its last user closed it.
    DropOrphan {
        ino: u64,
    },
    /// Compaction: the record's data is a copy of the extent of `ino`
    /// ending at `end`, if that extent still reads `len` bytes from `from`
    /// at `rec_off`; the extent then points at the copy. Otherwise (the file
    /// changed since) nothing happens. No time or size changes.
    Relocate {
        ino: u64,
        end: u64,
        from: Addr,
        rec_off: u32,
        len: u32,
    },
    /// A piece of a write too large for one record, other than its last:
    /// applied as `Write` is, but recovery applies the pieces only together
    /// with the `Write` that ends them, so a crash between two pieces
    /// leaves no part of the write.
    WritePart {
        ino: u64,
        off: u64,
        time: Timestamp,
    },
    /// Creates a regular file whose bytes are the object `source` (one
    /// external extent): an import. `mtime` is the object's.
    Import {
        parent: u64,
        name: Vec<u8>,
        ino: u64,
        perm: u16,
        uid: u32,
        gid: u32,
        source: crate::source::Source,
        mtime: Timestamp,
        time: Timestamp,
    },
    /// Makes regular file `ino` the object `source`, whatever it held: a
    /// refresh of an imported file whose object changed.
    Reimport {
        ino: u64,
        source: crate::source::Source,
        mtime: Timestamp,
        time: Timestamp,
    },
    /// Changes nothing: carries the request tag of a call that succeeded
    /// without logging anything else (see `volume::requests`).
    Mark,
    /// Makes bytes `[dst_off, dst_off + len)` of regular file `dst` the
    /// bytes `[src_off, src_off + len)` of `src` by pointing `dst`'s
    /// extents at `src`'s log bytes: no data is copied or logged. Holes
    /// stay holes. Validated first: both regular files, neither inline
    /// (spilled before), no external extent in the source range, the two
    /// ranges apart when `src == dst`.
    CloneRange {
        src: u64,
        src_off: u64,
        dst: u64,
        dst_off: u64,
        len: u64,
        time: Timestamp,
    },
    /// A plain `Rename` that replaces the last link of a file still open:
    /// the replaced file becomes an orphan, as an `Unlink` with
    /// `keep_orphan` leaves one, and goes at its last close (or at the
    /// next open of the volume). Its readers keep reading what it held.
    RenameOverOpen {
        parent: u64,
        name: Vec<u8>,
        new_parent: u64,
        new_name: Vec<u8>,
        time: Timestamp,
    },
}

/// The data bytes an intent carries, and where they live in the log.
pub struct Data<'a> {
    pub addr: Addr,
    pub crcs: &'a [u32],
    pub bytes: &'a [u8],
}

fn touch(i: &mut Inode, t: Timestamp) {
    i.mtime = t;
    i.ctime = t;
}

/// Applies one validated intent. `next_ino` tracks the highest inode used,
/// `features` the tree's feature bits.
pub fn apply(tx: &mut Txn, op: &Op, data: &Data, next_ino: &mut u64, features: &mut u64) -> Result<()> {
    match op {
        Op::InitRoot { perm, uid, gid, time } => {
            let root = new_inode(FileKind::Directory, *perm, *uid, *gid, 0, ROOT_INO, None, *time);
            tx.put_inode(ROOT_INO, &root)
        }
        Op::Create { parent, name, ino, kind, perm, uid, gid, rdev, target, time } => {
            let mut p = tx.inode(*parent)?;
            let mut node = new_inode(*kind, *perm, *uid, *gid, *rdev, *parent, target.clone(), *time);
            node.name = name.clone();
            tx.add_entry(&mut p, *parent, name, *ino, *kind)?;
            if *kind == FileKind::Directory {
                p.nlink += 1;
            }
            touch(&mut p, *time);
            tx.put_inode(*parent, &p)?;
            tx.put_inode(*ino, &node)?;
            *next_ino = (*next_ino).max(ino + 1);
            Ok(())
        }
        Op::Import { parent, name, ino, perm, uid, gid, source, mtime, time } => {
            let mut p = tx.inode(*parent)?;
            let mut node = new_inode(FileKind::Regular, *perm, *uid, *gid, 0, *parent, None, *time);
            node.name = name.clone();
            tx.add_entry(&mut p, *parent, name, *ino, FileKind::Regular)?;
            touch(&mut p, *time);
            tx.put_inode(*parent, &p)?;
            attach(tx, *ino, &mut node, source, *mtime)?;
            *next_ino = (*next_ino).max(ino + 1);
            *features |= super::commit::features::EXTERNAL_EXTENTS;
            Ok(())
        }
        Op::Mark => Ok(()),
        Op::Reimport { ino, source, mtime, time } => {
            let mut node = tx.inode(*ino)?;
            node.ctime = *time;
            attach(tx, *ino, &mut node, source, *mtime)?;
            *features |= super::commit::features::EXTERNAL_EXTENTS;
            Ok(())
        }
        Op::Link { ino, parent, name, time } => {
            let mut i = tx.inode(*ino)?;
            let mut p = tx.inode(*parent)?;
            tx.add_entry(&mut p, *parent, name, *ino, i.kind)?;
            touch(&mut p, *time);
            tx.put_inode(*parent, &p)?;
            // From two links on, every name is also kept under the inode.
            if i.nlink == 1 && tx.entry(i.parent, &i.name)?.is_some_and(|e| e.ino == *ino) {
                tx.put(keys::link(*ino, i.parent, &i.name), Vec::new())?;
            }
            tx.put(keys::link(*ino, *parent, name), Vec::new())?;
            i.nlink += 1;
            i.ctime = *time;
            i.parent = *parent;
            i.name = name.clone();
            tx.put_inode(*ino, &i)
        }
        Op::Unlink { parent, name, keep_orphan, time } => {
            let e = tx.remove_entry(*parent, name)?.ok_or(Error::NotFound)?;
            let mut p = tx.inode(*parent)?;
            touch(&mut p, *time);
            if e.kind == FileKind::Directory {
                p.nlink -= 1;
            }
            tx.put_inode(*parent, &p)?;
            drop_link(tx, e.ino, (*parent, name), *keep_orphan, *time)
        }
        Op::Rename { parent, name, new_parent, new_name, mode, time } => {
            apply_rename(tx, (*parent, name), (*new_parent, new_name), *mode, false, *time)
        }
        Op::RenameOverOpen { parent, name, new_parent, new_name, time } => {
            apply_rename(tx, (*parent, name), (*new_parent, new_name), RenameMode::Plain, true, *time)
        }
        Op::SetAttr { ino, perm, uid, gid, size, atime, mtime, time } => {
            let mut i = tx.inode(*ino)?;
            if let Some(p) = perm {
                i.perm = *p;
            }
            if let Some(u) = uid {
                i.uid = *u;
            }
            if let Some(g) = gid {
                i.gid = *g;
            }
            if let Some(a) = atime {
                i.atime = *a;
            }
            if let Some(m) = mtime {
                i.mtime = *m;
            }
            if let Some(size) = size {
                resize(tx, *ino, &mut i, *size)?;
                if mtime.is_none() {
                    i.mtime = *time;
                }
            }
            i.ctime = *time;
            tx.put_inode(*ino, &i)
        }
        Op::Write { ino, off, time } | Op::WritePart { ino, off, time } => {
            let mut i = tx.inode(*ino)?;
            let end = off + data.bytes.len() as u64;
            match &mut i.inline {
                Some(buf) if end <= INLINE_DATA_MAX => {
                    if (buf.len() as u64) < end {
                        buf.resize(end as usize, 0);
                    }
                    buf[*off as usize..end as usize].copy_from_slice(data.bytes);
                }
                _ => {
                    i.inline = None;
                    i.allocated -= tx.punch(*ino, *off, end)?;
                    let e =
                        Extent { data: data.addr, rec_off: 0, len: data.bytes.len() as u32, crcs: data.crcs.to_vec() };
                    tx.put_extent(*ino, end, &e)?;
                    i.allocated += e.len as u64;
                }
            }
            i.size = i.size.max(end);
            touch(&mut i, *time);
            tx.put_inode(*ino, &i)
        }
        Op::Spill { ino } => {
            let mut i = tx.inode(*ino)?;
            i.inline = None;
            if !data.bytes.is_empty() {
                let e = Extent { data: data.addr, rec_off: 0, len: data.bytes.len() as u32, crcs: data.crcs.to_vec() };
                tx.put_extent(*ino, e.len as u64, &e)?;
                i.allocated += e.len as u64;
            }
            tx.put_inode(*ino, &i)
        }
        Op::SetXattr { ino, name, value, time } => {
            let mut i = tx.inode(*ino)?;
            tx.put(keys::xattr(*ino, name), value.clone())?;
            i.ctime = *time;
            tx.put_inode(*ino, &i)
        }
        Op::RemoveXattr { ino, name, time } => {
            let mut i = tx.inode(*ino)?;
            tx.del(&keys::xattr(*ino, name))?;
            i.ctime = *time;
            tx.put_inode(*ino, &i)
        }
        Op::Relocate { ino, end, from, rec_off, len } => {
            let key = keys::extent(*ino, *end);
            let Some(v) = tx.tree.get(tx.store, &key)? else { return Ok(()) };
            let Piece::Log(e) = Piece::decode(&v)? else { return Ok(()) };
            if (e.data, e.rec_off, e.len) != (*from, *rec_off, *len) || data.bytes.len() != *len as usize {
                return Ok(());
            }
            tx.store.account_data(e.data.seg, -(e.len as i64));
            tx.put_extent(*ino, *end, &Extent { data: data.addr, rec_off: 0, len: *len, crcs: data.crcs.to_vec() })
        }
        Op::CloneRange { src, src_off, dst, dst_off, len, time } => {
            let parts = tx.extent_parts(*src, *src_off, src_off + len)?;
            let mut d = tx.inode(*dst)?;
            d.inline = None;
            d.allocated -= tx.punch(*dst, *dst_off, dst_off + len)?;
            for (at, piece) in parts {
                let Piece::Log(e) = piece else {
                    return Err(Error::Invalid("a clone of an imported object's bytes"));
                };
                let end = dst_off + (at - src_off) + e.len as u64;
                tx.put_extent(*dst, end, &e)?;
                d.allocated += e.len as u64;
            }
            d.size = d.size.max(dst_off + len);
            touch(&mut d, *time);
            tx.put_inode(*dst, &d)
        }
        Op::DropOrphan { ino } => match tx.try_inode(*ino)? {
            Some(i) if i.nlink == 0 => tx.delete_inode(*ino),
            _ => tx.del(&keys::orphan(*ino)).map(drop),
        },
    }
}

/// Makes `node` (inode `ino`, a regular file) hold exactly the bytes of
/// `source`: one external extent, its source record, its size.
fn attach(tx: &mut Txn, ino: u64, node: &mut Inode, source: &crate::source::Source, mtime: Timestamp) -> Result<()> {
    node.allocated -= tx.punch(ino, 0, u64::MAX)?;
    tx.put(keys::source(ino), crate::format::encode_value(source))?;
    node.inline = Some(Vec::new());
    node.size = 0;
    if source.size > 0 {
        node.inline = None;
        let e = Piece::Object(ObjectExtent { off: 0, len: source.size });
        tx.put(keys::extent(ino, source.size), e.encode())?;
        node.size = source.size;
        node.allocated += source.size;
    }
    node.mtime = mtime;
    tx.put_inode(ino, node)
}

#[allow(clippy::too_many_arguments)]
fn new_inode(
    kind: FileKind,
    perm: u16,
    uid: u32,
    gid: u32,
    rdev: u32,
    parent: u64,
    target: Option<Vec<u8>>,
    t: Timestamp,
) -> Inode {
    let is_dir = kind == FileKind::Directory;
    let inline = match kind {
        FileKind::Regular => Some(Vec::new()),
        FileKind::Symlink => target,
        _ => None,
    };
    Inode {
        kind,
        perm,
        uid,
        gid,
        size: inline.as_ref().map_or(0, |d| d.len() as u64),
        nlink: if is_dir { 2 } else { 1 },
        atime: t,
        mtime: t,
        ctime: t,
        crtime: t,
        rdev,
        parent,
        name: Vec::new(),
        next_cookie: FIRST_COOKIE,
        allocated: 0,
        inline,
    }
}

/// One name of `ino` (`gone`: directory and name) is gone: a directory
/// goes at once; a file when its last link goes, unless it is still open
/// (then it becomes an orphan). A file that keeps other links records one
/// of them as its name if `gone` was the one recorded.
fn drop_link(tx: &mut Txn, ino: u64, gone: (u64, &[u8]), keep_orphan: bool, time: Timestamp) -> Result<()> {
    let mut i = tx.inode(ino)?;
    if i.kind == FileKind::Directory {
        return tx.delete_inode(ino);
    }
    // Names are kept under the inode only while it has several.
    if i.nlink > 1 {
        tx.del(&keys::link(ino, gone.0, gone.1))?;
    }
    i.nlink = i.nlink.saturating_sub(1);
    i.ctime = time;
    if i.nlink > 0 {
        let others = tx.keys_with_prefix(&keys::link_prefix(ino))?;
        if (i.parent, i.name.as_slice()) == gone {
            // Another name, or none known (a disk written before names
            // were kept: diff then prints the inode number).
            (i.parent, i.name) = match others.first() {
                Some(k) => (keys::trailing_u64(k), k.get(17..).unwrap_or_default().to_vec()),
                None => (i.parent, Vec::new()),
            };
        }
        if i.nlink == 1 {
            for k in others {
                tx.del(&k)?;
            }
        }
        return tx.put_inode(ino, &i);
    }
    if keep_orphan {
        tx.put(keys::orphan(ino), Vec::new())?;
        return tx.put_inode(ino, &i);
    }
    tx.delete_inode(ino)
}

fn resize(tx: &mut Txn, ino: u64, i: &mut Inode, size: u64) -> Result<()> {
    match &mut i.inline {
        Some(buf) if size <= INLINE_DATA_MAX => buf.resize(size as usize, 0),
        _ => {
            i.inline = None;
            if size < i.size {
                i.allocated -= tx.punch(ino, size, u64::MAX)?;
            }
        }
    }
    i.size = size;
    Ok(())
}

/// `keep_orphan`: the replaced file (a plain rename's) stays as an orphan
/// when this was its last link.
fn apply_rename(
    tx: &mut Txn,
    (parent, name): (u64, &[u8]),
    (new_parent, new_name): (u64, &[u8]),
    mode: RenameMode,
    keep_orphan: bool,
    time: Timestamp,
) -> Result<()> {
    let src = tx.remove_entry(parent, name)?.ok_or(Error::NotFound)?;
    let dst = tx.remove_entry(new_parent, new_name)?;
    // (entry, from, its name there, to, its name there)
    let mut moved = vec![(src.clone(), parent, name, new_parent, new_name)];
    if let Some(d) = &dst {
        match mode {
            RenameMode::Exchange => moved.push((d.clone(), new_parent, new_name, parent, name)),
            _ => drop_link(tx, d.ino, (new_parent, new_name), keep_orphan, time)?,
        }
    }
    // Directory link counts: a directory leaving a parent takes one link with it.
    let dirs_out =
        |p: u64| moved.iter().filter(|(e, from, _, _, _)| e.kind == FileKind::Directory && *from == p).count() as i64;
    let dirs_in =
        |p: u64| moved.iter().filter(|(e, _, _, to, _)| e.kind == FileKind::Directory && *to == p).count() as i64;
    let replaced_dir = dst.as_ref().is_some_and(|d| d.kind == FileKind::Directory) && mode != RenameMode::Exchange;
    let mut parents = vec![parent];
    if new_parent != parent {
        parents.push(new_parent);
    }
    for p in parents {
        let mut pi = tx.inode(p)?;
        let mut delta = dirs_in(p) - dirs_out(p);
        if replaced_dir && p == new_parent {
            delta -= 1;
        }
        pi.nlink = (pi.nlink as i64 + delta) as u32;
        touch(&mut pi, time);
        for (e, _, _, to, to_name) in &moved {
            if *to == p {
                tx.add_entry(&mut pi, p, to_name, e.ino, e.kind)?;
            }
        }
        tx.put_inode(p, &pi)?;
    }
    for (e, from, from_name, to, to_name) in &moved {
        let mut i = tx.inode(e.ino)?;
        // A file with several names keeps them under its inode: move this one.
        if e.kind != FileKind::Directory && i.nlink > 1 && tx.del(&keys::link(e.ino, *from, from_name))? {
            tx.put(keys::link(e.ino, *to, to_name), Vec::new())?;
        }
        i.ctime = time;
        i.parent = *to;
        i.name = to_name.to_vec();
        tx.put_inode(e.ino, &i)?;
    }
    Ok(())
}
