//! Typed access to one tree: inodes, entries, extents. Used by validation
//! (read-only) and by `apply` (read-write).

use super::keys;
use super::types::*;
use crate::error::{Error, Result};
use crate::format::{decode_value, encode_value};
use crate::tree::{NodeStore, Tree};

pub struct View<'a> {
    pub tree: &'a Tree,
    pub store: &'a dyn NodeStore,
}

pub struct Txn<'a> {
    pub tree: &'a mut Tree,
    pub store: &'a dyn NodeStore,
}

/// Called with (extent start, extent end, encoded extent).
type ExtentVisitor<'a> = &'a mut dyn FnMut(u64, u64, &[u8]) -> Result<()>;

/// Reads shared by [`View`] and [`Txn`].
pub trait Reads {
    fn tree(&self) -> &Tree;
    fn store(&self) -> &dyn NodeStore;

    fn inode(&self, ino: u64) -> Result<Inode> {
        self.try_inode(ino)?.ok_or(Error::NotFound)
    }

    fn try_inode(&self, ino: u64) -> Result<Option<Inode>> {
        match self.tree().get(self.store(), &keys::inode(ino))? {
            Some(v) => Ok(Some(decode_value(&v, "inode")?)),
            None => Ok(None),
        }
    }

    fn dir_inode(&self, ino: u64) -> Result<Inode> {
        let i = self.inode(ino)?;
        if i.kind != FileKind::Directory {
            return Err(Error::NotDir);
        }
        Ok(i)
    }

    fn entry(&self, parent: u64, name: &[u8]) -> Result<Option<DirEntry>> {
        match self.tree().get(self.store(), &keys::dirent(parent, name))? {
            Some(v) => Ok(Some(decode_value(&v, "directory entry")?)),
            None => Ok(None),
        }
    }

    fn is_empty_dir(&self, ino: u64) -> Result<bool> {
        let prefix = keys::dirent_prefix(ino);
        Ok(!self.tree().first_from(self.store(), &prefix)?.is_some_and(|(k, _)| k.starts_with(&prefix)))
    }

    /// Calls `f(extent start, extent end, encoded extent)` for each extent
    /// of `ino` overlapping `[start, end)`, in order.
    fn scan_extents(&self, ino: u64, start: u64, end: u64, f: ExtentVisitor) -> Result<()> {
        let prefix = keys::extent_prefix(ino);
        self.tree().scan(self.store(), &keys::extent(ino, start.saturating_add(1)), &mut |k, v| {
            if !k.starts_with(&prefix) {
                return Ok(false);
            }
            let ext_end = keys::trailing_u64(k);
            let ext_start = ext_end.saturating_sub(Piece::encoded_len(v));
            if ext_start >= end {
                return Ok(false);
            }
            f(ext_start, ext_end, v)?;
            Ok(true)
        })
    }

    /// Extents of `ino` overlapping `[start, end)`, as `(file offset, extent)`.
    fn extents(&self, ino: u64, start: u64, end: u64) -> Result<Vec<(u64, Piece)>> {
        let mut out = Vec::new();
        self.scan_extents(ino, start, end, &mut |s, _, v| {
            out.push((s, Piece::decode(v)?));
            Ok(())
        })?;
        Ok(out)
    }

    /// The parts of extents of `ino` inside `[start, end)`, as
    /// `(file offset, extent part)`: what a read of that range needs.
    fn extent_parts(&self, ino: u64, start: u64, end: u64) -> Result<Vec<(u64, Piece)>> {
        let mut out = Vec::new();
        self.scan_extents(ino, start, end, &mut |s, e, v| {
            let (from, to) = (start.max(s), end.min(e));
            out.push((from, Piece::decode_slice(v, from - s, to - s)?));
            Ok(())
        })?;
        Ok(out)
    }

    /// The source object of an imported file, if it is one.
    fn source(&self, ino: u64) -> Result<Option<crate::source::Source>> {
        match self.tree().get(self.store(), &keys::source(ino))? {
            Some(v) => Ok(Some(decode_value(&v, "source object")?)),
            None => Ok(None),
        }
    }

