//! POSIX conformance: the pjdfstest suite against a real mount.
//!
//! Needs `pjdfstest` 0.2.2 on PATH and a user named `pjdtest` (`.ci/run`
//! installs both). On this machine's ext4 the same binary gives 351 passed,
//! 47 skipped, 0 failed; arbor skips one more, `link::link_count_max`,
//! because glibc's `pathconf(_PC_LINK_MAX)` knows no FUSE file system.

use arbor_tests::*;
use std::process::Command;

fn tool_available() -> bool {
    let have = Command::new("pjdfstest").arg("--help").output().is_ok_and(|o| o.status.success())
        && Command::new("id").arg("pjdtest").output().is_ok_and(|o| o.status.success());
    if !have {
        if std::env::var_os("CI").is_some() {
            panic!("pjdfstest and the pjdtest user must be installed in CI (.ci/run does it)");
        }
        eprintln!("SKIPPED: pjdfstest or the pjdtest user is missing");
    }
    have
}

/// `(failed, skipped, passed)` from pjdfstest's summary line.
fn summary(out: &str) -> Option<(u32, u32, u32)> {
    let line = out.lines().find(|l| l.starts_with("Summary:"))?;
    let num = |word: &str| -> Option<u32> {
        let at = line.find(word)?;
        line[..at].trim_end().rsplit([' ', ',']).next()?.parse().ok()
    };
    Some((num(" failed")?, num(" skipped")?, num(" passed")?))
}

#[test]
fn summary_line_parses() {
    let s = "Summary: 2 failed, 48 skipped, 350 passed, 0 expected failures, 398 total";
    assert_eq!(summary(s), Some((2, 48, 350)));
    assert_eq!(summary("nothing"), None);
}

/// Runs pjdfstest in `mnt` (mounted with `--allow-other`): (failed,
/// skipped, passed), and the names of the failed cases.
fn pjdfstest(scratch: &Scratch, mnt: &std::path::Path) -> (u32, u32, u32, Vec<String>) {
    let cfg = scratch.dir.path().join("pjdfstest.toml");
    std::fs::write(
        &cfg,
        "[settings]\nnaptime = 0.05\n[dummy_auth]\nentries = [[\"nobody\", \"nogroup\"], [\"pjdtest\", \"pjdtest\"]]\n",
    )
    .expect("config");
    // The test users must be able to reach the mount through its parents.
    let mut p = mnt.parent();
    while let Some(dir) = p {
        let _ = Command::new("chmod").arg("o+x").arg(dir).status();
        p = dir.parent();
    }
    let out = Command::new("pjdfstest")
        .args(["-c", cfg.to_str().expect("utf8"), "-p", mnt.to_str().expect("utf8")])
        .current_dir(mnt)
        .output()
        .expect("run pjdfstest");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let (failed, skipped, passed) = summary(&text).unwrap_or_else(|| panic!("no summary in:\n{text}"));
    let failures = text.lines().filter(|l| l.trim_end().ends_with("FAILED")).map(str::to_string).collect();
    (failed, skipped, passed, failures)
}

#[test]
fn pjdfstest_passes_on_a_real_mount() {
    if !fuse_available() || !tool_available() {
        return;
    }
    let s = Scratch::short();
    // Other users (pjdtest, nobody) must reach the mount.
    let m = Mount::start(s.disk_str(), &s.mnt, &["--allow-other"]);
    let (failed, skipped, passed, failures) = pjdfstest(&s, &s.mnt);
    println!("pjdfstest on arbor: {passed} passed, {failed} failed, {skipped} skipped");
    assert_eq!(failed, 0, "failures:\n{}", failures.join("\n"));
    assert!(passed >= 350, "only {passed} passed");
    m.unmount();

    // The same suite through a client of `arbor serve --branch`: the same
    // counts as the local mount. The suite runs as root, makes devices and
    // set-ID files and gives files away: an owner that trusts its clients'
    // root, and a client that honours what it makes.
    let token = s.dir.path().join("token");
    std::fs::write(&token, "posix-token\n").expect("token");
    let token = token.to_str().expect("utf8");
    let owner = Serve::start(
        s.disk_str(),
        free_port(),
        &["--branch", "main", "--token-file", token, "--allow-suid-devices", "--no-root-squash"],
        &[],
        &s.dir.path().join("owner.log"),
    );
    let client = Mount::start(s.disk_str(), &s.mnt, &["--allow-other", "--allow-suid-devices", "--token-file", token]);
    let remote = pjdfstest(&s, &s.mnt);
    println!("pjdfstest through the owner: {} passed, {} failed, {} skipped", remote.2, remote.0, remote.1);
    assert_eq!(remote.0, 0, "failures through the owner:\n{}", remote.3.join("\n"));
    assert_eq!((remote.1, remote.2), (skipped, passed), "the same skipped and passed counts as a local mount");
    client.unmount();
    owner.stop();
}
