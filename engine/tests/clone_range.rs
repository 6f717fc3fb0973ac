//! Cloning a range of one file into another: the clone shares the
//! source's log bytes, reads as the source did, and each side changes
//! alone afterwards; it survives a crash whole or not at all, keeps the
//! live-bytes table exact, and survives compaction of the shared segments.

use arbor_engine::device::{CrashMode, SimDevice};
use arbor_engine::env::TestEnv;
use arbor_engine::volume::*;
use arbor_engine::Result;
use std::sync::Arc;

fn cfg() -> Config {
    Config { commit_interval: None, segment_size: 1 << 20, env: TestEnv::new(11), ..Config::default() }
}

fn sim() -> (SimDevice, Arc<Volume>) {
    let dev = SimDevice::new();
    let vol = Volume::open(Arc::new(dev.clone()), cfg()).expect("open");
    (dev, vol)
}

fn file(vol: &Volume, name: &str) -> u64 {
    vol.create(ROOT_INO, name.as_bytes(), libc::S_IFREG | 0o644, 1000, 1000, 0).expect("create").ino
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed).wrapping_add((i >> 12) as u8)).collect()
}

fn errno<T: std::fmt::Debug>(r: Result<T>) -> i32 {
    r.expect_err("must fail").errno()
}

fn whole(vol: &Volume, ino: u64) -> Vec<u8> {
    let size = vol.getattr(ino).expect("attr").size as usize;
    vol.read(ino, 0, size + 1).expect("read")
}

fn assert_live_table_matches_a_recount(dev: &SimDevice, vol: &Volume) {
    vol.commit().expect("commit");
    let commit = vol.last_commit().expect("commit");
    let recount = recount_live_bytes(Arc::new(dev.clone()), commit).expect("recount");
    assert_eq!(vol.live_bytes(), recount, "in-memory table");
}

#[test]
fn a_clone_reads_as_its_source_and_each_side_changes_alone() {
    let (dev, vol) = sim();
    // A source of several records with a hole, a destination with bytes
    // of its own around the cloned range.
    let src = file(&vol, "src");
    let mut src_model = pattern(2_500_000, 1);
    vol.write(src, 0, &src_model).expect("write");
    let tail = pattern(300_000, 2);
    vol.write(src, 3_000_000, &tail).expect("write past a hole");
    src_model.resize(3_000_000, 0);
    src_model.extend_from_slice(&tail);
    let dst = file(&vol, "dst");
    let mut dst_model = pattern(4_000_000, 3);
    vol.write(dst, 0, &dst_model).expect("write");
    let before = vol.log_handle().expect("log").position();

    let (from, at, len) = (12_345u64, 777u64, 3_100_000u64);
    assert_eq!(vol.clone_range(src, from, dst, at, len).expect("clone"), len);
    dst_model[at as usize..(at + len) as usize].copy_from_slice(&src_model[from as usize..(from + len) as usize]);
    assert_eq!(whole(&vol, dst), dst_model);
    assert_eq!(whole(&vol, src), src_model);
    // No bytes were written for the clone: the log grew by one intent.
    let after = vol.log_handle().expect("log").position();
    assert_eq!(after.0, before.0, "a clone of {len} bytes moved the log to another segment");
    assert!(after.1 - before.1 < 4096, "a clone of {len} bytes logged {} bytes", after.1 - before.1);

    // Copy-on-write: a change to either side leaves the other as it was.
    vol.write(src, 20_000, b"source changed").expect("write src");
    src_model[20_000..20_014].copy_from_slice(b"source changed");
    vol.write(dst, 900_000, b"destination changed").expect("write dst");
    dst_model[900_000..900_019].copy_from_slice(b"destination changed");
    assert_eq!(whole(&vol, src), src_model);
    assert_eq!(whole(&vol, dst), dst_model);
    assert_live_table_matches_a_recount(&dev, &vol);

    // Past the source's end the range is cut; a clone that grows the
    // destination sets its size.
    let grown = file(&vol, "grown");
    let size = src_model.len() as u64;
    assert_eq!(vol.clone_range(src, size - 10, grown, 5_000, 1 << 20).expect("clone"), 10);
    assert_eq!(vol.getattr(grown).expect("attr").size, 5_010);
    let mut grown_model = vec![0u8; 5_000];
    grown_model.extend_from_slice(&src_model[src_model.len() - 10..]);
    assert_eq!(whole(&vol, grown), grown_model);
    assert_eq!(vol.clone_range(src, size, grown, 0, 100).expect("nothing to clone"), 0);
}

