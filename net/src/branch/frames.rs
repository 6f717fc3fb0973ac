//! A branch's requests and answers on a framed connection (see
//! [`crate::wire::frames`] for the connection, its hello and its frames):
//! after the [`Welcome`](crate::wire::frames::Welcome), any number of
//! [`Request`]s, each answered by one [`Answer`].
//!
//! File data travels after its frame as raw bytes, not inside it: a write
//! goes as a frame naming it and its length, then the bytes, and a reply of
//! bytes the same way ([`write_request`], [`read_request`],
//! [`write_answer`], [`read_answer`]; the frames' own types are private).
//! Neither side then copies a MiB into or out of an encoding buffer: the
//! sender writes the caller's buffer to the socket and the receiver reads
//! the socket into the buffer it hands on.

use crate::branch::owner::{FileOp, Out, Reply, SessionInfo};
use crate::wire::frames::{read_frame, read_payload, write_frame, write_with_payload};
use arbor_engine::volume::RequestTag;
use std::io::{self, Read, Write};

#[derive(Clone, Debug, bincode::Encode, bincode::Decode)]
pub enum Request {
    /// Open a new session (a client mount).
    Session,
    /// One file operation under `session`; `tag` names a request that
    /// changes the branch, so a copy sent again is not applied twice
    /// ([`crate::branch::requests`]).
    Op { session: u64, op: FileOp, tag: Option<RequestTag> },
}

#[derive(Clone, Debug, bincode::Encode, bincode::Decode)]
pub enum Answer {
    Session(SessionInfo),
    Reply(Reply),
    /// The owner does not know the session: open a new one.
    UnknownSession,
}

/// A request as its frame carries it (the same variants in the same order
/// as [`RequestFrame`], which reads it).
#[derive(bincode::Encode)]
enum RequestHead<'a> {
    Session,
    Op {
        session: u64,
        op: &'a FileOp,
        tag: Option<RequestTag>,
    },
    /// `FileOp::Write` under `session`, its `len` bytes following the frame.
    WriteData {
        session: u64,
        ino: u64,
        off: u64,
        len: u32,
        unprivileged: bool,
        append: bool,
        tag: Option<RequestTag>,
    },
}

#[derive(bincode::Decode)]
enum RequestFrame {
    Session,
    Op { session: u64, op: FileOp, tag: Option<RequestTag> },
    WriteData { session: u64, ino: u64, off: u64, len: u32, unprivileged: bool, append: bool, tag: Option<RequestTag> },
}

/// An answer as its frame carries it (as [`AnswerFrame`] reads it).
#[derive(bincode::Encode)]
enum AnswerHead<'a> {
    Session(&'a SessionInfo),
    Reply(&'a Reply),
    UnknownSession,
    /// A reply of bytes (`Ok(Out::Bytes)`): `len` of them follow the frame.
    Data(u32),
}

#[derive(bincode::Decode)]
enum AnswerFrame {
    Session(SessionInfo),
    Reply(Reply),
    UnknownSession,
    Data(u32),
}

/// Sends `req`, a write's data after its frame.
pub fn write_request(w: &mut impl Write, buf: &mut Vec<u8>, req: &Request) -> io::Result<()> {
    match req {
        Request::Op { session, op: FileOp::Write { ino, off, data, unprivileged, append }, tag } => {
            let at = Written { ino: *ino, off: *off, unprivileged: *unprivileged, append: *append };
            write_data(w, buf, *session, *tag, at, data)
        }
        Request::Op { session, op, tag } => write_frame(w, buf, &RequestHead::Op { session: *session, op, tag: *tag }),
        Request::Session => write_frame(w, buf, &RequestHead::Session),
    }
}

/// Where a write goes and who made it (`FileOp::Write` without its data).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    pub ino: u64,
    pub off: u64,
    pub unprivileged: bool,
    /// At the owner's end of the file (`O_APPEND`), not at `off`.
    pub append: bool,
}

impl Written {
    /// The operation that writes `data` here.
    pub fn op(self, data: Vec<u8>) -> FileOp {
        FileOp::Write { ino: self.ino, off: self.off, data, unprivileged: self.unprivileged, append: self.append }
    }
}

