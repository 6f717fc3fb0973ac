//! Source-object chunks on local disk: a node's second cache behind the
//! memory one, kept across restarts, in the [`ChunkStore`]'s budget (which
//! ranks and evicts them together with the segment chunks, and removes an
//! evicted chunk's file).
//!
//! An object version's chunk never changes (its id names the ETag), so a
//! cached chunk needs no invalidation; it needs only to be the bytes that
//! were put. Each chunk is one file, `<hh>/<hash>-<index>`, written to a
//! temporary name and renamed into place, holding a header (magic, the
//! body's crc32c and length, the full object id) and the body. A read
//! checks all of them: a file that fails is removed and counted, and the
//! chunk is fetched again — a damaged cache costs a fetch, never wrong
//! bytes. Nothing is fsynced: a file lost in a crash is only a miss. The
//! store renames a file into place and counts it in one step, and removes
//! one only with its entry, so what it counts is what the folder holds.

use super::fnv1a;
use super::store::{ChunkKey, ChunkStore};
use crate::error::Result;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const MAGIC: [u8; 8] = *b"ARBOBJC1";
/// magic, crc32c, body length, id length.
const HEADER: usize = 8 + 4 + 4 + 4;

/// (hash of the object id, chunk index).
type Key = (u64, u64);

pub struct ChunkFiles {
    dir: PathBuf,
    /// Which chunks are here, in the node's one budget.
    store: Arc<ChunkStore>,
    counts: ChunkFilesCounters,
    /// Numbers temporary file names (two writers of one chunk never share one).
    tmp: AtomicU64,
}

/// A chunk read from its file: the file's bytes, used in place.
pub struct FileChunk {
    file: Vec<u8>,
    start: usize,
}

impl FileChunk {
    /// The whole file and where the chunk's bytes start in it.
    pub fn into_parts(self) -> (Vec<u8>, usize) {
        (self.file, self.start)
    }
}

impl std::ops::Deref for FileChunk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.file[self.start..]
    }
}

crate::counters! {
    /// What [`ChunkFiles`] counts, read as [`ChunkFilesStats`].
    struct ChunkFilesCounters;
    /// What the files held and did, for status.
    #[derive(Copy, PartialEq, Eq)]
    pub struct ChunkFilesStats {
        /// Chunks read from the files.
        hits: Counter,
        /// Files that failed their checks (removed, fetched again).
        damaged: Counter,
    } and {
        /// Bytes of the chunk files, and the most the store they share
        /// with segment chunks may hold.
        bytes: u64,
        capacity: u64,
    }
}

impl ChunkFiles {
    /// Opens (creating it) the folder `dir` in `store`, which takes the
    /// chunks already there at its cold end (they leave first, the least
    /// recently written of them first) and keeps them within its one
    /// budget, beside the segment chunks. A folder the store holds already
    /// is not looked at again; another one is refused.
    pub fn open(dir: &Path, store: &Arc<ChunkStore>) -> Result<Arc<ChunkFiles>> {
        crate::private::create_dir_all(dir)?;
        store.open_objects(dir, || found(dir))?;
        Ok(Arc::new(ChunkFiles {
            dir: dir.to_path_buf(),
            store: store.clone(),
            counts: ChunkFilesCounters::default(),
            tmp: AtomicU64::new(0),
        }))
    }

    fn key(id: &str, index: u64) -> Key {
        (fnv1a(id.as_bytes()), index)
    }

    fn path(&self, key: Key) -> PathBuf {
        path(&self.dir, key)
    }

    /// Chunk `index` of object `id`, if it is here and passes its checks.
    pub fn get(&self, id: &str, index: u64) -> Option<FileChunk> {
        let key = Self::key(id, index);
        let put = self.store.object(key)?;
        let path = self.path(key);
        let Ok(file) = std::fs::read(&path) else {
            self.store.forget_object(key, put);
            return None;
        };
        match check(&file, id) {
            Some(start) => {
                self.store.touch(ChunkKey::Object(key.0, key.1));
                self.counts.hits.inc();
                Some(FileChunk { file, start })
            }
            None => {
                // Another object with the same hash is a plain miss; a
                // file of this object that fails its checks is damage.
                if same_object(&file, id) {
                    self.counts.damaged.inc();
                    tracing::warn!(file = %path.display(), "a cached chunk failed its checksum; fetching it again");
                }
                self.store.forget_object(key, put);
                None
            }
        }
    }

