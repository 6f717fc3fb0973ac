//! Shared branches in one process: an owner (`SharedBranch` behind a
//! `CacheServer` on 127.0.0.1) over a volume on a device that can lose
//! its unsynced bytes, and `BranchClient` clients. What the end-to-end tests
//! cannot force: an owner that loses acknowledged writes in a crash.

use arbor_engine::device::{CrashMode, SimDevice};
use arbor_engine::env::TestEnv;
use arbor_engine::files::Files;
use arbor_engine::volume::{Config, Place, RenameMode, RequestTag, Volume, ROOT_INO};
use arbor_net::branch::owner::{Event, FileOp, Out};
use arbor_net::{BranchClient, BranchClientOptions, CacheServer, Policy, Running, ServerOptions, SharedBranch};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

const TOKEN: &str = "t0k";

fn cfg() -> Config {
    Config { commit_interval: None, segment_size: 1 << 20, env: TestEnv::new(3), ..Config::default() }
}

/// An owner of branch `main` over `dev`, on a port of its own.
fn owner(dev: &SimDevice) -> (Arc<Volume>, Running) {
    let vol = Volume::open(Arc::new(dev.clone()), cfg()).expect("open");
    let running = serve(&vol);
    (vol, running)
}

/// `vol` served as branch `main`, on a port of its own.
fn serve(vol: &Arc<Volume>) -> Running {
    serve_branch(vol).1
}

/// The lock grace period of the owners here: long enough for a client to
/// take its locks back, short enough to wait out.
const GRACE: Duration = Duration::from_secs(2);

/// [`serve`], and the branch it serves.
fn serve_branch(vol: &Arc<Volume>) -> (Arc<SharedBranch>, Running) {
    let branch = SharedBranch::new("main", vol.clone(), None, Policy::default());
    branch.set_lock_grace(GRACE);
    let server =
        CacheServer::owner(None, vec![branch.clone()], ServerOptions { token: TOKEN.into(), ..Default::default() });
    (branch, server.spawn("127.0.0.1:0").expect("serve"))
}

/// Where clients find the owner: `server` now, changed by a test that
/// moves the owner.
fn found_at(server: &Running) -> Arc<Mutex<String>> {
    Arc::new(Mutex::new(server.addr.to_string()))
}

/// A client finding the owner at whatever `at` holds, reading every
/// file's bytes through it.
fn client(at: &Arc<Mutex<String>>) -> BranchClient {
    client_over(at, None)
}

/// A client that reads the bytes the owner locates from `segments` itself.
fn reading_client(at: &Arc<Mutex<String>>, segments: SimDevice) -> BranchClient {
    client_over(at, Some(Arc::new(segments)))
}

fn client_over(at: &Arc<Mutex<String>>, segments: Option<Arc<dyn arbor_engine::device::Device>>) -> BranchClient {
    let at = at.clone();
    BranchClient::connect(BranchClientOptions {
        branch: "main".into(),
        token: TOKEN.into(),
        locate: Arc::new(move || Some(at.lock().clone())),
        timeout: Some(Duration::from_secs(20)),
        segments,
        tls: None,
    })
    .expect("connect")
}

/// Power loss under the owner, and a new owner process on the same device.
fn crash_and_restart(dev: &SimDevice, old: (Arc<Volume>, Running), at: &Arc<Mutex<String>>) -> (Arc<Volume>, Running) {
    dev.crash(CrashMode::DropUnsynced);
    drop(old);
    let new = owner(dev);
    *at.lock() = new.1.addr.to_string();
    new
}

#[test]
fn writes_the_owner_lost_fail_the_next_fsync_and_are_never_sent_again() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    let f = c.create_open(ROOT_INO, b"ckpt", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.write(f.ino, 0, b"durable|").expect("write");
    c.fsync(f.ino).expect("fsync");
    // Acknowledged by the owner, not yet synced: the crash takes it. (A
    // write returns once sent; any other operation waits for its answer.)
    c.write(f.ino, 8, b"acknowledged").expect("write");
    assert_eq!(c.getattr(f.ino).expect("getattr").size, 20);
    assert_eq!(c.unsynced_requests(), 1);

    let (vol, _server) = crash_and_restart(&dev, first, &at);
    assert_eq!(vol.read(f.ino, 0, 100).expect("read"), b"durable|", "the crash lost the unsynced write");
    // The client's next fsync reaches the new owner, which lacks the
    // write: the fsync says so, and the write is not sent again (another
    // client could have written there since).
    assert_eq!(c.fsync(f.ino).map_err(|e| e.errno()), Err(libc::EIO));
    assert_eq!(c.unsynced_requests(), 0);
    assert_eq!(c.read(f.ino, 0, 100).expect("read"), b"durable|");
    assert_eq!(vol.read(f.ino, 0, 100).expect("read"), b"durable|");
    // Reported once; the file goes on from what is durable.
    c.write(f.ino, 8, b"again").expect("write");
    c.fsync(f.ino).expect("fsync");
    assert_eq!(vol.read(f.ino, 0, 100).expect("read"), b"durable|again");
    assert!(c.stats().sessions >= 2);
}

#[test]
fn a_lost_rename_fails_the_next_fsync_of_its_folder() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    let f = c.create_open(ROOT_INO, b"ckpt.tmp", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.write(f.ino, 0, b"body").expect("write");
    c.fsync(f.ino).expect("fsync");
    c.rename(ROOT_INO, b"ckpt.tmp", ROOT_INO, b"ckpt", RenameMode::Plain).expect("rename");
    let (vol, _server) = crash_and_restart(&dev, first, &at);
    assert!(vol.lookup(ROOT_INO, b"ckpt.tmp").is_ok(), "the crash took the rename");
    // The directory's fsync must not say the rename is durable.
    assert_eq!(c.fsync(ROOT_INO).map_err(|e| e.errno()), Err(libc::EIO));
    c.fsync(ROOT_INO).expect("reported once to each file");
}

#[test]
fn what_a_crashed_owner_made_durable_is_not_applied_again() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    let f = c.create_open(ROOT_INO, b"a", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.write(f.ino, 0, b"x").expect("write");
    c.unlink(ROOT_INO, b"a").expect("unlink");
    c.fsync(ROOT_INO).expect("fsync");
    c.mkdir(ROOT_INO, b"d", 0o755, 0, 0).expect("mkdir");
    first.0.sync_all().expect("the owner syncs on its own");
    let (vol, _server) = crash_and_restart(&dev, first, &at);
    assert!(vol.lookup(ROOT_INO, b"d").is_ok());
    // Nothing was lost: the owner's own sync covered the mkdir.
    c.fsync(ROOT_INO).expect("fsync after the restart");
    assert_eq!(c.unsynced_requests(), 0);
}

