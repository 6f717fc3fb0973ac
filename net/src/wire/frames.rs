//! The framed transport: length-prefixed bincode frames on a TCP
//! connection (inside TLS when the server has a certificate, see
//! [`crate::wire::stream`]), answered one at a time, in order. It carries file
//! operations to a branch's owner and segment chunks from a cache server.
//!
//! A client mount keeps a small pool of these connections and a FUSE
//! thread uses one for the whole of an operation: it writes the request
//! and reads the answer on its own thread, and the owner reads, applies
//! and answers on the connection's own thread. Nothing is handed between
//! threads on either side, so an operation costs one round trip and two
//! wake-ups (the owner's and the client's), where the same operation as an
//! HTTP/2 request took four more hand-offs between tasks and threads
//! (measured: a `getattr` took ~270 µs that way on this machine's two
//! cores; see ARCHITECTURE.md for the numbers this transport gives).
//! Writes are the exception: a client sends them on write connections
//! without waiting for each answer (several in flight, answered in order;
//! see the branch's client).
//!
//! The connection starts with [`MAGIC`], which no HTTP request starts with:
//! the cache server's port tells the two apart by its first bytes. Then:
//!
//! - the client sends a [`Hello`] (protocol version, the shared token, the
//!   branch; at most [`HELLO_MAX`] bytes, within
//!   [`HELLO_DEADLINE`](crate::wire::admission::HELLO_DEADLINE) of connecting)
//!   and the owner answers a [`Welcome`]; with a wrong token the answer is
//!   [`Welcome::Refused`] and the connection is closed;
//! - then any number of a branch's requests, each answered by one answer
//!   (their frames are the branch's own, `branch::frames`).
//!
//! A Hello that names no branch opens a *chunk connection* instead: any
//! number of [`ChunkAsk`]s (a segment chunk, or a part of it), each
//! answered by one [`ChunkAnswer`], its bytes after its frame. A client
//! may send several asks before reading their answers (the chunks of a
//! read-ahead run); the server takes the asks already waiting together
//! and fetches those it does not hold from the bucket at once, so a cold
//! server is not one bucket round trip per chunk behind. A server that
//! serves no chunk connections (one older than them) answers
//! [`Welcome::NoBranch`], and the client asks it over HTTP/2.
//!
//! A frame is a little-endian `u32` length and that many bytes of bincode
//! (standard configuration), at most [`MAX_FRAME`].
//!
//! Bytes travel after their frame, not inside it (a chunk's here, a
//! write's or a read's in the branch's frames): [`write_with_payload`],
//! [`read_payload`]. Neither side then copies a MiB into or out of an
//! encoding buffer.
//!
//! This module knows nothing of what a branch's frames carry: they are
//! any bincode type, sent and read with [`write_frame`] and [`read_frame`].

use std::io::{self, Read, Write};

/// The first bytes of a framed connection.
pub const MAGIC: [u8; 4] = *b"ARBF";
/// The version of the framed protocol: its hello, chunk asks, and the
/// branch's requests and answers.
pub const VERSION: u32 = 9;
/// The largest frame either side accepts (a 1 MiB write or read fits many
/// times).
pub const MAX_FRAME: usize = 16 << 20;
/// The largest [`Hello`] frame a server reads: a version, a token and a
/// branch name. A connection is nobody's until its hello is read, so a
/// larger announced length is refused before a byte of it is read.
pub const HELLO_MAX: usize = 4 << 10;
/// Bytes of a frame or a payload reserved before they arrive: a buffer
/// grows as the bytes come (doubling), never to a length a peer merely
/// announced. (A 1 MiB payload read in 64 KiB pieces took ~20 µs either
/// way, grown from here or reserved whole, measured on this machine.)
pub(crate) const RESERVED_AHEAD: usize = 64 << 10;

#[derive(Clone, Debug, bincode::Encode, bincode::Decode)]
pub struct Hello {
    pub version: u32,
    pub token: Vec<u8>,
    pub branch: String,
}

