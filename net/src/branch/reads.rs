//! A client mount reading file bytes without the owner: the owner says
//! where a range's bytes are ([`FileOp::Locate`](crate::branch::owner::FileOp::Locate)),
//! and the client reads the extents that lie in segments it can read
//! itself (the bucket through its own chunk cache and the cache servers,
//! or the folder that is the disk), checking every 4 KiB block against
//! the crc32c the extent carries. Bytes only the owner has (not uploaded
//! yet, inline in the tree, an imported file's object) are read from the
//! owner as before.
//!
//! A segment is immutable and its name never reused, so a location stays
//! right for as long as the file does not change: a client keeps the
//! locations of a window of each file ([`WINDOW`]) and forgets them when
//! the file changes — its own write or truncation, another node's change
//! (the owner's event), every `open` (close-to-open), and every new session
//! with the owner (a restarted owner may have lost what it located). A
//! read that fails here (a segment compacted away and deleted, a block
//! whose crc does not match) is read from the owner instead, and the
//! file's locations are forgotten.

use crate::branch::owner::{Located, Span};
use arbor_engine::device::Device;
use arbor_engine::volume::{fill_in_order, read_extent, Extent};
use arbor_engine::{Error, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// How much of a file one locate asks for: a sequential reader asks the
/// owner once per window, not once per read.
pub const WINDOW: u64 = 64 << 20;
/// Files whose locations a client keeps; past that it starts over.
const MAPS_MAX: usize = 4096;

/// The located part of one file.
struct Map {
    /// The offset the locate started at.
    start: u64,
    size: u64,
    end: u64,
    /// Sorted by offset, not overlapping; gaps are holes.
    spans: Vec<(u64, u64, Option<Extent>)>,
}

impl Map {
    fn decode(start: u64, l: Located) -> Result<Map> {
        let mut spans = Vec::with_capacity(l.spans.len());
        let mut last = start;
        for Span { at, len, extent } in l.spans {
            let extent = extent.map(|b| Extent::decode(&b)).transpose()?;
            let bad = at < last
                || at.checked_add(len).is_none_or(|e| e > l.end)
                || extent.as_ref().is_some_and(|e| e.len as u64 != len);
            if bad {
                return Err(Error::corrupted("located span", at));
            }
            last = at + len;
            spans.push((at, len, extent));
        }
        if l.end > l.size.max(start) {
            return Err(Error::corrupted("located range", l.end));
        }
        Ok(Map { start, size: l.size, end: l.end, spans })
    }

    /// Whether it answers a read of `[off, off + len)`.
    fn covers(&self, off: u64, len: u64) -> bool {
        off >= self.start && (off >= self.size || off.saturating_add(len).min(self.size) <= self.end)
    }
}

arbor_engine::counters! {
    /// Counters of reads a client made itself.
    pub struct ReadCounters;
    /// What a client's reads from the segments did.
    #[derive(Copy, PartialEq, Eq)]
    pub struct DirectReadStats {
        /// Reads made from the disk's segments, and their bytes.
        direct_reads: Counter,
        direct_bytes: Counter,
        /// Locates asked of the owner.
        locates: Counter,
        /// Direct reads that failed and went to the owner.
        direct_failed: Counter,
    }
}

/// Why a read from the segments gave no bytes.
#[derive(Debug)]
pub enum Failed {
    /// The owner's answer to the locate: the read's answer too.
    Owner(Error),
    /// Reading the segments failed (or the owner's answer did not add up):
    /// the owner reads it instead.
    Here(Error),
}

/// The segments a client reads itself, and the locations it keeps.
pub struct DirectReads {
    /// `None` once the mount is closed: the device (and a cache folder
    /// that goes with it) is not kept alive by threads still winding down.
    segments: parking_lot::RwLock<Option<Arc<dyn Device>>>,
    maps: Mutex<HashMap<u64, Arc<Map>>>,
    /// Changes at every forgetting: a locate that was under way then is
    /// not kept (it may predate the change).
    generation: AtomicU64,
    pub counters: ReadCounters,
}

impl DirectReads {
    pub fn new(segments: Arc<dyn Device>) -> DirectReads {
        DirectReads {
            segments: parking_lot::RwLock::new(Some(segments)),
            maps: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
            counters: ReadCounters::default(),
        }
    }

    /// Forgets what `ino`'s bytes were.
    pub fn forget(&self, ino: u64) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.maps.lock().remove(&ino);
    }

    /// Lets go of the segments: every later read goes to the owner.
    pub fn close(&self) {
        self.segments.write().take();
        self.forget_all();
    }

    pub fn forget_all(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.maps.lock().clear();
    }

    /// Reads `[off, off + buf.len())` of `ino` from the segments into
    /// `buf` (whatever it held), asking `locate(ino, off, len)` where they
    /// are when it does not know. Returns how many bytes of `buf` are the
    /// file's (short at end of file); `None`: some of the range only the
    /// owner has.
    pub fn read_into(
        &self,
        ino: u64,
        off: u64,
        buf: &mut [u8],
        locate: impl FnOnce(u64, u64, u64) -> Result<Located>,
    ) -> std::result::Result<Option<usize>, Failed> {
        let Some(segments) = self.segments.read().clone() else { return Ok(None) };
        let len64 = buf.len() as u64;
        let known = self.maps.lock().get(&ino).filter(|m| m.covers(off, len64)).cloned();
        let map = match known {
            Some(m) => m,
            None => {
                let generation = self.generation.load(Ordering::Acquire);
                self.counters.locates.inc();
                let located = locate(ino, off, len64.max(WINDOW)).map_err(Failed::Owner)?;
                let m = Arc::new(Map::decode(off, located).map_err(Failed::Here)?);
                let mut maps = self.maps.lock();
                if self.generation.load(Ordering::Acquire) == generation {
                    if maps.len() >= MAPS_MAX {
                        maps.clear();
                    }
                    maps.insert(ino, m.clone());
                }
                m
            }
        };
        if off >= map.size || buf.is_empty() {
            return Ok(Some(0));
        }
        let end = (off + len64).min(map.size);
        if end > map.end {
            // More pieces than one locate answers: the owner reads it.
            return Ok(None);
        }
        let first = map.spans.partition_point(|s| s.0 + s.1 <= off);
        if map.spans[first..].iter().take_while(|s| s.0 < end).any(|s| s.2.is_none()) {
            return Ok(None);
        }
        let out = &mut buf[..(end - off) as usize];
        let spans = map.spans[first..].iter().take_while(|s| s.0 < end).map(|(at, len, e)| (*at, *len, e));
        fill_in_order(out, off, spans, |extent, skip, dst| match extent {
            Some(e) => read_extent(segments.as_ref(), e, skip as u32, dst),
            None => Err(Error::Invalid("a span only the owner has")),
        })
        .map_err(Failed::Here)?;
        self.counters.direct_reads.inc();
        self.counters.direct_bytes.add(out.len() as u64);
        Ok(Some(out.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(at: u64, len: u64) -> Span {
        Span { at, len, extent: None }
    }

    #[test]
    fn a_located_answer_that_does_not_add_up_is_refused() {
        let ok = Located { size: 100, end: 50, spans: vec![span(0, 10), span(20, 30)] };
        let m = Map::decode(0, ok).expect("a good answer");
        assert!(m.covers(0, 50) && m.covers(10, 40) && !m.covers(10, 41) && m.covers(200, 5));
        for bad in [
            Located { size: 100, end: 50, spans: vec![span(20, 10), span(0, 10)] },
            Located { size: 100, end: 50, spans: vec![span(40, 20)] },
            Located { size: 10, end: 50, spans: vec![] },
            Located { size: 100, end: 50, spans: vec![Span { at: 0, len: 8, extent: Some(vec![1, 2, 3]) }] },
        ] {
            assert!(Map::decode(0, bad).is_err());
        }
    }
}