#[test]
fn a_file_the_owner_lost_fails_its_fsync_and_its_reads() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    let kept = c.create_open(ROOT_INO, b"kept", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.fsync(kept.ino).expect("fsync");
    // Made and written, never synced: gone with the crash.
    let lost = c.create_open(ROOT_INO, b"lost", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.write(lost.ino, 0, b"never synced").expect("write");
    assert_eq!(c.getattr(lost.ino).expect("getattr").size, 12);

    let (_vol, _server) = crash_and_restart(&dev, first, &at);
    assert_eq!(c.fsync(lost.ino).map_err(|e| e.errno()), Err(libc::EIO), "its fsync must not say durable");
    assert_eq!(c.read(lost.ino, 0, 10).map_err(|e| e.errno()), Err(libc::EIO));
    assert_eq!(c.lookup(ROOT_INO, b"lost").map_err(|e| e.errno()), Err(libc::ENOENT));
    // A file made anew may get the lost one's number; it is a new file.
    let again = c.create_open(ROOT_INO, b"again", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.write(again.ino, 0, b"new").expect("write");
    c.fsync(again.ino).expect("fsync");
    assert_eq!(c.read(again.ino, 0, 10).expect("read"), b"new");
    c.fsync(kept.ino).expect("the kept file syncs");
}

#[test]
fn other_sessions_hear_of_changes_and_not_of_their_own() {
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let b = SharedBranch::new("main", vol, None, Policy::default());
    let (s1, s2) = (b.open_session().expect("session"), b.open_session().expect("session"));
    let made =
        b.apply(s1.session, FileOp::Mkdir { parent: ROOT_INO, name: b"d".to_vec(), perm: 0o755, uid: 0, gid: 0 });
    let Ok(Out::Attr(d)) = made else { panic!("mkdir: {made:?}") };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    let heard = rt.block_on(b.events(s2.session, s2.seq, Duration::from_millis(10)));
    assert_eq!(heard.items, vec![Event::Entry(ROOT_INO, b"d".to_vec()), Event::Inode(ROOT_INO)]);
    let own = rt.block_on(b.events(s1.session, s1.seq, Duration::from_millis(10)));
    assert!(own.items.is_empty(), "{own:?}");
    // A rename names both places and the inode moved.
    let _ = b.apply(
        s2.session,
        FileOp::Rename {
            parent: ROOT_INO,
            name: b"d".to_vec(),
            new_parent: ROOT_INO,
            new_name: b"e".to_vec(),
            mode: arbor_engine::RenameMode::Plain,
        },
    );
    let heard = rt.block_on(b.events(s1.session, heard.next, Duration::from_millis(10)));
    for e in [Event::Entry(ROOT_INO, b"d".to_vec()), Event::Entry(ROOT_INO, b"e".to_vec()), Event::Inode(d.ino)] {
        assert!(heard.items.contains(&e), "{e:?} missing from {:?}", heard.items);
    }
}

#[test]
fn a_dropped_session_gives_back_its_open_files_and_locks() {
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let b = SharedBranch::new("main", vol.clone(), None, Policy::default());
    let (s1, s2) = (b.open_session().expect("session"), b.open_session().expect("session"));
    let Ok(Out::Attr(f)) = b.apply(
        s1.session,
        FileOp::CreateOpen { parent: ROOT_INO, name: b"f".to_vec(), mode: 0o100644, uid: 0, gid: 0 },
    ) else {
        panic!("create")
    };
    let all = arbor_engine::files::Lock { start: 0, end: u64::MAX, typ: libc::F_WRLCK, pid: 1 };
    assert!(b.try_lock(s1.session, f.ino, 7, all).is_ok());
    assert_eq!(b.try_lock(s2.session, f.ino, 9, all).err(), Some(libc::EAGAIN));
    // Unlinked while s1 has it open: still there for s1.
    assert!(b.apply(s2.session, FileOp::Unlink { parent: ROOT_INO, name: b"f".to_vec() }).is_ok());
    assert!(vol.getattr(f.ino).is_ok());
    // s1 goes quiet; s2 keeps being heard from.
    std::thread::sleep(Duration::from_millis(300));
    assert!(b.touch(s2.session));
    b.reap_idle(Duration::from_millis(200));
    assert_eq!(b.sessions(), 1);
    assert_eq!(b.locks(), 0);
    assert!(b.try_lock(s2.session, f.ino, 9, all).is_ok(), "the lock went with its session");
    assert!(vol.getattr(f.ino).is_err(), "the unlinked file went with its last opener");
}

/// Opens a framed connection and says hello with `token` for `branch`.
fn hello(
    addr: std::net::SocketAddr,
    token: &str,
    branch: &str,
) -> (std::net::TcpStream, arbor_net::wire::frames::Welcome) {
    use arbor_net::wire::frames::{read_frame, write_frame, Hello, MAGIC, VERSION};
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.write_all(&MAGIC).expect("magic");
    let h = Hello { version: VERSION, token: token.as_bytes().to_vec(), branch: branch.into() };
    write_frame(&mut s, &mut Vec::new(), &h).expect("hello");
    let w = read_frame(&mut s, &mut Vec::new()).expect("welcome");
    (s, w)
}

#[test]
fn the_framed_wire_answers_only_the_token_and_a_served_branch() {
    use arbor_net::branch::frames::{Answer, Request};
    use arbor_net::wire::frames::{read_frame, write_frame, Welcome};
    let dev = SimDevice::new();
    let (vol, server) = owner(&dev);
    vol.create(ROOT_INO, b"secret", libc::S_IFREG | 0o600, 0, 0, 0).expect("create");

    // A wrong token: refused, and the connection answers nothing more.
    let (mut s, w) = hello(server.addr, "t0j", "main");
    assert_eq!(w, Welcome::Refused);
    let _ = write_frame(&mut s, &mut Vec::new(), &Request::Session);
    assert!(read_frame::<Answer>(&mut s, &mut Vec::new()).is_err(), "closed after a refusal");
    // The right token for a branch not served here.
    assert_eq!(hello(server.addr, TOKEN, "other").1, Welcome::NoBranch);

    // The right token: a session, and operations under it; an operation
    // under a session the owner never gave is refused.
    let (mut s, w) = hello(server.addr, TOKEN, "main");
    assert_eq!(w, Welcome::Ok);
    let (mut r, mut b) = (Vec::new(), Vec::new());
    write_frame(
        &mut s,
        &mut b,
        &Request::Op { session: 42, op: FileOp::Lookup { parent: ROOT_INO, name: b"secret".to_vec() }, tag: None },
    )
    .expect("send");
    assert!(matches!(read_frame::<Answer>(&mut s, &mut r).expect("answer"), Answer::UnknownSession));
    write_frame(&mut s, &mut b, &Request::Session).expect("send");
    let Answer::Session(info) = read_frame::<Answer>(&mut s, &mut r).expect("answer") else { panic!("no session") };
    write_frame(
        &mut s,
        &mut b,
        &Request::Op {
            session: info.session,
            op: FileOp::Lookup { parent: ROOT_INO, name: b"secret".to_vec() },
            tag: None,
        },
    )
    .expect("send");
    assert!(matches!(read_frame::<Answer>(&mut s, &mut r).expect("answer"), Answer::Reply(Ok(Out::Attr(_)))));
    write_frame(
        &mut s,
        &mut b,
        &Request::Op {
            session: info.session,
            op: FileOp::Lookup { parent: ROOT_INO, name: b"missing".to_vec() },
            tag: None,
        },
    )
    .expect("send");
    assert!(matches!(read_frame::<Answer>(&mut s, &mut r).expect("answer"), Answer::Reply(Err(libc::ENOENT))));

    // A garbled frame ends the connection; the server serves on.
    use std::io::Write;
    s.write_all(&[3, 0, 0, 0, 0xff, 0xff, 0xff]).expect("send");
    assert!(read_frame::<Answer>(&mut s, &mut r).is_err());
    assert_eq!(hello(server.addr, TOKEN, "main").1, Welcome::Ok);
    // Stopping the server closes the connections it serves.
    let (mut idle, _) = hello(server.addr, TOKEN, "main");
    drop(server);
    assert!(read_frame::<Answer>(&mut idle, &mut r).is_err());
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed).collect()
}

/// Writes `data` from offset 0 in 1 MiB writes, each answered at once (on
/// its way to the owner, not applied yet).
fn write_in_mib(c: &BranchClient, ino: u64, data: &[u8]) {
    for (i, piece) in data.chunks(1 << 20).enumerate() {
        assert_eq!(c.write(ino, (i << 20) as u64, piece).expect("write"), piece.len());
    }
}

/// Reads through a buffer filled with junk first, as a FUSE answer's is:
/// holes must come back as zeros all the same.
fn read_all(c: &BranchClient, ino: u64, len: usize, piece: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = vec![0xeeu8; piece];
    while out.len() < len {
        buf.fill(0xee);
        let n = c.read_into(ino, out.len() as u64, &mut buf).expect("read");
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    out
}

#[test]
fn a_client_reads_located_bytes_itself_and_locates_again_after_every_change() {
    let dev = SimDevice::new();
    let (_vol, server) = owner(&dev);
    let at = found_at(&server);
    let writer = client(&at);
    let reader = reading_client(&at, dev.clone());

    // 3 MiB in 1 MiB segments, with a hole in the middle of it.
    let want = pattern(3 << 20, 1);
    let f = writer.create_open(ROOT_INO, b"data", libc::S_IFREG | 0o644, 0, 0).expect("create");
    for (i, piece) in want.chunks(256 << 10).enumerate() {
        if i != 5 {
            writer.write(f.ino, (i * (256 << 10)) as u64, piece).expect("write");
        }
    }
    writer.fsync(f.ino).expect("fsync");
    let mut want = want;
    want[5 * (256 << 10)..6 * (256 << 10)].fill(0);

    reader.open(f.ino).expect("open");
    // Reads not on block boundaries, across extents and the hole.
    assert!(read_all(&reader, f.ino, want.len(), 100_000) == want, "bytes read from the segments");
    let s = reader.stats();
    assert_eq!((s.owner_reads, s.direct_failed, s.locates), (0, 0, 1), "{s:?}");
    assert_eq!(s.direct_bytes, want.len() as u64);
    // Past the end: nothing, and still no trip to the owner for bytes.
    assert!(reader.read(f.ino, want.len() as u64 + 10, 4096).expect("read past the end").is_empty());

    // Another node changes the file; this one's next open locates anew.
    writer.write(f.ino, 4096, b"changed by the writer").expect("write");
    writer.flush(f.ino).expect("close");
    reader.open(f.ino).expect("open again");
    want[4096..4096 + 21].copy_from_slice(b"changed by the writer");
    assert!(read_all(&reader, f.ino, want.len(), 1 << 20) == want, "close-to-open");
    assert_eq!(reader.stats().locates, 2);

    // Its own write and its own truncation are seen at once.
    reader.write(f.ino, 0, b"own").expect("write");
    want[..3].copy_from_slice(b"own");
    assert_eq!(reader.read(f.ino, 0, 8).expect("read"), &want[..8]);
    let change = arbor_engine::SetAttr { size: Some(5000), ..Default::default() };
    reader.setattr(f.ino, change).expect("truncate");
    assert!(read_all(&reader, f.ino, 1 << 20, 1 << 20) == want[..5000]);

    // Bytes only the owner holds (a small file lives inline in the tree).
    let small = writer.create_open(ROOT_INO, b"small", libc::S_IFREG | 0o644, 0, 0).expect("create");
    writer.write(small.ino, 0, b"inline").expect("write");
    writer.flush(small.ino).expect("close");
    let before = reader.stats().owner_reads;
    assert_eq!(reader.read(small.ino, 0, 100).expect("read"), b"inline");
    assert_eq!(reader.stats().owner_reads, before + 1);
    assert_eq!(reader.stats().direct_failed, 0);
}

#[test]
fn segments_this_client_cannot_read_are_read_from_the_owner() {
    let dev = SimDevice::new();
    let (vol, server) = owner(&dev);
    let at = found_at(&server);
    let writer = client(&at);
    let want = pattern(2 << 20, 7);
    let f = writer.create_open(ROOT_INO, b"data", libc::S_IFREG | 0o644, 0, 0).expect("create");
    writer.write(f.ino, 0, &want).expect("write");
    writer.fsync(f.ino).expect("fsync");

    // A device without the owner's segments: as if compaction had deleted them.
    let elsewhere = reading_client(&at, SimDevice::new());
    elsewhere.open(f.ino).expect("open");
    assert!(read_all(&elsewhere, f.ino, want.len(), 1 << 20) == want);
    let s = elsewhere.stats();
    assert!(s.direct_failed > 0 && s.owner_bytes == want.len() as u64 && s.direct_bytes == 0, "{s:?}");

    // A block that fails its crc on the disk: an error, never other bytes.
    let located = vol.locate(f.ino, 0, 4096, 1).expect("locate");
    let Some((0, Place::Log(e))) = located.places.first().cloned() else { panic!("{located:?}") };
    dev.corrupt(e.data.seg, (e.data.off + e.rec_off) as usize + 100);
    let reader = reading_client(&at, dev.clone());
    reader.open(f.ino).expect("open");
    assert_eq!(reader.read(f.ino, 0, 4096).map_err(|e| e.errno()), Err(libc::EIO));
    assert_eq!(reader.stats().direct_failed, 1);
    // The blocks after it are whole, and still read from the segments.
    assert_eq!(reader.read(f.ino, 4096, 4096).expect("read"), &want[4096..8192]);
    assert!(reader.stats().direct_bytes >= 4096);
}

#[test]
fn writes_in_flight_keep_their_order_and_report_refusals_at_fsync_and_close() {
    let dev = SimDevice::new();
    let (vol, server) = owner(&dev);
    let at = found_at(&server);
    let c = client(&at);
    let other = client(&at);
    let f = c.create_open(ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, 0).expect("create");

    // Many writes on their way at once (more than a lane holds), then a
    // truncation and overlapping writes: every later operation sees every
    // write before it, in the order they were made.
    let want = pattern(24 << 20, 3);
    write_in_mib(&c, f.ino, &want);
    assert_eq!(c.getattr(f.ino).expect("getattr").size, want.len() as u64);
    let change = arbor_engine::SetAttr { size: Some(10), ..Default::default() };
    c.setattr(f.ino, change).expect("truncate");
    c.write(f.ino, 2, b"aaaa").expect("write");
    c.write(f.ino, 4, b"bb").expect("write");
    let mut head = want[..10].to_vec();
    head[2..6].copy_from_slice(b"aabb");
    assert_eq!(c.read(f.ino, 0, 100).expect("read"), head);

    // Another client sees them once this one closed the file.
    c.write(f.ino, 0, b"zz").expect("write");
    c.flush(f.ino).expect("close");
    head[..2].copy_from_slice(b"zz");
    assert_eq!(other.read(f.ino, 0, 100).expect("read"), head);
    assert_eq!(vol.read(f.ino, 0, 100).expect("read"), head);

    // A write the owner refuses (here: to a directory) returns at once and
    // is reported by the file's next fsync, once; or by its close.
    let d = c.mkdir(ROOT_INO, b"d", 0o755, 0, 0).expect("mkdir");
    c.write(d.ino, 0, b"x").expect("a write on its way");
    assert_eq!(c.fsync(d.ino).map_err(|e| e.errno()), Err(libc::EISDIR));
    c.fsync(d.ino).expect("reported once");
    c.write(d.ino, 0, b"x").expect("a write on its way");
    assert_eq!(c.flush(d.ino).map_err(|e| e.errno()), Err(libc::EISDIR));
    c.flush(d.ino).expect("reported once");
    assert_eq!(c.unsynced_requests(), 0, "a refused write is not kept");

    // A write past the largest file is refused at once, as a local mount refuses it.
    let max = arbor_engine::volume::MAX_FILE_SIZE;
    assert_eq!(c.write(f.ino, max - 1, b"xy").map_err(|e| e.errno()), Err(libc::EFBIG));
    c.fsync(f.ino).expect("fsync");
    assert_eq!(vol.read(f.ino, 0, 100).expect("read"), head);
}

#[test]
fn writes_in_flight_when_the_owner_stops_cleanly_are_drained_never_sent_to_the_next_one() {
    let dev = SimDevice::new();
    let vol = Volume::open(Arc::new(dev.clone()), cfg()).expect("open");
    let first = serve(&vol);
    let at = found_at(&first);
    let c = client(&at);
    let f = c.create_open(ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, 0).expect("create");
    // More than two lanes hold: writes are still on their way when the
    // owner stops. A clean stop drains its connections: it reads, applies
    // and answers what was sent before it closes them.
    let want = pattern(24 << 20, 9);
    write_in_mib(&c, f.ino, &want);
    drop(first);
    // The answers are there to read: the close confirms every write
    // without the owner (and does not wait for it to come back).
    c.flush(f.ino).expect("close after a clean stop");
    // The same volume served again (a new epoch, a new address): the
    // client asks which of its requests the owner has, sends nothing
    // again, and the fsync covers every write.
    let second = serve(&vol);
    *at.lock() = second.addr.to_string();
    c.fsync(f.ino).expect("a clean stop lost writes in flight");
    let got = vol.read(f.ino, 0, want.len()).expect("read");
    assert!(got == want, "the file after a clean stop is not every write, in order");
    assert!(read_all(&c, f.ino, got.len(), 1 << 20) == got);
    assert_eq!(c.unsynced_requests(), 0);
}

#[test]
fn threads_waiting_for_their_owner_share_each_lookup_of_it() {
    let dev = SimDevice::new();
    let (vol, running) = owner(&dev);
    let addr = running.addr.to_string();
    let lookups = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = lookups.clone();
    let c = BranchClient::connect(BranchClientOptions {
        branch: "main".into(),
        token: TOKEN.into(),
        locate: Arc::new(move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(addr.clone())
        }),
        timeout: Some(Duration::from_secs(2)),
        segments: None,
        tls: None,
    })
    .expect("connect");
    c.getattr(ROOT_INO).expect("getattr");
    let before = lookups.load(std::sync::atomic::Ordering::Relaxed);
    assert!(before >= 1);
    drop(running);
    drop(vol);
    // The owner is gone and four threads wait for it: each tries again
    // every 250 ms at most, but where the owner is (a request to the
    // bucket, for a client that finds its owner there) is asked once for
    // all of them, after 50 ms, 100 ms, … up to every 2 s.
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| assert!(c.getattr(ROOT_INO).is_err(), "an owner that is gone answered"));
        }
    });
    let during = lookups.load(std::sync::atomic::Ordering::Relaxed) - before;
    let st = c.stats();
    assert!(st.retries >= 8, "{} tries in 2 s by four threads", st.retries);
    assert!(during <= 8, "{during} lookups of the owner in 2 s of outage ({} tries)", st.retries);
    assert_eq!(st.owner_lookups, before + during);
}

