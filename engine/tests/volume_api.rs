//! The Volume API: behaviour, every errno case, persistence across reopen
//! and crashes, corruption, poisoning, group commit, live-bytes accounting.

use arbor_engine::device::{CrashMode, FileDevice, SimDevice};
use arbor_engine::env::TestEnv;
use arbor_engine::io::IoMode;
use arbor_engine::volume::*;
use arbor_engine::Result;
use std::sync::Arc;

fn cfg() -> Config {
    Config { commit_interval: None, segment_size: 1 << 20, env: TestEnv::new(7), ..Config::default() }
}

fn sim() -> (SimDevice, Arc<Volume>) {
    let dev = SimDevice::new();
    let vol = Volume::open(Arc::new(dev.clone()), cfg()).expect("open");
    (dev, vol)
}

fn reopen(dev: &SimDevice) -> Arc<Volume> {
    Volume::open(Arc::new(dev.clone()), cfg()).expect("reopen")
}

fn file(vol: &Volume, parent: u64, name: &str) -> u64 {
    vol.create(parent, name.as_bytes(), libc::S_IFREG | 0o644, 1000, 1000, 0).expect("create").ino
}

fn errno<T: std::fmt::Debug>(r: Result<T>) -> i32 {
    r.expect_err("must fail").errno()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn a_new_volume_has_a_root_directory() {
    let (_, vol) = sim();
    let root = vol.getattr(ROOT_INO).expect("root");
    assert_eq!((root.kind, root.perm, root.nlink), (FileKind::Directory, 0o755, 2));
    assert!(vol.list_dir(ROOT_INO).expect("list").is_empty());
}

#[test]
fn write_read_across_inline_spill_holes_and_overwrites() {
    let (_, vol) = sim();
    let ino = file(&vol, ROOT_INO, "f");
    vol.write(ino, 0, b"hello").expect("write");
    assert_eq!(vol.read(ino, 0, 100).expect("read"), b"hello");
    assert!(vol.getattr(ino).expect("attr").size == 5);
    // Grow past the inline limit: the inline bytes move into an extent.
    let big = pattern(3 << 20, 1);
    vol.write(ino, 3, &big).expect("write big");
    let mut model = b"hel".to_vec();
    model.extend_from_slice(&big);
    assert_eq!(vol.read(ino, 0, model.len() + 10).expect("read"), model);
    // Overwrite the middle, unaligned.
    vol.write(ino, 10_001, b"XYZ").expect("overwrite");
    model[10_001..10_004].copy_from_slice(b"XYZ");
    assert_eq!(vol.read(ino, 9_000, 2_000).expect("read"), model[9_000..11_000]);
    // A hole far past the end reads as zeros.
    vol.write(ino, 10 << 20, b"end").expect("write past end");
    let hole = vol.read(ino, model.len() as u64, 4096).expect("read hole");
    assert!(hole.iter().all(|b| *b == 0) && hole.len() == 4096);
    assert_eq!(vol.read(ino, 10 << 20, 10).expect("read"), b"end");
}

/// `read_into` fills a buffer whatever it held: the file's bytes, zeros
/// for holes, and the same count `read` gives, for inline files, extents,
/// holes between and after them, and reads past the end.
#[test]
fn read_into_a_used_buffer_gives_what_read_gives() {
    let (_, vol) = sim();
    let small = file(&vol, ROOT_INO, "small");
    vol.write(small, 0, b"inline bytes").expect("write");
    let sparse = file(&vol, ROOT_INO, "sparse");
    let mut model = vec![0u8; 5 << 20];
    for (at, len, seed) in [(0usize, 10_000usize, 1u8), (70_000, 4096, 2), (1 << 20, 300_000, 3), (4 << 20, 17, 4)] {
        let bytes = pattern(len, seed);
        vol.write(sparse, at as u64, &bytes).expect("write");
        model[at..at + len].copy_from_slice(&bytes);
    }
    model.truncate((4 << 20) + 17);
    vol.commit().expect("commit");
    let cases = [
        (0u64, 100usize),
        (9_000, 70_000),
        (10_000, 60_000),
        (65_000, 1 << 20),
        (1_300_000, 3 << 20),
        (0, 6 << 20),
        ((4 << 20) + 10, 4096),
        (5 << 20, 10),
    ];
    for ino in [small, sparse] {
        for (off, len) in cases {
            let want = vol.read(ino, off, len).expect("read");
            if ino == sparse {
                let start = (off as usize).min(model.len());
                let end = (off as usize + len).min(model.len());
                assert!(want == model[start..end], "read of {off}+{len}");
            }
            let mut buf = vec![0xeeu8; len];
            let n = vol.read_into(ino, off, &mut buf).expect("read_into");
            assert_eq!(n, want.len(), "count of {off}+{len} of {ino}");
            assert!(buf[..n] == want[..], "bytes of {off}+{len} of {ino}");
        }
    }
    let mut none = [0u8; 0];
    assert_eq!(vol.read_into(sparse, 0, &mut none).expect("empty"), 0);
    assert_eq!(errno(vol.read_into(ROOT_INO, 0, &mut [0u8; 8])), libc::EISDIR);
}

#[test]
fn sparse_files_reach_a_terabyte_and_refuse_past_the_maximum() {
    let (_, vol) = sim();
    let ino = file(&vol, ROOT_INO, "sparse");
    let tb = 1u64 << 40;
    vol.write(ino, tb, b"far").expect("write at 1 TiB");
    vol.write(ino, 5 << 30, b"past 4 GiB").expect("write at 5 GiB");
    assert_eq!(vol.getattr(ino).expect("attr").size, tb + 3);
    assert_eq!(vol.read(ino, tb, 3).expect("read"), b"far");
    assert_eq!(vol.read(ino, 5 << 30, 10).expect("read"), b"past 4 GiB");
    assert!(vol.getattr(ino).expect("attr").blocks < 10, "holes take no space");
    assert_eq!(errno(vol.write(ino, MAX_FILE_SIZE, b"x")), libc::EFBIG);
    assert_eq!(errno(vol.setattr(ino, SetAttr { size: Some(MAX_FILE_SIZE + 1), ..Default::default() })), libc::EFBIG);
    assert_eq!(vol.getattr(ino).expect("attr").size, tb + 3, "a refused write changes nothing");
}

#[test]
fn truncate_shrinks_then_grows_with_zeros() {
    let (_, vol) = sim();
    let ino = file(&vol, ROOT_INO, "t");
    vol.write(ino, 0, &pattern(20_000, 3)).expect("write");
    vol.setattr(ino, SetAttr { size: Some(5000), ..Default::default() }).expect("shrink");
    vol.setattr(ino, SetAttr { size: Some(20_000), ..Default::default() }).expect("grow");
    let back = vol.read(ino, 0, 20_000).expect("read");
    assert_eq!(back[..5000], pattern(20_000, 3)[..5000]);
    assert!(back[5000..].iter().all(|b| *b == 0));
    // Inline files too.
    let small = file(&vol, ROOT_INO, "s");
    vol.write(small, 0, b"abcdef").expect("write");
    vol.setattr(small, SetAttr { size: Some(2), ..Default::default() }).expect("shrink");
    vol.setattr(small, SetAttr { size: Some(4), ..Default::default() }).expect("grow");
    assert_eq!(vol.read(small, 0, 10).expect("read"), b"ab\0\0");
    vol.setattr(small, SetAttr { size: Some(100_000), ..Default::default() }).expect("grow past inline");
    assert_eq!(vol.read(small, 0, 4).expect("read"), b"ab\0\0");
    assert_eq!(vol.getattr(small).expect("attr").size, 100_000);
}

#[test]
fn namespace_errors_get_their_errno_and_change_nothing() {
    let (_, vol) = sim();
    let d = vol.mkdir(ROOT_INO, b"d", 0o755, 0, 0).expect("mkdir").ino;
    let f = file(&vol, ROOT_INO, "f");
    let before = vol.list_dir(ROOT_INO).expect("list");
    let long = vec![b'a'; 256];
    assert_eq!(errno(vol.create(ROOT_INO, &long, libc::S_IFREG | 0o644, 0, 0, 0)), libc::ENAMETOOLONG);
    assert_eq!(errno(vol.create(ROOT_INO, b"a/b", libc::S_IFREG, 0, 0, 0)), libc::EINVAL);
    assert_eq!(errno(vol.create(ROOT_INO, b"a\0b", libc::S_IFREG, 0, 0, 0)), libc::EINVAL);
    assert_eq!(errno(vol.create(ROOT_INO, b"f", libc::S_IFREG, 0, 0, 0)), libc::EEXIST);
    assert_eq!(errno(vol.mkdir(ROOT_INO, b"d", 0o755, 0, 0)), libc::EEXIST);
    assert_eq!(errno(vol.create(f, b"x", libc::S_IFREG, 0, 0, 0)), libc::ENOTDIR);
    assert_eq!(errno(vol.lookup(ROOT_INO, b"nope")), libc::ENOENT);
    assert_eq!(errno(vol.unlink(ROOT_INO, b"d")), libc::EISDIR);
    assert_eq!(errno(vol.rmdir(ROOT_INO, b"f")), libc::ENOTDIR);
    file(&vol, d, "inside");
    assert_eq!(errno(vol.rmdir(ROOT_INO, b"d")), libc::ENOTEMPTY);
    assert_eq!(errno(vol.rename(ROOT_INO, b"d", d, b"self", RenameMode::Plain)), libc::EINVAL);
    assert_eq!(errno(vol.rename(ROOT_INO, b"f", ROOT_INO, b"d", RenameMode::Plain)), libc::EISDIR);
    assert_eq!(errno(vol.rename(ROOT_INO, b"d", ROOT_INO, b"f", RenameMode::Plain)), libc::ENOTDIR);
    assert_eq!(errno(vol.rename(ROOT_INO, b"f", ROOT_INO, b"d", RenameMode::NoReplace)), libc::EEXIST);
    assert_eq!(errno(vol.rename(ROOT_INO, b"f", ROOT_INO, b"zz", RenameMode::Exchange)), libc::ENOENT);
    assert_eq!(errno(vol.link(d, ROOT_INO, b"dirlink")), libc::EPERM);
    assert_eq!(errno(vol.read(d, 0, 1)), libc::EISDIR);
    assert_eq!(errno(vol.write(d, 0, b"x")), libc::EISDIR);
    assert_eq!(errno(vol.readlink(f)), libc::EINVAL);
    assert_eq!(errno(vol.getxattr(f, b"user.none")), libc::ENODATA);
    assert_eq!(vol.list_dir(ROOT_INO).expect("list"), before);
}

#[test]
fn rename_replaces_exchanges_and_keeps_link_counts() {
    let (_, vol) = sim();
    let a = vol.mkdir(ROOT_INO, b"a", 0o755, 0, 0).expect("mkdir").ino;
    let b = vol.mkdir(ROOT_INO, b"b", 0o755, 0, 0).expect("mkdir").ino;
    let sub = vol.mkdir(a, b"sub", 0o755, 0, 0).expect("mkdir").ino;
    assert_eq!(vol.getattr(a).expect("a").nlink, 3);
    vol.rename(a, b"sub", b, b"moved", RenameMode::Plain).expect("move dir");
    assert_eq!((vol.getattr(a).expect("a").nlink, vol.getattr(b).expect("b").nlink), (2, 3));
    assert_eq!(vol.lookup(sub, b"..").expect("..").ino, b);
    // Replace a file atomically.
    let old = file(&vol, ROOT_INO, "ckpt");
    let new = file(&vol, ROOT_INO, "ckpt.tmp");
    vol.write(new, 0, b"new").expect("write");
    vol.rename(ROOT_INO, b"ckpt.tmp", ROOT_INO, b"ckpt", RenameMode::Plain).expect("replace");
    assert_eq!(vol.lookup(ROOT_INO, b"ckpt").expect("lookup").ino, new);
    assert_eq!(errno(vol.getattr(old)), libc::ENOENT);
    // Exchange a file and a directory across parents.
    let x = file(&vol, a, "x");
    vol.rename(a, b"x", ROOT_INO, b"b", RenameMode::Exchange).expect("exchange");
    assert_eq!(vol.lookup(ROOT_INO, b"b").expect("b").ino, x);
    assert_eq!(vol.lookup(a, b"x").expect("x").ino, b);
    assert_eq!(vol.lookup(b, b"..").expect("..").ino, a);
    assert_eq!((vol.getattr(ROOT_INO).expect("root").nlink, vol.getattr(a).expect("a").nlink), (3, 3));
    // Replacing an empty directory.
    let e = vol.mkdir(ROOT_INO, b"empty", 0o755, 0, 0).expect("mkdir").ino;
    vol.rename(ROOT_INO, b"a", ROOT_INO, b"empty", RenameMode::Plain).expect("replace dir");
    assert_eq!(errno(vol.getattr(e)), libc::ENOENT);
    assert_eq!(vol.getattr(ROOT_INO).expect("root").nlink, 3);
}

#[test]
fn hard_links_share_an_inode_until_the_last_goes() {
    let (_, vol) = sim();
    let f = file(&vol, ROOT_INO, "f");
    vol.write(f, 0, b"data").expect("write");
    vol.link(f, ROOT_INO, b"g").expect("link");
    assert_eq!(vol.getattr(f).expect("attr").nlink, 2);
    vol.unlink(ROOT_INO, b"f").expect("unlink");
    assert_eq!(vol.read(vol.lookup(ROOT_INO, b"g").expect("g").ino, 0, 9).expect("read"), b"data");
    vol.unlink(ROOT_INO, b"g").expect("unlink");
    assert_eq!(errno(vol.getattr(f)), libc::ENOENT);
}

#[test]
fn an_open_unlinked_file_lives_until_release_and_is_dropped_after_a_crash() {
    let (dev, vol) = sim();
    let f = file(&vol, ROOT_INO, "tmp");
    vol.write(f, 0, &pattern(10_000, 9)).expect("write");
    vol.acquire(f).expect("open");
    vol.unlink(ROOT_INO, b"tmp").expect("unlink");
    assert_eq!(vol.read(f, 0, 10_000).expect("still readable"), pattern(10_000, 9));
    vol.release(f).expect("release");
    assert_eq!(errno(vol.getattr(f)), libc::ENOENT);
    // Crash while an unlinked file is open: recovery deletes it.
    let g = file(&vol, ROOT_INO, "tmp2");
    vol.acquire(g).expect("open");
    vol.unlink(ROOT_INO, b"tmp2").expect("unlink");
    vol.sync_all().expect("sync");
    dev.crash(CrashMode::DropUnsynced);
    drop(vol);
    let vol = reopen(&dev);
    assert_eq!(errno(vol.getattr(g)), libc::ENOENT);
}

#[test]
fn a_file_replaced_by_a_rename_while_open_is_read_until_release_and_dropped_after_a_crash() {
    let (dev, vol) = sim();
    // Not open: the replaced file goes with its last name.
    let a = file(&vol, ROOT_INO, "a");
    vol.write(a, 0, b"old a").expect("write");
    let a2 = file(&vol, ROOT_INO, "a.tmp");
    vol.rename(ROOT_INO, b"a.tmp", ROOT_INO, b"a", RenameMode::Plain).expect("rename");
    assert_eq!(errno(vol.getattr(a)), libc::ENOENT);
    assert_eq!(vol.lookup(ROOT_INO, b"a").expect("a").ino, a2);

    // Open: its reader keeps reading what it held, the name shows the new
    // file, and the last close drops it.
    let f = file(&vol, ROOT_INO, "f");
    vol.write(f, 0, &pattern(100_000, 3)).expect("write");
    vol.acquire(f).expect("open");
    let g = file(&vol, ROOT_INO, "f.tmp");
    vol.write(g, 0, &pattern(50_000, 4)).expect("write");
    vol.rename(ROOT_INO, b"f.tmp", ROOT_INO, b"f", RenameMode::Plain).expect("rename");
    assert_eq!(vol.read(f, 0, 100_000).expect("the replaced file is still readable"), pattern(100_000, 3));
    assert_eq!(vol.getattr(f).expect("attr").nlink, 0);
    let now = vol.lookup(ROOT_INO, b"f").expect("f");
    assert_eq!(now.ino, g);
    assert_eq!(vol.read(g, 0, 50_000).expect("read"), pattern(50_000, 4));
    vol.release(f).expect("release");
    assert_eq!(errno(vol.getattr(f)), libc::ENOENT);

    // A second name keeps the file: no orphan, nothing dropped at close.
    let h = file(&vol, ROOT_INO, "h");
    vol.write(h, 0, b"linked").expect("write");
    vol.link(h, ROOT_INO, b"h2").expect("link");
    vol.acquire(h).expect("open");
    file(&vol, ROOT_INO, "h.tmp");
    vol.rename(ROOT_INO, b"h.tmp", ROOT_INO, b"h", RenameMode::Plain).expect("rename");
    vol.release(h).expect("release");
    assert_eq!(vol.read(vol.lookup(ROOT_INO, b"h2").expect("h2").ino, 0, 6).expect("read"), b"linked");

    // Crash while the replaced file is open: recovery deletes it, and the
    // name holds the new file.
    let k = file(&vol, ROOT_INO, "k");
    vol.write(k, 0, &pattern(20_000, 5)).expect("write");
    vol.acquire(k).expect("open");
    let k2 = file(&vol, ROOT_INO, "k.tmp");
    vol.write(k2, 0, b"new k").expect("write");
    vol.rename(ROOT_INO, b"k.tmp", ROOT_INO, b"k", RenameMode::Plain).expect("rename");
    vol.sync_all().expect("sync");
    dev.crash(CrashMode::DropUnsynced);
    drop(vol);
    let vol = reopen(&dev);
    assert_eq!(errno(vol.getattr(k)), libc::ENOENT);
    let now = vol.lookup(ROOT_INO, b"k").expect("k");
    assert_eq!(vol.read(now.ino, 0, 5).expect("read"), b"new k");
}

#[test]
fn readdir_offsets_stay_valid_while_the_directory_changes() {
    let (_, vol) = sim();
    for i in 0..100 {
        file(&vol, ROOT_INO, &format!("f{i:03}"));
    }
    let mut first = Vec::new();
    vol.readdir(ROOT_INO, 0, |e| {
        first.push(e);
        first.len() < 30
    })
    .expect("readdir");
    let resume = first.last().expect("entries").offset;
    // Remove listed and unlisted entries, add new ones.
    vol.unlink(ROOT_INO, b"f000").expect("unlink");
    vol.unlink(ROOT_INO, b"f050").expect("unlink");
    file(&vol, ROOT_INO, "new");
    let mut rest = Vec::new();
    vol.readdir(ROOT_INO, resume, |e| {
        rest.push(e.name);
        true
    })
    .expect("readdir");
    let mut names: Vec<Vec<u8>> = first.into_iter().map(|e| e.name).chain(rest).collect();
    assert_eq!(names.iter().filter(|n| n.as_slice() == b"f010").count(), 1, "no duplicates");
    assert!(!names.contains(&b"f050".to_vec()));
    assert!(names.contains(&b"f099".to_vec()) && names.contains(&b"new".to_vec()));
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 2 + 99 + 1, "., .., f000..f099 without f050, and new");
}