#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub enum Welcome {
    Ok,
    /// The token was wrong: nothing else is answered.
    Refused,
    /// The branch is not served by this process.
    NoBranch,
    /// The client speaks another version of this protocol.
    Version(u32),
}

/// A segment chunk, or a part of it, asked on a chunk connection (one
/// whose [`Hello`] names no branch): chunk `index` of `seg`, or only its
/// bytes `at..at + len` when `part` is `Some((at, len))` — what
/// `GET /v1/chunks/SEG/INDEX[?at=…&len=…]` asks over HTTP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct ChunkAsk {
    pub seg: arbor_engine::format::SegId,
    pub index: u32,
    pub part: Option<(u64, u32)>,
    /// A part proved against the chunk's digest: the part (whole 16 KiB
    /// leaves) followed by the hashes of all the chunk's leaves.
    pub proved: bool,
}

/// What a chunk connection answers a [`ChunkAsk`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChunkAnswer {
    /// The bytes, and whether the server had them cached already.
    Bytes { hit: bool, bytes: Vec<u8> },
    /// No such segment, chunk or part.
    NotFound,
    /// The server could not get them (its bucket failed, say).
    Failed(String),
}

/// A [`ChunkAnswer`] as its frame carries it: the bytes follow the frame.
#[derive(bincode::Encode, bincode::Decode)]
enum ChunkHead {
    Bytes { hit: bool, len: u32 },
    NotFound,
    Failed(String),
}

/// The most asks a chunk connection takes together (see
/// [`frame_waiting`]).
pub const MAX_PIPELINED: usize = 16;

