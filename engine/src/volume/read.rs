//! Reading file bytes: find the extents under the tree lock, then read and
//! verify their blocks without it.

use super::txn::Reads;
use super::types::{Extent, FileKind, Piece};
use super::Volume;
use crate::device::{Checked, Device, SegmentFile};
use crate::error::{Error, Result};
use crate::format::BLOCK_SIZE;
use crate::source::Source;

enum Plan {
    Bytes(Vec<u8>),
    Extents { start: u64, len: usize, extents: Vec<(u64, Piece)>, source: Option<Source> },
}

impl Volume {
    /// Reads up to `len` bytes at `off`; short at end of file. Holes read as
    /// zeros; a block that fails its checksum is an error, never other bytes.
    pub fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        match self.plan_read(ino, off, len)? {
            Plan::Bytes(b) => Ok(b),
            plan @ Plan::Extents { len, .. } => {
                let mut out = vec![0u8; len];
                self.fill(ino, plan, &mut out)?;
                Ok(out)
            }
        }
    }

    /// [`read`](Self::read) into `buf`, whatever it held: fills the first
    /// `n` bytes (holes with zeros) and returns `n`, short at end of file.
    /// A reader with a buffer of its own (a FUSE answer's) saves the
    /// allocation, its zeroing and a copy. On an error `buf` holds nothing
    /// meaningful.
    pub fn read_into(&self, ino: u64, off: u64, buf: &mut [u8]) -> Result<usize> {
        match self.plan_read(ino, off, buf.len())? {
            Plan::Bytes(b) => {
                buf[..b.len()].copy_from_slice(&b);
                Ok(b.len())
            }
            plan @ Plan::Extents { len, .. } => {
                self.fill(ino, plan, &mut buf[..len])?;
                Ok(len)
            }
        }
    }

    /// Where the bytes of a read are, found under the tree lock.
    fn plan_read(&self, ino: u64, off: u64, len: usize) -> Result<Plan> {
        let st = self.state.read();
        let v = self.view(&st);
        let i = v.inode(ino)?;
        readable(i.kind)?;
        if off >= i.size || len == 0 {
            return Ok(Plan::Bytes(Vec::new()));
        }
        let n = (len as u64).min(i.size - off) as usize;
        Ok(match &i.inline {
            Some(b) => Plan::Bytes(b[off as usize..off as usize + n].to_vec()),
            None => {
                let extents = v.extent_parts(ino, off, off + n as u64)?;
                let external = extents.iter().any(|(_, p)| matches!(p, Piece::Object(_)));
                let source = if external { v.source(ino)? } else { None };
                Plan::Extents { start: off, len: n, extents, source }
            }
        })
    }

    /// Fills `out` (the planned range, whatever it held) without the tree
    /// lock: each extent's bytes, verified, and zeros between them.
    fn fill(&self, ino: u64, plan: Plan, out: &mut [u8]) -> Result<()> {
        let Plan::Extents { start, len, extents, source } = plan else {
            return Err(Error::Invalid("a read plan without extents"));
        };
        debug_assert_eq!(out.len(), len);
        let pieces = extents.into_iter().map(|(from, part)| (from, part.len(), part));
        fill_in_order(out, start, pieces, |part, _, dst| match &part {
            Piece::Log(e) => self.read_extent(e, 0, dst),
            Piece::Object(e) => {
                let src = source.as_ref().ok_or_else(|| Error::corrupted("source of inode", ino))?;
                self.sources.read(src, e.off, dst)
            }
        })
    }

    /// For fsck: verifies every block of `ino` held in the log and, with
    /// `online`, that an imported file's object still has the recorded ETag
    /// (one conditional byte; its bytes stay in the bucket). Returns the
    /// log bytes verified.
    pub fn verify_file(&self, ino: u64, online: bool) -> Result<u64> {
        let (extents, source) = {
            let st = self.state.read();
            let v = self.view(&st);
            let i = v.inode(ino)?;
            if i.kind != FileKind::Regular || i.inline.is_some() {
                return Ok(i.inline.map_or(0, |b| b.len() as u64));
            }
            (v.extent_parts(ino, 0, i.size)?, v.source(ino)?)
        };
        let mut verified = 0;
        let mut source_checked = false;
        for (_, part) in extents {
            match &part {
                Piece::Log(e) => {
                    let mut buf = vec![0u8; e.len as usize];
                    self.read_extent(e, 0, &mut buf)?;
                    verified += e.len as u64;
                }
                Piece::Object(_) if !online || source_checked => {}
                Piece::Object(_) => {
                    let src = source.as_ref().ok_or_else(|| Error::corrupted("source of inode", ino))?;
                    let mut one = [0u8; 1];
                    self.sources.read(src, 0, &mut one)?;
                    source_checked = true;
                }
            }
        }
        Ok(verified)
    }

    /// Where the bytes of `[off, off + len)` of `ino` are, for a reader on
    /// another node that reads the disk's segments itself: extents in
    /// segments every node can read (the bucket, or the folder that is the
    /// disk), and the ranges only this volume can give (bytes not uploaded
    /// yet, inline bytes, imported files' objects). Gaps are holes. At most
    /// `max_places` places: `Located::end` says how far they reach.
    pub fn locate(&self, ino: u64, off: u64, len: u64, max_places: usize) -> Result<Located> {
        let (size, inline, extents) = {
            let st = self.state.read();
            let v = self.view(&st);
            let i = v.inode(ino)?;
            readable(i.kind)?;
            if off >= i.size || len == 0 {
                return Ok(Located { size: i.size, end: off, places: Vec::new() });
            }
            let end = off + len.min(i.size - off);
            let extents = if i.inline.is_some() { Vec::new() } else { v.extent_parts(ino, off, end)? };
            (i.size, i.inline.is_some(), extents)
        };
        let mut end = off + len.min(size - off);
        if inline {
            return Ok(Located { size, end, places: vec![(off, Place::Here(end - off))] });
        }
        let replica = self.device().replica();
        // Neighbouring extents mostly share a segment: ask about each once.
        let mut known: Option<(crate::format::SegId, bool)> = None;
        let mut shared = |seg| match known {
            Some((s, yes)) if s == seg => yes,
            _ => {
                let yes = replica.is_none_or(|r| r.segment_shared(seg));
                known = Some((seg, yes));
                yes
            }
        };
        let mut places: Vec<(u64, Place)> = Vec::new();
        for (from, part) in extents {
            if from >= end {
                break;
            }
            if places.len() >= max_places.max(1) {
                end = from;
                break;
            }
            let to = (from + part.len()).min(end);
            let place = match part {
                Piece::Log(e) if shared(e.data.seg) => {
                    // Bytes still in the write-behind queue are not in the
                    // segment file yet.
                    if let Some(log) = self.nodes.log.get() {
                        log.wait_written(e.data.seg, e.data.end())?;
                    }
                    Place::Log(if to - from < e.len as u64 { e.slice(0, (to - from) as u32) } else { e })
                }
                _ => Place::Here(to - from),
            };
            places.push((from, place));
        }
        Ok(Located { size, end, places })
    }

    /// Fills `dst` from extent `e` starting `at` bytes into it, verifying
    /// every data block it touches.
    pub(super) fn read_extent(&self, e: &Extent, at: u32, dst: &mut [u8]) -> Result<()> {
        if let Some(log) = self.nodes.log.get() {
            log.wait_written(e.data.seg, e.data.end())?;
        }
        read_extent(self.device().as_ref(), e, at, dst)
    }
}