    /// Keeps `body` as chunk `index` of object `id`. A failure to write
    /// is logged and forgotten: the chunk is simply not cached.
    pub fn put(&self, id: &str, index: u64, body: &[u8]) {
        let key = Self::key(id, index);
        let path = self.path(key);
        let mut header = Vec::with_capacity(HEADER + id.len());
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&crate::crc::crc32c(body).to_le_bytes());
        header.extend_from_slice(&(body.len() as u32).to_le_bytes());
        header.extend_from_slice(&(id.len() as u32).to_le_bytes());
        header.extend_from_slice(id.as_bytes());
        let n = self.tmp.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            // Private, as everything in a cache folder is.
            let create = || crate::private::options().write(true).create(true).truncate(true).open(&tmp);
            let mut f = match create() {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    path.parent().map_or(Ok(()), crate::private::create_dir_all)?;
                    create()?
                }
                other => other?,
            };
            f.write_all(&header)?;
            f.write_all(body)?;
            drop(f);
            let len = (header.len() + body.len()) as u64;
            self.store.insert_object(key, len, || std::fs::rename(&tmp, &path))
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot cache a chunk on disk");
        }
    }

    pub fn stats(&self) -> ChunkFilesStats {
        ChunkFilesStats { bytes: self.store.object_bytes(), capacity: self.store.capacity(), ..self.counts.snapshot() }
    }
}

/// Where chunk `key` of a chunk-files folder `dir` is kept.
pub(super) fn path(dir: &Path, (hash, index): Key) -> PathBuf {
    dir.join(format!("{:02x}", hash >> 56)).join(format!("{hash:016x}-{index}"))
}

/// The length of the file keeping a chunk of `body_len` bytes of object `id`.
#[cfg(test)]
pub(super) fn file_len(id: &str, body_len: usize) -> u64 {
    (HEADER + id.len() + body_len) as u64
}

/// The chunks in folder `dir` (key, file length), the least recently
/// written first; temporary files a crash left behind are removed.
fn found(dir: &Path) -> Vec<(Key, u64)> {
    let mut found = Vec::new();
    let Ok(subs) = std::fs::read_dir(dir) else { return Vec::new() };
    for sub in subs.flatten() {
        let Ok(files) = std::fs::read_dir(sub.path()) else { continue };
        for f in files.flatten() {
            let name = f.file_name();
            let Some(key) = name.to_str().and_then(parse_name) else {
                let _ = std::fs::remove_file(f.path());
                continue;
            };
            if let Ok(m) = f.metadata() {
                found.push((m.modified().ok(), key, m.len()));
            }
        }
    }
    found.sort_unstable();
    found.into_iter().map(|(_, key, len)| (key, len)).collect()
}

/// `<hash>-<index>`, the name of a chunk's file.
fn parse_name(name: &str) -> Option<Key> {
    let (hash, index) = name.split_once('-')?;
    if hash.len() != 16 {
        return None;
    }
    Some((u64::from_str_radix(hash, 16).ok()?, index.parse().ok()?))
}

/// The little-endian u32 at `at`, if the file is that long.
fn word(file: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(file.get(at..at + 4)?.try_into().ok()?))
}

/// Where the body of a chunk file for object `id` starts, if the file is
/// whole.
fn check(file: &[u8], id: &str) -> Option<usize> {
    if file.len() < HEADER || file[..8] != MAGIC {
        return None;
    }
    let (crc, len, id_len) = (word(file, 8)?, word(file, 12)? as usize, word(file, 16)? as usize);
    if file.len() != HEADER + id_len + len || &file[HEADER..HEADER + id_len] != id.as_bytes() {
        return None;
    }
    (crate::crc::crc32c(&file[HEADER + id_len..]) == crc).then_some(HEADER + id_len)
}