/// Whether a whole frame is already waiting to be read on `stream`
/// (looked at without taking it, and without waiting).
pub fn frame_waiting(stream: &std::net::TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut head = [0u8; 4 + 64];
    // SAFETY: a valid socket and a buffer of the length given; MSG_PEEK
    // leaves the bytes in the socket, MSG_DONTWAIT never blocks.
    let n = unsafe {
        libc::recv(stream.as_raw_fd(), head.as_mut_ptr().cast(), head.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    if n < 4 {
        return false;
    }
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    4 + len <= n as usize
}

/// Sends `answer`, its bytes after its frame.
pub fn write_chunk_answer(w: &mut impl Write, buf: &mut Vec<u8>, answer: &ChunkAnswer) -> io::Result<()> {
    match answer {
        ChunkAnswer::Bytes { hit, bytes } => {
            let len = u32::try_from(bytes.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
            write_with_payload(w, buf, &ChunkHead::Bytes { hit: *hit, len }, bytes)
        }
        ChunkAnswer::NotFound => write_frame(w, buf, &ChunkHead::NotFound),
        ChunkAnswer::Failed(why) => write_frame(w, buf, &ChunkHead::Failed(why.clone())),
    }
}

/// The most [`send_file`] hands the kernel in one call.
pub const SEND_SLICE: usize = 256 << 10;

/// Sends the frame of a [`ChunkAnswer::Bytes`] of `len` bytes, for a
/// sender that sends the bytes themselves some other way ([`send_file`]).
pub fn write_chunk_head(w: &mut impl Write, buf: &mut Vec<u8>, hit: bool, len: u32) -> io::Result<()> {
    write_frame(w, buf, &ChunkHead::Bytes { hit, len })
}

/// Sends bytes `off..off + len` of `file` on `stream` with `sendfile`:
/// the kernel moves them from the page cache to the socket without a copy
/// through this process. `len` on success; `TimedOut` once `deadline` has
/// passed with bytes left to send. A socket's write timeout does not do
/// that: it bounds a wait with no progress, so one `sendfile` to a client
/// that keeps taking a few bytes at a time goes on for as long as the
/// client likes. The bytes go [`SEND_SLICE`] at a time, the deadline
/// looked at between slices.
pub fn send_file(
    stream: &std::net::TcpStream,
    file: &std::fs::File,
    off: u64,
    len: usize,
    deadline: std::time::Instant,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut at = libc::off_t::try_from(off).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut left = len;
    // Bounded: every round sends at least a byte or returns, and the
    // rounds end at the deadline.
    while left > 0 {
        if std::time::Instant::now() > deadline {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the client took too long to read a chunk"));
        }
        // SAFETY: two valid descriptors, and `at` a valid offset the call
        // advances by what it sent.
        let n = unsafe { libc::sendfile(stream.as_raw_fd(), file.as_raw_fd(), &mut at, left.min(SEND_SLICE)) };
        match n {
            n if n > 0 => left -= n as usize,
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file ended before the chunk")),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(len)
}

/// Reads a [`ChunkAnswer`], its bytes included.
pub fn read_chunk_answer(r: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<ChunkAnswer> {
    Ok(match read_frame::<ChunkHead>(r, buf)? {
        ChunkHead::Bytes { hit, len } => ChunkAnswer::Bytes { hit, bytes: read_payload(r, len)? },
        ChunkHead::NotFound => ChunkAnswer::NotFound,
        ChunkHead::Failed(why) => ChunkAnswer::Failed(why),
    })
}

/// Reads the [`Welcome`] that answers a hello. A server that speaks TLS
/// answers a clear-text hello with a TLS alert record: said so.
pub fn read_welcome(r: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<Welcome> {
    let mut head = [0u8; 4];
    r.read_exact(&mut head)?;
    // A TLS record: content type alert (21), then version 3.x.
    if head[..2] == [0x15, 0x03] {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the server speaks TLS: give --tls-ca or --tls-fingerprint",
        ));
    }
    read_frame(&mut Read::chain(&head[..], r), buf)
}

/// The encoding of every frame.
fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME>()
}

/// How much memory the lengths inside a frame may claim, as a multiple of
/// the frame's own bytes: a list of small items takes more room decoded
/// than on the wire (an empty name is one byte there and 24 in memory),
/// but never this much more.
pub const CLAIM_FACTOR: usize = 64;

/// Decodes a frame of `buf.len()` bytes. What its lengths claim for a
/// `Vec` or a `String` is refused before it is allocated past the first
/// power of two from 4 KiB that holds [`CLAIM_FACTOR`] times the frame (at
/// most [`MAX_FRAME`]): a frame of a few bytes that claims 16 MiB is
/// garbled, and allocates nothing of it.
fn decode_frame<T: bincode::Decode<()>>(buf: &[u8]) -> Result<(T, usize), bincode::error::DecodeError> {
    macro_rules! limited {
        ($($limit:expr),*) => {{
            let want = buf.len().saturating_mul(CLAIM_FACTOR);
            $(if want <= $limit {
                return bincode::decode_from_slice(buf, bincode::config::standard().with_limit::<{ $limit }>());
            })*
            bincode::decode_from_slice(buf, config())
        }};
    }
    limited!(
        4 << 10,
        8 << 10,
        16 << 10,
        32 << 10,
        64 << 10,
        128 << 10,
        256 << 10,
        512 << 10,
        1 << 20,
        2 << 20,
        4 << 20,
        8 << 20
    )
}

/// The length of a hello frame from its 4-byte head, refused (as
/// `InvalidData`) past [`HELLO_MAX`].
pub fn hello_len(head: [u8; 4]) -> io::Result<usize> {
    let len = u32::from_le_bytes(head) as usize;
    if len > HELLO_MAX {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a hello of {len} bytes is too large")));
    }
    Ok(len)
}

/// Decodes a [`Hello`] from the `frame` [`hello_len`] allowed, claiming
/// no more than [`HELLO_MAX`] bytes for its token and branch.
pub fn decode_hello(frame: &[u8]) -> io::Result<Hello> {
    let config = bincode::config::standard().with_limit::<HELLO_MAX>();
    match bincode::decode_from_slice(frame, config) {
        Ok((hello, used)) if used == frame.len() => Ok(hello),
        _ => Err(io::Error::new(io::ErrorKind::InvalidData, "a garbled hello")),
    }
}

/// Sends `hello` as its frame, refused here (`InvalidInput`) if it is
/// larger than a server reads (a token of kilobytes).
pub fn write_hello(w: &mut impl Write, buf: &mut Vec<u8>, hello: &Hello) -> io::Result<()> {
    encode_frame(buf, hello)?;
    if buf.len() - 4 > HELLO_MAX {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "the token and branch name are too long for a hello"));
    }
    w.write_all(buf)
}

/// Reads `len` bytes from `r` onto the end of `buf`, which grows as they
/// arrive: a peer that announces a large frame and sends little costs
/// little. An `UnexpectedEof` error if the stream ends first.
fn read_growing(r: &mut impl Read, buf: &mut Vec<u8>, len: usize) -> io::Result<()> {
    let start = buf.len();
    buf.reserve(len.min(RESERVED_AHEAD));
    r.take(len as u64).read_to_end(buf)?;
    if buf.len() - start != len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "a frame cut short"));
    }
    Ok(())
}