#[test]
fn xattrs_set_get_list_remove_with_flags() {
    let (_, vol) = sim();
    let f = file(&vol, ROOT_INO, "f");
    vol.setxattr(f, b"user.a", b"1", XattrFlags::Create).expect("set");
    assert_eq!(errno(vol.setxattr(f, b"user.a", b"2", XattrFlags::Create)), libc::EEXIST);
    assert_eq!(errno(vol.setxattr(f, b"user.b", b"2", XattrFlags::Replace)), libc::ENODATA);
    vol.setxattr(f, b"user.b", b"", XattrFlags::Any).expect("set empty");
    assert_eq!(vol.listxattr(f).expect("list"), vec![b"user.a".to_vec(), b"user.b".to_vec()]);
    assert_eq!(vol.getxattr(f, b"user.a").expect("get"), b"1");
    vol.removexattr(f, b"user.a").expect("remove");
    assert_eq!(errno(vol.removexattr(f, b"user.a")), libc::ENODATA);
    assert_eq!(errno(vol.setxattr(f, b"user.big", &vec![0; XATTR_VALUE_MAX + 1], XattrFlags::Any)), libc::E2BIG);
}

#[test]
fn everything_survives_a_clean_reopen_and_an_fsynced_crash() {
    let (dev, vol) = sim();
    let d = vol.mkdir(ROOT_INO, b"data", 0o750, 5, 6).expect("mkdir").ino;
    let f = file(&vol, d, "shard-0");
    let body = pattern(300_000, 4);
    vol.write(f, 0, &body).expect("write");
    vol.symlink(ROOT_INO, b"link", b"data/shard-0", 0, 0).expect("symlink");
    vol.setxattr(f, b"user.k", b"v", XattrFlags::Any).expect("xattr");
    vol.commit().expect("commit");
    vol.write(f, 1000, b"after-commit").expect("write");
    vol.fsync(f).expect("fsync");
    vol.write(f, 2000, b"lost").expect("unsynced write");
    dev.crash(CrashMode::DropUnsynced);
    drop(vol);
    let vol = reopen(&dev);
    let f2 = vol.lookup(vol.lookup(ROOT_INO, b"data").expect("data").ino, b"shard-0").expect("shard").ino;
    assert_eq!(f2, f);
    let mut want = body.clone();
    want[1000..1012].copy_from_slice(b"after-commit");
    assert_eq!(vol.read(f, 0, body.len()).expect("read"), want);
    assert_eq!(vol.readlink(vol.lookup(ROOT_INO, b"link").expect("link").ino).expect("readlink"), b"data/shard-0");
    assert_eq!(vol.getxattr(f, b"user.k").expect("xattr"), b"v");
    assert_eq!(vol.getattr(d).expect("dir").perm, 0o750);
    // New inode numbers never collide with recovered ones.
    assert!(file(&vol, ROOT_INO, "next") > f);
}

