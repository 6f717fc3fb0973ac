//! Real mounts of the real binary: the ML workloads, crashes by kill -9,
//! unmounts from outside, open-but-unlinked files and locks.

use arbor_tests::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

fn pattern_mib(mib: usize) -> Vec<u8> {
    let block: Vec<u8> = (0..1usize << 20).map(|i| ((i * 7 + 3) % 251) as u8).collect();
    block.repeat(mib)
}

#[test]
fn ml_workloads_run_through_a_real_mount_and_persist() {
    if !fuse_available() || !numpy_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let out = python("ml_workloads.py", &[s.mnt.to_str().expect("utf8")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "workloads failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok ")).count(), 5, "{stdout}");
    m.unmount();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let ckpt = std::fs::metadata(s.mnt.join("ckpt/step.pt")).expect("checkpoint after remount");
    assert_eq!(ckpt.len(), 3_000_000 * 4);
    assert_eq!(std::fs::metadata(s.mnt.join("tokens.bin")).expect("tokens").len(), 24 * 1024 * 1024 * 2);
    m.unmount();
}

#[test]
fn fsynced_data_survives_kill_9_of_the_mount() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let path = s.mnt.join("weights.bin");
    let script = arbor_tests::manifest_dir().join("clients/fsync_then_wait.py");
    let mut client = Command::new("python3")
        .arg(script)
        .args([path.to_str().expect("utf8"), "24"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python");
    let mut line = String::new();
    BufReader::new(client.stdout.take().expect("stdout")).read_line(&mut line).expect("read");
    assert_eq!(line.trim(), "fsynced");
    m.kill9();
    let _ = client.kill();
    let _ = client.wait();
    // The old mountpoint is stale; mounting again recovers it.
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let back = std::fs::read(&path).expect("read after crash");
    assert!(back == pattern_mib(24), "fsynced bytes differ after kill -9");
    m.unmount();
}

#[test]
fn a_kill_9_mid_stream_leaves_a_prefix_with_everything_fsynced() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let script = arbor_tests::manifest_dir().join("clients/write_rename_stream.py");
    let mut client = Command::new("python3")
        .arg(script)
        .arg(s.mnt.to_str().expect("utf8"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("python");
    let stdout = client.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        let mut last = None;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(n) = line.strip_prefix("durable ") {
                last = n.trim().parse::<u64>().ok();
            }
        }
        last
    });
    std::thread::sleep(Duration::from_millis(1500));
    m.kill9();
    let _ = client.wait();
    let durable = reader.join().expect("reader").expect("at least one fsync returned before the crash");
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let mut finals: Vec<u64> = std::fs::read_dir(&s.mnt)
        .expect("list")
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("ckpt-")?.parse().ok())
        .collect();
    finals.sort();
    let last = *finals.last().expect("files");
    assert!(last >= durable, "step {durable} was fsynced but only {last} survived");
    assert_eq!(finals, (0..=last).collect::<Vec<_>>(), "the surviving steps must be a prefix");
    for i in finals {
        let want = (format!("step {i} ").repeat(3000).into_bytes())[..20000 + i as usize].to_vec();
        assert!(std::fs::read(s.mnt.join(format!("ckpt-{i}"))).expect("read") == want, "ckpt-{i} content");
    }
    m.unmount();
}

#[test]
fn fusermount_unmount_flushes_and_the_server_exits_cleanly() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let mut m = Mount::start(s.disk_str(), &s.mnt, &[]);
    std::fs::write(s.mnt.join("unsynced.txt"), b"written just before unmount").expect("write");
    let st = Command::new("fusermount3").arg("-u").arg(&s.mnt).status().expect("fusermount3");
    assert!(st.success());
    let status = m.child.wait().expect("wait");
    assert!(status.success(), "server: {}", std::fs::read_to_string(&m.log).unwrap_or_default());
    std::mem::forget(m);
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    assert_eq!(std::fs::read(s.mnt.join("unsynced.txt")).expect("read"), b"written just before unmount");
    m.unmount();
}

#[test]
fn open_unlinked_files_and_locks_behave_like_a_local_disk() {
    client_on_a_fresh_mount("unlinked_and_locks.py");
}

/// The mount tells the kernel to remember that a name is missing; every
/// way of making that name exist through the mount must still show it.
#[test]
fn names_probed_while_missing_appear_once_created_by_any_call() {
    client_on_a_fresh_mount("missing_names.py");
}

