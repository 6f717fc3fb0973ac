//! The values stored in the tree and the types of the Volume API.

use crate::env::Timestamp;
use crate::format::{Addr, BLOCK_SIZE};

/// Largest file size: 16 TiB, as on ext4 with 4 KiB blocks.
pub const MAX_FILE_SIZE: u64 = 1 << 44;
/// Files up to this size keep their bytes inside the inode.
pub const INLINE_DATA_MAX: u64 = 2048;
pub const NAME_MAX: usize = 255;
pub const XATTR_NAME_MAX: usize = 255;
pub const XATTR_VALUE_MAX: usize = 64 << 10;
pub const LINK_MAX: u32 = 65_000;
pub const ROOT_INO: u64 = 1;
/// Readdir offsets 1 and 2 are "." and ".."; entries count from here.
pub const FIRST_COOKIE: u64 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub enum FileKind {
    Regular,
    Directory,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl FileKind {
    pub fn from_mode(mode: u32) -> Option<FileKind> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG | 0 => FileKind::Regular,
            libc::S_IFDIR => FileKind::Directory,
            libc::S_IFLNK => FileKind::Symlink,
            libc::S_IFIFO => FileKind::Fifo,
            libc::S_IFSOCK => FileKind::Socket,
            libc::S_IFCHR => FileKind::CharDevice,
            libc::S_IFBLK => FileKind::BlockDevice,
            _ => return None,
        })
    }

    pub fn mode_bits(self) -> u32 {
        match self {
            FileKind::Regular => libc::S_IFREG,
            FileKind::Directory => libc::S_IFDIR,
            FileKind::Symlink => libc::S_IFLNK,
            FileKind::Fifo => libc::S_IFIFO,
            FileKind::Socket => libc::S_IFSOCK,
            FileKind::CharDevice => libc::S_IFCHR,
            FileKind::BlockDevice => libc::S_IFBLK,
        }
    }
}

#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct Inode {
    pub kind: FileKind,
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub nlink: u32,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
    pub crtime: Timestamp,
    pub rdev: u32,
    /// The directory holding one of this inode's names: a directory's one
    /// parent (for "..", and to refuse moving a directory into itself); for
    /// a file with several links, the last one made, or another of them
    /// (its `'L'` keys) once that one is removed.
    pub parent: u64,
    /// That name (empty for the root, and for a file whose recorded link
    /// was removed on a disk written before links were kept). With
    /// `parent`, what `diff` prints.
    pub name: Vec<u8>,
    /// A directory's next readdir cookie.
    pub next_cookie: u64,
    /// Bytes held in extents.
    pub allocated: u64,
    /// A small file's bytes (always `size` long), or a symlink's target.
    pub inline: Option<Vec<u8>>,
}

/// `D parent name` → the child.
#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct DirEntry {
    pub ino: u64,
    pub kind: FileKind,
    pub cookie: u64,
}

/// `R parent cookie` → the entry, in listing order.
#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct CookieEntry {
    pub ino: u64,
    pub kind: FileKind,
    pub name: Vec<u8>,
}

/// `E ino end` → `len` file bytes ending at `end`, stored at
/// `data.off + rec_off` in a write record whose data blocks have `crcs`
/// (only the blocks this extent touches). Fixed-width encoding: it is
/// decoded on every read.
#[derive(Clone, Debug, PartialEq)]
pub struct Extent {
    pub data: Addr,
    pub rec_off: u32,
    pub len: u32,
    pub crcs: Vec<u32>,
}

impl Extent {
    /// The `len` field of an encoded extent (0 if it is too short to hold one).
    pub fn encoded_len(bytes: &[u8]) -> u32 {
        bytes.get(24..28).and_then(|b| b.try_into().ok()).map_or(0, u32::from_le_bytes)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = crate::format::Writer::new();
        w.addr(&self.data);
        w.u32(self.rec_off);
        w.u32(self.len);
        for c in &self.crcs {
            w.u32(*c);
        }
        w.buf
    }

    pub fn decode(bytes: &[u8]) -> crate::error::Result<Extent> {
        let mut r = crate::format::Reader::new(bytes, "extent");
        let data = r.addr()?;
        let (rec_off, len) = (r.u32()?, r.u32()?);
        let table = r.take(r.remaining())?;
        let blocks =
            if len == 0 { 0 } else { (rec_off + len - 1) as usize / BLOCK_SIZE - rec_off as usize / BLOCK_SIZE + 1 };
        if table.len() != blocks * 4 || rec_off.checked_add(len).is_none_or(|end| end > data.len) {
            return Err(crate::error::Error::corrupted("extent", data));
        }
        let crcs = table.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok(Extent { data, rec_off, len, crcs })
    }