/// Writes `value` as one frame, encoded into `buf` (kept for reuse) and
/// sent with one `write`.
pub fn write_frame<T: bincode::Encode>(w: &mut impl Write, buf: &mut Vec<u8>, value: &T) -> io::Result<()> {
    encode_frame(buf, value)?;
    w.write_all(buf)
}

/// `value` as one frame, its length first, in `buf`.
fn encode_frame<T: bincode::Encode>(buf: &mut Vec<u8>, value: &T) -> io::Result<()> {
    buf.clear();
    buf.extend_from_slice(&[0; 4]);
    bincode::encode_into_std_write(value, buf, config()).map_err(io::Error::other)?;
    let len = buf.len() - 4;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("a frame of {len} bytes is too large")));
    }
    buf[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

/// Reads one frame into `buf` (kept for reuse) and decodes it. A frame
/// that is too large or does not decode is an `InvalidData` error: the
/// connection cannot be trusted after it.
pub fn read_frame<T: bincode::Decode<()>>(r: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<T> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a frame of {len} bytes is too large")));
    }
    buf.clear();
    read_growing(r, buf, len)?;
    match decode_frame(buf) {
        Ok((v, used)) if used == len => Ok(v),
        _ => Err(io::Error::new(io::ErrorKind::InvalidData, "a garbled frame")),
    }
}

/// Reads the `len` raw bytes that follow a frame, into a buffer of their
/// own (handed on as it is).
pub fn read_payload(r: &mut impl Read, len: u32) -> io::Result<Vec<u8>> {
    let len = len as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a payload of {len} bytes is too large")));
    }
    let mut data = Vec::new();
    read_growing(r, &mut data, len)?;
    Ok(data)
}

/// Writes `value` as a frame followed by `payload`.
pub fn write_with_payload<T: bincode::Encode>(
    w: &mut impl Write,
    buf: &mut Vec<u8>,
    value: &T,
    payload: &[u8],
) -> io::Result<()> {
    if payload.len() > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a payload of {} bytes is too large", payload.len()),
        ));
    }
    write_frame(w, buf, value)?;
    w.write_all(payload)
}

/// A TCP connection to `addr` (`host:port`, each address it resolves to
/// tried in turn, each within `timeout`), with Nagle off and
/// [`keep_alive`] on: how either kind of framed connection starts.
pub fn dial(addr: &str, timeout: std::time::Duration) -> io::Result<std::net::TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        match std::net::TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                s.set_nodelay(true)?;
                keep_alive(&s);
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no address")))
}

fn set_int(stream: &std::net::TcpStream, level: i32, name: i32, v: i32) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid socket descriptor and a pointer to an int of the
    // size given; a failure leaves the option as it was.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&v as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        );
    }
}