/// Fills `out`, the bytes of a file from `start` on, from `pieces`: each a
/// file offset, a length and what holds those bytes, in file order and not
/// overlapping. `fill(piece, skip, dst)` fills `dst` with the piece's bytes
/// from `skip` bytes into it; the gaps between pieces are holes and read as
/// zeros, whatever `out` held. Pieces out of order are an error
/// ([`Error::Corrupted`]), never stale bytes.
pub fn fill_in_order<P>(
    out: &mut [u8],
    start: u64,
    pieces: impl IntoIterator<Item = (u64, u64, P)>,
    mut fill: impl FnMut(P, u64, &mut [u8]) -> Result<()>,
) -> Result<()> {
    let end = start + out.len() as u64;
    let mut at = start;
    for (piece_at, len, piece) in pieces {
        let (from, to) = (piece_at.max(start), (piece_at + len).min(end));
        if from < at {
            return Err(Error::corrupted("order of a read's pieces", piece_at));
        }
        if to <= from {
            continue;
        }
        out[(at - start) as usize..(from - start) as usize].fill(0);
        fill(piece, from - piece_at, &mut out[(from - start) as usize..(to - start) as usize])?;
        at = to;
    }
    out[(at - start) as usize..].fill(0);
    Ok(())
}

/// Only a regular file's bytes are read.
fn readable(kind: FileKind) -> Result<()> {
    match kind {
        FileKind::Regular => Ok(()),
        FileKind::Directory => Err(Error::IsDir),
        _ => Err(Error::Invalid("read of a special file")),
    }
}

