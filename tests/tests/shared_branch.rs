//! One branch, many writers: `arbor serve --branch` owns it and client
//! mounts (separate processes, real FUSE) write through it. Names,
//! errnos, close-to-open, locks across clients, the distributed-checkpoint
//! pattern, and the owner killed with -9 in the middle of writes.

use arbor_tests::*;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Polls `f` every millisecond for up to `limit`; how long it took.
fn time_until(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return Some(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

#[test]
fn clients_write_through_the_owner_and_see_each_other() {
    let Some(w) = SharedWorld::start() else { return };
    let a = w.client("a");
    let b = w.client_with("b", &["--server", &w.owner.addr]);
    let (pa, pb) = (a.mnt.clone(), b.mnt.clone());

    // A name made on one node shows on the other, even where the other
    // had just been told it was not there (a cached negative entry).
    std::fs::create_dir(pa.join("d")).expect("mkdir");
    assert!(!pb.join("d/new").exists());
    std::fs::write(pa.join("d/new"), b"made on a").expect("write");
    let seen = time_until(Duration::from_secs(5), || pb.join("d/new").exists()).expect("b sees a's file");
    println!("a file made on client a showed on client b after {seen:?}");
    // The kernel keeps names for 1 s on a shared mount: seeing it sooner
    // means the owner's invalidation did it.
    assert!(seen < Duration::from_millis(900), "seen after {seen:?}: not pushed");
    let listed = time_until(Duration::from_secs(5), || {
        std::fs::read_dir(pb.join("d")).expect("ls").any(|e| e.expect("entry").file_name() == "new")
    });
    assert!(listed.is_some());

    // Close-to-open: b reads (and caches) a file, a rewrites it in place,
    // and b's next open sees a's bytes.
    let v1 = pattern(300_000, 1);
    let v2 = pattern(300_000, 2);
    std::fs::write(pa.join("f"), &v1).expect("write v1");
    assert_eq!(std::fs::read(pb.join("f")).expect("read"), v1);
    {
        let mut f = std::fs::OpenOptions::new().write(true).open(pa.join("f")).expect("open");
        f.write_all(&v2).expect("write v2");
    }
    assert_eq!(std::fs::read(pb.join("f")).expect("read after a's close"), v2, "close-to-open");
    // And appends change the size b sees.
    std::fs::OpenOptions::new().append(true).open(pa.join("f")).expect("open").write_all(b"tail").expect("append");
    let mut got = Vec::new();
    std::fs::File::open(pb.join("f")).expect("open").read_to_end(&mut got).expect("read");
    assert_eq!(got.len(), v2.len() + 4);
    assert_eq!(&got[v2.len()..], b"tail");

    // The same errno for the same bad input as a local mount.
    assert_eq!(errno_of(std::fs::create_dir(pb.join("d"))), libc::EEXIST);
    assert_eq!(errno_of(std::fs::remove_dir(pb.join("d"))), libc::ENOTEMPTY);
    assert_eq!(errno_of(std::fs::remove_file(pb.join("missing"))), libc::ENOENT);
    assert_eq!(errno_of(std::fs::rename(pb.join("d"), pb.join("d/inside"))), libc::EINVAL);
    assert_eq!(errno_of(std::fs::read_dir(pb.join("f"))), libc::ENOTDIR);
    assert_eq!(errno_of(std::fs::write(pb.join("x".repeat(300)), b"")), libc::ENAMETOOLONG);
    // rename is atomic for every client: b never sees neither name.
    std::fs::write(pa.join("r1"), b"one").expect("write");
    std::fs::rename(pa.join("r1"), pa.join("r2")).expect("rename");
    assert_eq!(std::fs::read(pb.join("r2")).expect("read renamed"), b"one");
    assert!(!pb.join("r1").exists());

    // Unlinked while open on another node: still readable there.
    let mut held = std::fs::File::open(pb.join("r2")).expect("open");
    std::fs::remove_file(pa.join("r2")).expect("unlink");
    let mut s = String::new();
    held.seek(SeekFrom::Start(0)).expect("seek");
    held.read_to_string(&mut s).expect("read an unlinked open file");
    assert_eq!(s, "one");
    drop(held);

    let status = arbor_ok(&["status", pb.to_str().expect("utf8")]);
    assert!(status.contains(&w.owner.addr), "{status}");
    a.unmount();
    b.unmount();
    w.owner.stop();
    let fsck = arbor_ok(&["fsck", w.s.disk_str()]);
    assert!(fsck.contains("verified"), "{fsck}");
}

/// torch.distributed.checkpoint's layout: every rank writes its shard and
/// fsyncs, rank 0 writes the metadata and renames the folder into place;
/// then another node reads every byte back.
#[test]
fn four_ranks_save_a_distributed_checkpoint_and_a_fifth_reads_it() {
    let Some(w) = SharedWorld::start() else { return };
    const RANKS: usize = 4;
    const SHARD: usize = 6 << 20;
    let ranks: Vec<Mount> = (0..RANKS).map(|r| w.client(&format!("rank{r}"))).collect();
    for step in [100, 200] {
        let tmp = format!("step-{step}.tmp");
        std::fs::create_dir(ranks[0].mnt.join(&tmp)).expect("mkdir");
        std::thread::scope(|sc| {
            for (r, m) in ranks.iter().enumerate() {
                let dir = m.mnt.join(&tmp);
                sc.spawn(move || {
                    // The folder rank 0 made may take a moment to show here.
                    wait_until("the step folder", Duration::from_secs(5), || dir.is_dir());
                    let mut f = std::fs::File::create(dir.join(format!("__{r}_0.distcp"))).expect("create shard");
                    let data = pattern(SHARD, (step * 10 + r) as u32);
                    for piece in data.chunks(1 << 20) {
                        f.write_all(piece).expect("write shard");
                    }
                    f.sync_all().expect("fsync shard");
                });
            }
        });
        write_synced(&ranks[0].mnt.join(&tmp).join(".metadata"), format!("step {step}").as_bytes());
        std::fs::rename(ranks[0].mnt.join(&tmp), ranks[0].mnt.join(format!("step-{step}"))).expect("rename");
        // Rank 0 freezes the disk through its own mount (the owner does it).
        arbor_ok(&["checkpoints", "create", ranks[0].mnt.to_str().expect("utf8"), &format!("ckpt-{step}")]);
    }
    let reader = w.client("reader");
    for step in [100, 200] {
        let dir = reader.mnt.join(format!("step-{step}"));
        assert_eq!(std::fs::read(dir.join(".metadata")).expect("metadata"), format!("step {step}").as_bytes());
        for r in 0..RANKS {
            let got = std::fs::read(dir.join(format!("__{r}_0.distcp"))).expect("shard");
            assert!(got == pattern(SHARD, (step * 10 + r) as u32), "step {step} rank {r}: wrong bytes");
        }
        assert!(!reader.mnt.join(format!("step-{step}.tmp")).exists());
    }
    // The shards' bytes came from the disk's segments, not through the owner.
    let status: serde_json::Value =
        serde_json::from_str(&arbor_ok(&["status", reader.mnt.to_str().expect("utf8"), "--json"])).expect("json");
    let reads = &status["reads"];
    let shards = (2 * RANKS * SHARD) as u64;
    println!("reader: {reads}");
    assert!(reads["from_segments_bytes"].as_u64().expect("bytes") >= shards, "{reads}");
    assert!(reads["from_owner_bytes"].as_u64().expect("bytes") < 4096, "{reads}");
    assert_eq!(reads["segment_reads_failed"], 0, "{reads}");
    reader.unmount();
    for m in ranks {
        m.unmount();
    }
    w.owner.stop();
    // A plain mount of the branch (no owner now) has it all too, and the
    // first checkpoint has the first step only.
    let m = Mount::start(w.s.disk_str(), &w.s.mnt, &[]);
    assert_eq!(std::fs::read_dir(m.mnt.join("step-200")).expect("ls").count(), RANKS + 1);
    m.unmount();
    let m = Mount::start(w.s.disk_str(), &w.s.mnt, &["--checkpoint", "ckpt-100"]);
    assert!(m.mnt.join("step-100/.metadata").exists());
    assert!(!m.mnt.join("step-200").exists());
    assert!(std::fs::read(m.mnt.join("step-100/__3_0.distcp")).expect("shard") == pattern(SHARD, 1003));
    m.unmount();
}

/// Two clients create, rename and unlink in one folder at once; every name
/// ends where the operations say.
#[test]
fn two_clients_change_one_folder_at_once() {
    let Some(w) = SharedWorld::start() else { return };
    let (a, b) = (w.client("a"), w.client("b"));
    std::fs::create_dir(a.mnt.join("shared")).expect("mkdir");
    wait_until("the folder on b", Duration::from_secs(5), || b.mnt.join("shared").is_dir());
    const N: usize = 150;
    std::thread::scope(|sc| {
        for (who, m) in [("a", &a), ("b", &b)] {
            let dir = m.mnt.join("shared");
            sc.spawn(move || {
                for i in 0..N {
                    let (made, moved) = (dir.join(format!("{who}-new-{i}")), dir.join(format!("{who}-{i}")));
                    std::fs::write(&made, format!("{who} {i}")).expect("create");
                    std::fs::rename(&made, &moved).expect("rename");
                    if i % 3 == 0 {
                        std::fs::remove_file(&moved).expect("unlink");
                    }
                }
            });
        }
    });
    let mut want: Vec<String> =
        ["a", "b"].iter().flat_map(|w| (0..N).filter(|i| i % 3 != 0).map(move |i| format!("{w}-{i}"))).collect();
    want.sort();
    for m in [&a, &b] {
        let mut got: Vec<String> = std::fs::read_dir(m.mnt.join("shared"))
            .expect("ls")
            .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
            .collect();
        got.sort();
        assert_eq!(got, want, "names on {}", m.mnt.display());
        for name in &want {
            let (who, i) = name.split_once('-').expect("name");
            assert_eq!(std::fs::read_to_string(m.mnt.join("shared").join(name)).expect("read"), format!("{who} {i}"));
        }
    }
    a.unmount();
    b.unmount();
    w.owner.stop();
    let fsck = arbor(&["fsck", w.s.disk_str()]);
    assert!(fsck.status.success(), "fsck: {}", String::from_utf8_lossy(&fsck.stdout));
}

/// A valid `security.capability` value (revision 2, CAP_NET_BIND_SERVICE
/// permitted and effective).
const A_CAPABILITY: [u8; 20] = [1, 0, 0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

fn capability_of(p: &Path) -> std::io::Result<Vec<u8>> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("path");
    let mut buf = [0u8; 64];
    // SAFETY: a NUL-terminated path and name, and a buffer of the length given.
    let n = unsafe { libc::getxattr(c.as_ptr(), c"security.capability".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(buf[..n as usize].to_vec())
}

fn set_capability(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: a NUL-terminated path and name, and a value of the length given.
    let r = unsafe {
        libc::setxattr(c.as_ptr(), c"security.capability".as_ptr(), A_CAPABILITY.as_ptr().cast(), A_CAPABILITY.len(), 0)
    };
    assert_eq!(r, 0, "setxattr: {}", std::io::Error::last_os_error());
}

/// Writes through a client mount clear set-user-ID bits and capabilities
/// as a local mount does, and the kernel does not ask for
/// `security.capability` before every write (each such question was a
/// round trip to the owner that also waited for every write in flight).
#[test]
fn client_writes_clear_set_id_bits_and_capabilities_without_a_question_per_write() {
    use std::os::unix::fs::PermissionsExt;
    // Root sets set-ID bits and capabilities and gives the file away: an
    // owner that trusts its clients' root.
    let Some(w) = SharedWorld::start_with(&["--allow-suid-devices", "--no-root-squash"]) else { return };
    let a = w.client_with("a", &["--allow-other"]);
    let b = w.client("b");
    std::fs::set_permissions(&a.mnt, std::fs::Permissions::from_mode(0o777)).expect("chmod mnt");
    let f = a.mnt.join("tool");
    let asked = status_number(&a.mnt, "fuse_getxattr_requests");
    let want = pattern(64 << 16, 5);
    {
        let mut h = std::fs::File::create(&f).expect("create");
        for piece in want.chunks(1 << 16) {
            h.write_all(piece).expect("write");
        }
        h.sync_all().expect("fsync");
    }
    let asked = status_number(&a.mnt, "fuse_getxattr_requests") - asked;
    println!("{asked} GETXATTR requests for 64 writes");
    assert!(asked < 8, "{asked} GETXATTR requests for 64 writes");
    assert!(std::fs::read(b.mnt.join("tool")).expect("read on b") == want);

    let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o7777;
    let set = |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).expect("chmod");
    assert_writes_and_chown_clear_set_id_bits(&f);
    assert_eq!(mode(&b.mnt.join("tool")), 0o0755, "the owner holds the mode they left");

    // Capabilities set on another node go with a write here, whoever
    // makes it, even once a's kernel has marked the file as having none.
    for (name, m) in [("plain", 0o644), ("tool", 0o2767)] {
        let (here, there) = (a.mnt.join(name), b.mnt.join(name));
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&here)
            .expect("open")
            .write_all(b"1")
            .expect("write");
        set(&here, m);
        std::fs::OpenOptions::new().append(true).open(&here).expect("open").write_all(b"2").expect("write");
        set_capability(&there);
        assert_eq!(capability_of(&there).expect("the capability on b"), A_CAPABILITY);
        std::fs::OpenOptions::new().append(true).open(&here).expect("open").write_all(b"3").expect("write");
        assert_eq!(errno_of(capability_of(&here)), libc::ENODATA, "{name}: capability after a write on a");
        assert_eq!(errno_of(capability_of(&there)), libc::ENODATA, "{name}: capability after a write, on b");
    }
    a.unmount();
    b.unmount();
    w.owner.stop();
}

fn flock(f: &std::fs::File, how: i32) -> i32 {
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), how) } == 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }
}

