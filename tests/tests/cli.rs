//! The `arbor` command as a user runs it.

use arbor_tests::*;

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn errors_are_one_line_with_a_nonzero_exit() {
    let s = Scratch::new();
    let token_path = s.dir.path().join("token");
    std::fs::write(&token_path, "a-token-for-tests\n").expect("token");
    std::fs::set_permissions(&token_path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
    let token = token_path.display().to_string();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let serve = |listen: &str| -> Vec<String> {
        ["serve", s.disk_str(), "--branch", "main", "--listen", listen, "--token-file", &token]
            .map(String::from)
            .to_vec()
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["init".into(), s.disk_str().into()], "already an arbor disk"),
        (vec!["mount".into(), "/nonexistent/disk".into(), "/tmp".into()], "does not exist"),
        (vec!["mount".into(), "gs://bucket/p".into(), "/tmp".into()], "not supported"),
        (vec!["init".into(), "s3://Bad_Bucket/p".into()], "not a valid bucket name"),
        (vec!["status".into(), s.mnt.display().to_string()], "not an arbor mount"),
        (vec!["mount".into(), s.disk_str().into(), s.dir.path().join("nope").display().to_string()], "does not exist"),
        (vec!["mount".into(), s.disk_str().into(), s.disk_str().to_string() + "/disk"], "not a directory"),
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
        (vec!["checkpoints".into(), "create".into(), s.disk_str().into(), "bad/name".into()], "invalid name"),
        (
            vec![
                "branches".into(),
                "create".into(),
                s.disk_str().into(),
                "x".into(),
                "--from-checkpoint".into(),
                "nope".into(),
            ],
            "no checkpoint named",
        ),
        (vec!["branches".into(), "delete".into(), s.disk_str().into(), "main".into()], "cannot be deleted"),
        (
            vec![
                "mount".into(),
                s.disk_str().into(),
                s.mnt.display().to_string(),
                "--checkpoint".into(),
                "nope".into(),
            ],
            "no checkpoint named",
        ),
        (
            vec!["mount".into(), s.disk_str().into(), s.mnt.display().to_string(), "--branch".into(), "nope".into()],
            "no branch named",
        ),
        (vec!["diff".into(), s.disk_str().into(), "main".into(), "nope".into()], "no checkpoint or branch"),
        (vec!["prefetch".into(), s.mnt.display().to_string(), "x".into()], "not an arbor mount"),
        (vec!["compact".into(), s.disk_str().into(), "--max-live".into(), "2".into()], "between 0 and 1"),
        (vec!["compact".into(), s.disk_str().into(), "--branch".into(), "nope".into()], "no branch named"),
        (
            vec![
                "mount".into(),
                s.disk_str().into(),
                s.mnt.display().to_string(),
                "--cache-server".into(),
                "127.0.0.1:7070,127.0.0.1:notaport".into(),
                "--token-file".into(),
                token.clone(),
            ],
            "cache server \"127.0.0.1:notaport\" is not HOST:PORT",
        ),
        (
            vec![
                "mount".into(),
                s.disk_str().into(),
                s.mnt.display().to_string(),
                "--server".into(),
                "owner-host".into(),
                "--token-file".into(),
                token.clone(),
            ],
            "--server \"owner-host\" is not HOST:PORT",
        ),
        // A server already answering at the address must not pass for this
        // one having started.
        (serve(&busy.local_addr().expect("addr").to_string()), "cannot listen on"),
        (serve("127.0.0.1:0"), "give a port"),
        (
            [serve("127.0.0.1:1"), vec!["--advertise".into(), "owner-host".into()]].concat(),
            "--advertise \"owner-host\" is not HOST:PORT",
        ),
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
    for cmd in
        ["init", "mount", "unmount", "status", "checkpoints", "branches", "diff", "prefetch", "gc", "compact", "fsck"]
    {
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

#[test]
fn checkpoints_and_branches_on_an_unmounted_disk_and_a_read_only_checkpoint_mount() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let mnt = s.mnt.to_str().expect("utf8");
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    std::fs::write(s.mnt.join("tokens.bin"), vec![7u8; 100_000]).expect("write");
    // No fsync: a checkpoint includes unsynced writes.
    assert!(arbor_ok(&["checkpoints", "create", mnt, "v1"]).contains("created checkpoint v1"));
    let out = arbor(&["checkpoints", "create", mnt, "v1"]);
    assert!(stderr(&out).contains("already exists"), "{}", stderr(&out));
    std::fs::write(s.mnt.join("after.txt"), b"not in v1").expect("write");
    m.unmount();
    // On the unmounted disk.
    arbor_ok(&["branches", "create", s.disk_str(), "exp", "--from-checkpoint", "v1"]);
    arbor_ok(&["branches", "create", s.disk_str(), "copy", "--from-branch", "main"]);
    let list = arbor_ok(&["branches", "list", s.disk_str(), "--json"]);
    assert!(list.contains("\"exp\"") && list.contains("\"copy\"") && list.contains("\"main\""), "{list}");
    assert!(arbor_ok(&["checkpoints", "list", s.disk_str()]).contains("v1"));
    let d = arbor_ok(&["diff", s.disk_str(), "v1", "copy"]);
    assert_eq!(d.trim(), "A after.txt  (9 B)", "{d}");
    // A checkpoint mounts read-only and holds exactly what it froze.
    let m = Mount::start(s.disk_str(), &s.mnt, &["--checkpoint", "v1"]);
    assert_eq!(std::fs::read(s.mnt.join("tokens.bin")).expect("read").len(), 100_000);
    assert!(!s.mnt.join("after.txt").exists());
    let err = std::fs::write(s.mnt.join("new.txt"), b"x").expect_err("read-only");
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    assert!(arbor_ok(&["status", mnt]).contains("checkpoint   v1 (read-only)"));
    m.unmount();
    arbor_ok(&["branches", "reset", s.disk_str(), "copy", "--to-checkpoint", "v1"]);
    assert_eq!(arbor_ok(&["diff", s.disk_str(), "v1", "copy"]).trim(), "");
    arbor_ok(&["branches", "delete", s.disk_str(), "exp"]);
    arbor_ok(&["checkpoints", "delete", s.disk_str(), "v1"]);
    assert!(arbor_ok(&["gc", s.disk_str(), "--grace", "0"]).contains("deleted"));
    assert!(arbor_ok(&["fsck", s.disk_str()]).contains("segments"));
}

/// Files written once and big files written and deleted after them: the
/// segments the big files filled stay, kept by the small files' tree nodes
/// and the bytes of the file written first, until compact moves those and
/// gc deletes the segments.
#[test]
fn compact_then_gc_gives_back_segments_kept_only_by_a_few_live_bytes() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    std::fs::create_dir_all(s.mnt.join("keep")).expect("mkdir");
    for i in 0..200 {
        std::fs::write(s.mnt.join(format!("keep/f{i}")), format!("small {i}")).expect("write");
    }
    // File bytes that stay live in the first segment, beside the dead ones.
    let tokens: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(s.mnt.join("keep/tokens.bin"), &tokens).expect("write");
    for round in 0..3u8 {
        std::fs::write(s.mnt.join(format!("big{round}")), vec![round; 70 << 20]).expect("write");
    }
    for round in 0..3 {
        std::fs::remove_file(s.mnt.join(format!("big{round}"))).expect("remove");
    }
    let mnt = s.mnt.to_str().expect("utf8");
    let status = arbor_ok(&["status", mnt]);
    assert!(status.contains("compactable  ") && status.contains(" segments hold "), "{status}");
    let out = arbor_ok(&["compact", mnt, "--max-live", "0.5"]);
    assert!(out.contains("branch main: moved"), "{out}");
    let status = arbor_ok(&["status", mnt, "--json"]);
    assert!(status.contains("\"compactable\":{\"live_bytes\":0,\"segments\":0}"), "{status}");
    m.unmount();
    let segments = || std::fs::read_dir(s.disk.join("segments")).expect("segments").count();
    let before = segments();
    // Again on the unmounted disk (the mount's last segment is sealed now).
    let out = arbor_ok(&["compact", s.disk_str(), "--branch", "main"]);
    assert!(out.contains("branch main: moved"), "{out}");
    let out = arbor_ok(&["gc", s.disk_str(), "--grace", "0"]);
    // All that is left is the segment the last compaction wrote (without
    // compaction, the first segment stays too, kept by what lives in it).
    assert_eq!(segments(), 1, "{before} segments before gc: {out}");
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    for i in 0..200 {
        assert_eq!(std::fs::read_to_string(s.mnt.join(format!("keep/f{i}"))).expect("read"), format!("small {i}"));
    }
    assert!(std::fs::read(s.mnt.join("keep/tokens.bin")).expect("read") == tokens);
    m.unmount();
    assert!(arbor_ok(&["fsck", s.disk_str(), "--json"]).contains("\"problems\":[]"));
}

/// A mount told to maintain itself compacts on its own: what compact would
/// empty drops to nothing without any command.
#[test]
fn a_mount_with_maintain_every_compacts_by_itself() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &["--maintain-every", "5"]);
    let tokens: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
    std::fs::write(s.mnt.join("tokens.bin"), &tokens).expect("write");
    std::fs::write(s.mnt.join("big"), vec![1u8; 70 << 20]).expect("write");
    std::fs::remove_file(s.mnt.join("big")).expect("remove");
    let mnt = s.mnt.to_str().expect("utf8");
    // The first segment holds the tokens and the dead start of the big file.
    assert!(arbor_ok(&["status", mnt]).contains("compactable  "));
    wait_until("background compaction", std::time::Duration::from_secs(60), || {
        arbor_ok(&["status", mnt, "--json"]).contains("\"compactable\":{\"live_bytes\":0,\"segments\":0}")
    });
    m.unmount();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    assert!(std::fs::read(s.mnt.join("tokens.bin")).expect("read") == tokens);
    m.unmount();
}