    /// The part `[from, to)` of an encoded extent, decoding only the crcs of
    /// the blocks that part touches: the hot path of every read.
    pub fn decode_slice(bytes: &[u8], from: u32, to: u32) -> crate::error::Result<Extent> {
        let mut r = crate::format::Reader::new(bytes, "extent");
        let data = r.addr()?;
        let (rec_off, len) = (r.u32()?, r.u32()?);
        if from > to || to > len || rec_off.checked_add(len).is_none_or(|end| end > data.len) {
            return Err(crate::error::Error::corrupted("extent", data));
        }
        let first = rec_off as usize / BLOCK_SIZE;
        let (lo, hi) = ((rec_off + from) as usize / BLOCK_SIZE, (rec_off + to).saturating_sub(1) as usize / BLOCK_SIZE);
        let table = r.take(r.remaining())?;
        let want = table
            .get((lo - first) * 4..(hi + 1 - first) * 4)
            .ok_or_else(|| crate::error::Error::corrupted("extent", data))?;
        let crcs = want.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok(Extent { data, rec_off: rec_off + from, len: to - from, crcs })
    }

    fn first_block(&self) -> usize {
        self.rec_off as usize / BLOCK_SIZE
    }

    /// The crc of data block `block` (counted from the record's data start).
    pub fn crc_of(&self, block: usize) -> Option<u32> {
        block.checked_sub(self.first_block()).and_then(|i| self.crcs.get(i)).copied()
    }

    /// The part of this extent from `from` to `to` (offsets within it).
    pub fn slice(&self, from: u32, to: u32) -> Extent {
        let rec_off = self.rec_off + from;
        let first = rec_off as usize / BLOCK_SIZE;
        let last = (rec_off + (to - from)).saturating_sub(1) as usize / BLOCK_SIZE;
        let skip = first - self.first_block();
        let crcs = self.crcs.iter().skip(skip).take(last + 1 - first).copied().collect();
        Extent { data: self.data, rec_off, len: to - from, crcs }
    }
}

/// `E ino end` of an imported file: `len` bytes of the file's source
/// object (`'S' ino`, a [`crate::source::Source`]) from byte `off` of it.
/// Encoded in [`ObjectExtent::ENCODED`] bytes, a length no log extent has
/// (those are 28 bytes and more).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjectExtent {
    pub off: u64,
    pub len: u64,
}

impl ObjectExtent {
    pub const ENCODED: usize = 16;

    pub fn encode(&self) -> Vec<u8> {
        let mut w = crate::format::Writer::new();
        w.u64(self.off);
        w.u64(self.len);
        w.buf
    }

    fn decode(bytes: &[u8]) -> crate::error::Result<ObjectExtent> {
        let mut r = crate::format::Reader::new(bytes, "external extent");
        let e = ObjectExtent { off: r.u64()?, len: r.u64()? };
        r.finish()?;
        if e.len == 0 || e.off.checked_add(e.len).is_none() {
            return Err(crate::error::Error::corrupted("external extent", format!("{e:?}")));
        }
        Ok(e)
    }
}

/// An extent of either kind.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// Bytes in the log.
    Log(Extent),
    /// Bytes of the file's source object.
    Object(ObjectExtent),
}

impl Piece {
    /// The length of an encoded extent of either kind (0 if it holds none).
    pub fn encoded_len(bytes: &[u8]) -> u64 {
        if bytes.len() == ObjectExtent::ENCODED {
            bytes.get(8..16).and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes)
        } else {
            Extent::encoded_len(bytes) as u64
        }
    }

    pub fn decode(bytes: &[u8]) -> crate::error::Result<Piece> {
        if bytes.len() == ObjectExtent::ENCODED {
            ObjectExtent::decode(bytes).map(Piece::Object)
        } else {
            Extent::decode(bytes).map(Piece::Log)
        }
    }

    /// The part `[from, to)` of an encoded extent (see [`Extent::decode_slice`]).
    pub fn decode_slice(bytes: &[u8], from: u64, to: u64) -> crate::error::Result<Piece> {
        if bytes.len() == ObjectExtent::ENCODED {
            let e = ObjectExtent::decode(bytes)?;
            if from > to || to > e.len {
                return Err(crate::error::Error::corrupted("external extent", format!("{e:?}")));
            }
            Ok(Piece::Object(ObjectExtent { off: e.off + from, len: to - from }))
        } else {
            Extent::decode_slice(bytes, from as u32, to as u32).map(Piece::Log)
        }
    }

    pub fn len(&self) -> u64 {
        match self {
            Piece::Log(e) => e.len as u64,
            Piece::Object(e) => e.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The part from `from` to `to` (offsets within it).
    pub fn slice(&self, from: u64, to: u64) -> Piece {
        match self {
            Piece::Log(e) => Piece::Log(e.slice(from as u32, to as u32)),
            Piece::Object(e) => Piece::Object(ObjectExtent { off: e.off + from, len: to - from }),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            Piece::Log(e) => e.encode(),
            Piece::Object(e) => e.encode(),
        }
    }
}

/// What `getattr` returns.
#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct Attr {
    pub ino: u64,
    pub kind: FileKind,
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub blocks: u64,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
    pub crtime: Timestamp,
    pub rdev: u32,
    pub blksize: u32,
}