fn fcntl_lock(f: &std::fs::File, typ: i32, start: i64, len: i64) -> i32 {
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = typ as i16;
    l.l_whence = libc::SEEK_SET as i16;
    l.l_start = start;
    l.l_len = len;
    // SAFETY: F_SETLK with a filled struct flock on a descriptor we own.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETLK, &l) } == 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }
}

#[test]
fn locks_exclude_across_clients_and_die_with_their_client() {
    let Some(w) = SharedWorld::start() else { return };
    let (a, b) = (w.client("a"), w.client("b"));
    std::fs::write(a.mnt.join("lockfile"), b"x").expect("create");
    let fa = std::fs::File::open(a.mnt.join("lockfile")).expect("open a");
    let fb = std::fs::OpenOptions::new().read(true).write(true).open(b.mnt.join("lockfile")).expect("open b");

    // flock: held on a, refused on b, and a blocked locker on b gets it
    // once a lets go.
    assert_eq!(flock(&fa, libc::LOCK_EX), 0);
    assert_eq!(flock(&fb, libc::LOCK_EX | libc::LOCK_NB), libc::EWOULDBLOCK);
    let waited = std::thread::scope(|sc| {
        let t = sc.spawn(|| {
            let t0 = Instant::now();
            assert_eq!(flock(&fb, libc::LOCK_EX), 0);
            t0.elapsed()
        });
        std::thread::sleep(Duration::from_millis(300));
        assert!(!t.is_finished(), "b's blocking flock must wait while a holds it");
        assert_eq!(flock(&fa, libc::LOCK_UN), 0);
        t.join().expect("join")
    });
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    assert_eq!(flock(&fa, libc::LOCK_EX | libc::LOCK_NB), libc::EWOULDBLOCK, "b holds it now");
    assert_eq!(flock(&fb, libc::LOCK_UN), 0);

    // fcntl byte ranges: overlapping write locks conflict, disjoint ones do not.
    let fa_rw = std::fs::OpenOptions::new().read(true).write(true).open(a.mnt.join("lockfile")).expect("open");
    assert_eq!(fcntl_lock(&fa_rw, libc::F_WRLCK, 0, 100), 0);
    assert_eq!(fcntl_lock(&fb, libc::F_WRLCK, 50, 10), libc::EAGAIN);
    assert_eq!(fcntl_lock(&fb, libc::F_WRLCK, 100, 100), 0);
    assert_eq!(fcntl_lock(&fa_rw, libc::F_UNLCK, 0, 100), 0);
    assert_eq!(fcntl_lock(&fb, libc::F_WRLCK, 50, 10), 0);
    drop((fa, fa_rw, fb));

    // A client killed with -9 while a process on it holds a lock: the
    // owner drops the lock once the client's connection is gone.
    // Its own process group, so that the `sleep` under `flock` is stopped
    // with it at the end.
    let holder = Command::new("flock")
        .arg(a.mnt.join("lockfile"))
        .args(["-c", "sleep 600"])
        .process_group(0)
        .spawn()
        .expect("flock holder");
    let fb = std::fs::File::open(b.mnt.join("lockfile")).expect("open b");
    wait_until("a's holder to take the lock", Duration::from_secs(10), || {
        // Got it first: let go, so that the holder can have it.
        let r = flock(&fb, libc::LOCK_EX | libc::LOCK_NB);
        if r == 0 {
            flock(&fb, libc::LOCK_UN);
        }
        r == libc::EWOULDBLOCK
    });
    let mnt_a = a.mnt.clone();
    a.kill9();
    let freed = time_until(Duration::from_secs(30), || {
        let r = flock(&fb, libc::LOCK_EX | libc::LOCK_NB);
        r == 0
    });
    println!("a dead client's lock was dropped after {freed:?}");
    assert!(freed.is_some(), "the dead client's lock was never dropped");
    let mut holder = holder;
    // SAFETY: signals the holder's own process group.
    unsafe { libc::kill(-(holder.id() as i32), libc::SIGKILL) };
    let _ = holder.wait();
    let _ = arbor(&["unmount", mnt_a.to_str().expect("utf8")]);
    drop(fb);
    b.unmount();
}