/// What [`Volume::locate`] found: the file's size, how far the places
/// reach, and each place with the file offset it starts at.
#[derive(Clone, Debug, PartialEq)]
pub struct Located {
    pub size: u64,
    pub end: u64,
    pub places: Vec<(u64, Place)>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Place {
    /// In a segment every node can read: read it with [`read_extent`].
    Log(Extent),
    /// This many bytes only the volume that located them can give.
    Here(u64),
}

/// Fills `dst` from extent `e` of a segment of `dev`, starting `at` bytes
/// into the extent, verifying every data block it touches against the
/// extent's crc32c: an error, never other bytes.
pub fn read_extent(dev: &dyn Device, e: &Extent, at: u32, dst: &mut [u8]) -> Result<()> {
    let data = e.data;
    if at as u64 + dst.len() as u64 > e.len as u64 {
        return Err(Error::Invalid("a read past the end of its extent"));
    }
    let r0 = (e.rec_off + at) as usize;
    let r1 = r0 + dst.len();
    let b0 = r0 / BLOCK_SIZE;
    let span_end = (r1.div_ceil(BLOCK_SIZE) * BLOCK_SIZE).min(data.len as usize);
    let file = dev.open_segment(data.seg)?.ok_or_else(|| Error::corrupted("missing segment", data))?;
    let at = data.off as u64 + (b0 * BLOCK_SIZE) as u64;
    let skip = r0 - b0 * BLOCK_SIZE;
    if skip == 0 && span_end - b0 * BLOCK_SIZE == dst.len() {
        // Whole blocks (a sequential reader's pages): read and check them
        // where they go, without a buffer to fill and copy out of.
        let read = read_blocks(file.as_ref(), e, b0, at, dst);
        if read.is_err() {
            dst.fill(0);
        }
        return read;
    }
    let mut buf = vec![0u8; span_end - b0 * BLOCK_SIZE];
    read_blocks(file.as_ref(), e, b0, at, &mut buf)?;
    dst.copy_from_slice(&buf[skip..skip + dst.len()]);
    Ok(())
}

/// Reads `buf.len()` bytes of `e`'s data at `at` of `file`, from its block
/// `b0` on, and checks each block against the extent's crc32c.
fn read_blocks(file: &dyn SegmentFile, e: &Extent, b0: usize, at: u64, buf: &mut [u8]) -> Result<()> {
    let bad_block = |buf: &[u8]| {
        buf.chunks(BLOCK_SIZE).enumerate().position(|(i, b)| e.crc_of(b0 + i) != Some(crate::crc::crc32c(b)))
    };
    let checked = file.read_for_check(buf, at)?;
    let mut bad = bad_block(buf);
    // Bytes nobody checked yet (a cache server's part of a chunk) that
    // fail here are read again the way that checks them.
    if bad.is_some() && checked == Checked::Unchecked {
        file.unchecked_failed(at);
        file.read_at(buf, at)?;
        bad = bad_block(buf);
    }
    match bad {
        Some(i) => Err(Error::corrupted("data block checksum", format!("{} block {}", e.data, b0 + i))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces as (file offset, length, byte): `fill` writes the byte plus
    /// how far into the piece the read began.
    fn filled(start: u64, len: usize, pieces: &[(u64, u64, u8)]) -> Result<Vec<u8>> {
        let mut out = vec![0xee; len];
        fill_in_order(&mut out, start, pieces.iter().copied(), |b, skip, dst| {
            dst.fill(b + skip as u8);
            Ok(())
        })?;
        Ok(out)
    }

    #[test]
    fn pieces_fill_their_ranges_and_the_holes_between_them_read_as_zeros() {
        // A piece that began before the read, a hole, a piece, a trailing hole.
        let got = filled(10, 12, &[(8, 4, 7), (15, 3, 9)]).expect("fill");
        assert_eq!(got, [9, 9, 0, 0, 0, 9, 9, 9, 0, 0, 0, 0]);
        // No pieces: all holes; an empty piece is skipped.
        assert_eq!(filled(0, 4, &[]).expect("fill"), [0; 4]);
        assert_eq!(filled(0, 4, &[(1, 0, 5), (2, 1, 6)]).expect("fill"), [0, 0, 6, 0]);
        // A piece running past the end is cut at it.
        assert_eq!(filled(0, 3, &[(1, 10, 4)]).expect("fill"), [0, 4, 4]);
    }

    #[test]
    fn pieces_out_of_order_are_an_error_never_stale_bytes() {
        let e = filled(0, 10, &[(5, 3, 1), (2, 2, 2)]).expect_err("out of order");
        assert_eq!(e.errno(), libc::EIO, "{e}");
        let e = filled(0, 10, &[(0, 4, 1), (3, 2, 2)]).expect_err("overlapping");
        assert_eq!(e.errno(), libc::EIO, "{e}");
    }
}