/// Sends `FileOp::Write` under `session` straight from the caller's buffer.
pub fn write_data(
    w: &mut impl Write,
    buf: &mut Vec<u8>,
    session: u64,
    tag: Option<RequestTag>,
    at: Written,
    data: &[u8],
) -> io::Result<()> {
    let len = u32::try_from(data.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let Written { ino, off, unprivileged, append } = at;
    write_with_payload(w, buf, &RequestHead::WriteData { session, ino, off, len, unprivileged, append, tag }, data)
}

/// Reads a request, a write's data included.
pub fn read_request(r: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<Request> {
    Ok(match read_frame::<RequestFrame>(r, buf)? {
        RequestFrame::WriteData { session, ino, off, len, unprivileged, append, tag } => {
            let op = FileOp::Write { ino, off, data: read_payload(r, len)?, unprivileged, append };
            Request::Op { session, op, tag }
        }
        RequestFrame::Op { session, op, tag } => Request::Op { session, op, tag },
        RequestFrame::Session => Request::Session,
    })
}

/// Sends `answer`, a reply of bytes after its frame.
pub fn write_answer(w: &mut impl Write, buf: &mut Vec<u8>, answer: &Answer) -> io::Result<()> {
    match answer {
        Answer::Reply(Ok(Out::Bytes(data))) => {
            let len = u32::try_from(data.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
            write_with_payload(w, buf, &AnswerHead::Data(len), data)
        }
        Answer::Reply(reply) => write_frame(w, buf, &AnswerHead::Reply(reply)),
        Answer::Session(info) => write_frame(w, buf, &AnswerHead::Session(info)),
        Answer::UnknownSession => write_frame(w, buf, &AnswerHead::UnknownSession),
    }
}

/// Reads an answer, a reply of bytes included.
pub fn read_answer(r: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<Answer> {
    Ok(match read_frame::<AnswerFrame>(r, buf)? {
        AnswerFrame::Data(len) => Answer::Reply(Ok(Out::Bytes(read_payload(r, len)?))),
        AnswerFrame::Reply(reply) => Answer::Reply(reply),
        AnswerFrame::Session(info) => Answer::Session(info),
        AnswerFrame::UnknownSession => Answer::UnknownSession,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::frames::{MAX_FRAME, RESERVED_AHEAD};

    #[test]
    fn frames_round_trip_and_reuse_their_buffers() {
        let mut wire = Vec::new();
        let mut buf = Vec::new();
        let write = Request::Op {
            session: 7,
            op: FileOp::Write { ino: 3, off: 9, data: vec![0xab; 100_000], unprivileged: false, append: false },
            tag: None,
        };
        write_frame(&mut wire, &mut buf, &write).expect("write");
        write_frame(&mut wire, &mut buf, &Request::Session).expect("write");
        write_frame(&mut wire, &mut buf, &Answer::Reply(Err(libc::ENOENT))).expect("write");
        let mut r = &wire[..];
        let mut rbuf = Vec::new();
        match read_frame::<Request>(&mut r, &mut rbuf).expect("read") {
            Request::Op {
                session: 7,
                op: FileOp::Write { ino: 3, off: 9, data, unprivileged: false, append: false },
                tag: None,
            } => {
                assert_eq!(data, vec![0xab; 100_000])
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(read_frame::<Request>(&mut r, &mut rbuf).expect("read"), Request::Session));
        assert!(matches!(read_frame::<Answer>(&mut r, &mut rbuf).expect("read"), Answer::Reply(Err(libc::ENOENT))));
        assert!(r.is_empty());
        // The end of the stream is an error, not a frame.
        assert!(read_frame::<Answer>(&mut r, &mut rbuf).is_err());
    }

    #[test]
    fn file_data_travels_after_its_frame_and_comes_back_whole() {
        let data: Vec<u8> = (0..1_048_576u32).map(|i| (i * 7 + 3) as u8).collect();
        let (mut wire, mut buf) = (Vec::new(), Vec::new());
        let tag = Some(RequestTag { client: 5, slot: crate::branch::requests::PIPELINED_SLOT, seq: 11 });
        let write = Request::Op {
            session: 7,
            op: FileOp::Write { ino: 3, off: 9, data: data.clone(), unprivileged: true, append: true },
            tag,
        };
        write_request(&mut wire, &mut buf, &write).expect("write");
        // The frame names the write; the bytes follow it raw.
        let frame = u32::from_le_bytes([wire[0], wire[1], wire[2], wire[3]]) as usize;
        assert!(frame < 64, "a {frame}-byte frame");
        assert_eq!(wire.len(), 4 + frame + data.len());
        assert!(wire[4 + frame..] == data[..]);
        write_answer(&mut wire, &mut buf, &Answer::Reply(Ok(Out::Bytes(data.clone())))).expect("answer");
        write_answer(&mut wire, &mut buf, &Answer::Reply(Ok(Out::Bytes(Vec::new())))).expect("empty");
        write_answer(&mut wire, &mut buf, &Answer::Reply(Err(libc::EIO))).expect("errno");
        write_request(&mut wire, &mut buf, &Request::Session).expect("session");
        let mut r = &wire[..];
        let mut rbuf = Vec::new();
        match read_request(&mut r, &mut rbuf).expect("read") {
            // Who wrote it travels in the frame.
            Request::Op {
                session: 7,
                op: FileOp::Write { ino: 3, off: 9, data: got, unprivileged: true, append: true },
                tag: t,
            } => {
                assert!(got == data);
                assert_eq!(t, tag, "the tag travels with the write");
            }
            other => panic!("{other:?}"),
        }
        match read_answer(&mut r, &mut rbuf).expect("read") {
            Answer::Reply(Ok(Out::Bytes(got))) => assert!(got == data),
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(read_answer(&mut r, &mut rbuf).expect("read"), Answer::Reply(Ok(Out::Bytes(b))) if b.is_empty())
        );
        assert!(matches!(read_answer(&mut r, &mut rbuf).expect("read"), Answer::Reply(Err(libc::EIO))));
        assert!(matches!(read_request(&mut r, &mut rbuf).expect("read"), Request::Session));
        assert!(r.is_empty());

        // Data cut short, or announced larger than any frame: refused.
        let mut short = Vec::new();
        write_answer(&mut short, &mut buf, &Answer::Reply(Ok(Out::Bytes(vec![1; 1000])))).expect("answer");
        short.truncate(short.len() - 1);
        assert!(read_answer(&mut &short[..], &mut rbuf).is_err());
        let mut huge = Vec::new();
        write_frame(&mut huge, &mut buf, &AnswerHead::Data(MAX_FRAME as u32 + 1)).expect("frame");
        let err = read_answer(&mut &huge[..], &mut rbuf).expect_err("too large");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn garbage_is_refused_by_every_reader_without_a_panic() {
        let mut rbuf = Vec::new();
        crate::wire::frames::garbage_frames(|wire| {
            let _ = read_request(&mut &wire[..], &mut rbuf);
            let _ = read_answer(&mut &wire[..], &mut rbuf);
            assert!(rbuf.capacity() <= RESERVED_AHEAD.max(64 + 4), "{} bytes held", rbuf.capacity());
        });
    }

    #[test]
    fn a_small_frame_claiming_much_memory_is_refused_and_dense_lists_still_decode() {
        // A 6-byte frame: Answer::Reply(Ok(Out::Message(Ok(String)))) of a
        // string claiming 16 MiB.
        let mut claim = Vec::new();
        write_frame(&mut claim, &mut Vec::new(), &AnswerHead::Reply(&Ok(Out::Message(Ok(String::new())))))
            .expect("write");
        let body_len = claim.len() - 4;
        claim.truncate(claim.len() - 1);
        claim.extend_from_slice(&[253, 0, 0, 0, 1, 0, 0, 0, 0]); // varint u64: 16 MiB
        let n = (claim.len() - 4) as u32;
        claim[..4].copy_from_slice(&n.to_le_bytes());
        assert!(body_len < 8);
        let err = read_answer(&mut &claim[..], &mut Vec::new()).expect_err("claims too much");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // Lists of the smallest items a peer sends decode whatever their
        // count: each is larger in memory than on the wire, by far less
        // than CLAIM_FACTOR.
        let entry = arbor_engine::volume::DirEntryOut {
            ino: 0,
            kind: arbor_engine::volume::FileKind::Regular,
            name: Vec::new(),
            offset: 0,
        };
        let span = crate::branch::owner::Span { at: 0, len: 0, extent: None };
        let replies = [
            Out::Names(vec![Vec::new(); 100_000]),
            Out::Entries(vec![entry; 50_000]),
            Out::Slots(vec![(0, 0); 50_000]),
            Out::Located(crate::branch::owner::Located { size: 0, end: 0, spans: vec![span; 50_000] }),
        ];
        for out in replies {
            let (mut wire, mut buf) = (Vec::new(), Vec::new());
            write_answer(&mut wire, &mut buf, &Answer::Reply(Ok(out.clone()))).expect("write");
            let back = read_answer(&mut &wire[..], &mut buf).unwrap_or_else(|e| panic!("{e}: {out:?}"));
            assert!(matches!(back, Answer::Reply(Ok(_))));
        }
    }

    #[test]
    fn oversized_truncated_and_garbled_frames_are_refused() {
        let mut rbuf = Vec::new();
        let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
        let err = read_frame::<Request>(&mut &huge[..], &mut rbuf).expect_err("too large");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // Announces 10 bytes, has 3.
        let short = [10u8, 0, 0, 0, 1, 2, 3];
        assert!(read_frame::<Request>(&mut &short[..], &mut rbuf).is_err());
        // A variant that does not exist.
        let bad = [1u8, 0, 0, 0, 99];
        let err = read_frame::<Request>(&mut &bad[..], &mut rbuf).expect_err("garbled");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // Trailing bytes inside a frame.
        let mut wire = Vec::new();
        write_frame(&mut wire, &mut Vec::new(), &Request::Session).expect("write");
        wire.push(0);
        wire[0] += 1;
        assert!(read_frame::<Request>(&mut &wire[..], &mut rbuf).is_err());
    }
}