/// Runs a client script from `tests/clients` on a fresh mount and checks
/// that it succeeded and said "ok".
fn client_on_a_fresh_mount(script: &str) {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let out = python(script, &[s.mnt.to_str().expect("utf8")]);
    assert!(out.status.success(), "{script} failed: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok", "{script}");
    m.unmount();
}

#[test]
fn ioctls_get_enotty_and_leave_the_log_quiet() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let path = s.mnt.join("plain.txt");
    std::fs::write(&path, b"text").expect("write");
    let f = std::fs::File::open(&path).expect("open");
    for _ in 0..20 {
        let mut flags: libc::c_long = 0;
        // SAFETY: FS_IOC_GETFLAGS writes one long into `flags`.
        let rc = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&f), libc::FS_IOC_GETFLAGS, &mut flags) };
        let errno = std::io::Error::last_os_error().raw_os_error();
        assert!(rc == -1 && errno == Some(libc::ENOTTY), "ioctl: rc {rc}, errno {errno:?}");
        // And what Python's open() asks: is this a terminal?
        let mut ws = std::mem::MaybeUninit::<libc::winsize>::uninit();
        // SAFETY: TIOCGWINSZ fills a winsize.
        let rc = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&f), libc::TIOCGWINSZ, ws.as_mut_ptr()) };
        assert_eq!(rc, -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::ENOTTY));
    }
    drop(f);
    let log = m.log.clone();
    m.unmount();
    let log = std::fs::read_to_string(log).expect("mount log");
    assert!(!log.contains("Not Implemented") && !log.contains("ioctl"), "the log speaks of ioctls:\n{log}");
}

#[test]
fn a_file_read_twice_is_served_from_the_page_cache_the_second_time() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let path = s.mnt.join("shard.bin");
    let want = pattern(8 << 20, 5);
    write_synced(&path, &want);
    // Drop what the write left cached, so the first pass must ask arbor.
    let f = std::fs::File::open(&path).expect("open");
    // SAFETY: advice on a valid descriptor.
    unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, libc::POSIX_FADV_DONTNEED) };
    drop(f);
    let before = status_number(&s.mnt, "fuse_read_requests");
    assert!(std::fs::read(&path).expect("first read") == want, "first pass");
    let first = status_number(&s.mnt, "fuse_read_requests");
    assert!(first > before, "the first pass must reach arbor ({before} -> {first})");
    for pass in 0..2 {
        assert!(std::fs::read(&path).expect("warm read") == want, "warm pass {pass}");
    }
    // A kernel that dropped the file's pages at open would send the first
    // pass's requests again on every warm pass; with the pages kept, none
    // come but for pages the kernel reclaimed in between (a proactive
    // reclaimer such as DAMON's may take a few).
    let warm = status_number(&s.mnt, "fuse_read_requests") - first;
    assert!(
        warm * 8 < first - before,
        "warm passes must be served by the page cache: {warm} reads reached arbor, the first pass took {}",
        first - before
    );
    // A change through the mount is seen at once by the next read.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| {
            use std::io::{Seek, Write};
            f.seek(std::io::SeekFrom::Start(100))?;
            f.write_all(b"changed")
        })
        .expect("overwrite");
    let back = std::fs::read(&path).expect("read after change");
    assert_eq!(&back[100..107], b"changed");
    m.unmount();
}

#[test]
fn large_writes_go_to_the_log_past_the_page_cache_and_read_back_after_a_remount() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let direct = arbor_engine::testkit::takes_direct_writes(&s.disk);
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let path = s.mnt.join("ckpt.bin");
    // Not a multiple of a page, after a small file: the log's end is off
    // every page boundary when the large records come.
    std::fs::write(s.mnt.join("small.json"), b"{\"step\": 1}").expect("small file");
    let want = pattern((24 << 20) + 4321, 9);
    write_synced(&path, &want);
    let went = status_number(&s.mnt, "log_direct_bytes");
    if direct {
        assert!(went >= 16 << 20, "only {went} bytes of 24 MiB went past the page cache");
    } else {
        eprintln!("the scratch folder's file system refuses O_DIRECT: every write went through the page cache");
        assert_eq!(went, 0);
    }
    let status = arbor_ok(&["status", s.mnt.to_str().expect("utf8")]);
    assert!(status.contains("written past the page cache"), "{status}");
    m.unmount();
    // A new mount reads the log from its files, the direct part from disk;
    // with ARBOR_IO=buffered it writes through the page cache only.
    let m = Mount::start_env(s.disk_str(), &s.mnt, &[], &[("ARBOR_IO", "buffered".into())]);
    assert!(std::fs::read(&path).expect("read back") == want, "bytes differ after a remount");
    assert_eq!(std::fs::read(s.mnt.join("small.json")).expect("small"), b"{\"step\": 1}");
    write_synced(&s.mnt.join("buffered.bin"), &want);
    assert_eq!(status_number(&s.mnt, "log_direct_bytes"), 0, "ARBOR_IO=buffered wrote past the page cache");
    m.unmount();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    assert!(std::fs::read(s.mnt.join("buffered.bin")).expect("read back") == want, "buffered bytes differ");
    m.unmount();
}