#[test]
fn the_sweep_walkthrough_runs_as_written() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let script = arbor_tests::manifest_dir().join("../examples/sweep.sh");
    let work = s.dir.path().join("sweep");
    let out = std::process::Command::new("bash")
        .arg(script)
        .arg(&work)
        .env("ARBOR", arbor_bin())
        .output()
        .expect("run sweep.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    assert!(stdout.contains("created checkpoint dataset-v1"), "{stdout}");
    assert!(stdout.contains("A ckpt/step-200.pt"), "{stdout}");
    assert!(stdout.contains("M config/base.yaml"), "{stdout}");
    assert!(stdout.contains("sweep done"), "{stdout}");
}

#[test]
fn errors_name_the_real_cause_of_a_bad_path() {
    let out = arbor(&["checkpoints", "create", "/etc/passwd/x", "v1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a folder") && !err.contains("does not exist"), "{err}");
    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: the permission case runs a copy of arbor as user nobody, which needs root");
        return;
    }
    // A folder only root may enter, and a copy of arbor nobody may run.
    let private = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(private.path().join("mnt")).expect("mkdir");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let open = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bin = open.path().join("arbor");
    std::fs::copy(arbor_bin(), &bin).expect("copy arbor");
    let target = private.path().join("mnt");
    let out = std::process::Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .arg(&bin)
        .args(["checkpoints", "create"])
        .arg(&target)
        .arg("v1")
        .output()
        .expect("runuser");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("permission denied") && !err.contains("does not exist"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
}

