//! Root on one node is not root on the others: what client mounts of a
//! shared branch, and the owner behind them, let through. A set-user-ID
//! shell made on one client, device nodes, capabilities, giving files
//! away as root, and a set-user-ID mode sent straight on the wire.

use arbor_engine::volume::{SetAttr, ROOT_INO};
use arbor_net::branch::frames::{self as branch_frames, Answer, Request};
use arbor_net::branch::owner::{FileOp, Out, Reply};
use arbor_net::branch::policy::Caller;
use arbor_net::wire::frames::{self, Hello, Welcome};
use arbor_tests::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// An owner that trusts its clients' root (both opt-ins).
const TRUSTING: [&str; 2] = ["--allow-suid-devices", "--no-root-squash"];

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).expect("stat").permissions().mode() & 0o7777
}

fn chmod(p: &Path, m: u32) -> std::io::Result<()> {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m))
}

/// A copy of bash at `p`, made by root through its mount.
fn copy_shell(p: &Path) {
    std::fs::copy("/bin/bash", p).expect("copy bash");
}

/// The effective uid `shell -p` runs with when user nobody starts it
/// (bounded: `timeout` kills it after 20 s).
fn euid_as_nobody(shell: &Path) -> u32 {
    let out = Command::new("timeout")
        .args(["20", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(shell)
        .args(["-p", "-c", "id -u"])
        .output()
        .expect("setpriv");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{shell:?} as nobody: {out:?}");
    text.trim().parse().unwrap_or_else(|_| panic!("id -u printed {text:?}"))
}

fn options_of(mnt: &Path) -> String {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let line = info.lines().find(|l| l.split(' ').nth(4).is_some_and(|m| Path::new(m) == mnt));
    line.and_then(|l| l.split(' ').nth(5)).unwrap_or_else(|| panic!("{mnt:?} is not mounted")).to_string()
}

/// The bug this file is about: root on client A copies a shell and makes
/// it set-user-ID; user nobody runs it on client B.
#[test]
fn a_set_user_id_shell_made_on_one_client_does_not_run_as_root_on_another() {
    let Some(w) = SharedWorld::start() else { return };
    let a = w.client("a");
    let b = w.client_with("b", &["--allow-other"]);
    let_others_reach(&b.mnt);
    assert!(options_of(&b.mnt).contains("nosuid"), "{}", options_of(&b.mnt));
    assert!(options_of(&b.mnt).contains("nodev"), "{}", options_of(&b.mnt));
    let rsh = a.mnt.join("rsh");
    copy_shell(&rsh);
    // The owner refuses the bit, and root made the copy as nobody.
    assert_eq!(errno_of(chmod(&rsh, 0o4755)), libc::EPERM);
    assert_eq!(errno_of(chmod(&rsh, 0o6755)), libc::EPERM);
    chmod(&rsh, 0o755).expect("a plain chmod of what root made");
    let there = b.mnt.join("rsh");
    assert_eq!(mode(&there), 0o755);
    assert_eq!(std::fs::metadata(&there).expect("stat").uid(), 65534);
    assert_eq!(euid_as_nobody(&there), 65534);
    a.unmount();
    b.unmount();
    w.owner.stop();

    // An owner that accepts the bit from a client's root: a client mount
    // still ignores it unless it opts in too, and then it is root's.
    let Some(w) = SharedWorld::start_with(&TRUSTING) else { return };
    let a = w.client("a");
    let b = w.client_with("b", &["--allow-other"]);
    let c = w.client_with("c", &["--allow-other", "--allow-suid-devices"]);
    let_others_reach(&b.mnt);
    assert!(!options_of(&c.mnt).contains("nosuid"), "{}", options_of(&c.mnt));
    let rsh = a.mnt.join("rsh");
    copy_shell(&rsh);
    chmod(&rsh, 0o4755).expect("chmod 4755 through a trusted client");
    let there = b.mnt.join("rsh");
    wait_until("b to see the bit", Duration::from_secs(5), || mode(&there) == 0o4755);
    assert_eq!(std::fs::metadata(&there).expect("stat").uid(), 0);
    assert_eq!(euid_as_nobody(&there), 65534, "a nosuid client mount");
    assert_eq!(euid_as_nobody(&c.mnt.join("rsh")), 0, "both opt-ins: root on every node");
    a.unmount();
    b.unmount();
    c.unmount();
    w.owner.stop();
}

fn mknod(p: &Path, kind: u32, dev: libc::dev_t) -> std::io::Result<()> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::mknod(c.as_ptr(), kind | 0o666, dev) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn set_capability(p: &Path) -> std::io::Result<()> {
    // A version 2 capability set with CAP_SETUID permitted and effective.
    const CAPS: [u8; 20] = [0, 0, 0, 2, 0x81, 0, 0, 0, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: a NUL-terminated path and name, and a value of the length given.
    let r = unsafe { libc::setxattr(c.as_ptr(), c"security.capability".as_ptr(), CAPS.as_ptr().cast(), CAPS.len(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn device_nodes_and_capabilities_from_clients_are_refused() {
    let null = libc::makedev(1, 3);
    let Some(w) = SharedWorld::start() else { return };
    let a = w.client("a");
    assert_eq!(errno_of(mknod(&a.mnt.join("null"), libc::S_IFCHR, null)), libc::EPERM);
    assert_eq!(errno_of(mknod(&a.mnt.join("disk"), libc::S_IFBLK, libc::makedev(7, 0))), libc::EPERM);
    assert!(!a.mnt.join("null").exists());
    // FIFOs and sockets grant nothing.
    mknod(&a.mnt.join("fifo"), libc::S_IFIFO, 0).expect("mkfifo");
    mknod(&a.mnt.join("sock"), libc::S_IFSOCK, 0).expect("a socket node");
    std::fs::write(a.mnt.join("tool"), b"#!/bin/sh\n").expect("write");
    assert_eq!(errno_of(set_capability(&a.mnt.join("tool"))), libc::EPERM);
    a.unmount();
    w.owner.stop();

    // The same calls through an owner that allows them.
    let Some(w) = SharedWorld::start_with(&["--allow-suid-devices"]) else { return };
    let a = w.client("a");
    mknod(&a.mnt.join("null"), libc::S_IFCHR, null).expect("mknod through an owner that allows it");
    assert_eq!(std::fs::metadata(a.mnt.join("null")).expect("stat").rdev(), null);
    std::fs::write(a.mnt.join("tool"), b"#!/bin/sh\n").expect("write");
    set_capability(&a.mnt.join("tool")).expect("capabilities through an owner that allows them");
    a.unmount();
    w.owner.stop();
}

/// Under root squash (the default) root on a client is nobody: what it
/// makes is nobody's and it cannot give a file away (EPERM, as root on an
/// NFS client with root_squash gets); with --no-root-squash it can.
#[test]
fn root_on_a_client_is_nobody_unless_the_owner_says_otherwise() {
    let Some(w) = SharedWorld::start() else { return };
    let a = w.client("a");
    let f = a.mnt.join("f");
    std::fs::write(&f, b"made by root").expect("write");
    let m = std::fs::metadata(&f).expect("stat");
    assert_eq!((m.uid(), m.gid()), (65534, 65534));
    assert_eq!(errno_of(std::os::unix::fs::chown(&f, Some(1000), Some(1000))), libc::EPERM);
    assert_eq!(errno_of(std::os::unix::fs::chown(&f, None, Some(0))), libc::EPERM);
    // The branch's root folder is root's: squashed root may not chmod it.
    assert_eq!(errno_of(chmod(&a.mnt, 0o777)), libc::EPERM);
    assert_eq!(std::fs::metadata(&f).expect("stat").uid(), 65534);
    a.unmount();
    w.owner.stop();

    let Some(w) = SharedWorld::start_with(&["--no-root-squash"]) else { return };
    let a = w.client("a");
    let f = a.mnt.join("f");
    std::fs::write(&f, b"made by root").expect("write");
    assert_eq!(std::fs::metadata(&f).expect("stat").uid(), 0);
    std::os::unix::fs::chown(&f, Some(1000), Some(1000)).expect("chown as root");
    let m = std::fs::metadata(&f).expect("stat");
    assert_eq!((m.uid(), m.gid()), (1000, 1000));
    chmod(&a.mnt, 0o777).expect("chmod of the root folder");
    // Still no set-ID bits without --allow-suid-devices.
    assert_eq!(errno_of(chmod(&f, 0o4755)), libc::EPERM);
    a.unmount();
    w.owner.stop();
}

/// A connection to the owner as a client speaks it, and a session on it.
struct Wire {
    stream: std::net::TcpStream,
    buf: Vec<u8>,
    session: u64,
}

impl Wire {
    fn open(addr: &str) -> Wire {
        use std::io::Write;
        let mut stream = frames::dial(addr, Duration::from_secs(5)).expect("dial");
        stream.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut buf = Vec::new();
        stream.write_all(&frames::MAGIC).expect("magic");
        let hello = Hello { version: frames::VERSION, token: TOKEN.as_bytes().to_vec(), branch: "main".into() };
        frames::write_frame(&mut stream, &mut buf, &hello).expect("hello");
        assert_eq!(frames::read_frame::<Welcome>(&mut stream, &mut buf).expect("welcome"), Welcome::Ok);
        branch_frames::write_request(&mut stream, &mut buf, &Request::Session).expect("session");
        let session = match branch_frames::read_answer(&mut stream, &mut buf).expect("answer") {
            Answer::Session(s) => s.session,
            other => panic!("{other:?}"),
        };
        Wire { stream, buf, session }
    }

    fn ask(&mut self, op: FileOp) -> Reply {
        let req = Request::Op { session: self.session, op, tag: None };
        branch_frames::write_request(&mut self.stream, &mut self.buf, &req).expect("request");
        match branch_frames::read_answer(&mut self.stream, &mut self.buf).expect("answer") {
            Answer::Reply(r) => r,
            other => panic!("{other:?}"),
        }
    }
}

/// A client need not run arbor: whatever a holder of the token sends
/// is checked by the owner.
#[test]
fn a_set_user_id_mode_sent_on_the_wire_is_refused_by_the_owner() {
    let Some(w) = SharedWorld::start() else { return };
    let a = w.client("a");
    copy_shell(&a.mnt.join("rsh"));
    let mut wire = Wire::open(&w.owner.addr);
    let ino = match wire.ask(FileOp::Lookup { parent: ROOT_INO, name: b"rsh".to_vec() }) {
        Ok(Out::Attr(at)) => at.ino,
        other => panic!("lookup: {other:?}"),
    };
    let setattr = |perm: u16, caller: Caller| FileOp::SetAttr {
        ino,
        change: SetAttr { perm: Some(perm), ..Default::default() },
        caller,
        kill_suidgid: false,
    };
    // As root (squashed to nobody, who owns the copy) and as nobody: the
    // owner may change the mode, not add the bit.
    let nobody = Caller { uid: 65534, gid: 65534 };
    for caller in [Caller::ROOT, nobody] {
        assert_eq!(wire.ask(setattr(0o4755, caller)).err(), Some(libc::EPERM), "{caller:?}");
        assert_eq!(wire.ask(setattr(0o6711, caller)).err(), Some(libc::EPERM), "{caller:?}");
    }
    // The same request without the bit is applied: the wire works.
    match wire.ask(setattr(0o700, nobody)) {
        Ok(Out::Attr(at)) => assert_eq!(at.perm, 0o700),
        other => panic!("chmod 700: {other:?}"),
    }
    // Another user may not change nobody's file at all.
    let other = Caller { uid: 1000, gid: 1000 };
    assert_eq!(wire.ask(setattr(0o755, other)).err(), Some(libc::EPERM));
    // Nor are devices or capabilities made on the wire.
    let device = FileOp::Create {
        parent: ROOT_INO,
        name: b"kmem".to_vec(),
        mode: libc::S_IFCHR | 0o666,
        uid: 0,
        gid: 0,
        rdev: libc::makedev(1, 2) as u32,
    };
    assert_eq!(wire.ask(device).err(), Some(libc::EPERM));
    let caps = FileOp::SetXattr {
        ino,
        name: b"security.capability".to_vec(),
        value: vec![0; 20],
        flags: arbor_engine::volume::XattrFlags::Any,
    };
    assert_eq!(wire.ask(caps).err(), Some(libc::EPERM));
    // What the wire changed shows on the client (the owner tells it).
    wait_until("a to see the mode", Duration::from_secs(5), || mode(&a.mnt.join("rsh")) == 0o700);
    assert!(!a.mnt.join("kmem").exists());
    drop(wire);
    a.unmount();
    w.owner.stop();
}