/// `MAJ:MIN` of the file system mounted at `mnt`, from its `stat`.
fn device_of(mnt: &std::path::Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(mnt).expect("stat the mount").dev();
    format!("{}:{}", libc::major(dev), libc::minor(dev))
}

#[test]
fn the_kernel_reads_ahead_as_far_as_the_mount_asks() {
    if !fuse_available() {
        return;
    }
    // The kernel starts every FUSE mount at 128 KiB and caps what INIT
    // asks for there; the mount sets what --read-ahead says through sysfs.
    let s = Scratch::new();
    for (args, kib) in [(&[][..], 4096u64), (&["--read-ahead", "2097152"][..], 2048)] {
        let m = Mount::start(s.disk_str(), &s.mnt, args);
        let knob = format!("/sys/class/bdi/{}/read_ahead_kb", device_of(&s.mnt));
        let set: u64 = std::fs::read_to_string(&knob).expect("read_ahead_kb").trim().parse().expect("a number");
        assert_eq!(set, kib, "{knob} with {args:?}");
        assert_eq!(status_number(&s.mnt, "kernel_read_ahead"), kib * 1024, "status with {args:?}");
        let path = s.mnt.join("stream.bin");
        let want = pattern(6 << 20, 11);
        write_synced(&path, &want);
        assert!(std::fs::read(&path).expect("read back") == want, "bytes with {args:?}");
        m.unmount();
    }
}

