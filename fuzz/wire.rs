//! The body of the fuzz target of the framed protocol's decoders, shared by
//! `fuzz_targets/frames.rs` and by `net/tests/fuzz_frames.rs`, which
//! replays the committed corpus and a long stream of generated inputs in
//! the normal test run. Arbitrary bytes are read as a peer's stream: the
//! requests an owner reads, the answers a client reads, chunk asks and
//! answers, welcomes and hellos. Every reader must return (never panic or
//! hang), and no allocation may be larger than the bytes justify.
//!
//! The binary that runs it installs [`Counting`] as its global allocator,
//! which notes the largest allocation made on the thread under test.
//! Test code: nothing here ships in arbor.

use arbor_net::branch::frames::{read_answer, read_request};
use arbor_net::wire::frames::{
    decode_hello, hello_len, read_chunk_answer, read_frame, ChunkAsk, Welcome, CLAIM_FACTOR, HELLO_MAX,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    /// Whether allocations on this thread are noted, and the largest so far.
    static WATCHED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, noting the largest allocation on a watched thread.
pub struct Counting;

// SAFETY: every call is passed to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's layout, as GlobalAlloc requires.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn note(size: usize) {
    let _ = WATCHED.try_with(|w| {
        if w.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

/// The largest allocation `f` makes on this thread.
pub fn largest_in(f: impl FnOnce()) -> usize {
    LARGEST.with(|l| l.set(0));
    WATCHED.with(|w| w.set(true));
    f();
    WATCHED.with(|w| w.set(false));
    LARGEST.with(|l| l.get())
}

/// The most any reader may allocate at once for `len` bytes of input: a
/// buffer reserved ahead of a frame's bytes (64 KiB), or what a frame of
/// at most `len` bytes may claim (twice [`CLAIM_FACTOR`] times, as the
/// claim's limit is a power of two; 4 KiB at least).
pub fn allowed(len: usize) -> usize {
    (64 << 10).max(2 * CLAIM_FACTOR * len).max(HELLO_MAX)
}

/// Reads `data` as a stream of frames with `read`, until one fails.
fn stream<'a, T>(data: &'a [u8], read: impl Fn(&mut &'a [u8], &mut Vec<u8>) -> std::io::Result<T>) {
    let mut r = data;
    let mut buf = Vec::new();
    let mut done = false;
    let most = largest_in(|| {
        // Every frame is at least its 4-byte length: this bounds the walk.
        for _ in 0..=data.len() / 4 {
            if read(&mut r, &mut buf).is_err() {
                done = true;
                return;
            }
        }
    });
    assert!(done, "a reader did not stop at the end of its input");
    assert!(most <= allowed(data.len()), "{most} bytes allocated at once for {} bytes of input", data.len());
}

/// Feeds `data` to every decoder of the framed protocol.
pub fn frames(data: &[u8]) {
    // As an owner reads a client's connection.
    stream(data, read_request);
    // As a client reads an owner's answers, and a cache server's chunks.
    stream(data, read_answer);
    stream(data, read_chunk_answer);
    stream(data, read_frame::<Welcome>);
    // As a cache server reads chunk asks.
    stream(data, read_frame::<ChunkAsk>);
    // A hello, as the server reads it before anything else.
    let most = largest_in(|| {
        if let Some(head) = data.get(..4) {
            if let Ok(len) = hello_len([head[0], head[1], head[2], head[3]]) {
                if let Some(frame) = data.get(4..4 + len) {
                    let _ = decode_hello(frame);
                }
            }
        }
        let _ = decode_hello(data);
    });
    assert!(most <= allowed(data.len()), "a hello: {most} bytes allocated for {}", data.len());
}