impl Attr {
    pub fn from_inode(ino: u64, i: &Inode) -> Attr {
        let bytes = i.allocated + i.inline.as_ref().map_or(0, |d| d.len() as u64);
        Attr {
            ino,
            kind: i.kind,
            perm: i.perm,
            nlink: i.nlink,
            uid: i.uid,
            gid: i.gid,
            size: i.size,
            blocks: bytes.div_ceil(512),
            atime: i.atime,
            mtime: i.mtime,
            ctime: i.ctime,
            crtime: i.crtime,
            rdev: i.rdev,
            blksize: BLOCK_SIZE as u32,
        }
    }

    pub fn mode(&self) -> u32 {
        self.kind.mode_bits() | self.perm as u32
    }
}

/// A time to set: the volume's clock, or a given time.
#[derive(Clone, Copy, Debug, bincode::Encode, bincode::Decode)]
pub enum TimeSet {
    Now,
    At(Timestamp),
}

/// `setattr` arguments; `None` leaves a field alone.
#[derive(Clone, Debug, Default, bincode::Encode, bincode::Decode)]
pub struct SetAttr {
    pub perm: Option<u16>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub enum RenameMode {
    /// Replace the target if there is one.
    Plain,
    /// Fail with EEXIST if the target exists.
    NoReplace,
    /// Swap source and target, which must both exist.
    Exchange,
}

/// One listed directory entry; `offset` resumes the listing after it.
#[derive(Clone, Debug, PartialEq, bincode::Encode, bincode::Decode)]
pub struct DirEntryOut {
    pub ino: u64,
    pub kind: FileKind,
    pub name: Vec<u8>,
    pub offset: u64,
}

#[derive(Clone, Debug, bincode::Encode, bincode::Decode)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
}

/// How `setxattr` treats an existing attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, bincode::Encode, bincode::Decode)]
pub enum XattrFlags {
    #[default]
    Any,
    /// Fail with EEXIST if it exists.
    Create,
    /// Fail with ENODATA if it does not.
    Replace,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slicing_an_extent_keeps_the_crcs_of_the_blocks_it_touches() {
        let e = Extent { data: Addr::default(), rec_off: 0, len: 10_000, crcs: vec![1, 2, 3] };
        let mid = e.slice(5000, 9000);
        assert_eq!((mid.rec_off, mid.len, mid.crcs.clone()), (5000, 4000, vec![2, 3]));
        assert_eq!(mid.crc_of(1), Some(2));
        assert_eq!(mid.crc_of(0), None);
        let inner = mid.slice(100, 200);
        assert_eq!((inner.rec_off, inner.crcs), (5100, vec![2]));
    }

    #[test]
    fn kinds_round_trip_through_mode_bits() {
        for k in [
            FileKind::Regular,
            FileKind::Directory,
            FileKind::Symlink,
            FileKind::Fifo,
            FileKind::Socket,
            FileKind::CharDevice,
            FileKind::BlockDevice,
        ] {
            assert_eq!(FileKind::from_mode(k.mode_bits() | 0o644), Some(k));
        }
    }
}

#[cfg(test)]
mod extent_codec_tests {
    use super::*;
    use crate::format::SegId;

    #[test]
    fn extents_round_trip_and_reject_inconsistent_tables() {
        let data = Addr { seg: SegId { writer: 1, seq: 2 }, off: 100, len: 20_000 };
        let e = Extent { data, rec_off: 5000, len: 6000, crcs: vec![7, 8] };
        assert_eq!(Extent::decode(&e.encode()).ok(), Some(e.clone()));
        let mut short = e.encode();
        short.truncate(short.len() - 4);
        assert!(Extent::decode(&short).is_err());
        let past_end = Extent { rec_off: 19_000, len: 6000, ..e };
        assert!(Extent::decode(&past_end.encode()).is_err());
    }
}

#[cfg(test)]
mod extent_slice_tests {
    use super::*;
    use crate::format::SegId;

    #[test]
    fn decode_slice_equals_slicing_the_decoded_extent() {
        let data = Addr { seg: SegId { writer: 1, seq: 2 }, off: 0, len: 40_000 };
        let e = Extent { data, rec_off: 1000, len: 30_000, crcs: (0..8).collect() };
        let bytes = e.encode();
        for (from, to) in [(0, 30_000), (0, 1), (3095, 3097), (7000, 29_999), (29_999, 30_000)] {
            assert_eq!(Extent::decode_slice(&bytes, from, to).ok(), Some(e.slice(from, to)), "{from}..{to}");
        }
        assert!(Extent::decode_slice(&bytes, 10, 30_001).is_err());
        assert!(Extent::decode_slice(&bytes[..30], 0, 10).is_err());
    }
}