#[test]
fn fsynced_writes_survive_the_owner_killed_and_restarted() {
    let Some(mut w) = SharedWorld::start() else { return };
    let a = w.client("a");
    let b = w.client("b");
    const FILES: usize = 24;
    const LEN: usize = 3 << 20;
    // The writer runs on; the owner is killed and restarted under it.
    let done = std::thread::scope(|sc| {
        let dir = a.mnt.clone();
        let writer = sc.spawn(move || {
            // A file is saved as a training job saves a checkpoint: write
            // it all, fsync, and start it again if that fails (a file the
            // owner lost with its restart gives EIO).
            let save = |i: usize| -> std::io::Result<()> {
                let data = pattern(LEN, i as u32);
                let mut f = std::fs::File::create(dir.join(format!("f{i}")))?;
                for piece in data.chunks(256 << 10) {
                    f.write_all(piece)?;
                }
                f.sync_all()
            };
            let mut synced = Vec::new();
            for i in 0..FILES {
                for attempt in 1..=3 {
                    match save(i) {
                        Ok(()) => {
                            synced.push(i);
                            break;
                        }
                        Err(e) => println!("f{i}, attempt {attempt}: {e}; saving it again"),
                    }
                }
            }
            synced
        });
        // Kill the owner twice in the middle of the writes.
        for at in [4, 12] {
            let marker = a.mnt.join(format!("f{at}"));
            wait_until("the writer to get that far", Duration::from_secs(120), || {
                writer.is_finished() || marker.exists()
            });
            assert!(!writer.is_finished(), "the writer finished before the owner was killed");
            w.owner.kill9_and_restart();
        }
        writer.join().expect("writer")
    });
    assert_eq!(done.len(), FILES, "every write and fsync returned");
    // Every fsynced file is whole, on the writer and on the other client,
    // and neither was remounted.
    for m in [&a, &b] {
        for i in &done {
            let got = std::fs::read(m.mnt.join(format!("f{i}"))).expect("read");
            assert!(got == pattern(LEN, *i as u32), "f{i} on {} is not what was fsynced", m.mnt.display());
        }
    }
    let status = arbor_ok(&["status", a.mnt.to_str().expect("utf8"), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&status).expect("json");
    assert!(v["owner_sessions"].as_u64().unwrap_or(0) >= 2, "a new session after the restart: {status}");
    a.unmount();
    b.unmount();
    w.owner.stop();
    let fsck = arbor(&["fsck", w.s.disk_str()]);
    assert!(fsck.status.success(), "fsck: {}", String::from_utf8_lossy(&fsck.stdout));
}

/// A client overwrites a file without fsync and the owner is stopped
/// cleanly and started again: the file is what was written last, never
/// the overwritten bytes sent again over it; and another client's fsynced
/// bytes are never overwritten by a client's older unsynced ones.
#[test]
fn a_clean_owner_restart_brings_back_no_overwritten_bytes() {
    let Some(mut w) = SharedWorld::start() else { return };
    let a = w.client("a");
    let b = w.client("b");
    let f = a.mnt.join("f");
    std::fs::write(&f, pattern(8 << 20, 7)).expect("8 MiB");
    std::fs::write(&f, b"").expect("truncate");
    std::fs::write(&f, b"new\n").expect("rewrite");
    // a writes g and closes it, unsynced; b then overwrites and fsyncs.
    std::fs::write(a.mnt.join("g"), b"old from a").expect("a's g");
    let _ = std::fs::read(b.mnt.join("g")).expect("b opens g after a's close");
    write_synced(&b.mnt.join("g"), b"NEW FROM B");
    w.owner.term_and_restart();
    let got = std::fs::read(&f).expect("read f after the restart");
    assert_eq!(got, b"new\n", "f is {} bytes after the restart, not the last write", got.len());
    let len = std::fs::metadata(&f).expect("stat").len();
    assert_eq!(len, 4);
    // a's next fsync of f reports nothing lost (a clean stop kept it all).
    std::fs::OpenOptions::new().write(true).open(&f).expect("open").sync_all().expect("fsync after a clean stop");
    for m in [&a, &b] {
        assert_eq!(std::fs::read(m.mnt.join("g")).expect("read g"), b"NEW FROM B", "on {}", m.mnt.display());
    }
    a.unmount();
    b.unmount();
}

#[test]
fn a_new_owner_takes_over_and_clients_follow_it() {
    let Some(mut w) = SharedWorld::start() else { return };
    let a = w.client("a");
    write_synced(&a.mnt.join("before"), b"written through the first owner");
    // A second owner while the first lives is refused.
    let out = Command::new(arbor_bin())
        .args(["serve", w.s.disk_str(), "--branch", "main", "--listen", "127.0.0.1:0", "--foreground"])
        .args(["--token-file", w.token.to_str().expect("utf8")])
        .output()
        .expect("second owner");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already open") || err.contains("read-write"), "{err}");
    // The first dies; a new one starts on another port; the client finds
    // it through the owner record and carries on.
    w.owner.kill9_only();
    let second = SharedWorld::owner(&w.s, &w.token, free_port(), &[]);
    write_synced(&a.mnt.join("after"), b"written through the second owner");
    assert_eq!(std::fs::read(a.mnt.join("before")).expect("read"), b"written through the first owner");
    let status = arbor_ok(&["status", a.mnt.to_str().expect("utf8"), "--json"]);
    assert!(status.contains(&second.addr), "{status}");
    a.unmount();
    second.stop();
    let m = Mount::start(w.s.disk_str(), &w.s.mnt, &[]);
    assert_eq!(std::fs::read(m.mnt.join("after")).expect("read"), b"written through the second owner");
    m.unmount();
}

/// A client mount started while its owner is down (killed, its lease not
/// renewed, not started again yet) waits for it: it never takes the branch
/// itself, which would leave the owner unable to start.
#[test]
fn a_client_mount_started_while_its_owner_is_down_waits_for_it() {
    let Some(mut w) = SharedWorld::start() else { return };
    let a = w.client("a");
    write_synced(&a.mnt.join("before"), b"through the owner");
    w.owner.kill9_only();
    let mnt = w.s.dir.path().join("c");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let (disk, token) = (w.s.disk_str().to_string(), w.token.to_str().expect("utf8").to_string());
    let c = std::thread::spawn(move || Mount::start(&disk, &mnt, &["--token-file", &token]));
    std::thread::sleep(Duration::from_secs(3));
    assert!(!c.is_finished(), "the mount did not wait for the owner");
    w.owner.start_again();
    let c = c.join().expect("the mount came up once the owner did");
    write_synced(&c.mnt.join("from-c"), b"through the owner again");
    assert_eq!(std::fs::read(a.mnt.join("from-c")).expect("a reads it"), b"through the owner again");
    assert_eq!(std::fs::read(c.mnt.join("before")).expect("c reads it"), b"through the owner");
    c.unmount();
    a.unmount();
}

/// Two nodes appending to one log through `O_APPEND` descriptors: each
/// kernel knows only the size it last saw, and the owner appends at the
/// end it has, so no line overwrites another.
#[test]
fn appends_from_two_nodes_keep_every_line() {
    let Some(w) = SharedWorld::start() else { return };
    let (a, b) = (w.client("a"), w.client("b"));
    std::fs::write(a.mnt.join("log"), b"").expect("create");
    wait_until("b to see the log", Duration::from_secs(10), || b.mnt.join("log").exists());
    let open = |p: std::path::PathBuf| std::fs::OpenOptions::new().append(true).open(p).expect("open O_APPEND");
    let (mut fa, mut fb) = (open(a.mnt.join("log")), open(b.mnt.join("log")));
    let mut want = Vec::new();
    for i in 0..25 {
        for (f, who) in [(&mut fa, "a"), (&mut fb, "b")] {
            let line = format!("{who}{i:03}\n");
            f.write_all(line.as_bytes()).expect("append");
            want.push(line);
        }
    }
    fa.sync_all().expect("fsync");
    fb.sync_all().expect("fsync");
    let got = String::from_utf8(std::fs::read(b.mnt.join("log")).expect("read")).expect("utf8");
    let mut lines: Vec<String> = got.split_inclusive('\n').map(str::to_string).collect();
    assert_eq!(got.len(), want.len() * 5, "{got:?}");
    lines.sort();
    want.sort();
    assert_eq!(lines, want);
    drop((fa, fb));
    a.unmount();
    b.unmount();
}

/// Owners on other hosts (another UTS namespace and network namespace):
/// their leases are judged by watching them, never by their pids or
/// clocks. A second owner is refused while the first renews its lease;
/// after a kill -9, `--take-over` takes the branch at once, and without it
/// a new owner waits until it has seen the lease go unrenewed for its
/// life. The client follows each owner.
#[test]
fn take_over_from_an_owner_on_another_node() {
    if !fuse_available() || !Command::new("unshare").args(["-u", "true"]).status().is_ok_and(|s| s.success()) {
        return;
    }
    let s = Scratch::new();
    let token = s.dir.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("token");
    let tok = token.to_str().expect("utf8");
    const TTL: Duration = Duration::from_secs(3);
    let owner_args = ["--branch", "main", "--token-file", tok, "--lease-ttl", "3s"];
    // node-a is a host of its own: another network namespace (its own
    // address) and another host name. Where a namespace cannot be made,
    // only the host name is its own.
    let net = NetNs::create("take-over")
        .map_err(|e| eprintln!("SKIPPED the network namespace ({e}): node-a differs by host name only"))
        .ok();
    let a_log = s.dir.path().join("a.log");
    let mut first = Serve::start_on(net.as_ref(), Some("node-a"), s.disk_str(), free_port(), &owner_args, &[], &a_log);
    let mnt = s.dir.path().join("client");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let client = Mount::start(s.disk_str(), &mnt, &["--token-file", tok]);
    write_synced(&mnt.join("before"), b"through node-a");
    if let Some(n) = &net {
        let status = arbor_ok(&["status", mnt.to_str().expect("utf8"), "--json"]);
        assert!(status.contains(&n.ip), "the client reaches node-a at its own address: {status}");
    }

    // Refused while node-a lives (on a local-folder disk the folder's
    // own branch lock refuses first; on a bucket, watching the lease does,
    // as engine/tests/bucket_tier.rs shows).
    let out = Command::new(arbor_bin())
        .args(["serve", s.disk_str(), "--listen", "127.0.0.1:0", "--foreground"])
        .args(owner_args)
        .output()
        .expect("second owner");
    let err = String::from_utf8_lossy(&out.stderr);
    let named = err.contains("node-a") || err.contains(&first.addr);
    assert!(!out.status.success() && named, "refused, naming the holder: {err}");

    // node-a dies; node-b takes over at once.
    first.kill9_only();
    let killed = Instant::now();
    let b_log = s.dir.path().join("b.log");
    let b_args = [&owner_args[..], &["--take-over"]].concat();
    let mut second = Serve::start_on(None, Some("node-b"), s.disk_str(), free_port(), &b_args, &[], &b_log);
    println!("node-b took over {:?} after node-a was killed", killed.elapsed());
    write_synced(&mnt.join("after"), b"through node-b");
    assert_eq!(std::fs::read(mnt.join("before")).expect("read"), b"through node-a");
    let status = arbor_ok(&["status", mnt.to_str().expect("utf8"), "--json"]);
    assert!(status.contains(&second.addr), "the client follows the new owner: {status}");

    // node-b dies; an owner here without --take-over waits for its lease
    // to lapse by this node's clock, then owns the branch.
    second.kill9_only();
    let killed = Instant::now();
    let third = Serve::start(s.disk_str(), free_port(), &owner_args, &[], &s.dir.path().join("c.log"));
    let waited = killed.elapsed();
    println!("an owner here took the branch {waited:?} after node-b was killed");
    assert!(waited >= TTL, "claimed after {waited:?}, before node-b's lease was seen unrenewed for its life");
    write_synced(&mnt.join("last"), b"through this node");
    assert_eq!(std::fs::read(mnt.join("after")).expect("read"), b"through node-b");
    client.unmount();
    third.stop();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    assert_eq!(std::fs::read(m.mnt.join("last")).expect("read"), b"through this node");
    m.unmount();
}

/// A mount on the owner's host in a PID namespace of its own and with its
/// own cache folder (a container with host networking), its clock 40 s
/// ahead: the owner's pid means nothing there and its clock says the lease
/// ran out, yet it never becomes a second writer. Without the token it is
/// refused; with it, it mounts through the owner like any client.
#[test]
fn a_mount_in_another_pid_namespace_with_a_stepped_clock_never_becomes_a_second_writer() {
    let Some(w) = SharedWorld::start() else { return };
    let pidns = Command::new("unshare").args(["-pf", "true"]).status().is_ok_and(|s| s.success());
    let ahead = clock_40s_ahead().unwrap_or_default();
    let faketime =
        !ahead.is_empty() && Command::new(&ahead[0]).args(&ahead[1..]).arg("true").status().is_ok_and(|s| s.success());
    if !pidns || !faketime {
        if std::env::var_os("CI").is_some() {
            panic!("CI needs unshare -p and faketime");
        }
        eprintln!("SKIPPED: unshare -p or faketime is missing");
        return;
    }
    let a = w.client("a");
    write_synced(&a.mnt.join("before"), b"through the owner");
    let container: Vec<&str> = ahead.iter().map(String::as_str).chain(["unshare", "-pf"]).collect();
    let cache = w.s.dir.path().join("container-cache");
    let env = [("XDG_CACHE_HOME", cache.to_str().expect("utf8").to_string())];
    let mnt = w.s.dir.path().join("container");
    std::fs::create_dir_all(&mnt).expect("mkdir");

    // Without the token: refused, pointing at the owner, within bounds.
    let log = w.s.dir.path().join("container-refused.log");
    let mut child = Command::new(container[0])
        .args(&container[1..])
        .arg(arbor_bin())
        .args(["mount", w.s.disk_str(), mnt.to_str().expect("utf8"), "--foreground", "--branch", "main"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(std::fs::File::create(&log).expect("log"))
        .stderr(std::fs::File::create(log.with_extension("err")).expect("log"))
        .spawn()
        .expect("spawn");
    let started = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            let _ = Command::new(arbor_bin()).args(["unmount", mnt.to_str().expect("utf8")]).output();
            panic!("the container's mount did not give up: it may have become a second writer");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = std::fs::read_to_string(log.with_extension("err")).unwrap_or_default();
    assert!(!status.success() && err.contains("served by arbor serve"), "{status}: {err}");

    // The owner is still the writer: its client's fsyncs still land.
    write_synced(&a.mnt.join("still"), b"the owner kept the branch");

    // With the token it is a client of the same owner.
    let c =
        Mount::start_under(&container, w.s.disk_str(), &mnt, &["--token-file", w.token.to_str().expect("utf8")], &env);
    write_synced(&c.mnt.join("from-container"), b"through the owner too");
    assert_eq!(std::fs::read(a.mnt.join("from-container")).expect("a reads it"), b"through the owner too");
    assert_eq!(std::fs::read(c.mnt.join("still")).expect("c reads it"), b"the owner kept the branch");
    write_synced(&a.mnt.join("after"), b"after the container mounted");
    let owner_log = std::fs::read_to_string(&w.owner.log).unwrap_or_default();
    assert!(!owner_log.contains("fenced") && !owner_log.contains("lost the branch"), "{owner_log}");
    c.unmount();
    a.unmount();
}

#[test]
fn without_the_token_nothing_is_listed_read_or_written() {
    let Some(w) = SharedWorld::start() else { return };
    let a = w.client("a");
    std::fs::write(a.mnt.join("secret"), b"s").expect("write");
    // A mount with the wrong token fails, with a message, and mounts nothing.
    let wrong = w.s.dir.path().join("wrong");
    std::fs::write(&wrong, "not-the-token\n").expect("token");
    let mnt = w.s.dir.path().join("intruder");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let out =
        arbor(&["mount", w.s.disk_str(), mnt.to_str().expect("utf8"), "--token-file", wrong.to_str().expect("utf8")]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("token"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!is_mounted(&mnt));
    // The wire: without the token every file request is 401 and empty.
    for path in ["/v1/files/main/session", "/v1/files/main", "/v1/files/main/events?session=1&after=0"] {
        let (status, body) = http_get(&w.owner.addr, path, None).expect("GET");
        assert!(status.contains(" 401 "), "{path}: {status}");
        assert!(body.is_empty(), "{path}: {body}");
    }
    a.unmount();
}

#[test]
fn with_a_timeout_an_operation_fails_with_eio_while_the_owner_is_away() {
    let Some(mut w) = SharedWorld::start() else { return };
    let a = w.client_with("a", &["--timeout", "2s"]);
    write_synced(&a.mnt.join("f"), b"before");
    w.owner.kill9_only();
    let t = Instant::now();
    let r = std::fs::metadata(a.mnt.join("never-looked-up"));
    let took = t.elapsed();
    assert_eq!(errno_of(r), libc::EIO, "after the timeout, EIO");
    assert!(took >= Duration::from_millis(1500) && took < Duration::from_secs(20), "{took:?}");
    // The owner back: the same mount carries on.
    w.owner.kill9_and_restart();
    assert_eq!(std::fs::read(a.mnt.join("f")).expect("read"), b"before");
    write_synced(&a.mnt.join("g"), b"after");
    a.unmount();
}

/// The bytes under every folder named `objects` below `root`.
fn chunk_file_bytes(root: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                if e.file_name() == "objects" {
                    total += bytes_under(&e.path());
                } else {
                    stack.push(e.path());
                }
            }
        }
    }
    total
}

#[test]
fn an_imported_file_read_through_the_owner_keeps_its_chunks_in_the_owners_cache() {
    use arbor_engine::bucket::ObjectStore;
    let Some(w) = S3World::start() else { return };
    let body = pattern((3 << 20) + 99, 41);
    w.bucket().put("corpus/shard.tar", &body).expect("put");
    let disk = w.dir.path().join("disk");
    let disk = disk.to_str().expect("utf8");
    arbor_env_ok(&["init", disk], &w.env);
    arbor_env_ok(&["import", disk, &format!("s3://{}/corpus", arbor_engine::testkit::S3_BUCKET)], &w.env);
    let token = w.dir.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("token");
    let token = token.to_str().expect("utf8");
    let log = w.dir.path().join("owner.log");
    let owner = Serve::start(disk, free_port(), &["--branch", "main", "--token-file", token], &w.env, &log);
    assert_eq!(chunk_file_bytes(w.dir.path()), 0, "nothing cached before a read");
    let c = Mount::start_env(disk, &w.mnt("client"), &["--token-file", token], &w.env);
    assert!(std::fs::read(c.mnt.join("shard.tar")).expect("read") == body, "the object's bytes, through the owner");
    c.unmount_env(&w.env);
    owner.stop();
    let cached = chunk_file_bytes(w.dir.path());
    assert!(cached > body.len() as u64, "the owner kept the chunks it fetched: {cached} B");
}

/// On an s3 disk a client reads the bytes the bucket already holds as
/// chunks, through a cache server (here the owner's own port, which gives
/// the chunks its branch wrote from its own cache, not the bucket) and its
/// memory cache, and only the bytes not uploaded yet through the owner's
/// file operations; every byte is the one written.
#[test]
fn clients_read_uploaded_bytes_through_the_chunk_cache_not_the_owner() {
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{}/disks/rwx", arbor_engine::testkit::S3_BUCKET);
    arbor_env_ok(&["init", &disk], &w.env);
    let token = w.dir.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("token");
    let tok = token.to_str().expect("utf8");
    // Every process reaches the bucket through a proxy that counts.
    let proxy = arbor_engine::testkit::Proxy::start(w.s3_addr(), Duration::ZERO).expect("proxy");
    let env = w.env_via(&proxy.endpoint());
    let log = w.dir.path().join("owner.log");
    let owner = Serve::start(
        &disk,
        free_port(),
        &["--branch", "main", "--token-file", tok, "--segment-size", "1M"],
        &env,
        &log,
    );

    let mnt_a = w.mnt("a");
    // On the owner's node, where the branch's cache folder is the owner's:
    // this mount caches in a folder of its own.
    let a = Mount::start_env(&disk, &mnt_a, &["--token-file", tok], &env);
    let data = pattern(6 << 20, 41);
    let (_, before) = w.objects_and_bytes_under("disks/rwx/segments");
    write_synced(&mnt_a.join("data"), &data);
    // Sealed segments go up in the background. Counted in bytes, not
    // objects: a 1 MiB write is stored in pieces, and a segment of 1 MiB
    // holds about half of one.
    wait_until("5 MiB of segments in the bucket", Duration::from_secs(30), || {
        w.objects_and_bytes_under("disks/rwx/segments").1 >= before + (5 << 20)
    });

    let mnt_b = w.mnt("b");
    let b = Mount::start_env(
        &disk,
        &mnt_b,
        &["--token-file", tok, "--cache-server", &owner.addr, "--cache-dir", "none", "--cache-memory", "64M"],
        &env,
    );
    let from_bucket = proxy.sent();
    assert!(std::fs::read(mnt_b.join("data")).expect("read") == data, "the bytes a wrote");
    let from_bucket = proxy.sent() - from_bucket;
    println!("the bucket sent {from_bucket} bytes for b's read");
    assert!(from_bucket < 256 << 10, "the owner's own chunks, not the bucket's: {from_bucket} bytes from the bucket");
    let status: serde_json::Value =
        serde_json::from_str(&arbor_env_ok(&["status", mnt_b.to_str().expect("utf8"), "--json"], &env)).expect("json");
    let (reads, servers) = (&status["reads"], &status["cache_servers"]);
    println!("b: {reads} {servers}");
    let direct = reads["from_segments_bytes"].as_u64().expect("bytes");
    let via_owner = reads["from_owner_bytes"].as_u64().expect("bytes");
    assert!(direct >= 4 << 20, "uploaded bytes read from the bucket's segments: {reads}");
    assert!(direct + via_owner >= data.len() as u64, "{reads}");
    assert_eq!(reads["segment_reads_failed"], 0, "{reads}");
    assert!(servers[0]["chunks"].as_u64().expect("chunks") >= 4, "chunks came through the cache server: {servers}");
    b.unmount_env(&env);
    a.unmount_env(&env);
    owner.stop();
    // a's own cache folder, and b's memory-only one, went with them, or
    // with the next arbor process on this node.
    arbor_env_ok(&["branches", "list", &disk], &env);
    let mut left = Vec::new();
    let mut stack = vec![w.dir.path().join("cache")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                if e.file_name().to_string_lossy().starts_with("cmd-") {
                    left.push(e.path());
                }
                stack.push(e.path());
            }
        }
    }
    assert!(left.is_empty(), "cache folders left behind: {left:?}");
}