#[test]
fn a_mount_point_reached_through_a_symbolic_link_is_one_mount_point() {
    if !fuse_available() {
        return;
    }
    // The kernel names a mount point by its real path; the CLI must find
    // the mount it started, its control socket and its device by either.
    let s = Scratch::new();
    let link = s.dir.path().join("link");
    std::os::unix::fs::symlink(s.dir.path(), &link).expect("symlink");
    let via_link = link.join("mnt");
    let real_mnt = s.dir.path().canonicalize().expect("real path").join("mnt");
    let (disk, linked, real) = (s.disk_str(), via_link.to_str().expect("utf8"), real_mnt.to_str().expect("utf8"));
    arbor_ok(&["mount", disk, linked]);
    std::fs::write(via_link.join("f"), b"through the link").expect("write");
    assert_eq!(std::fs::read(s.mnt.join("f")).expect("read"), b"through the link");
    for path in [linked, real] {
        let out = arbor_ok(&["status", path, "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("status json");
        assert_eq!(v["mountpoint"].as_str(), Some(real), "status of {path}");
    }
    assert_eq!(status_number(&via_link, "kernel_read_ahead"), 4 << 20);
    arbor_ok(&["unmount", linked]);
    assert!(!arbor_fs_mounted(&real_mnt), "unmounted through the link");
    // A mount point that is itself a link to a directory.
    let link_mnt = s.dir.path().join("mnt-link");
    std::os::unix::fs::symlink(&s.mnt, &link_mnt).expect("symlink");
    let link_mnt = link_mnt.to_str().expect("utf8");
    arbor_ok(&["mount", disk, link_mnt]);
    assert_eq!(std::fs::read(s.mnt.join("f")).expect("read"), b"through the link");
    let out = arbor_ok(&["status", link_mnt, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("status json");
    assert_eq!(v["mountpoint"].as_str(), Some(real), "status of {link_mnt}");
    arbor_ok(&["unmount", link_mnt]);
    assert!(!arbor_fs_mounted(&real_mnt), "unmounted through the link to the mount point");
}

/// Whether /proc/self/mountinfo lists `path` (a real path).
fn arbor_fs_mounted(path: &std::path::Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    info.lines().any(|l| l.split(' ').nth(4) == path.to_str())
}

#[test]
fn the_mount_says_which_transport_answers_it() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let ring = std::env::var("ARBOR_FUSE").as_deref() == Ok("ring");
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let before = status_number(&s.mnt, "fuse_ring_requests");
    for i in 0..50 {
        std::fs::write(s.mnt.join(format!("f{i}")), b"x").expect("write");
    }
    assert_eq!(std::fs::read_dir(&s.mnt).expect("list").count(), 50);
    let after = status_number(&s.mnt, "fuse_ring_requests");
    let out = arbor_ok(&["status", s.mnt.to_str().expect("utf8"), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let transport = v["fuse_transport"].as_str().expect("fuse_transport").to_string();
    assert!(!ring || transport.starts_with("io_uring"), "ARBOR_FUSE=ring, but {transport}");
    if transport.starts_with("io_uring") {
        // Each file costs several requests (LOOKUP, CREATE, WRITE, RELEASE…).
        assert!(after >= before + 150, "the ring answered {} requests", after - before);
    } else {
        assert_eq!(after, before, "no ring, no ring requests ({transport})");
    }
    m.unmount();
}

#[test]
fn a_fresh_listing_with_stat_needs_no_lookup_per_entry() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let dir = s.mnt.join("shards");
    std::fs::create_dir(&dir).expect("mkdir");
    let n = 400;
    for i in 0..n {
        std::fs::write(dir.join(format!("s{i:04}")), vec![7u8; i % 50]).expect("write");
    }
    m.unmount();
    // A new mount: the kernel knows none of these names.
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let before = status_number(&s.mnt, "fuse_lookup_requests");
    let mut seen = 0;
    for e in std::fs::read_dir(&dir).expect("list") {
        let e = e.expect("entry");
        let i: usize = e.file_name().to_str().expect("utf8")[1..].parse().expect("index");
        let md = std::fs::symlink_metadata(e.path()).expect("stat");
        assert_eq!(md.len() as usize, i % 50, "size of {:?}", e.file_name());
        assert!(md.is_file());
        seen += 1;
    }
    assert_eq!(seen, n);
    let lookups = status_number(&s.mnt, "fuse_lookup_requests") - before;
    // READDIRPLUS hands the kernel each entry's attributes with its name;
    // the kernel may still list the first page plainly before it switches.
    assert!(lookups < n as u64 / 4, "{lookups} LOOKUPs for {n} entries listed and stat'ed");
    m.unmount();
}

#[test]
fn writes_and_chown_clear_set_id_bits_as_the_kernel_would() {
    use std::os::unix::fs::PermissionsExt;
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &["--allow-other"]);
    std::fs::set_permissions(&s.mnt, std::fs::Permissions::from_mode(0o777)).expect("chmod mnt");
    let f = s.mnt.join("tool");
    std::fs::write(&f, b"#!/bin/sh\n").expect("write");
    assert_writes_and_chown_clear_set_id_bits(&f);
    // And all of it is what the disk holds, not only what the kernel shows.
    m.unmount();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    assert_eq!(std::fs::metadata(&f).expect("stat").permissions().mode() & 0o7777, 0o0755);
    m.unmount();
}

/// Whether this kernel drops cached pages before a direct write (6.6 on),
/// which write-only opens past the page cache rely on.
fn kernel_takes_direct_writes() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    let mut v = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
    (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (6, 6)
}

/// Write-only opens (every checkpoint writer) write past the kernel's
/// page cache; a reader holding the file open, or reading it while the
/// writes land, still sees every byte written, and so does a remount.
#[test]
fn write_only_opens_write_past_the_page_cache_and_readers_see_every_write() {
    use std::io::{Read, Write};
    use std::os::unix::fs::FileExt;
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let path = s.mnt.join("ckpt.bin");
    let mut want = pattern(8 << 20, 3);
    write_synced(&path, &want);
    let direct = status_number(&s.mnt, "fuse_direct_write_opens");
    if kernel_takes_direct_writes() {
        assert!(direct >= 1, "a write-only open used the page cache");
    } else {
        eprintln!("this kernel does not drop cached pages before a direct write: write-only opens use the page cache");
        assert_eq!(direct, 0);
    }
    let writer = || std::fs::OpenOptions::new().write(true).open(&path).expect("open write-only");

    // A reader with the file cached sees writes made through another
    // descriptor once they return.
    let reader = std::fs::File::open(&path).expect("open reader");
    let mut all = Vec::new();
    (&reader).read_to_end(&mut all).expect("read");
    assert!(all == want, "first read");
    let w = writer();
    for at in [100u64, 5 << 20, (8 << 20) - 3] {
        w.write_all_at(b"new", at).expect("overwrite");
        want[at as usize..at as usize + 3].copy_from_slice(b"new");
        let mut got = [0u8; 3];
        reader.read_exact_at(&mut got, at).expect("reread");
        assert_eq!(&got, b"new", "the reader's cached page at {at} was not dropped");
    }
    drop(w);

    // Overwrites racing a reader that keeps reading the whole file: once
    // the writer is done, the reader sees the last bytes written.
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut buf = vec![0u8; 8 << 20];
            for _ in 0..10_000 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                reader.read_exact_at(&mut buf, 0).expect("racing read");
            }
        });
        let w = writer();
        for round in 0..64u32 {
            let at = (round as usize % 32) * (256 << 10) + 1000;
            let bytes = pattern(70_000, 100 + round);
            w.write_all_at(&bytes, at as u64).expect("racing write");
            want[at..at + bytes.len()].copy_from_slice(&bytes);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let mut back = vec![0u8; want.len()];
    reader.read_exact_at(&mut back, 0).expect("read after the race");
    assert!(back == want, "a reader kept bytes older than the last write");

    // Appends (a training log opened write-only with O_APPEND) while a
    // reader follows the end: never a stale page at the old end of file.
    let log = s.mnt.join("train.log");
    std::fs::write(&log, b"").expect("create log");
    let mut follower = std::fs::File::open(&log).expect("open follower");
    let mut app = std::fs::OpenOptions::new().append(true).open(&log).expect("open append");
    let mut written = Vec::new();
    let mut seen = Vec::new();
    for i in 0..200u32 {
        let line = format!("step {i:05} loss {:.6} {}\n", 1.0 / f64::from(i + 1), "x".repeat((i as usize * 37) % 3000));
        app.write_all(line.as_bytes()).expect("append");
        written.extend_from_slice(line.as_bytes());
        if i % 3 == 0 {
            follower.read_to_end(&mut seen).expect("follow");
            assert!(seen == written[..seen.len()], "the follower read other bytes than were appended (line {i})");
        }
    }
    drop(app);
    follower.read_to_end(&mut seen).expect("follow to the end");
    assert!(seen == written, "the follower missed appended bytes");
    drop((follower, reader));
    m.unmount();

    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    assert!(std::fs::read(&path).expect("read after a remount") == want, "bytes differ after a remount");
    assert!(std::fs::read(&log).expect("log after a remount") == written, "log differs after a remount");
    m.unmount();

    // Turned off, write-only opens go through the page cache again.
    let m = Mount::start_env(s.disk_str(), &s.mnt, &[], &[("ARBOR_DIRECT_WRITES", "0".into())]);
    write_synced(&s.mnt.join("cached.bin"), &want);
    assert_eq!(
        status_number(&s.mnt, "fuse_direct_write_opens"),
        0,
        "ARBOR_DIRECT_WRITES=0 still opened past the cache"
    );
    m.unmount();
}

/// `copy_file_range(2)` on a mount shares the bytes (a clone of their
/// extents): the copy reads as its source, the disk grows by a record or
/// two, and a later write to either file leaves the other as it was.
#[test]
fn copy_file_range_shares_the_bytes_instead_of_copying_them() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let (src, dst) = (s.mnt.join("model.bin"), s.mnt.join("model-copy.bin"));
    let body = pattern(16 << 20, 5);
    write_synced(&src, &body);
    let before = folder_bytes(s.disk.as_path());
    let from = std::fs::File::open(&src).expect("open source");
    let to = std::fs::OpenOptions::new().write(true).create_new(true).open(&dst).expect("create copy");
    let mut copied = 0usize;
    for _ in 0..64 {
        // SAFETY: two open descriptors; null offsets use and move theirs.
        let n = unsafe {
            libc::copy_file_range(
                from.as_raw_fd(),
                std::ptr::null_mut(),
                to.as_raw_fd(),
                std::ptr::null_mut(),
                body.len() - copied,
                0,
            )
        };
        assert!(n >= 0, "copy_file_range: {}", std::io::Error::last_os_error());
        if n == 0 {
            break;
        }
        copied += n as usize;
    }
    assert_eq!(copied, body.len());
    to.sync_all().expect("fsync the copy");
    let grown = folder_bytes(s.disk.as_path()).saturating_sub(before);
    assert!(grown < 2 << 20, "a copy of 16 MiB grew the disk by {grown} bytes");
    assert!(std::fs::read(&dst).expect("read copy") == body, "the copy differs from its source");
    // Copy-on-write: each side changes alone.
    to.write_all_at(b"copy changed", 4096).expect("write copy");
    to.sync_all().expect("fsync");
    assert!(std::fs::read(&src).expect("read source") == body, "a write to the copy changed its source");
    drop((from, to));
    m.unmount();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    let mut want = body.clone();
    want[4096..4108].copy_from_slice(b"copy changed");
    assert!(std::fs::read(&dst).expect("read copy") == want, "the copy after a remount");
    m.unmount();
}