/// Whether a chunk file names object `id` (whatever state its body is in).
fn same_object(file: &[u8], id: &str) -> bool {
    let Some(id_len) = word(file, 16).map(|n| n as usize) else { return false };
    file.get(HEADER..HEADER + id_len) == Some(id.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "corpus\0shards/a.tar\0\"etag-1\"";

    #[test]
    fn chunks_come_back_across_a_reopen_and_damage_is_a_counted_miss() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = ChunkFiles::open(dir.path(), &ChunkStore::new(1 << 20)).expect("open");
        assert!(files.get(ID, 0).is_none());
        files.put(ID, 0, b"chunk zero");
        files.put(ID, 7, &[7u8; 1000]);
        assert_eq!(files.get(ID, 0).as_deref(), Some(&b"chunk zero"[..]));
        // Another version of the object is another object.
        assert!(files.get("corpus\0shards/a.tar\0\"etag-2\"", 0).is_none());
        drop(files);

        let files = ChunkFiles::open(dir.path(), &ChunkStore::new(1 << 20)).expect("reopen");
        assert_eq!(files.get(ID, 7).as_deref(), Some(&[7u8; 1000][..]));
        // Flip one byte of chunk 7's body on disk.
        let path = files.path(ChunkFiles::key(ID, 7));
        let mut raw = std::fs::read(&path).expect("read");
        let last = raw.len() - 1;
        raw[last] ^= 1;
        std::fs::write(&path, &raw).expect("write");
        assert!(files.get(ID, 7).is_none(), "a damaged chunk is not given");
        assert_eq!(files.stats().damaged, 1);
        assert!(!path.exists(), "and is removed");
        // A truncated file too.
        let path0 = files.path(ChunkFiles::key(ID, 0));
        std::fs::write(&path0, &std::fs::read(&path0).expect("read")[..10]).expect("truncate");
        assert!(files.get(ID, 0).is_none());
        assert_eq!(files.stats().bytes, 0, "both forgotten");
    }

    #[test]
    fn the_least_recently_used_chunks_leave_first_and_segment_chunks_take_their_share() {
        let dir = tempfile::tempdir().expect("tempdir");
        let body = vec![1u8; 1000];
        let one = (HEADER + ID.len() + body.len()) as u64;
        // Three chunks fit, and trimming to 90 % still keeps three.
        let capacity = (3 * one).div_ceil(9) * 10;
        let files = ChunkFiles::open(dir.path(), &ChunkStore::new(capacity)).expect("open");
        for i in 0..3 {
            files.put(ID, i, &body);
        }
        assert!(files.get(ID, 0).is_some(), "0 is now the most recent");
        files.put(ID, 3, &body);
        assert!(files.get(ID, 1).is_none(), "1 was the least recently used");
        for i in [0, 2, 3] {
            assert!(files.get(ID, i).is_some(), "{i} stays");
        }
        assert_eq!(files.stats().bytes, 3 * one);
        drop(files);
        // Reopened in a store whose segment chunks fill two thirds of it.
        let store = ChunkStore::new(capacity);
        let seg = crate::format::SegId { writer: 1, seq: 1 };
        store.insert_segments(&[((seg, 0), one as u32, 0), ((seg, 1), one as u32, one)], false);
        let files = ChunkFiles::open(dir.path(), &store).expect("reopen");
        assert_eq!(files.stats().bytes, one, "trimmed to what is left of the budget");
        let on_disk = walk(dir.path());
        assert_eq!(on_disk, 1, "the files follow");
    }

    fn walk(dir: &Path) -> usize {
        std::fs::read_dir(dir).expect("dir").flatten().map(|s| std::fs::read_dir(s.path()).expect("sub").count()).sum()
    }
}