    /// Keys of `prefix`, in order.
    fn keys_with_prefix(&self, prefix: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        self.tree().scan(self.store(), prefix, &mut |k, _| {
            if !k.starts_with(prefix) {
                return Ok(false);
            }
            out.push(k.to_vec());
            Ok(true)
        })?;
        Ok(out)
    }
}

impl Reads for View<'_> {
    fn tree(&self) -> &Tree {
        self.tree
    }
    fn store(&self) -> &dyn NodeStore {
        self.store
    }
}

impl Reads for Txn<'_> {
    fn tree(&self) -> &Tree {
        self.tree
    }
    fn store(&self) -> &dyn NodeStore {
        self.store
    }
}

impl Txn<'_> {
    pub fn put_inode(&mut self, ino: u64, i: &Inode) -> Result<()> {
        self.tree.insert(self.store, keys::inode(ino), encode_value(i))?;
        Ok(())
    }

    pub fn put(&mut self, key: Vec<u8>, val: Vec<u8>) -> Result<()> {
        self.tree.insert(self.store, key, val)?;
        Ok(())
    }

    /// Removes `key`; whether it was there.
    pub fn del(&mut self, key: &[u8]) -> Result<bool> {
        Ok(self.tree.remove(self.store, key)?.is_some())
    }

    pub fn add_entry(
        &mut self,
        parent: &mut Inode,
        parent_ino: u64,
        name: &[u8],
        ino: u64,
        kind: FileKind,
    ) -> Result<()> {
        let cookie = parent.next_cookie;
        parent.next_cookie += 1;
        self.put(keys::dirent(parent_ino, name), encode_value(&DirEntry { ino, kind, cookie }))?;
        self.put(keys::cookie(parent_ino, cookie), encode_value(&CookieEntry { ino, kind, name: name.to_vec() }))
    }

    pub fn remove_entry(&mut self, parent_ino: u64, name: &[u8]) -> Result<Option<DirEntry>> {
        let Some(e) = self.entry(parent_ino, name)? else {
            return Ok(None);
        };
        self.del(&keys::dirent(parent_ino, name))?;
        self.del(&keys::cookie(parent_ino, e.cookie))?;
        Ok(Some(e))
    }

    /// Drops every extent byte in `[start, end)`, keeping the parts of
    /// extents outside it. Returns the bytes dropped.
    pub fn punch(&mut self, ino: u64, start: u64, end: u64) -> Result<u64> {
        let mut dropped = 0;
        for (ext_start, e) in self.extents(ino, start, end)? {
            let ext_end = ext_start + e.len();
            self.del(&keys::extent(ino, ext_end))?;
            self.account(&e, -1);
            let mut kept = 0;
            if ext_start < start {
                let left = e.slice(0, start - ext_start);
                kept += left.len();
                self.account(&left, 1);
                self.put(keys::extent(ino, start), left.encode())?;
            }
            if ext_end > end {
                let right = e.slice(end - ext_start, e.len());
                kept += right.len();
                self.account(&right, 1);
                self.put(keys::extent(ino, ext_end), right.encode())?;
            }
            dropped += e.len() - kept;
        }
        Ok(dropped)
    }

    /// Counts a log extent's bytes as live in its segment (`sign` 1) or
    /// no longer (-1); source bytes live in no segment.
    fn account(&self, e: &Piece, sign: i64) {
        if let Piece::Log(e) = e {
            self.store.account_data(e.data.seg, sign * e.len as i64);
        }
    }

    /// Adds an extent ending at `end`.
    pub fn put_extent(&mut self, ino: u64, end: u64, e: &Extent) -> Result<()> {
        self.store.account_data(e.data.seg, e.len as i64);
        self.put(keys::extent(ino, end), e.encode())
    }

    /// Removes an inode with everything it owns.
    pub fn delete_inode(&mut self, ino: u64) -> Result<()> {
        self.punch(ino, 0, u64::MAX)?;
        for prefix in [keys::extent_prefix(ino), keys::xattr_prefix(ino), keys::link_prefix(ino)] {
            for k in self.keys_with_prefix(&prefix)? {
                self.del(&k)?;
            }
        }
        self.del(&keys::orphan(ino))?;
        self.del(&keys::source(ino))?;
        self.del(&keys::inode(ino)).map(drop)
    }
}