#[test]
fn inline_files_clone_too_and_bad_ranges_are_refused_without_a_change() {
    let (_, vol) = sim();
    let small = file(&vol, "small");
    vol.write(small, 0, b"a small inline file").expect("write");
    let into = file(&vol, "into");
    vol.write(into, 0, b"0123456789").expect("write");
    assert_eq!(vol.clone_range(small, 2, into, 4, 5).expect("clone"), 5);
    assert_eq!(whole(&vol, into), b"0123small9");
    assert_eq!(whole(&vol, small), b"a small inline file");

    let dir = vol.mkdir(ROOT_INO, b"d", 0o755, 0, 0).expect("mkdir").ino;
    assert_eq!(errno(vol.clone_range(dir, 0, into, 0, 1)), libc::EISDIR);
    assert_eq!(errno(vol.clone_range(small, 0, dir, 0, 1)), libc::EISDIR);
    assert_eq!(errno(vol.clone_range(small, 0, 999_999, 0, 1)), libc::ENOENT);
    // Overlapping ranges of one file.
    assert_eq!(errno(vol.clone_range(into, 0, into, 3, 5)), libc::EINVAL);
    assert_eq!(whole(&vol, into), b"0123small9");
    // Apart, within one file, is fine.
    assert_eq!(vol.clone_range(into, 0, into, 10, 4).expect("clone"), 4);
    assert_eq!(whole(&vol, into), b"0123small90123");
}

#[test]
fn a_clone_is_whole_or_absent_after_a_crash_and_fsynced_clones_survive() {
    let (dev, vol) = sim();
    let src = file(&vol, "src");
    let body = pattern(1_500_000, 4);
    vol.write(src, 0, &body).expect("write");
    let kept = file(&vol, "kept");
    let lost = file(&vol, "lost");
    vol.sync_all().expect("sync");
    vol.clone_range(src, 100, kept, 0, 1_000_000).expect("clone");
    vol.fsync(kept).expect("fsync");
    vol.clone_range(src, 0, lost, 0, 1_500_000).expect("unsynced clone");
    dev.crash(CrashMode::DropUnsynced);
    drop(vol);
    let vol = Volume::open(Arc::new(dev.clone()), cfg()).expect("reopen");
    assert_eq!(whole(&vol, kept), body[100..1_000_100]);
    let after = whole(&vol, lost);
    assert!(after.is_empty() || after == body, "a torn clone: {} bytes", after.len());
    assert_live_table_matches_a_recount(&dev, &vol);
}

#[test]
fn compaction_and_a_deleted_source_leave_the_clone_readable() {
    let (dev, vol) = sim();
    let src = file(&vol, "src");
    let body = pattern(2_000_000, 5);
    vol.write(src, 0, &body).expect("write");
    let dst = file(&vol, "dst");
    vol.clone_range(src, 0, dst, 0, body.len() as u64).expect("clone");
    vol.unlink(ROOT_INO, b"src").expect("unlink");
    // Fill more segments so the shared ones are sealed, then move
    // everything out of them.
    let filler = file(&vol, "filler");
    vol.write(filler, 0, &pattern(3_000_000, 6)).expect("write");
    vol.setattr(filler, SetAttr { size: Some(0), ..Default::default() }).expect("truncate");
    let report = vol.compact(1.0).expect("compact");
    assert!(report.data_bytes >= body.len() as u64, "compaction moved {} bytes", report.data_bytes);
    assert_eq!(whole(&vol, dst), body);
    assert_live_table_matches_a_recount(&dev, &vol);
    vol.sync_all().expect("sync");
    drop(vol);
    let vol = Volume::open(Arc::new(dev.clone()), cfg()).expect("reopen");
    assert_eq!(whole(&vol, dst), body);
}