/// Sends `op` as request `tag` under a new session of `addr`'s owner, on a
/// connection of its own, and returns the owner's answer.
fn tagged_request(addr: std::net::SocketAddr, op: FileOp, tag: RequestTag) -> arbor_net::branch::frames::Answer {
    use arbor_net::branch::frames::{write_request, Answer, Request};
    use arbor_net::wire::frames::{read_frame, Welcome};
    let (mut s, w) = hello(addr, TOKEN, "main");
    assert_eq!(w, Welcome::Ok);
    let (mut r, mut b) = (Vec::new(), Vec::new());
    write_request(&mut s, &mut b, &Request::Session).expect("send");
    let Answer::Session(info) = read_frame::<Answer>(&mut s, &mut r).expect("answer") else { panic!("no session") };
    write_request(&mut s, &mut b, &Request::Op { session: info.session, op, tag: Some(tag) }).expect("send");
    read_frame::<Answer>(&mut s, &mut r).expect("answer")
}

#[test]
fn a_request_sent_again_after_a_lost_reply_is_answered_not_applied_again() {
    use arbor_net::branch::frames::Answer;
    let dev = SimDevice::new();
    let (vol, server) = owner(&dev);
    vol.create(ROOT_INO, b"x", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    let unlink = FileOp::Unlink { parent: ROOT_INO, name: b"x".to_vec() };
    let tag = RequestTag { client: 77, slot: 3, seq: 1 };
    assert!(matches!(tagged_request(server.addr, unlink.clone(), tag), Answer::Reply(Ok(Out::Unit))));
    // Another client makes a new `x`; the first copy's reply was lost, so
    // the request comes again on another connection: it gets the first
    // answer, and the new `x` stays.
    let new_x = vol.create(ROOT_INO, b"x", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    assert!(matches!(tagged_request(server.addr, unlink.clone(), tag), Answer::Reply(Ok(Out::Unit))));
    assert_eq!(vol.lookup(ROOT_INO, b"x").expect("the new x").ino, new_x.ino);
    // An O_EXCL create sent twice succeeds once, and its copy says so too.
    let excl = FileOp::Mkdir { parent: ROOT_INO, name: b"lock".to_vec(), perm: 0o755, uid: 0, gid: 0 };
    let tag2 = RequestTag { client: 77, slot: 4, seq: 1 };
    assert!(matches!(tagged_request(server.addr, excl.clone(), tag2), Answer::Reply(Ok(Out::Attr(_)))));
    assert!(matches!(tagged_request(server.addr, excl.clone(), tag2), Answer::Reply(Ok(Out::Attr(_)))));
    // The next request on the slot is a new one: applied, and refused.
    let next = RequestTag { seq: 2, ..tag2 };
    assert!(matches!(tagged_request(server.addr, excl, next), Answer::Reply(Err(libc::EEXIST))));

    // After a crash and a new owner, what the old one made durable is still
    // answered, not applied: the tags are in the branch's state.
    vol.sync_all().expect("sync");
    let (vol2, server2) = {
        let at = Arc::new(Mutex::new(String::new()));
        crash_and_restart(&dev, (vol, server), &at)
    };
    let newer = vol2.lookup(ROOT_INO, b"x").expect("x survived").ino;
    assert!(matches!(tagged_request(server2.addr, unlink, tag), Answer::Reply(Ok(Out::Unit))));
    assert_eq!(vol2.lookup(ROOT_INO, b"x").expect("x stays").ino, newer);
}

/// Two files of `c` on different write lanes (a lane is `ino % 2`): the
/// first on lane 1, the second on lane 0, made durable.
fn files_on_lanes(c: &BranchClient) -> (arbor_engine::volume::Attr, arbor_engine::volume::Attr) {
    let (mut odd, mut even) = (None, None);
    for i in 0..8 {
        let a = c.create_open(ROOT_INO, format!("lane{i}").as_bytes(), libc::S_IFREG | 0o644, 0, 0).expect("create");
        if a.ino % 2 == 1 && odd.is_none() {
            odd = Some(a);
        } else if a.ino % 2 == 0 && even.is_none() {
            even = Some(a);
        }
    }
    c.fsync(ROOT_INO).expect("fsync");
    (odd.expect("an odd inode"), even.expect("an even inode"))
}

#[test]
fn a_write_answered_by_the_old_owner_but_read_after_the_new_owner_was_met_fails_its_fsync() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    let (f, g) = files_on_lanes(&c);
    // A write on its lane: the owner applies it and answers, and the
    // answer waits in the client's socket (answers are read lazily).
    c.write(f.ino, 0, b"answered, never synced").expect("write");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while first.0.getattr(f.ino).expect("getattr").size == 0 {
        assert!(std::time::Instant::now() < deadline, "the owner never applied the write");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    let (vol, _server) = crash_and_restart(&dev, first, &at);
    assert_eq!(vol.getattr(f.ino).expect("getattr").size, 0, "the crash took the unsynced write");
    // Something else meets the new owner first (in a mount, most often the
    // event poll, which settles no lane): it reconciles before f's answer
    // from the old owner is read.
    let _ = c.write(g.ino, 0, b"other lane");
    let _ = c.fsync(g.ino);
    // f's write is not in the branch: its fsync must not say durable.
    let synced = c.fsync(f.ino).map_err(|e| e.errno());
    assert_eq!(vol.read(f.ino, 0, 100).expect("read"), b"", "the new owner never had the write");
    assert_eq!(synced, Err(libc::EIO), "an fsync acknowledged a write the owner lost");
}

const WHOLE: arbor_engine::files::Lock =
    arbor_engine::files::Lock { start: 0, end: u64::MAX, typ: libc::F_WRLCK, pid: 1 };

/// Two clients of the owner `at` names: a made file `name`, made it
/// durable and holds its whole-file lock; b has it open.
fn a_holds_the_lock_b_has_the_file_open(
    at: &Arc<Mutex<String>>,
    name: &[u8],
) -> (BranchClient, BranchClient, arbor_engine::volume::Attr) {
    let (a, b) = (client(at), client(at));
    let f = a.create_open(ROOT_INO, name, libc::S_IFREG | 0o644, 0, 0).expect("create");
    a.fsync(f.ino).expect("fsync");
    a.setlk(f.ino, 1, WHOLE, false).expect("a takes the lock");
    b.open(f.ino).expect("open");
    (a, b, f)
}

fn unlock() -> arbor_engine::files::Lock {
    arbor_engine::files::Lock { typ: libc::F_UNLCK, ..WHOLE }
}

#[test]
fn a_lock_held_before_an_owner_crash_is_taken_back_and_not_granted_to_another() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let (a, b, f) = a_holds_the_lock_b_has_the_file_open(&at, b"lockfile");
    assert_eq!(b.setlk(f.ino, 2, WHOLE, false).map_err(|e| e.errno()), Err(libc::EAGAIN));
    // The owner's node loses power; a new owner process opens the branch.
    // That the branch has locks was made durable before the first grant.
    let (_vol, second) = crash_and_restart(&dev, first, &at);
    a.getattr(f.ino).expect("a goes on, and takes its lock back");
    // b asks in the grace period: it waits for its end, then finds a's lock.
    assert_eq!(b.setlk(f.ino, 2, WHOLE, false).map_err(|e| e.errno()), Err(libc::EAGAIN), "two holders of one lock");
    assert_eq!(b.getlk(f.ino, 2, WHOLE).expect("getlk").map(|l| l.typ), Some(libc::F_WRLCK));
    a.fsync(f.ino).expect("a's lock was kept: nothing to report");
    a.setlk(f.ino, 1, unlock(), false).expect("a lets go");
    b.setlk(f.ino, 2, WHOLE, false).expect("b takes it once a let go");
    drop(second);
}

#[test]
fn a_lock_request_in_the_grace_period_waits_for_its_end() {
    let dev = SimDevice::new();
    let (vol, first) = owner(&dev);
    let at = found_at(&first);
    let a = client(&at);
    let f = a.create_open(ROOT_INO, b"lockfile", libc::S_IFREG | 0o644, 0, 0).expect("create");
    a.setlk(f.ino, 1, WHOLE, false).expect("lock");
    a.setlk(f.ino, 1, unlock(), false).expect("unlock");
    drop(first);
    let (branch, _second) = serve_branch(&vol);
    *at.lock() = _second.addr.to_string();
    assert!(branch.in_lock_grace(), "the branch had locks: the new owner starts in a grace period");
    // A client new to this owner has nothing to take back: its lock
    // waits for the grace period, so that no holder from before loses out.
    let c = client(&at);
    let started = std::time::Instant::now();
    c.setlk(f.ino, 3, WHOLE, false).expect("granted after the grace period");
    assert!(started.elapsed() >= GRACE / 2, "granted {:?} into a {GRACE:?} grace period", started.elapsed());
    assert!(!branch.in_lock_grace());
}

#[test]
fn a_branch_with_no_locks_from_before_starts_without_a_grace_period() {
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let (branch, first) = serve_branch(&vol);
    assert!(!branch.in_lock_grace(), "a new branch");
    drop((branch, first));
    let (branch, first) = serve_branch(&vol);
    assert!(!branch.in_lock_grace(), "its first owner granted no lock");
    // A lock granted and released: the next owner cannot know it was
    // released, so it gives the holders a grace period...
    let s = branch.open_session().expect("session");
    let Ok(Out::Attr(f)) = branch
        .apply(s.session, FileOp::CreateOpen { parent: ROOT_INO, name: b"f".to_vec(), mode: 0o100644, uid: 0, gid: 0 })
    else {
        panic!("create")
    };
    assert!(branch.try_lock(s.session, f.ino, 7, WHOLE).is_ok());
    assert!(branch.try_lock(s.session, f.ino, 7, unlock()).is_ok());
    drop((branch, first));
    let (branch, first) = serve_branch(&vol);
    assert!(branch.in_lock_grace());
    // ...and once that ends with nothing taken back, the mark is cleared.
    std::thread::sleep(GRACE + Duration::from_millis(100));
    branch.reap();
    drop((branch, first));
    let (branch, _first) = serve_branch(&vol);
    assert!(!branch.in_lock_grace(), "nothing was held after the last grace period");
}

#[test]
fn a_client_whose_session_the_owner_dropped_loses_its_locks_and_hears_of_it() {
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let (branch, running) = serve_branch(&vol);
    let at = found_at(&running);
    let (a, b, f) = a_holds_the_lock_b_has_the_file_open(&at, b"lockfile");
    // a is silent past its session's life (paused, cut off): the owner
    // drops its session, and its lock goes to b.
    std::thread::sleep(Duration::from_millis(300));
    b.getattr(f.ino).expect("b is heard from");
    branch.reap_idle(Duration::from_millis(200));
    b.setlk(f.ino, 2, WHOLE, false).expect("b takes the lock a's session held");
    b.write(f.ino, 0, b"b's").expect("b writes under its lock");
    b.fsync(f.ino).expect("fsync");
    // a comes back: it must not go on as if it held the lock, nor write
    // over what b wrote under it.
    assert_eq!(a.fsync(f.ino).map_err(|e| e.errno()), Err(libc::EIO), "a's fsync under a lost lock");
    assert_eq!(a.write(f.ino, 0, b"a's").map_err(|e| e.errno()), Err(libc::EIO), "a's write under a lost lock");
    assert_eq!(vol.read(f.ino, 0, 10).expect("read"), b"b's");
    assert_eq!(a.setlk(f.ino, 1, WHOLE, false).map_err(|e| e.errno()), Err(libc::ENOLCK), "told once");
    assert_eq!(a.setlk(f.ino, 1, WHOLE, false).map_err(|e| e.errno()), Err(libc::EAGAIN), "b holds it");
}

#[test]
fn a_failed_write_sent_again_on_its_lane_is_not_answered_as_written() {
    use arbor_net::branch::frames::{write_request, Answer, Request};
    use arbor_net::wire::frames::{read_frame, Welcome};
    let dev = SimDevice::new();
    let (vol, server) = owner(&dev);
    let d = vol.mkdir(ROOT_INO, b"d", 0o755, 0, 0).expect("mkdir");
    let f = vol.create(ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    let (mut s, w) = hello(server.addr, TOKEN, "main");
    assert_eq!(w, Welcome::Ok);
    s.set_nodelay(true).expect("nodelay");
    let (mut r, mut b) = (Vec::new(), Vec::new());
    write_request(&mut s, &mut b, &Request::Session).expect("send");
    let Answer::Session(info) = read_frame::<Answer>(&mut s, &mut r).expect("answer") else { panic!("no session") };
    let lane = arbor_net::branch::requests::PIPELINED_SLOT;
    let mut send = |ino: u64, off: u64, seq: u64| {
        let op = FileOp::Write { ino, off, data: vec![b'w'; 100], unprivileged: false, append: false };
        let tag = RequestTag { client: 99, slot: lane, seq };
        write_request(&mut s, &mut b, &Request::Op { session: info.session, op, tag: Some(tag) }).expect("send");
        match read_frame::<Answer>(&mut s, &mut r).expect("answer") {
            Answer::Reply(reply) => reply,
            other => panic!("{other:?}"),
        }
    };
    // The lane's first write fails; 5000 small writes follow it (500 KB,
    // well inside the 8 MiB a lane keeps in flight).
    assert!(matches!(send(d.ino, 0, 1), Err(libc::EISDIR)));
    for seq in 2..=5001u64 {
        assert!(matches!(send(f.ino, (seq - 2) * 100, seq), Ok(Out::Written(100))));
    }
    // The lane's connection broke before the client read any answer: it
    // sends its writes in flight again, the first one first.
    assert!(matches!(send(d.ino, 0, 1), Err(libc::EISDIR)), "a refused write was answered as written");
}

#[test]
fn opening_a_file_again_does_not_clear_the_loss_its_other_descriptor_must_report() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    let f = c.create_open(ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.write(f.ino, 0, b"durable").expect("write");
    c.fsync(f.ino).expect("fsync");
    c.write(f.ino, 7, b"+answered").expect("write");
    assert_eq!(c.getattr(f.ino).expect("getattr").size, 16, "answered");
    let (vol, _server) = crash_and_restart(&dev, first, &at);
    assert_eq!(vol.read(f.ino, 0, 100).expect("read"), b"durable", "the crash took the unsynced write");
    // Another process on the client opens the same file (a second
    // descriptor) before the writer fsyncs its own.
    c.open(f.ino).expect("open the same file again");
    assert_eq!(c.fsync(f.ino).map_err(|e| e.errno()), Err(libc::EIO), "an fsync acknowledged a lost write");
}

#[test]
fn a_session_speaks_for_one_client_only() {
    use arbor_net::branch::frames::{write_request, Answer, Request};
    use arbor_net::wire::frames::{read_frame, Welcome};
    let dev = SimDevice::new();
    let (_vol, server) = owner(&dev);
    let (mut s, w) = hello(server.addr, TOKEN, "main");
    assert_eq!(w, Welcome::Ok);
    let (mut r, mut b) = (Vec::new(), Vec::new());
    write_request(&mut s, &mut b, &Request::Session).expect("send");
    let Answer::Session(info) = read_frame::<Answer>(&mut s, &mut r).expect("answer") else { panic!("no session") };
    let mut ask = |op: FileOp, tag: Option<RequestTag>| {
        write_request(&mut s, &mut b, &Request::Op { session: info.session, op, tag }).expect("send");
        match read_frame::<Answer>(&mut s, &mut r).expect("answer") {
            Answer::Reply(reply) => reply.map(|_| ()),
            other => panic!("{other:?}"),
        }
    };
    let mkdir =
        |name: &str| FileOp::Mkdir { parent: ROOT_INO, name: name.as_bytes().to_vec(), perm: 0o755, uid: 0, gid: 0 };
    assert_eq!(ask(mkdir("a"), Some(RequestTag { client: 5, slot: 0, seq: 1 })), Ok(()));
    // Another mount's client id, on this session: its slots are not ours
    // to move, nor to read.
    assert_eq!(ask(mkdir("b"), Some(RequestTag { client: 6, slot: 0, seq: 9 })), Err(libc::EPERM));
    assert_eq!(ask(FileOp::Slots { client: 6 }, None), Err(libc::EPERM));
    assert_eq!(ask(FileOp::Slots { client: 5 }, None), Ok(()));
    assert_eq!(ask(mkdir("c"), Some(RequestTag { client: 5, slot: 0, seq: 2 })), Ok(()));
}

/// An owner that says hello and gives sessions, then answers nothing else,
/// as one paused (SIGSTOP) with its sockets open does. Stops within 60 s.
fn silent_owner() -> std::net::SocketAddr {
    use arbor_net::branch::frames::{read_request, Answer, Request};
    use arbor_net::branch::owner::SessionInfo;
    use arbor_net::wire::frames::{read_frame, write_frame, Hello, Welcome};
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        let until = std::time::Instant::now() + Duration::from_secs(60);
        listener.set_nonblocking(true).expect("nonblocking");
        while std::time::Instant::now() < until {
            let Ok((mut s, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            std::thread::spawn(move || {
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
                let (mut r, mut w) = (Vec::new(), Vec::new());
                let mut magic = [0u8; 4];
                if s.read_exact(&mut magic).is_err() || read_frame::<Hello>(&mut s, &mut r).is_err() {
                    return;
                }
                let _ = write_frame(&mut s, &mut w, &Welcome::Ok);
                while let Ok(req) = read_request(&mut s, &mut r) {
                    if let Request::Session = req {
                        let info = SessionInfo { session: 1, epoch: 0xdead, seq: 0, generation: 1 };
                        let _ = write_frame(&mut s, &mut w, &Answer::Session(info));
                    } else {
                        // Paused: holds the connection, answers nothing.
                        std::thread::sleep(Duration::from_secs(60));
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// A hard mount (no timeout) connected to a paused owner, whose successor
/// `real` is recorded half a second later.
fn hard_client_of_a_paused_owner(real: &Running) -> BranchClient {
    let at = Arc::new(Mutex::new(silent_owner().to_string()));
    let find = at.clone();
    let c = BranchClient::connect(BranchClientOptions {
        branch: "main".into(),
        token: TOKEN.into(),
        locate: Arc::new(move || Some(find.lock().clone())),
        timeout: None,
        segments: None,
        tls: None,
    })
    .expect("connect to the paused owner");
    let next = real.addr.to_string();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        *at.lock() = next;
    });
    c
}

#[test]
fn a_hard_mount_waiting_on_a_paused_owner_moves_to_its_successor() {
    let (vol, real) = owner(&SimDevice::new());
    vol.mkdir(ROOT_INO, b"here", 0o755, 0, 0).expect("mkdir");
    let c = hard_client_of_a_paused_owner(&real);
    let started = std::time::Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(c.lookup(ROOT_INO, b"here").map(|a| a.ino).map_err(|e| e.errno()));
    });
    let got = rx.recv_timeout(Duration::from_secs(45)).expect("the hard mount still waits on the paused owner");
    assert_eq!(got, Ok(vol.lookup(ROOT_INO, b"here").expect("lookup").ino));
    println!("answered by the successor after {:?}", started.elapsed());
}

/// A lost rename must fail the fsync of the process that
/// renamed, not only whichever fsync of the mount comes first. Here a
/// second writer's fsync of its own file eats the report, and the saver's
/// folder fsync then acknowledges a rename the new owner never had.
#[test]
fn a_lost_rename_is_reported_to_the_folder_fsync_even_after_another_files_fsync() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    let other = c.create_open(ROOT_INO, b"other", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.fsync(other.ino).expect("fsync");
    let f = c.create_open(ROOT_INO, b"ckpt.tmp", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.write(f.ino, 0, b"body").expect("write");
    c.fsync(f.ino).expect("fsync");
    c.rename(ROOT_INO, b"ckpt.tmp", ROOT_INO, b"ckpt", RenameMode::Plain).expect("rename");
    let (vol, _server) = crash_and_restart(&dev, first, &at);
    assert!(vol.lookup(ROOT_INO, b"ckpt").is_err(), "the crash took the rename");
    // Another process on this mount fsyncs its own file first ...
    let _ = c.fsync(other.ino);
    // ... then the saver fsyncs the folder, as rename-then-fsync(dir) does.
    assert_eq!(
        c.fsync(ROOT_INO).map_err(|e| e.errno()),
        Err(libc::EIO),
        "the folder's fsync acknowledged a rename the owner lost"
    );
}

/// The 10 s owner check covers writes in flight on a lane too: a hard
/// mount with a write in flight to a paused owner moves on once a
/// successor is recorded.
#[test]
fn a_hard_mount_with_a_write_in_flight_to_a_paused_owner_moves_to_its_successor() {
    let (_vol, real) = owner(&SimDevice::new());
    let c = hard_client_of_a_paused_owner(&real);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Sent on its lane at once; the fsync waits for its answer.
        let w = c.write(1000, 0, b"in flight").map_err(|e| e.errno());
        let _ = tx.send((w, c.fsync(1000).map_err(|e| e.errno())));
    });
    let (w, fsync) =
        rx.recv_timeout(Duration::from_secs(45)).expect("the hard mount still waits on the paused owner's lane");
    assert_eq!(w, Ok(9));
    assert_eq!(fsync, Err(libc::EIO), "the write in flight to the deposed owner is lost, and its fsync says so");
}

/// Two clients of one owner after a lost its lock on file `ino` to b.
struct LostLock {
    vol: Arc<Volume>,
    _owner: (Arc<SharedBranch>, Running),
    a: BranchClient,
    b: BranchClient,
    ino: u64,
}

/// a takes the lock, goes silent past its session's life; the owner drops
/// the session and b takes the lock and writes under it.
fn a_loses_its_lock_to_b(name: &[u8]) -> LostLock {
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let (branch, running) = serve_branch(&vol);
    let at = found_at(&running);
    let (a, b, f) = a_holds_the_lock_b_has_the_file_open(&at, name);
    std::thread::sleep(Duration::from_millis(300));
    b.getattr(f.ino).expect("b is heard from");
    branch.reap_idle(Duration::from_millis(200));
    b.setlk(f.ino, 2, WHOLE, false).expect("b takes the lock a's session held");
    b.write(f.ino, 0, b"b's").expect("b writes under its lock");
    b.fsync(f.ino).expect("fsync");
    LostLock { vol, _owner: (branch, running), a, b, ino: f.ino }
}

#[test]
fn a_client_that_lost_its_lock_cannot_truncate_what_the_next_holder_wrote() {
    let LostLock { vol, a, ino, _owner, .. } = a_loses_its_lock_to_b(b"trunc");
    // a comes back and, believing it holds the lock, truncates the file
    // to rewrite it (ftruncate, or open with O_TRUNC).
    let cut = a
        .setattr(ino, arbor_engine::SetAttr { size: Some(0), ..Default::default() })
        .map(|_| ())
        .map_err(|e| e.errno());
    assert_eq!(
        vol.read(ino, 0, 10).expect("read"),
        b"b's",
        "a's truncate ({cut:?}) under a lost lock wiped what b wrote"
    );
}

#[test]
fn a_file_whose_lost_lock_was_heard_of_and_dropped_works_again() {
    let LostLock { a, b, ino, _owner, .. } = a_loses_its_lock_to_b(b"closed");
    b.setlk(ino, 2, unlock(), false).expect("b lets go");
    assert_eq!(a.fsync(ino).map_err(|e| e.errno()), Err(libc::EIO), "a hears of the loss");
    // Its holder closes the file: flush/release drop its locks there.
    a.unlock_all(ino, 1).expect("close drops the holder's locks");
    // Another process on a's node takes the lock anew and reads the file.
    a.setlk(ino, 3, WHOLE, false).expect("another lock owner takes the lock");
    assert_eq!(a.read(ino, 0, 10).map_err(|e| e.errno()), Ok(b"b's".to_vec()), "the file stays unreadable on a's node");
}

#[test]
fn a_write_racing_the_discovery_of_a_lost_lock_does_not_land() {
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let (branch, running) = serve_branch(&vol);
    let at = found_at(&running);
    let (a, b) = (Arc::new(client(&at)), client(&at));
    let f = a.create_open(ROOT_INO, b"race", libc::S_IFREG | 0o644, 0, 0).expect("create");
    // Files a holds open: its next session opens each again, which takes a while.
    for i in 0..300 {
        a.create_open(ROOT_INO, format!("open{i}").as_bytes(), libc::S_IFREG | 0o644, 0, 0).expect("create");
    }
    a.fsync(f.ino).expect("fsync");
    a.setlk(f.ino, 1, WHOLE, false).expect("a takes the lock");
    b.open(f.ino).expect("open");
    std::thread::sleep(Duration::from_millis(300));
    b.getattr(f.ino).expect("b is heard from");
    branch.reap_idle(Duration::from_millis(200));
    b.setlk(f.ino, 2, WHOLE, false).expect("b takes the lock a's session held");
    b.write(f.ino, 0, b"bbbb").expect("b writes under its lock");
    b.fsync(f.ino).expect("fsync");
    // a comes back on two threads (its event poll, a writer): one finds
    // the session gone and sets up the next; the other writes meanwhile.
    let a2 = a.clone();
    let meets = std::thread::spawn(move || a2.getattr(ROOT_INO).map(|_| ()).map_err(|e| e.errno()));
    std::thread::sleep(Duration::from_millis(5));
    let mut answers = Vec::new();
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        let r = a.write(f.ino, 0, b"AAAA").map(|_| ()).map_err(|e| e.errno());
        answers.push(r);
        if r.is_err() {
            break;
        }
    }
    let _ = meets.join();
    let _ = a.fsync(f.ino);
    assert_eq!(
        vol.read(f.ino, 0, 4).expect("read"),
        b"bbbb",
        "a's write landed over b's after a lost its lock: {answers:?}"
    );
}

#[test]
fn a_lock_another_took_after_a_grace_period_is_not_taken_back_from_the_owner_after() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let (a, b, f) = a_holds_the_lock_b_has_the_file_open(&at, b"chain");
    // The owner crashes; a is cut off through the next owner's grace period.
    let second = crash_and_restart(&dev, first, &at);
    std::thread::sleep(GRACE + Duration::from_millis(200));
    b.setlk(f.ino, 2, WHOLE, false).expect("b takes the lock nobody took back");
    b.write(f.ino, 0, b"b's").expect("b writes under it");
    b.fsync(f.ino).expect("fsync");
    // That owner goes too; a comes back within RECLAIM_WINDOW of its last
    // answer from the first owner and meets the third.
    let (_vol, _third) = crash_and_restart(&dev, second, &at);
    a.getattr(f.ino).expect("a meets the third owner");
    assert_eq!(
        a.fsync(f.ino).map_err(|e| e.errno()),
        Err(libc::EIO),
        "a took back a lock b held in between, and was told nothing"
    );
}

/// A TCP relay to `upstream`: while `hold` is set, what the server sends
/// on connections opened before `frozen_below` is held back.
struct Relay {
    addr: String,
    hold: Arc<std::sync::atomic::AtomicBool>,
    frozen_below: Arc<std::sync::atomic::AtomicUsize>,
    opened: Arc<std::sync::atomic::AtomicUsize>,
}

fn relay(upstream: std::net::SocketAddr) -> Relay {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let hold = Arc::new(AtomicBool::new(false));
    let frozen_below = Arc::new(AtomicUsize::new(0));
    let opened = Arc::new(AtomicUsize::new(0));
    let (h, fb, o) = (hold.clone(), frozen_below.clone(), opened.clone());
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { return };
            let id = o.fetch_add(1, SeqCst);
            let Ok(up) = std::net::TcpStream::connect(upstream) else { continue };
            let _ = (c.set_nodelay(true), up.set_nodelay(true));
            let (mut c_r, mut up_w) = (c.try_clone().expect("clone"), up.try_clone().expect("clone"));
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_r, &mut up_w);
                let _ = up_w.shutdown(std::net::Shutdown::Write);
            });
            let (h, fb) = (h.clone(), fb.clone());
            let (mut up_r, mut c_w) = (up, c);
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = match up_r.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    while h.load(SeqCst) && id < fb.load(SeqCst) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    if c_w.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = c_w.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    Relay { addr, hold, frozen_below, opened }
}