/// Turns on TCP keep-alive so a peer that vanished without closing (a
/// host gone, a cable pulled) is noticed within about 25 s rather than
/// never: a blocked read then fails and the client looks for the owner
/// again.
pub fn keep_alive(stream: &std::net::TcpStream) {
    // A whole 1 MiB write or read fits in the socket's buffers: the sender
    // does not wait for the reader to drain them piece by piece.
    set_int(stream, libc::SOL_SOCKET, libc::SO_SNDBUF, 4 << 20);
    set_int(stream, libc::SOL_SOCKET, libc::SO_RCVBUF, 4 << 20);
    set_int(stream, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set_int(stream, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10);
    set_int(stream, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5);
    set_int(stream, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
}

/// 20,000 frames of garbage from a fixed xorshift stream, each given to
/// `each`: announced lengths from tiny to past the limits, bodies of noise
/// (some starting with a valid variant), and bytes after them. What the
/// tests of every room's frame readers feed them.
#[cfg(test)]
pub(crate) fn garbage_frames(mut each: impl FnMut(&[u8])) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..20_000 {
        let body_len = (next() % 64) as usize;
        let announced = match round % 4 {
            0 => body_len as u32,
            1 => next() as u32,
            _ => (body_len as u32).saturating_add((next() % 3) as u32),
        };
        let mut wire = announced.to_le_bytes().to_vec();
        wire.extend((0..body_len).map(|_| next() as u8));
        wire.extend((0..(next() % 16)).map(|_| next() as u8));
        each(&wire);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_to_a_client_that_reads_a_little_at_a_time_ends_at_its_deadline() {
        use std::io::Write as _;
        let mut file = tempfile::tempfile().expect("file");
        file.write_all(&vec![7u8; 32 << 20]).expect("fill");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client = std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        // Longer than the deadline, and never reached: the client keeps
        // taking bytes, so no wait of the sender's goes without progress.
        server.set_write_timeout(Some(std::time::Duration::from_secs(2))).expect("timeout");
        // A client that takes 4 KiB every 10 ms (32 MiB at this pace takes
        // over a minute).
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut client = client;
                let mut buf = [0u8; 4096];
                for _ in 0..10_000 {
                    if stop.load(std::sync::atomic::Ordering::SeqCst) || matches!(client.read(&mut buf), Ok(0) | Err(_))
                    {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            })
        };
        let started = std::time::Instant::now();
        let sent = send_file(&server, &file, 0, 32 << 20, started + std::time::Duration::from_millis(500));
        let took = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        drop(server);
        reader.join().expect("reader");
        let e = sent.expect_err("the whole chunk went to a client reading 400 KiB/s");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(took < std::time::Duration::from_secs(20), "the send went on for {took:?}");
    }

    #[test]
    fn parts_of_chunks_travel_after_their_frames_and_come_back_whole() {
        let seg = arbor_engine::format::SegId { writer: 0xfeed, seq: 9 };
        let ask = ChunkAsk { seg, index: 3, part: Some((4096, 4096)), proved: true };
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 1) as u8).collect();
        let (mut wire, mut buf) = (Vec::new(), Vec::new());
        write_frame(&mut wire, &mut buf, &ask).expect("ask");
        write_chunk_answer(&mut wire, &mut buf, &ChunkAnswer::Bytes { hit: true, bytes: bytes.clone() })
            .expect("bytes");
        write_chunk_answer(&mut wire, &mut buf, &ChunkAnswer::NotFound).expect("not found");
        write_chunk_answer(&mut wire, &mut buf, &ChunkAnswer::Failed("the bucket is down".into())).expect("failed");
        let mut r = &wire[..];
        let mut rbuf = Vec::new();
        assert_eq!(read_frame::<ChunkAsk>(&mut r, &mut rbuf).expect("ask"), ask);
        assert_eq!(read_chunk_answer(&mut r, &mut rbuf).expect("bytes"), ChunkAnswer::Bytes { hit: true, bytes });
        assert_eq!(read_chunk_answer(&mut r, &mut rbuf).expect("not found"), ChunkAnswer::NotFound);
        assert_eq!(
            read_chunk_answer(&mut r, &mut rbuf).expect("failed"),
            ChunkAnswer::Failed("the bucket is down".into())
        );
        assert!(r.is_empty());
        // Bytes cut short are an error, not a shorter part.
        let mut short = Vec::new();
        write_chunk_answer(&mut short, &mut buf, &ChunkAnswer::Bytes { hit: false, bytes: vec![7; 100] })
            .expect("bytes");
        short.truncate(short.len() - 1);
        assert!(read_chunk_answer(&mut &short[..], &mut rbuf).is_err());
    }

    #[test]
    fn a_frame_announced_large_grows_its_buffer_only_as_its_bytes_come() {
        // Announces the largest frame, sends 10 bytes of it.
        let mut wire = (MAX_FRAME as u32).to_le_bytes().to_vec();
        wire.extend_from_slice(&[0; 10]);
        let mut rbuf = Vec::new();
        let err = read_frame::<ChunkAsk>(&mut &wire[..], &mut rbuf).expect_err("cut short");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert!(rbuf.capacity() <= RESERVED_AHEAD, "{} bytes held for 10", rbuf.capacity());
        // A payload the same way.
        let mut data = Vec::new();
        assert!(read_growing(&mut &[7u8; 10][..], &mut data, MAX_FRAME).is_err());
        assert!(data.capacity() <= RESERVED_AHEAD, "{} bytes held for 10", data.capacity());
        // Bytes that do come are all read, however many.
        let big: Vec<u8> = (0..3 * RESERVED_AHEAD as u32 + 5).map(|i| i as u8).collect();
        let mut got = Vec::new();
        read_growing(&mut &big[..], &mut got, big.len()).expect("read");
        assert!(got == big);
    }

    #[test]
    fn a_hello_is_read_only_within_its_size() {
        let hello = Hello { version: VERSION, token: b"s3cret".to_vec(), branch: "main".into() };
        let (mut wire, mut buf) = (Vec::new(), Vec::new());
        write_hello(&mut wire, &mut buf, &hello).expect("hello");
        let len = hello_len([wire[0], wire[1], wire[2], wire[3]]).expect("length");
        let back = decode_hello(&wire[4..4 + len]).expect("decode");
        assert_eq!((back.version, &back.token, &back.branch), (hello.version, &hello.token, &hello.branch));
        // Announced larger than a hello: refused unread.
        assert!(hello_len((HELLO_MAX as u32).to_le_bytes()).is_ok());
        let err = hello_len((HELLO_MAX as u32 + 1).to_le_bytes()).expect_err("too large");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // A token claiming more than a hello holds, trailing bytes, nonsense.
        for bad in [&[5u8, 251, 0xff, 0xff][..], &[5, 0, 0, 9], &[], &[0xff; 16]] {
            assert_eq!(decode_hello(bad).expect_err("garbled").kind(), io::ErrorKind::InvalidData, "{bad:?}");
        }
        // A sender whose token would not fit is told so before sending.
        let long = Hello { token: vec![b'x'; HELLO_MAX], ..hello };
        let mut sent = Vec::new();
        let err = write_hello(&mut sent, &mut buf, &long).expect_err("too long");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(sent.is_empty());
    }

    #[test]
    fn garbage_is_refused_by_every_reader_without_a_panic() {
        let (mut rbuf, mut buf) = (Vec::new(), Vec::new());
        garbage_frames(|wire| {
            let _ = read_chunk_answer(&mut &wire[..], &mut buf);
            let _ = read_frame::<ChunkAsk>(&mut &wire[..], &mut rbuf);
            let _ = read_frame::<Welcome>(&mut &wire[..], &mut rbuf);
            let _ = decode_hello(&wire[4..]);
            assert!(rbuf.capacity() <= RESERVED_AHEAD.max(64 + 4), "{} bytes held", rbuf.capacity());
        });
    }
}
