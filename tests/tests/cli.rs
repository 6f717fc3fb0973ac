//! The `arbor` command as a user runs it.

use arbor_tests::*;

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn errors_are_one_line_with_a_nonzero_exit() {
    let s = Scratch::new();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["init".into(), s.disk_str().into()], "already an arbor disk"),
        (vec!["mount".into(), "/nonexistent/disk".into(), "/tmp".into()], "does not exist"),
        (vec!["mount".into(), "s3://bucket/p".into(), "/tmp".into()], "not supported yet"),
        (vec!["status".into(), s.mnt.display().to_string()], "not an arbor mount"),
        (vec!["mount".into(), s.disk_str().into(), s.dir.path().join("nope").display().to_string()], "not a directory"),
        (
            vec![
                "mount".into(),
                s.disk_str().into(),
                s.mnt.display().to_string(),
                "--branch".into(),
                "bad/name".into(),
            ],
            "invalid name",
        ),
        (vec!["fsck".into(), s.disk_str().into(), "--branch".into(), "other".into()], "no branch"),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = arbor(&args);
        let err = stderr(&out);
        assert!(!out.status.success(), "{args:?} must fail");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line, got {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn help_says_what_each_command_does_with_an_example() {
    for cmd in ["init", "mount", "unmount", "status", "fsck"] {
        let out = arbor_ok(&[cmd, "--help"]);
        assert!(out.contains("Example:"), "{cmd}: {out}");
    }
    assert!(arbor_ok(&["--help"]).contains("Example:"));
}

#[test]
fn background_mount_status_second_mount_refused_unmount_and_fsck() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let mnt = s.mnt.to_str().expect("utf8");
    let out = arbor_ok(&["mount", s.disk_str(), mnt]);
    assert!(out.contains("mounted"), "{out}");
    std::fs::write(s.mnt.join("hello.txt"), b"hi").expect("write");
    let status = arbor_ok(&["status", mnt, "--json"]);
    assert!(status.contains("\"branch\":\"main\"") && status.contains("\"io_backend\""), "{status}");
    assert!(arbor_ok(&["status", mnt]).contains("branch       main"));
    // The same branch read-write a second time, at another mountpoint: refused.
    let other = s.dir.path().join("mnt2");
    std::fs::create_dir_all(&other).expect("mkdir");
    let out = arbor(&["mount", s.disk_str(), other.to_str().expect("utf8")]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("already mounted read-write"), "{}", stderr(&out));
    // A busy mountpoint: refused.
    let out = arbor(&["mount", s.disk_str(), mnt]);
    assert!(stderr(&out).contains("busy"), "{}", stderr(&out));
    // fsck refuses a mounted branch.
    assert!(!arbor(&["fsck", s.disk_str()]).status.success());
    arbor_ok(&["unmount", mnt]);
    assert!(!is_mounted(&s.mnt));
    let report = arbor_ok(&["fsck", s.disk_str(), "--json"]);
    assert!(report.contains("\"problems\":[]") && report.contains("\"files\":1"), "{report}");
}