#[test]
fn a_grant_read_after_the_same_owner_dropped_the_session_is_not_believed() {
    use std::sync::atomic::Ordering::SeqCst;
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let (branch, running) = serve_branch(&vol);
    let r = relay(running.addr);
    let via = Arc::new(Mutex::new(r.addr.clone()));
    let at = found_at(&running);
    let a = Arc::new(client(&via));
    let b = client(&at);
    let f = a.create_open(ROOT_INO, b"late", libc::S_IFREG | 0o644, 0, 0).expect("create");
    a.fsync(f.ino).expect("fsync");
    b.open(f.ino).expect("open");
    // a asks for the lock; the owner grants it; the answer is delayed on
    // the way (a partition TCP outlives, or a paused client).
    r.frozen_below.store(r.opened.load(SeqCst), SeqCst);
    r.hold.store(true, SeqCst);
    let a2 = a.clone();
    let ino = f.ino;
    let asks = std::thread::spawn(move || a2.setlk(ino, 1, WHOLE, false).map_err(|e| e.errno()));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(branch.locks(), 1, "the owner granted a's lock");
    // a is heard from no more: the owner drops its session; b takes the lock.
    b.getattr(f.ino).expect("b is heard from");
    branch.reap_idle(Duration::from_millis(200));
    b.setlk(f.ino, 2, WHOLE, false).expect("b takes the lock a's session held");
    b.write(f.ino, 0, b"b's").expect("write");
    b.fsync(f.ino).expect("fsync");
    // a meets the same owner again on another connection (a new session),
    // then reads the grant.
    a.getattr(ROOT_INO).expect("a meets the owner again");
    r.hold.store(false, SeqCst);
    let granted = asks.join().expect("join");
    // a writes only if told it holds the lock.
    let wrote = granted.map(|()| a.write(f.ino, 0, b"AAA").map(|_| ()).map_err(|e| e.errno()));
    let _ = a.fsync(f.ino);
    assert_eq!(
        vol.read(f.ino, 0, 3).expect("read"),
        b"b's",
        "a believed a grant ({granted:?}) its dropped session got, and wrote over b ({wrote:?})"
    );
}