#[test]
fn a_flipped_data_byte_is_eio_never_other_bytes() {
    let (dev, vol) = sim();
    let f = file(&vol, ROOT_INO, "f");
    vol.write(f, 0, &pattern(64 << 10, 2)).expect("write");
    vol.commit().expect("commit");
    let (seg, _) = vol.log_handle().expect("log").position();
    // Find the data: read a block, flip each of a sample of its bytes.
    let len = dev.segment_len(seg);
    let mut eio = 0;
    for off in (0..len).step_by(331) {
        dev.corrupt(seg, off);
        // Whole blocks (read where they go) and a span inside blocks (read
        // through a buffer): either is checked.
        for (at, n) in [(0u64, 64usize << 10), (5_000, 20_000)] {
            match vol.read(f, at, n) {
                Ok(bytes) => {
                    let want = &pattern(64 << 10, 2)[at as usize..at as usize + n];
                    assert!(bytes == want, "flip at {off} returned wrong bytes for {at}+{n}");
                }
                Err(e) => {
                    assert_eq!(e.errno(), libc::EIO);
                    eio += 1;
                }
            }
        }
        dev.corrupt(seg, off);
    }
    assert!(eio > 130, "flips in the data must be caught ({eio})");
}

#[test]
fn a_failed_fsync_poisons_the_volume() {
    let (dev, vol) = sim();
    let f = file(&vol, ROOT_INO, "f");
    vol.write(f, 0, b"x").expect("write");
    dev.fail_next_syncs(1);
    assert_eq!(errno(vol.fsync(f)), libc::EIO);
    assert_eq!(errno(vol.write(f, 0, b"y")), libc::EIO);
    assert_eq!(errno(vol.fsync(f)), libc::EIO);
    assert!(vol.is_poisoned());
}