/// A CA and a certificate for 127.0.0.1 it signed, written under `dir`:
/// (ca.pem, server.pem, server.key).
fn tls_files(dir: &Path) -> (String, String, String) {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name.push(rcgen::DnType::CommonName, "arbor test CA");
    let ca = rcgen::CertifiedIssuer::self_signed(ca, rcgen::KeyPair::generate().expect("key")).expect("ca");
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
    let cert = params.signed_by(&key, &ca).expect("sign");
    let write = |name: &str, pem: String| {
        let p = dir.join(name);
        std::fs::write(&p, pem).expect("write");
        p.to_str().expect("utf8").to_string()
    };
    (write("ca.pem", ca.pem()), write("server.pem", cert.pem()), write("server.key", key.serialize_pem()))
}

#[test]
fn a_mount_through_an_owner_speaking_tls_writes_syncs_and_reads_back_and_clear_text_is_refused() {
    let certs = tempfile::tempdir().expect("tempdir");
    let (ca, cert, key) = tls_files(certs.path());
    let Some(w) = SharedWorld::start_with(&["--tls-cert", &cert, "--tls-key", &key]) else { return };
    let a = w.client_with("a", &["--tls-ca", &ca]);
    let data = pattern(3 << 20, 9);
    write_synced(&a.mnt.join("over-tls"), &data);
    assert_eq!(std::fs::read(a.mnt.join("over-tls")).expect("read back"), data);
    // A mount without TLS is refused with a reason, and mounts nothing.
    let mnt = w.s.dir.path().join("clear");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let (mnt_s, token) = (mnt.to_str().expect("utf8"), w.token.to_str().expect("utf8"));
    let out = arbor(&["mount", w.s.disk_str(), mnt_s, "--token-file", token, "--server", &w.owner.addr]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("speaks TLS"), "{err}");
    assert!(!is_mounted(&mnt));
    a.unmount();
    w.owner.stop();
    // A key that is not the certificate's: refused before serving, naming it.
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let bad = ["serve", w.s.disk_str(), "--listen", &listen, "--token-file", token, "--tls-cert", &cert, "--tls-key"];
    let out = arbor(&[&bad[..], &[ca.as_str()]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let said: Vec<&str> = err.lines().filter(|l| l.starts_with("arbor:")).collect();
    assert!(said.len() == 1 && said[0].contains("ca.pem") && said[0].contains("private key"), "{err}");
}