#[test]
fn a_lock_granted_anew_after_a_loss_lets_its_holder_write() {
    let LostLock { vol, a, b, ino, _owner } = a_loses_its_lock_to_b(b"anew");
    b.setlk(ino, 2, unlock(), false).expect("b lets go");
    // a's first word after its session was dropped is a lock request: it
    // is granted (b let go), under a's new session.
    a.setlk(ino, 1, WHOLE, false).expect("a takes the lock again");
    let wrote = a.write(ino, 0, b"a's").map(|_| ()).map_err(|e| e.errno());
    let _ = a.fsync(ino);
    assert_eq!(
        (wrote, vol.read(ino, 0, 3).expect("read")),
        (Ok(()), b"a's".to_vec()),
        "a holds the lock and cannot write"
    );
}

#[test]
fn an_owner_with_no_grace_period_then_one_with_does_not_let_a_lock_be_taken_back_after_another_held_it() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let (a, b, f) = a_holds_the_lock_b_has_the_file_open(&at, b"zero");
    // The owner crashes; the next is started with --lock-grace 0 ("gives up
    // locks from before at once").
    dev.crash(CrashMode::DropUnsynced);
    drop(first);
    let vol = Volume::open(Arc::new(dev.clone()), cfg()).expect("open");
    let branch = SharedBranch::new("main", vol.clone(), None, Policy::default());
    branch.set_lock_grace(Duration::ZERO);
    let second = (
        vol,
        CacheServer::owner(None, vec![branch], ServerOptions { token: TOKEN.into(), ..Default::default() })
            .spawn("127.0.0.1:0")
            .expect("serve"),
    );
    *at.lock() = second.1.addr.to_string();
    b.setlk(f.ino, 2, WHOLE, false).expect("b takes the lock at once");
    b.write(f.ino, 0, b"b's").expect("b writes under it");
    b.fsync(f.ino).expect("fsync");
    // That owner is restarted with the default grace period; a, back
    // within seconds, meets it.
    let (_vol, _third) = crash_and_restart(&dev, second, &at);
    a.getattr(f.ino).expect("a meets the third owner");
    assert_eq!(
        a.fsync(f.ino).map_err(|e| e.errno()),
        Err(libc::EIO),
        "a took back a lock b held in between, and was told nothing"
    );
}