#[test]
fn read_only_volumes_refuse_changes_with_erofs() {
    let (dev, vol) = sim();
    file(&vol, ROOT_INO, "f");
    vol.close().expect("close");
    drop(vol);
    let ro = Volume::open(Arc::new(dev), Config { read_only: true, ..cfg() }).expect("open ro");
    assert!(ro.lookup(ROOT_INO, b"f").is_ok());
    assert_eq!(errno(ro.create(ROOT_INO, b"g", libc::S_IFREG, 0, 0, 0)), libc::EROFS);
    assert_eq!(errno(ro.mkdir(ROOT_INO, b"g", 0o755, 0, 0)), libc::EROFS);
}

#[test]
fn a_large_directory_stays_searchable() {
    let (dev, vol) = sim();
    let d = vol.mkdir(ROOT_INO, b"big", 0o755, 0, 0).expect("mkdir").ino;
    let n = 50_000;
    for i in 0..n {
        vol.create(d, format!("entry-{i}").as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
    }
    vol.commit().expect("commit");
    drop(vol);
    let vol = reopen(&dev);
    for i in (0..n).step_by(997) {
        vol.lookup(d, format!("entry-{i}").as_bytes()).expect("lookup");
    }
    let mut count = 0;
    vol.readdir(d, 2, |_| {
        count += 1;
        true
    })
    .expect("readdir");
    assert_eq!(count, n);
}

#[test]
fn concurrent_fsyncs_share_fdatasyncs_on_a_real_directory() {
    for mode in [IoMode::Syscall, IoMode::Uring] {
        if mode == IoMode::Uring && arbor_engine::io::UringIo::new().is_err() {
            eprintln!("SKIPPED: io_uring unavailable");
            continue;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let dev = FileDevice::open(dir.path(), mode).expect("device");
        let vol = Volume::open(dev, cfg()).expect("open");
        let threads = 8;
        let per = 40;
        // Every round, all threads write and then fsync at the same moment:
        // whether fsyncs overlap must not hang on how fast this machine's
        // writes are against its fdatasyncs (with io_uring they often did
        // not overlap at all when each thread went at its own pace).
        let together = std::sync::Barrier::new(threads as usize);
        std::thread::scope(|s| {
            for t in 0..threads {
                let (vol, together) = (&vol, &together);
                s.spawn(move || {
                    let f = file(vol, ROOT_INO, &format!("t{t}"));
                    for i in 0..per {
                        vol.write(f, i * 10, b"0123456789").expect("write");
                        together.wait();
                        vol.fsync(f).expect("fsync");
                    }
                });
            }
        });
        let syncs = vol.log_handle().expect("log").sync_count();
        assert!(syncs < threads * per, "{mode:?}: {syncs} fdatasyncs for {} fsyncs", threads * per);
        vol.close().expect("close");
        drop(vol);
        let vol = Volume::open(FileDevice::open(dir.path(), mode).expect("device"), cfg()).expect("reopen");
        assert_eq!(vol.list_dir(ROOT_INO).expect("list").len() as u64, threads);
    }
}

fn assert_live_table_matches_a_recount(dev: &SimDevice, vol: &Volume) {
    vol.commit().expect("commit");
    let commit = vol.last_commit().expect("commit");
    let recount = recount_live_bytes(Arc::new(dev.clone()), commit).expect("recount");
    assert_eq!(live_table_of(dev, commit).expect("table"), recount, "commit record table");
    assert_eq!(vol.live_bytes(), recount, "in-memory table");
}

#[test]
fn live_bytes_per_segment_match_a_full_recount_through_changes_and_recovery() {
    let (dev, vol) = sim();
    let d = vol.mkdir(ROOT_INO, b"d", 0o755, 0, 0).expect("mkdir").ino;
    let mut files = Vec::new();
    for i in 0..3000u32 {
        let f = file(&vol, d, &format!("f{i}"));
        vol.write(f, 0, &pattern(3000 + (i as usize % 7) * 1000, i as u8)).expect("write");
        files.push(f);
    }
    assert_live_table_matches_a_recount(&dev, &vol);
    // Overwrites, truncates, punches and deletes (splits, then merges).
    for (i, f) in files.iter().enumerate() {
        match i % 4 {
            0 => drop(vol.write(*f, 1000, &pattern(2500, 1)).expect("overwrite")),
            1 => drop(vol.setattr(*f, SetAttr { size: Some(500), ..Default::default() }).expect("truncate")),
            2 => vol.unlink(d, format!("f{i}").as_bytes()).expect("unlink"),
            _ => {}
        }
    }
    assert_live_table_matches_a_recount(&dev, &vol);
    // Replay after a crash must account the same way.
    for f in files.iter().skip(3).step_by(4).take(200) {
        vol.write(*f, 0, &pattern(9000, 3)).expect("write");
    }
    vol.sync_all().expect("sync");
    dev.crash(CrashMode::DropUnsynced);
    drop(vol);
    let vol = reopen(&dev);
    assert_live_table_matches_a_recount(&dev, &vol);
}

/// A write too large for one record goes to the log in pieces; after a
/// crash anywhere among them, and with commits due after every intent, the
/// file holds all of the write or none of it.
#[test]
fn a_write_logged_in_pieces_survives_a_crash_whole_or_not_at_all() {
    // 256 KiB segments hold pieces of 124 KiB: 600 KB is five pieces.
    let cfg = Config { segment_size: 256 << 10, commit_every_ops: 1, ..cfg() };
    let (old, new) = (pattern(8 << 10, 1), pattern(600_000, 2));
    let (mut crashed, mut outcomes) = (0, std::collections::BTreeSet::new());
    for nth in 0..40 {
        for mode in [CrashMode::DropUnsynced, CrashMode::Scramble { seed: nth }] {
            let dev = SimDevice::new();
            let vol = Volume::open(Arc::new(dev.clone()), cfg.clone()).expect("open");
            let f = file(&vol, ROOT_INO, "shard");
            vol.write(f, 0, &old).expect("write");
            vol.sync_all().expect("sync");
            dev.crash_at_failpoint(None, nth);
            let done = vol.write(f, 0, &new).and_then(|_| vol.sync_all());
            dev.crash(mode);
            drop(vol);
            crashed += usize::from(done.is_err());
            let vol = Volume::open(Arc::new(dev.clone()), cfg.clone()).expect("recovery");
            let f = vol.lookup(ROOT_INO, b"shard").expect("the file was synced").ino;
            let got = vol.read(f, 0, 1 << 20).expect("read");
            if done.is_ok() {
                assert!(got == new, "crash at failpoint {nth} after the sync: the write must be whole");
            }
            assert!(
                got == old || got == new,
                "crash at failpoint {nth}: {} bytes, neither before nor after",
                got.len()
            );
            outcomes.insert(got == new);
        }
    }
    assert!(crashed > 0 && outcomes.len() == 2, "crashes landed inside the write and on both sides of it");
}

#[test]
fn a_full_disk_refuses_new_changes_with_enospc_changes_nothing_and_recovers_when_freed() {
    let (dev, vol) = sim();
    file(&vol, ROOT_INO, "made-before");
    let a = file(&vol, ROOT_INO, "a");
    vol.write(a, 0, &pattern(100_000, 1)).expect("write");
    vol.fsync(a).expect("fsync");
    let before = vol.getattr(a).expect("attr");
    // Just short of room for a 1 MiB write beside the reserve.
    dev.set_free_bytes(Some(SPACE_RESERVE + (1 << 20) - 1));
    assert_eq!(errno(vol.write(a, 0, &pattern(1 << 20, 2))), libc::ENOSPC);
    assert_eq!(vol.getattr(a).expect("attr").size, before.size, "a refused write changed the size");
    assert!(vol.read(a, 0, 100_000).expect("read") == pattern(100_000, 1), "a refused write changed bytes");
    // A small write still fits; metadata needs the reserve too.
    vol.write(a, 0, b"fits").expect("a small write fits");
    dev.set_free_bytes(Some(SPACE_RESERVE - 1));
    assert_eq!(errno(vol.create(ROOT_INO, b"b", libc::S_IFREG | 0o644, 0, 0, 0)), libc::ENOSPC);
    assert_eq!(errno(vol.lookup(ROOT_INO, b"b")), libc::ENOENT, "a refused create left a name");
    assert_eq!(errno(vol.mkdir(ROOT_INO, b"d", 0o755, 0, 0)), libc::ENOSPC);
    // Cleaning up is allowed into half of the reserve.
    vol.unlink(ROOT_INO, b"made-before").expect("unlink into the reserve");
    // What was fsynced is intact, and syncs still work: nothing is poisoned.
    vol.fsync(a).expect("fsync on a full disk");
    assert!(!vol.is_poisoned());
    // Space comes back: everything works again, no reopen.
    dev.set_free_bytes(Some(1 << 40));
    let b = file(&vol, ROOT_INO, "b");
    vol.write(b, 0, &pattern(1 << 20, 3)).expect("write after space is freed");
    vol.fsync(b).expect("fsync");
    let vol = reopen(&dev);
    let a = vol.lookup(ROOT_INO, b"a").expect("a").ino;
    let mut want = pattern(100_000, 1);
    want[..4].copy_from_slice(b"fits");
    assert!(vol.read(a, 0, 100_000).expect("read") == want);
    let b = vol.lookup(ROOT_INO, b"b").expect("b").ino;
    assert!(vol.read(b, 0, 1 << 20).expect("read") == pattern(1 << 20, 3));
}

#[test]
fn paths_resolve_from_the_root() {
    let (_, vol) = sim();
    let a = vol.mkdir(ROOT_INO, b"a", 0o755, 0, 0).expect("mkdir").ino;
    let b = vol.mkdir(a, b"b", 0o755, 0, 0).expect("mkdir").ino;
    let f = file(&vol, b, "f");
    for p in ["a/b/f", "/a/./b//f"] {
        assert_eq!(vol.lookup_path(p).expect(p).ino, f, "{p}");
    }
    assert_eq!(vol.lookup_path("").expect("root").ino, ROOT_INO);
    assert_eq!(errno(vol.lookup_path("a/nope")), libc::ENOENT);
    assert_eq!(errno(vol.lookup_path("a/b/f/x")), libc::ENOTDIR);
}

/// A writer killed with its records in the page cache (the node kept
/// running), then a new writer of the same log: what the new one replays
/// is made durable before it commits on top, so an fsync there answers for
/// it, and a power loss afterwards keeps it.
#[test]
fn a_new_writer_makes_what_it_replayed_durable_before_it_commits() {
    let (dev, vol) = sim();
    let f = file(&vol, ROOT_INO, "answered");
    vol.sync_all().expect("sync");
    let body = pattern(200_000, 9);
    vol.write(f, 0, &body).expect("write, answered, never synced");
    // As a mount that outlives its process answers a change: written out
    // to the segment file, not synced.
    vol.write_out().expect("write out");
    // Killed: nothing of the volume runs again; its records stay where the
    // kernel holds them.
    std::mem::forget(vol);
    let next = reopen(&dev);
    let g = file(&next, ROOT_INO, "after");
    next.write(g, 0, b"later").expect("write");
    next.fsync(g).expect("fsync");
    dev.crash(CrashMode::DropUnsynced);
    std::mem::forget(next);
    let vol = reopen(&dev);
    let got = vol.read(f, 0, body.len()).expect("read after power loss");
    assert!(got == body, "after the power loss the answered write reads {} bytes, not its {}", got.len(), body.len());
    assert_eq!(vol.read(vol.lookup(ROOT_INO, b"after").expect("after").ino, 0, 5).expect("read"), b"later");
}