#[test]
fn output_into_a_closed_pipe_ends_a_command_quietly() {
    // `arbor … | head -1` with the reader gone before arbor prints: no
    // panic about stdout, as with any other tool.
    let s = Scratch::new();
    let disk = s.dir.path().join("second");
    let mut child = std::process::Command::new(arbor_bin())
        .args(["init", disk.to_str().expect("utf8")])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
    assert!(disk.is_dir(), "the command did its work before it printed");
}

/// The next message a child sent to the `NOTIFY_SOCKET` bound at `sock`
/// (`None` after `wait` without one).
fn notification(sock: &std::os::unix::net::UnixDatagram, wait: std::time::Duration) -> Option<String> {
    sock.set_read_timeout(Some(wait)).expect("timeout");
    let mut buf = [0u8; 512];
    let n = sock.recv(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).trim().to_string())
}

/// A child process killed (and reaped) if the test ends early.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn foreground_mounts_and_servers_tell_systemd_when_they_are_ready_and_when_they_stop() {
    use std::os::unix::net::UnixDatagram;
    use std::process::{Command, Stdio};
    use std::time::Duration;
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let mnt = s.mnt.to_str().expect("utf8");
    let sockets = tempfile::tempdir().expect("tempdir");
    let sock_path = sockets.path().join("notify");
    let sock = UnixDatagram::bind(&sock_path).expect("bind the notify socket");
    let sigterm = |child: &std::process::Child| {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    };

    // A foreground mount (a `Type=notify` unit): READY once mounted and
    // answering `arbor status`, STOPPING when told to stop.
    let log = s.dir.path().join("mount.log");
    let child = Command::new(arbor_bin())
        .args(["mount", s.disk_str(), mnt, "--foreground"])
        .env("NOTIFY_SOCKET", &sock_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("spawn arbor mount");
    let mut mount = Mount { child, mnt: s.mnt.clone(), log };
    assert_eq!(notification(&sock, Duration::from_secs(60)).as_deref(), Some("READY=1"));
    assert!(is_mounted(&s.mnt) && statfs_ok(&s.mnt), "ready before it was mounted");
    assert!(arbor_ok(&["status", mnt]).contains("branch"));
    std::fs::write(s.mnt.join("kept.txt"), b"kept").expect("write");
    // A file still open when the stop comes (as any fork on the node
    // briefly holds one): the unmount waits for it instead of leaving the
    // mount behind.
    let held = std::fs::File::open(s.mnt.join("kept.txt")).expect("open");
    sigterm(&mount.child);
    assert_eq!(notification(&sock, Duration::from_secs(60)).as_deref(), Some("STOPPING=1"));
    std::thread::sleep(Duration::from_millis(300));
    assert!(is_mounted(&s.mnt), "unmounted under an open file");
    drop(held);
    let status = mount.child.wait().expect("wait");
    assert!(status.success(), "{status}: {}", std::fs::read_to_string(&mount.log).unwrap_or_default());
    std::mem::forget(mount);
    assert!(!is_mounted(&s.mnt));

    // `arbor serve --branch` in the foreground: READY once it takes
    // connections, STOPPING on SIGTERM, then a clean exit.
    let token = s.dir.path().join("token");
    std::fs::write(&token, "a-token-for-the-notify-test\n").expect("token");
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
    let addr = format!("127.0.0.1:{}", free_port());
    let mut serve = Killed(
        Command::new(arbor_bin())
            .args(["serve", s.disk_str(), "--branch", "main", "--listen", &addr])
            .args(["--token-file", token.to_str().expect("utf8"), "--foreground"])
            .env("NOTIFY_SOCKET", &sock_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn arbor serve"),
    );
    assert_eq!(notification(&sock, Duration::from_secs(60)).as_deref(), Some("READY=1"));
    assert!(std::net::TcpStream::connect(&addr).is_ok(), "ready before it listened");
    sigterm(&serve.0);
    assert_eq!(notification(&sock, Duration::from_secs(60)).as_deref(), Some("STOPPING=1"));
    assert!(serve.0.wait().expect("wait").success());

    // A background mount (a `Type=forking` unit) is ready when `arbor
    // mount` returns; its server process is another pid and says nothing.
    let env = [("NOTIFY_SOCKET", sock_path.to_str().expect("utf8").to_string())];
    arbor_env_ok(&["mount", s.disk_str(), mnt], &env);
    let heard = notification(&sock, Duration::from_millis(500));
    let kept = std::fs::read(s.mnt.join("kept.txt"));
    arbor_ok(&["unmount", mnt]);
    assert_eq!(heard, None);
    assert_eq!(kept.expect("read"), b"kept");
}

/// docs/configuration.md names every flag of every command (in that
/// command's section) and every `ARBOR_…` variable the code reads.
#[test]
fn the_configuration_page_lists_every_flag_and_variable() {
    let root = arbor_tests::manifest_dir().join("..");
    let doc = std::fs::read_to_string(root.join("docs/configuration.md")).expect("docs/configuration.md");
    let commands: &[&[&str]] = &[
        &["init"],
        &["mount"],
        &["unmount"],
        &["status"],
        &["checkpoints", "create"],
        &["checkpoints", "list"],
        &["checkpoints", "delete"],
        &["branches", "create"],
        &["branches", "list"],
        &["branches", "delete"],
        &["branches", "reset"],
        &["branches", "rename"],
        &["diff"],
        &["prefetch"],
        &["gc"],
        &["compact"],
        &["serve"],
        &["warm"],
        &["import"],
        &["export"],
        &["fsck"],
        &["csi"],
        &["keeper"],
    ];
    let mut missing = Vec::new();
    for cmd in commands {
        let mut args = cmd.to_vec();
        args.push("--help");
        let help = arbor_ok(&args);
        let options = help.split("Options:").nth(1).unwrap_or_default();
        let heading = format!("## arbor {}\n", cmd.join(" "));
        let section = doc.split(&heading).nth(1).map(|s| s.split("\n## ").next().unwrap_or_default());
        for line in options.lines() {
            let Some(flag) = line.trim_start().trim_start_matches("-h, ").split([' ', '<']).next() else { continue };
            if !flag.starts_with("--") || flag == "--help" || flag == "--version" {
                continue;
            }
            if !section.is_some_and(|s| s.contains(&format!("`{flag}`"))) {
                missing.push(format!("arbor {} {flag}", cmd.join(" ")));
            }
        }
    }
    // Every ARBOR_ variable a crate's code names.
    for krate in ["engine", "fs", "net", "node", "cli", "snapshot"] {
        let mut stack = vec![root.join(krate).join("src")];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).expect("read_dir").flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                    continue;
                }
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                for piece in text.split('"').skip(1).step_by(2) {
                    let name = piece.split('=').next().unwrap_or_default();
                    let var = name.len() > 6
                        && name.starts_with("ARBOR_")
                        && name.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
                    if var && !doc.contains(name) {
                        missing.push(format!("{name} ({})", p.display()));
                    }
                }
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(missing.is_empty(), "not in docs/configuration.md (python3 docs/configuration.py): {missing:#?}");
}