#[test]
fn a_late_unknown_session_answer_does_not_drop_the_newer_session_and_its_locks() {
    use std::sync::atomic::Ordering::SeqCst;
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let (branch, running) = serve_branch(&vol);
    let r = relay(running.addr);
    let via = Arc::new(Mutex::new(r.addr.clone()));
    let a = Arc::new(client(&via));
    let f = a.create_open(ROOT_INO, b"late-unknown", libc::S_IFREG | 0o644, 0, 0).expect("create");
    a.fsync(f.ino).expect("fsync");
    // a is silent past its session's life; it held no lock then.
    std::thread::sleep(Duration::from_millis(300));
    branch.reap_idle(Duration::from_millis(200));
    // One thread's request meets the dropped session; that answer is slow.
    r.frozen_below.store(r.opened.load(SeqCst), SeqCst);
    r.hold.store(true, SeqCst);
    let a2 = a.clone();
    let slow = std::thread::spawn(move || a2.getattr(ROOT_INO).map(|_| ()).map_err(|e| e.errno()));
    std::thread::sleep(Duration::from_millis(200));
    // Another thread meets the owner again (a new session) and takes a lock.
    a.setlk(f.ino, 1, WHOLE, false).expect("a takes the lock under its new session");
    r.hold.store(false, SeqCst);
    let _ = slow.join();
    // a holds the lock: it may write under it.
    let wrote = a.write(f.ino, 0, b"a's").map(|_| ()).map_err(|e| e.errno());
    let synced = a.fsync(f.ino).map_err(|e| e.errno());
    assert_eq!((wrote, synced), (Ok(()), Ok(())), "a lock held under the current session was dropped as lost");
}

#[test]
fn appends_from_two_clients_land_at_the_owners_end_of_the_file() {
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let (_branch, running) = serve_branch(&vol);
    let at = found_at(&running);
    let (a, b) = (client(&at), client(&at));
    let f = a.create_open(ROOT_INO, b"log", libc::S_IFREG | 0o644, 0, 0).expect("create");
    b.open(f.ino).expect("open");
    // Each client's kernel places an O_APPEND write at the end of the file
    // as it last saw it: 0 for both here.
    a.write_appending(f.ino, 0, b"from a\n", false).expect("append");
    a.fsync(f.ino).expect("fsync");
    b.write_appending(f.ino, 0, b"from b\n", false).expect("append");
    b.fsync(f.ino).expect("fsync");
    a.write_appending(f.ino, 7, b"a again\n", true).expect("append");
    a.fsync(f.ino).expect("fsync");
    assert_eq!(vol.read(f.ino, 0, 100).expect("read"), b"from a\nfrom b\na again\n");
    // A plain write still goes where it is told.
    b.write(f.ino, 0, b"FROM").expect("write");
    b.fsync(f.ino).expect("fsync");
    assert_eq!(vol.read(f.ino, 0, 100).expect("read"), b"FROM a\nfrom b\na again\n");
}

#[test]
fn a_new_owner_never_gives_out_again_the_number_of_a_file_a_crash_took() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    let kept = c.create_open(ROOT_INO, b"kept", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.fsync(ROOT_INO).expect("fsync");
    // Answered, never synced: the crash takes it, and this client still
    // has it open under its number.
    let lost = c.create_open(ROOT_INO, b"lost", libc::S_IFREG | 0o644, 0, 0).expect("create");
    let (vol, _second) = crash_and_restart(&dev, first, &at);
    assert!(vol.lookup(ROOT_INO, b"lost").is_err(), "the crash took it");
    let other = client(&at);
    let new = other.create_open(ROOT_INO, b"new", libc::S_IFREG | 0o644, 0, 0).expect("create");
    assert!(new.ino != lost.ino && new.ino != kept.ino, "{} given out again", new.ino);
}

