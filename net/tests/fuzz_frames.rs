//! The framed protocol's fuzz target (`fuzz/wire.rs`) as an ordinary
//! test: the committed corpus replayed, then a long stream of inputs made
//! from real encodings (cut, flipped, lengths rewritten, spliced) and of
//! noise. `ARBOR_FUZZ_CASES` sets how many (default 20,000).
//!
//! Seeds: `ARBOR_WRITE_SEEDS=1 cargo test -p arbor-net --test fuzz_frames`.

use arbor_engine::format::SegId;
use arbor_net::branch::frames::{write_answer, write_request, Answer, Request};
use arbor_net::branch::owner::{FileOp, Located, Out, SessionInfo, Span};
use arbor_net::wire::frames::{
    write_chunk_answer, write_frame, write_hello, ChunkAnswer, ChunkAsk, Hello, Welcome, VERSION,
};
use std::path::PathBuf;

#[path = "../../fuzz/wire.rs"]
mod wire;

#[global_allocator]
static ALLOC: wire::Counting = wire::Counting;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/frames")
}

/// A frame of a few bytes whose string claims nearly 16 MiB: an
/// answer of `Err` text (`Answer::Reply(Ok(Out::Message(Err(…))))`).
fn claims_much() -> Vec<u8> {
    let mut buf = Vec::new();
    let mut wire = Vec::new();
    write_answer(&mut wire, &mut buf, &Answer::Reply(Ok(Out::Message(Err(String::new()))))).expect("write");
    wire.pop();
    let claim = ((16u32 << 20) - 64).to_le_bytes();
    wire.extend_from_slice(&[0xfc, claim[0], claim[1], claim[2], claim[3], b'x']);
    let len = (wire.len() - 4) as u32;
    wire[..4].copy_from_slice(&len.to_le_bytes());
    wire
}

/// Streams of frames as the real writers send them.
fn seeds() -> Vec<Vec<u8>> {
    let mut buf = Vec::new();
    let mut one = |write: &dyn Fn(&mut Vec<u8>, &mut Vec<u8>)| {
        let mut wire = Vec::new();
        write(&mut wire, &mut buf);
        wire
    };
    let seg = SegId { writer: 3, seq: 9 };
    let requests = one(&|w, b| {
        write_request(w, b, &Request::Session).expect("write");
        let lookup = FileOp::Lookup { parent: 1, name: b"data".to_vec() };
        write_request(w, b, &Request::Op { session: 7, op: lookup, tag: None }).expect("write");
        let write = FileOp::Write { ino: 5, off: 4096, data: vec![0xab; 300], unprivileged: true, append: false };
        write_request(w, b, &Request::Op { session: 7, op: write, tag: None }).expect("write");
        let read = FileOp::Read { ino: 5, off: 0, len: 1 << 20 };
        write_request(w, b, &Request::Op { session: 7, op: read, tag: None }).expect("write");
    });
    let answers = one(&|w, b| {
        write_answer(w, b, &Answer::Session(SessionInfo { session: 7, epoch: 2, seq: 11, generation: 3 }))
            .expect("write");
        write_answer(w, b, &Answer::Reply(Ok(Out::Bytes(vec![1; 200])))).expect("write");
        write_answer(w, b, &Answer::Reply(Ok(Out::Names(vec![b"a".to_vec(), Vec::new()])))).expect("write");
        let spans = vec![Span { at: 0, len: 10, extent: Some(vec![9; 20]) }, Span { at: 10, len: 5, extent: None }];
        write_answer(w, b, &Answer::Reply(Ok(Out::Located(Located { size: 15, end: 15, spans })))).expect("write");
        write_answer(w, b, &Answer::Reply(Err(libc::ENOENT))).expect("write");
        write_answer(w, b, &Answer::UnknownSession).expect("write");
    });
    let chunks = one(&|w, b| {
        write_chunk_answer(w, b, &ChunkAnswer::Bytes { hit: true, bytes: vec![7; 100] }).expect("write");
        write_chunk_answer(w, b, &ChunkAnswer::NotFound).expect("write");
        write_chunk_answer(w, b, &ChunkAnswer::Failed("the bucket is away".into())).expect("write");
    });
    let asks = one(&|w, b| {
        write_frame(w, b, &ChunkAsk { seg, index: 3, part: None, proved: false }).expect("write");
        write_frame(w, b, &ChunkAsk { seg, index: 4, part: Some((4096, 8192)), proved: true }).expect("write");
        write_frame(w, b, &Welcome::Version(VERSION)).expect("write");
    });
    let hello = one(&|w, b| {
        write_hello(w, b, &Hello { version: VERSION, token: b"a-token".to_vec(), branch: "main".into() })
            .expect("write")
    });
    vec![requests, answers, chunks, asks, hello, claims_much()]
}

/// A fixed xorshift stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// An input made from a seed, or noise.
fn mutated(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut data = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(4) {
        match rng.below(8) {
            0 => data.truncate(rng.below(data.len() + 1)),
            1 if !data.is_empty() => {
                let i = rng.below(data.len());
                data[i] ^= 1 << rng.below(8);
            }
            2 if !data.is_empty() => {
                let i = rng.below(data.len());
                data[i] = [0, 0xff, 0xfb, 0xfc, 0xfd, 0x80][rng.below(6)];
            }
            // A frame length rewritten: larger, smaller, huge.
            3 if data.len() >= 4 => {
                let n = [rng.next() as u32, rng.below(64) as u32, 16 << 20, (16 << 20) + 1][rng.below(4)];
                data[..4].copy_from_slice(&n.to_le_bytes());
            }
            4 => {
                let other = &seeds[rng.below(seeds.len())];
                let from = rng.below(other.len());
                data.extend_from_slice(&other[from..]);
            }
            5 => data.extend((0..rng.below(32)).map(|_| rng.next() as u8)),
            // A length (a u32 varint) of up to 16 MiB where a length may be.
            6 if !data.is_empty() => {
                let at = rng.below(data.len());
                let claim = (rng.below(16 << 20) as u32).to_le_bytes();
                data.splice(at..at, [0xfc, claim[0], claim[1], claim[2], claim[3]]);
            }
            _ => data = (0..rng.below(96)).map(|_| rng.next() as u8).collect(),
        }
    }
    data
}

#[test]
fn the_allocator_sees_what_a_reader_allocates() {
    assert!(wire::largest_in(|| drop(std::hint::black_box(vec![0u8; 1 << 20]))) >= 1 << 20);
}

#[test]
fn every_corpus_input_runs_clean() {
    let dir = corpus_dir();
    if std::env::var_os("ARBOR_WRITE_SEEDS").is_some() {
        std::fs::create_dir_all(&dir).expect("mkdir");
        for (i, bytes) in seeds().into_iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), bytes).expect("write seed");
        }
    }
    let mut ran = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("corpus {dir:?}: {e}")) {
        wire::frames(&std::fs::read(entry.expect("entry").path()).expect("read input"));
        ran += 1;
    }
    assert!(ran >= seeds().len(), "the corpus holds the seeds at least");
}

#[test]
fn seeds_decode_whole_and_generated_inputs_run_clean() {
    let seeds = seeds();
    for s in &seeds {
        wire::frames(s);
    }
    let cases: usize = std::env::var("ARBOR_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for _ in 0..cases {
        wire::frames(&mutated(&mut rng, &seeds));
    }
}
