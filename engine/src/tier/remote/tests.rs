//! The segment tier's handles and the chunk store: which file a segment's
//! chunks are in.

use super::*;
use crate::bucket::MemObjectStore;
use crate::device::SegmentFile;
use crate::tier::object::with_footer;

const CHUNK: u32 = 4096;

/// A memory-only tier over a bucket holding one segment of three chunks.
fn memory_tier() -> (Arc<Remote>, SegId, Vec<u8>) {
    let id = SegId { writer: 7, seq: 1 };
    let data: Vec<u8> = (0..3 * CHUNK).map(|i| (i * 7 + i / 4096) as u8).collect();
    let (body, _) = with_footer(data.clone(), CHUNK);
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    store.put(&segment_key(id), &body).expect("put");
    let remote = Remote::new(store, PathBuf::new(), ChunkStore::new(1 << 20), 0, 1, true, None).expect("tier");
    (remote, id, data)
}

/// Lets go of open segment `id` as the tier does when too many are open.
fn let_go(remote: &Remote, id: SegId) {
    remote.let_go(&mut remote.segs.write(), &[id]);
}

/// Chunk `i` of `seg`, landed through `seg` as a fetch of it does.
fn land(remote: &Remote, seg: &RemoteSeg, data: &[u8], i: usize) {
    let (s, e) = seg.footer.chunk_range(i);
    remote.land(seg, &[((seg.id, i as u32), &data[s as usize..e as usize], s)]);
}

fn read(seg: &RemoteSeg, i: usize) -> Vec<u8> {
    let (s, e) = seg.footer.chunk_range(i);
    let mut buf = vec![0u8; (e - s) as usize];
    seg.read_unstreamed(&mut buf, s).expect("read");
    buf
}

#[test]
fn a_chunk_landed_through_a_handle_let_go_is_read_right_through_the_next() {
    let (remote, id, data) = memory_tier();
    let chunk = |i: usize| data[i * CHUNK as usize..(i + 1) * CHUNK as usize].to_vec();
    let first = remote.open(id).expect("open").expect("segment");
    // Many segments opened since: this one's handle is let go while a
    // fetch worker still holds it, and the segment is opened again.
    let_go(&remote, id);
    let second = remote.open(id).expect("open").expect("segment");
    land(&remote, &first, &data, 1);
    assert!(read(&second, 1) == chunk(1), "a chunk landed through the first handle");
    land(&remote, &second, &data, 0);
    assert!(read(&first, 0) == chunk(0), "a chunk landed through the second handle");
    // Once nobody holds it, the segment is opened anew and its chunks
    // fetched again.
    let_go(&remote, id);
    drop((first, second));
    let third = remote.open(id).expect("open").expect("segment");
    assert!(!remote.holds(id, 0) && !remote.holds(id, 1), "a new memory file holds nothing");
    assert!((0..3).all(|i| read(&third, i) == chunk(i)), "fetched again");
    remote.shutdown();
}

#[test]
fn an_evicted_chunk_is_punched_out_of_a_handle_let_go() {
    let (remote, id, data) = memory_tier();
    let seg = remote.open(id).expect("open").expect("segment");
    land(&remote, &seg, &data, 1);
    let Backing::Object { file } = &seg.backing else { panic!("a segment object") };
    let (s, e) = seg.footer.chunk_range(1);
    assert!(is_data(file, s, e), "landed");
    let_go(&remote, id);
    remote.evict_unused_since(remote.tick() + 1);
    assert!(!is_data(file, s, e), "its memory given back");
    remote.shutdown();
}