#[test]
fn an_append_sent_again_after_a_lost_reply_or_an_owner_crash_lands_once() {
    use arbor_net::branch::frames::Answer;
    let dev = SimDevice::new();
    let (vol, server) = owner(&dev);
    let f = vol.create(ROOT_INO, b"log", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    let lane = arbor_net::branch::requests::PIPELINED_SLOT | 1;
    let append =
        |data: &[u8]| FileOp::Write { ino: f.ino, off: 0, data: data.to_vec(), unprivileged: false, append: true };
    let t1 = RequestTag { client: 4242, slot: lane, seq: 1 };
    assert!(matches!(tagged_request(server.addr, append(b"one\n"), t1), Answer::Reply(Ok(Out::Written(4)))));
    // The reply was lost: the same append comes again on another connection.
    assert!(matches!(tagged_request(server.addr, append(b"one\n"), t1), Answer::Reply(Ok(Out::Written(4)))));
    assert_eq!(vol.read(f.ino, 0, 100).expect("read"), b"one\n");
    // Another node appends meanwhile; then this lane's next append.
    vol.append(f.ino, b"other\n").expect("append");
    let t2 = RequestTag { seq: 2, ..t1 };
    assert!(matches!(tagged_request(server.addr, append(b"two\n"), t2), Answer::Reply(Ok(Out::Written(4)))));
    vol.sync_all().expect("sync");
    // A crash, a new owner: both appends are answered from the tags, not
    // appended again.
    let (vol2, server2) = {
        let at = Arc::new(Mutex::new(String::new()));
        crash_and_restart(&dev, (vol, server), &at)
    };
    assert!(matches!(tagged_request(server2.addr, append(b"one\n"), t1), Answer::Reply(Ok(Out::Written(4)))));
    assert!(matches!(tagged_request(server2.addr, append(b"two\n"), t2), Answer::Reply(Ok(Out::Written(4)))));
    assert_eq!(vol2.read(f.ino, 0, 100).expect("read"), b"one\nother\ntwo\n");
}

/// What `arbor import` (or any writer that opens the branch itself, such
/// as a plain mount after a clean owner stop) does between two owners: it
/// opens the volume without a `SharedBranch`, so it never skips the
/// reserved numbers.
#[test]
fn a_writer_between_owners_does_not_give_out_a_lost_files_number_again() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    c.create_open(ROOT_INO, b"kept", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.fsync(ROOT_INO).expect("fsync");
    // Answered, never synced: the crash takes it; the client keeps it open.
    let lost = c.create_open(ROOT_INO, b"lost", libc::S_IFREG | 0o644, 0, 0).expect("create");
    dev.crash(CrashMode::DropUnsynced);
    drop(first);
    // A writer of the branch that is not an owner (arbor import).
    let local = Volume::open(Arc::new(dev.clone()), cfg()).expect("open");
    let imported = local.create(ROOT_INO, b"imported", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    local.sync_all().expect("sync");
    drop(local);
    assert_ne!(imported.ino, lost.ino, "a writer between owners gave the lost file's number out again");
}

/// The harm of a number given out again (the test before): a descriptor of the
/// file the crash took writes into the file the writer in between made.
#[test]
fn a_descriptor_of_a_lost_file_never_writes_into_another_file() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    c.create_open(ROOT_INO, b"kept", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.fsync(ROOT_INO).expect("fsync");
    let lost = c.create_open(ROOT_INO, b"lost", libc::S_IFREG | 0o644, 0, 0).expect("create");
    dev.crash(CrashMode::DropUnsynced);
    drop(first);
    let local = Volume::open(Arc::new(dev.clone()), cfg()).expect("open");
    let imported = local.create(ROOT_INO, b"imported", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    local.write(imported.ino, 0, b"imported bytes").expect("write");
    local.close().expect("close");
    drop(local);
    let (vol2, _second) = owner(&dev);
    *at.lock() = _second.addr.to_string();
    // The descriptor of the lost file: its write fails (the file is gone).
    assert_eq!(c.write(lost.ino, 0, b"OLD").map_err(|e| e.errno()), Err(libc::EIO));
    // Another process on the client opens `imported` by name.
    let a = c.lookup(ROOT_INO, b"imported").expect("lookup");
    c.open(a.ino).expect("open");
    // The old descriptor (the kernel knows it only by its number) writes
    // again and fsyncs.
    let wrote = c.write(lost.ino, 0, b"OLD");
    let synced = c.fsync(lost.ino);
    assert_eq!(
        vol2.read(imported.ino, 0, 100).expect("read"),
        b"imported bytes",
        "a descriptor of the lost file wrote into another file (write {:?}, fsync {:?})",
        wrote.map_err(|e| e.errno()),
        synced.map_err(|e| e.errno())
    );
}

/// Client `a` (through a [`holding_relay`]) writes file `f` and fsyncs it,
/// then writes "stale" into a held connection, and its close gives the
/// write up (EIO); client `b` then writes "NEWER" there and fsyncs.
struct GivenUp {
    vol: Arc<Volume>,
    _server: Running,
    a: BranchClient,
    f: u64,
    release: Arc<std::sync::atomic::AtomicBool>,
}

fn a_write_given_up_then_newer_bytes() -> GivenUp {
    use std::sync::atomic::Ordering::SeqCst;
    let (vol, server) = owner(&SimDevice::new());
    let (relayed, hold, release) = holding_relay(server.addr);
    let a = client(&Arc::new(Mutex::new(relayed)));
    let b = client(&found_at(&server));
    let f = a.create_open(ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, 0).expect("create").ino;
    a.write(f, 0, b"first").expect("write");
    a.fsync(f).expect("fsync");
    // The next write goes out on its lane and is held there.
    hold.store(true, SeqCst);
    a.write(f, 0, b"stale").expect("a write on its way");
    assert_eq!(a.flush(f).map_err(|e| e.errno()), Err(libc::EIO), "the close confirmed a write nobody answered");
    // Later connections pass (the held one waits for `release`).
    hold.store(false, SeqCst);
    // Another node writes the file afterwards, and makes it durable.
    let fb = b.open(f).expect("open");
    b.write(fb.ino, 0, b"NEWER").expect("write");
    b.fsync(fb.ino).expect("fsync");
    GivenUp { vol, _server: server, a, f, release }
}

/// A close that could not learn whether the owner took a write reports
/// it (EIO) and gives it up: sent again later, by then over another
/// node's newer, fsynced bytes, it would bring back what was overwritten.
#[test]
fn a_write_a_close_could_not_confirm_is_reported_and_never_lands_over_newer_bytes() {
    // Held, never released: the write is swallowed and its connection cut.
    let GivenUp { vol, _server, a, f, .. } = a_write_given_up_then_newer_bytes();
    // The first node reaches the owner again: its next operations on the
    // lane (an fsync) must not send the given-up write.
    assert_eq!(a.fsync(f).map_err(|e| e.errno()), Err(libc::EIO), "the loss is reported to the fsync too");
    a.fsync(f).expect("reported once");
    let g = a.create_open(ROOT_INO, b"g", libc::S_IFREG | 0o644, 0, 0).expect("create after the partition");
    a.write(g.ino, 0, b"fine").expect("write");
    a.fsync(g.ino).expect("fsync");
    assert_eq!(vol.read(f, 0, 100).expect("read"), b"NEWER", "a given-up write landed over newer bytes");
    assert_eq!(vol.read(g.ino, 0, 100).expect("read"), b"fine");
}

/// Sends `op` as request `tag` under `session` on a connection of its own.
fn in_session(
    addr: std::net::SocketAddr,
    session: u64,
    op: FileOp,
    tag: RequestTag,
) -> arbor_net::branch::frames::Answer {
    use arbor_net::branch::frames::{write_request, Answer, Request};
    use arbor_net::wire::frames::{read_frame, Welcome};
    let (mut s, w) = hello(addr, TOKEN, "main");
    assert_eq!(w, Welcome::Ok);
    let (mut r, mut b) = (Vec::new(), Vec::new());
    write_request(&mut s, &mut b, &Request::Op { session, op, tag: Some(tag) }).expect("send");
    read_frame::<Answer>(&mut s, &mut r).expect("answer")
}

/// Opens and releases are counted per session: one sent again after a
/// lost reply must be answered, not counted twice (a deleted file kept
/// forever, or freed while a descriptor still reads it).
#[test]
fn an_open_or_release_sent_again_after_a_lost_reply_counts_once() {
    use arbor_net::branch::frames::{write_request, Answer, Request};
    use arbor_net::wire::frames::{read_frame, Welcome};
    let (vol, server) = owner(&SimDevice::new());
    let (mut s, w) = hello(server.addr, TOKEN, "main");
    assert_eq!(w, Welcome::Ok);
    let (mut r, mut b) = (Vec::new(), Vec::new());
    write_request(&mut s, &mut b, &Request::Session).expect("send");
    let Answer::Session(info) = read_frame::<Answer>(&mut s, &mut r).expect("answer") else { panic!("no session") };
    let tag = |seq| RequestTag { client: 91, slot: 0, seq };
    let call = |op: FileOp, seq| in_session(server.addr, info.session, op, tag(seq));

    // x: opened once, the open sent twice; deleted; released once: gone.
    let x = vol.create(ROOT_INO, b"x", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    vol.write(x.ino, 0, b"x body").expect("write");
    assert!(matches!(call(FileOp::Open { ino: x.ino, count: 1 }, 1), Answer::Reply(Ok(Out::Attr(_)))));
    assert!(matches!(call(FileOp::Open { ino: x.ino, count: 1 }, 1), Answer::Reply(Ok(Out::Attr(_)))));
    vol.unlink(ROOT_INO, b"x").expect("unlink");
    assert!(matches!(call(FileOp::Release { ino: x.ino }, 2), Answer::Reply(Ok(Out::Unit))));
    assert!(vol.getattr(x.ino).is_err(), "a doubled open kept a deleted file");

    // y: opened twice; deleted; one release sent twice: still open once.
    let y = vol.create(ROOT_INO, b"y", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    vol.write(y.ino, 0, b"y body").expect("write");
    assert!(matches!(call(FileOp::Open { ino: y.ino, count: 1 }, 3), Answer::Reply(Ok(Out::Attr(_)))));
    assert!(matches!(call(FileOp::Open { ino: y.ino, count: 1 }, 4), Answer::Reply(Ok(Out::Attr(_)))));
    vol.unlink(ROOT_INO, b"y").expect("unlink");
    assert!(matches!(call(FileOp::Release { ino: y.ino }, 5), Answer::Reply(Ok(Out::Unit))));
    assert!(matches!(call(FileOp::Release { ino: y.ino }, 5), Answer::Reply(Ok(Out::Unit))));
    assert_eq!(vol.read(y.ino, 0, 100).expect("a doubled release freed a file still open"), b"y body");
    assert!(matches!(call(FileOp::Release { ino: y.ino }, 6), Answer::Reply(Ok(Out::Unit))));
    assert!(vol.getattr(y.ino).is_err(), "the last release frees it");
}

/// A new session of `addr`'s owner, opened on a connection of its own.
fn new_session(addr: std::net::SocketAddr) -> u64 {
    use arbor_net::branch::frames::{write_request, Answer, Request};
    use arbor_net::wire::frames::{read_frame, Welcome};
    let (mut s, w) = hello(addr, TOKEN, "main");
    assert_eq!(w, Welcome::Ok);
    let (mut r, mut b) = (Vec::new(), Vec::new());
    write_request(&mut s, &mut b, &Request::Session).expect("send");
    let Answer::Session(info) = read_frame::<Answer>(&mut s, &mut r).expect("answer") else { panic!("no session") };
    info.session
}

/// A lock granted under a session that then expired (its reply lost, the
/// lock given to another) must not be answered granted again when the
/// same request comes under the client's next session.
#[test]
fn a_lock_sent_again_under_a_new_session_is_not_answered_from_the_old_one() {
    use arbor_net::branch::frames::Answer;
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let (branch, server) = serve_branch(&vol);
    let f = vol.create(ROOT_INO, b"lockfile", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    let lock = arbor_engine::files::Lock { start: 0, end: u64::MAX, typ: libc::F_WRLCK, pid: 1 };
    let take = FileOp::SetLk { ino: f.ino, owner: 5, lock, wait: false, reclaim: false };
    let tag = RequestTag { client: 93, slot: 0, seq: 1 };
    let first = new_session(server.addr);
    assert!(matches!(in_session(server.addr, first, take.clone(), tag), Answer::Reply(Ok(_))));
    // The client goes silent past the session's life: the owner drops
    // the session, and another client takes the lock.
    std::thread::sleep(Duration::from_millis(20));
    branch.reap_idle(Duration::from_millis(10));
    let other = new_session(server.addr);
    let theirs = RequestTag { client: 94, slot: 0, seq: 1 };
    assert!(matches!(in_session(server.addr, other, take.clone(), theirs), Answer::Reply(Ok(_))));
    // The first client's copy of its request, under its new session.
    let second = new_session(server.addr);
    assert_ne!(second, first, "a session id came back");
    let again = in_session(server.addr, second, take, tag);
    assert!(!matches!(again, Answer::Reply(Ok(_))), "two holders of one lock: {again:?}");
}

/// A relay to `upstream` that, while `hold` is set, keeps what a client
/// sends next, cuts the client off, and passes the kept bytes on (with the
/// connection's end in the same segment) only if `release` is set: a request
/// that reaches the owner after the client gave it up, as from an owner
/// paused with the request in its socket buffer, or (never released) a
/// partition that takes a request and answers nothing. Connections made
/// while `hold` is unset pass bytes both ways.
fn holding_relay(
    upstream: std::net::SocketAddr,
) -> (String, Arc<std::sync::atomic::AtomicBool>, Arc<std::sync::atomic::AtomicBool>) {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let (hold, release) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let (h, r) = (hold.clone(), release.clone());
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { return };
            let Ok(up) = std::net::TcpStream::connect(upstream) else { continue };
            let _ = (c.set_nodelay(true), up.set_nodelay(true));
            let (mut c_r, mut up_w) = (c.try_clone().expect("clone"), up.try_clone().expect("clone"));
            let (h, r) = (h.clone(), r.clone());
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = match c_r.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if h.load(SeqCst) {
                        let _ = c_r.shutdown(std::net::Shutdown::Both);
                        // Bounded: 30 s for the test to release.
                        for _ in 0..3000 {
                            if r.load(SeqCst) {
                                // Corked, the kept bytes go out with the
                                // connection's end in one segment: the owner
                                // finds both at once, as an owner paused with
                                // the request in its socket buffer does.
                                use std::os::fd::AsRawFd;
                                let on: libc::c_int = 1;
                                // SAFETY: a socket option on a socket we own.
                                unsafe {
                                    libc::setsockopt(
                                        up_w.as_raw_fd(),
                                        libc::IPPROTO_TCP,
                                        libc::TCP_CORK,
                                        (&on as *const libc::c_int).cast(),
                                        std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                                    )
                                };
                                let _ = up_w.write_all(&buf[..n]);
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(10));
                        }
                        break;
                    }
                    if up_w.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = up_w.shutdown(std::net::Shutdown::Write);
            });
            let (mut up_r, mut c_w) = (up, c);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut up_r, &mut c_w);
                let _ = c_w.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    (addr, hold, release)
}

/// The owner does not apply a lane's write it reads after the client
/// closed that connection: the client's close gave the write up (EIO),
/// and another node has written the file since.
#[test]
fn a_write_reaching_the_owner_after_its_close_gave_it_up_is_not_applied() {
    let GivenUp { vol, _server, f, release, .. } = a_write_given_up_then_newer_bytes();
    // The given-up write reaches the owner now, its connection closed.
    release.store(true, std::sync::atomic::Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(vol.read(f, 0, 100).expect("read"), b"NEWER", "a given-up write was applied over newer bytes");
}

/// A client whose reclaims broke off half way (the new owner went away
/// again before it answered them all) takes them back under its next
/// session: the locks its abandoned session holds are its own. Another
/// client's reclaim of them still conflicts.
#[test]
fn locks_reclaimed_under_an_abandoned_session_move_to_the_same_clients_next_one() {
    use arbor_net::branch::frames::Answer;
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg()).expect("open");
    let f = vol.create(ROOT_INO, b"locked", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    let lock = arbor_engine::files::Lock { start: 0, end: u64::MAX, typ: libc::F_WRLCK, pid: 1 };
    let tag = |client, seq| RequestTag { client, slot: 0, seq };
    // An owner grants the lock, then stops: the next one starts in its
    // grace period, when only reclaims are granted.
    {
        let (_branch, first) = serve_branch(&vol);
        let s = new_session(first.addr);
        let take = FileOp::SetLk { ino: f.ino, owner: 8, lock, wait: false, reclaim: false };
        assert!(matches!(in_session(first.addr, s, take, tag(95, 50)), Answer::Reply(Ok(_))));
    }
    let (_branch, server) = serve_branch(&vol);
    let reclaim = FileOp::SetLk { ino: f.ino, owner: 8, lock, wait: false, reclaim: true };
    // Each session first asks for its client's slots, as a client does
    // after an owner change: that binds the session to the client.
    let session_of = |client: u64| {
        let s = new_session(server.addr);
        let a = in_session(server.addr, s, FileOp::Slots { client }, tag(client, 100));
        assert!(matches!(a, Answer::Reply(Ok(Out::Slots(_)))), "{a:?}");
        s
    };
    let abandoned = session_of(95);
    assert!(matches!(in_session(server.addr, abandoned, reclaim.clone(), tag(95, 1)), Answer::Reply(Ok(_))));
    let next = session_of(95);
    let again = in_session(server.addr, next, reclaim.clone(), tag(95, 2));
    assert!(matches!(again, Answer::Reply(Ok(_))), "the client's own abandoned reclaim conflicted: {again:?}");
    let other = session_of(96);
    let theirs = in_session(server.addr, other, reclaim, tag(96, 1));
    assert!(!matches!(theirs, Answer::Reply(Ok(_))), "another client took a reclaimed lock: {theirs:?}");
}

#[test]
fn a_clone_through_the_owner_shares_bytes_written_in_flight_and_is_applied_once() {
    use arbor_net::branch::frames::Answer;
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let (writer, reader) = (client(&at), client(&at));
    let src = writer.create_open(ROOT_INO, b"part-1", libc::S_IFREG | 0o644, 0, 0).expect("create");
    let body = pattern(3 << 20, 9);
    // Written on the lanes and not yet answered: the clone must see them.
    write_in_mib(&writer, src.ino, &body);
    // A set-user-ID file (made on the owner: clients may not make one).
    let dst = first.0.create(ROOT_INO, b"object", libc::S_IFREG | 0o4755, 0, 0, 0).expect("create");
    first.0.write(dst.ino, 0, b"head:").expect("write");
    assert_eq!(writer.clone_range(src.ino, 0, dst.ino, 5, body.len() as u64).expect("clone"), body.len() as u64);
    writer.fsync(dst.ino).expect("fsync");
    let mut want = b"head:".to_vec();
    want.extend_from_slice(&body);
    assert_eq!(read_all(&reader, dst.ino, want.len(), 1 << 20), want);
    // Like a write by a client, the clone dropped the set-ID bits.
    assert_eq!(reader.getattr(dst.ino).expect("attr").perm & 0o6000, 0);

    // A clone sent again after its reply was lost, even to a new owner
    // after a crash, is answered, not applied again over a later write.
    let clone = FileOp::CloneRange { src: src.ino, src_off: 0, dst: dst.ino, dst_off: 0, len: 4 };
    let tag = RequestTag { client: 91, slot: 2, seq: 1 };
    assert!(matches!(tagged_request(first.1.addr, clone.clone(), tag), Answer::Reply(Ok(Out::Written(4)))));
    first.0.write(dst.ino, 0, b"LAST").expect("a later write");
    first.0.sync_all().expect("sync");
    let second = crash_and_restart(&dev, first, &at);
    assert!(matches!(tagged_request(second.1.addr, clone, tag), Answer::Reply(Ok(Out::Written(4)))));
    assert_eq!(
        second.0.read(dst.ino, 0, 9).expect("read"),
        b"LAST:".iter().chain(&body[..4]).copied().collect::<Vec<_>>()
    );
}

/// A clone the owner refuses (EISDIR, EINVAL) leaves the destination as it
/// was: the set-ID bits go only once the clone is sure to happen.
#[test]
fn a_refused_clone_changes_nothing() {
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let c = client(&at);
    let src = c.create_open(ROOT_INO, b"src", libc::S_IFREG | 0o644, 0, 0).expect("create");
    c.write(src.ino, 0, b"0123456789").expect("write");
    c.fsync(src.ino).expect("fsync");
    // A shared folder whose new files take its group (made on the owner).
    let dir = first.0.mkdir(ROOT_INO, b"shared", 0o2775, 0, 0).expect("mkdir");
    let r = c.clone_range(src.ino, 0, dir.ino, 0, 4);
    assert_eq!(r.map_err(|e| e.errno()), Err(libc::EISDIR));
    let after_dir = first.0.getattr(dir.ino).expect("attr").perm & 0o7777;
    // A set-user-ID file cloned onto an overlapping range of itself.
    let suid = first.0.create(ROOT_INO, b"suid", libc::S_IFREG | 0o4755, 0, 0, 0).expect("create");
    first.0.write(suid.ino, 0, b"abcdefgh").expect("write");
    let r = c.clone_range(suid.ino, 0, suid.ino, 2, 4);
    assert_eq!(r.map_err(|e| e.errno()), Err(libc::EINVAL));
    let after_suid = first.0.getattr(suid.ino).expect("attr").perm & 0o7777;
    assert_eq!((after_dir, after_suid), (0o2775, 0o4755), "a refused clone changed the destination's mode");
}

/// On the wire a clone names an exact range within its source, so a copy
/// sent again after its owner crashed is answered with the count the
/// first was; a client cuts what it asks at the source's end itself.
#[test]
fn a_resent_clone_is_answered_with_the_bytes_it_cloned() {
    use arbor_net::branch::frames::Answer;
    let dev = SimDevice::new();
    let first = owner(&dev);
    let at = found_at(&first.1);
    let src = first.0.create(ROOT_INO, b"src", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    let body = pattern(10_000, 1);
    first.0.write(src.ino, 0, &body).expect("write");
    let dst = first.0.create(ROOT_INO, b"dst", libc::S_IFREG | 0o4755, 0, 0, 0).expect("create");
    // Past the source's end, or empty: refused, and nothing changed.
    let past = FileOp::CloneRange { src: src.ino, src_off: 9_000, dst: dst.ino, dst_off: 0, len: 1 << 20 };
    let a = tagged_request(first.1.addr, past, RequestTag { client: 93, slot: 1, seq: 1 });
    assert!(matches!(a, Answer::Reply(Err(libc::EINVAL))), "{a:?}");
    let empty = FileOp::CloneRange { src: src.ino, src_off: 0, dst: dst.ino, dst_off: 0, len: 0 };
    let a = tagged_request(first.1.addr, empty, RequestTag { client: 93, slot: 1, seq: 2 });
    assert!(matches!(a, Answer::Reply(Err(libc::EINVAL))), "{a:?}");
    assert_eq!(first.0.getattr(dst.ino).expect("attr").perm & 0o7777, 0o4755);
    // The exact range: applied, and after a crash answered, not applied again.
    let clone = FileOp::CloneRange { src: src.ino, src_off: 9_000, dst: dst.ino, dst_off: 0, len: 1_000 };
    let tag = RequestTag { client: 93, slot: 1, seq: 3 };
    let a = tagged_request(first.1.addr, clone.clone(), tag);
    assert!(matches!(a, Answer::Reply(Ok(Out::Written(1_000)))), "{a:?}");
    first.0.sync_all().expect("sync");
    let second = crash_and_restart(&dev, first, &at);
    assert_eq!(second.0.getattr(dst.ino).expect("attr").size, 1_000);
    let again = tagged_request(second.1.addr, clone, tag);
    assert!(matches!(again, Answer::Reply(Ok(Out::Written(1_000)))), "{again:?}");
    // A client asks for more than is there and gets what was, then 0.
    let c = client(&at);
    let into = c.create_open(ROOT_INO, b"into", libc::S_IFREG | 0o644, 0, 0).expect("create");
    assert_eq!(c.clone_range(src.ino, 9_000, into.ino, 0, 1 << 20).expect("clone"), 1_000);
    assert_eq!(c.clone_range(src.ino, 10_000, into.ino, 1_000, 4096).expect("clone at the end"), 0);
    assert_eq!(c.read(into.ino, 0, 4096).expect("read"), &body[9_000..]);
}
