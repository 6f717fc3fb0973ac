//! Where a chunk can come from before the bucket: cache servers nearby
//! (`arbor serve`). A sealed segment's object is immutable and its name is
//! never reused, so a chunk is a pure function of (segment, index): any
//! server may hold a copy, and the reader checks every byte it is given
//! against the footer it read from the bucket itself (never one a server
//! gave: a server could then vouch for its own bytes). A chunk a server
//! did not give, or gave wrong, is read from the bucket.

use crate::format::SegId;
use crate::format::Source;
use std::ops::Range;

/// One chunk asked of a [`ChunkSource`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkRequest {
    pub index: u32,
    /// Its bytes in the segment object (the last chunk may be short).
    pub range: Range<u64>,
}

/// Chunks of sealed segments from somewhere other than the bucket.
pub trait ChunkSource: Send + Sync {
    /// The chunks `wanted` of segment `seg`, in order: `None` for each one
    /// this source cannot give now (the caller reads the bucket for it).
    /// Never blocks longer than the source's own timeout.
    fn fetch(&self, seg: SegId, wanted: &[ChunkRequest]) -> Vec<Option<Vec<u8>>>;
    /// As [`ChunkSource::fetch`], but hands each chunk to `got` (its
    /// number in `wanted`, and the bytes or `None`) as soon as it is
    /// there, so the caller can use the first before the last has come.
    fn fetch_each(&self, seg: SegId, wanted: &[ChunkRequest], got: &mut dyn FnMut(usize, Option<Vec<u8>>)) {
        for (k, bytes) in self.fetch(seg, wanted).into_iter().enumerate() {
            got(k, bytes);
        }
    }
    /// Chunk `index` of `seg` (or a part of it) as given failed its
    /// checksum.
    fn rejected(&self, seg: SegId, index: u32);
    /// The footer of sealed segment `seg` as its object ends (the crc
    /// table and the trailer, checked by its own crc32c): a reader opening
    /// a segment asks this of a source that [`ChunkSource::is_local`] (and
    /// no other) before a GET of the bucket; `None` when this source cannot
    /// give it now.
    fn fetch_footer(&self, _seg: SegId) -> Option<Vec<u8>> {
        None
    }
    /// A footer as given failed its check.
    fn footer_rejected(&self, _seg: SegId) {}
    /// Whether what it gives stays on this node (another cache of this
    /// process): a reader then need not keep a copy of its own.
    fn is_local(&self) -> bool {
        false
    }
    /// Bytes `within` (offsets inside the chunk) of chunk `index` of
    /// `seg`, for a small read whose reader checks them itself against
    /// its block crcs; `None` when this source cannot give them now.
    /// Bytes `leaves` (whole 16 KiB leaves inside the chunk) of chunk
    /// `index` of `seg` followed by the hash of every leaf of the chunk
    /// (the bucket tier's `prove_part`), for a reader that checks
    /// them against the chunk's digest; `None` when this source cannot.
    fn fetch_proved_part(&self, _seg: SegId, _index: u32, _leaves: Range<u64>) -> Option<Vec<u8>> {
        None
    }
    fn fetch_part(&self, _seg: SegId, _index: u32, _within: Range<u64>) -> Option<Vec<u8>> {
        None
    }

    /// Chunks `wanted` (1 MiB each, by index) of source object `src`, in
    /// order: `None` for each this source cannot give now. An object
    /// chunk has no checksum in the bucket: a source checks what it can
    /// (its transport's) and gives only what passed.
    fn fetch_object(&self, _src: &Source, wanted: &[u64]) -> Vec<Option<Vec<u8>>> {
        vec![None; wanted.len()]
    }
    /// Chunk `index` of `src` as given had the wrong length.
    fn object_rejected(&self, _src: &Source, _index: u64) {}
}

/// Sources added after the reader that asks them was made: the segments an
/// `arbor serve --branch` process writes itself are cached by its branches'
/// devices, which are opened after its chunk cache. Asked in the order added.
#[derive(Default)]
pub struct LateSources {
    sources: parking_lot::RwLock<Vec<std::sync::Arc<dyn ChunkSource>>>,
}

impl LateSources {
    pub fn add(&self, source: std::sync::Arc<dyn ChunkSource>) {
        self.sources.write().push(source);
    }
}

impl ChunkSource for LateSources {
    fn fetch(&self, seg: SegId, wanted: &[ChunkRequest]) -> Vec<Option<Vec<u8>>> {
        let mut out = vec![None; wanted.len()];
        for s in self.sources.read().iter() {
            let missing: Vec<usize> = (0..wanted.len()).filter(|&i| out[i].is_none()).collect();
            if missing.is_empty() {
                break;
            }
            let asks: Vec<ChunkRequest> = missing.iter().map(|&i| wanted[i].clone()).collect();
            for (i, got) in missing.into_iter().zip(s.fetch(seg, &asks)) {
                out[i] = got;
            }
        }
        out
    }
    fn rejected(&self, seg: SegId, index: u32) {
        for s in self.sources.read().iter() {
            s.rejected(seg, index);
        }
    }
    fn fetch_footer(&self, seg: SegId) -> Option<Vec<u8>> {
        self.sources.read().iter().find_map(|s| s.fetch_footer(seg))
    }
    fn footer_rejected(&self, seg: SegId) {
        for s in self.sources.read().iter() {
            s.footer_rejected(seg);
        }
    }
    fn is_local(&self) -> bool {
        let sources = self.sources.read();
        !sources.is_empty() && sources.iter().all(|s| s.is_local())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Gives the chunks and footer it holds, tagged with its name.
    struct Holds {
        name: u8,
        chunks: Vec<u32>,
        footer: bool,
    }

    impl ChunkSource for Holds {
        fn fetch(&self, _seg: SegId, wanted: &[ChunkRequest]) -> Vec<Option<Vec<u8>>> {
            wanted.iter().map(|w| self.chunks.contains(&w.index).then(|| vec![self.name, w.index as u8])).collect()
        }
        fn rejected(&self, _seg: SegId, _index: u32) {}
        fn fetch_footer(&self, _seg: SegId) -> Option<Vec<u8>> {
            self.footer.then(|| vec![self.name])
        }
    }

    #[test]
    fn late_sources_are_asked_in_order_for_what_the_earlier_ones_lack() {
        let late = LateSources::default();
        let seg = SegId { writer: 1, seq: 2 };
        let ask = |i: u32| ChunkRequest { index: i, range: 0..1 };
        assert_eq!(late.fetch(seg, &[ask(0)]), vec![None], "nothing added yet");
        assert_eq!(late.fetch_footer(seg), None);
        late.add(Arc::new(Holds { name: 1, chunks: vec![0, 2], footer: false }));
        late.add(Arc::new(Holds { name: 2, chunks: vec![0, 1], footer: true }));
        let got = late.fetch(seg, &[ask(0), ask(1), ask(2), ask(3)]);
        assert_eq!(got, vec![Some(vec![1, 0]), Some(vec![2, 1]), Some(vec![1, 2]), None]);
        assert_eq!(late.fetch_footer(seg), Some(vec![2]));
    }
}
