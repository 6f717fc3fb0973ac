//! Helpers for end-to-end tests: find the `arbor` binary, make disks, and
//! mount them for real through `/dev/fuse`.

pub mod faults;

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The `arbor` binary cargo built next to this test.
pub fn arbor_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ARBOR_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    dir.join("arbor")
}

/// Whether real mounts can run here; outside CI a missing FUSE skips loudly.
pub fn fuse_available() -> bool {
    // SAFETY: plain syscall.
    let root = unsafe { libc::geteuid() } == 0;
    let ok = root && Path::new("/dev/fuse").exists();
    if !ok {
        if std::env::var_os("CI").is_some() {
            panic!("FUSE tests must run in CI: need root and /dev/fuse");
        }
        eprintln!("SKIPPED: FUSE tests need root and /dev/fuse");
    }
    ok
}

pub fn arbor(args: &[&str]) -> Output {
    Command::new(arbor_bin()).args(args).output().expect("run arbor")
}

/// Runs arbor with extra environment variables.
pub fn arbor_env(args: &[&str], env: &[(&str, String)]) -> Output {
    Command::new(arbor_bin()).args(args).envs(env.iter().map(|(k, v)| (*k, v))).output().expect("run arbor")
}

/// Runs arbor with extra environment variables and insists it succeeded.
pub fn arbor_env_ok(args: &[&str], env: &[(&str, String)]) -> String {
    let out = arbor_env(args, env);
    assert!(out.status.success(), "arbor {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs arbor and insists it succeeded.
pub fn arbor_ok(args: &[&str]) -> String {
    let out = arbor(args);
    assert!(out.status.success(), "arbor {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn is_mounted(mp: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines().any(|l| l.split(' ').nth(4).is_some_and(|m| Path::new(m) == mp))
}

/// Whether `statfs` succeeds: it always reaches the FUSE server.
pub fn statfs_ok(p: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else { return false };
    let mut buf = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: a valid path and a buffer statfs fills.
    unsafe { libc::statfs(c.as_ptr(), buf.as_mut_ptr()) == 0 }
}

pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fresh disk and a mountpoint in a temporary folder.
pub struct Scratch {
    pub dir: tempfile::TempDir,
    pub disk: PathBuf,
    pub mnt: PathBuf,
}

impl Scratch {
    pub fn new() -> Scratch {
        Self::new_in(&scratch_root())
    }

    /// A scratch with a short path, for tests that bind Unix sockets inside
    /// the mount (a socket path is limited to 108 bytes).
    pub fn short() -> Scratch {
        Self::new_in(&std::env::temp_dir())
    }

    fn new_in(root: &Path) -> Scratch {
        let dir = tempfile::Builder::new().prefix("arb").tempdir_in(root).expect("tempdir");
        let disk = dir.path().join("disk");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir_all(&mnt).expect("mkdir");
        arbor_ok(&["init", disk.to_str().expect("utf8")]);
        Scratch { dir, disk, mnt }
    }

    pub fn disk_str(&self) -> &str {
        self.disk.to_str().expect("utf8")
    }
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

/// Scratch space on the same disk as the build (not a tmpfs), so fsync
/// means what it says.
fn scratch_root() -> PathBuf {
    let p = std::env::var_os("ARBOR_TEST_DIR").map(PathBuf::from).unwrap_or_else(|| {
        arbor_bin().parent().and_then(Path::parent).map(|t| t.join("e2e-scratch")).expect("target dir")
    });
    std::fs::create_dir_all(&p).expect("scratch root");
    p
}

/// `arbor mount --foreground` as a child process; unmounted on drop.
pub struct Mount {
    pub child: Child,
    pub mnt: PathBuf,
    pub log: PathBuf,
}

impl Mount {
    pub fn start(disk: &str, mnt: &Path, extra: &[&str]) -> Mount {
        Self::start_env(disk, mnt, extra, &[])
    }

    /// Mounts with extra environment variables (an S3 endpoint, credentials).
    pub fn start_env(disk: &str, mnt: &Path, extra: &[&str], env: &[(&str, String)]) -> Mount {
        Self::start_under(&[], disk, mnt, extra, env)
    }

    /// Mounts with `arbor` run under `wrapper` (e.g. `unshare -pf`, for a
    /// process in a PID namespace of its own, or `faketime`).
    pub fn start_under(wrapper: &[&str], disk: &str, mnt: &Path, extra: &[&str], env: &[(&str, String)]) -> Mount {
        let child = Self::spawn(wrapper, disk, mnt, extra, env, |_| {});
        let log = mnt.with_extension(format!("log-{}", std::process::id()));
        let mut m = Mount { child, mnt: mnt.to_path_buf(), log };
        wait_until("the mount", Duration::from_secs(30), || {
            if let Ok(Some(status)) = m.child.try_wait() {
                panic!("arbor mount exited with {status}: {}", std::fs::read_to_string(&m.log).unwrap_or_default());
            }
            // A stale mount from a killed server is listed too, but answers ENOTCONN.
            is_mounted(&m.mnt) && std::fs::read_dir(&m.mnt).is_ok() && statfs_ok(&m.mnt)
        });
        m
    }

    /// Mounts as a process group of its own (as a service manager starts
    /// one, so that [`Mount::kill_group`] kills all of it and nothing
    /// else), and returns once `arbor status` answers: a mount point whose
    /// connection a keeper holds waits for its server, so nothing here
    /// touches the mount itself before one answers.
    pub fn start_in_group(disk: &str, mnt: &Path, extra: &[&str], env: &[(&str, String)]) -> Mount {
        use std::os::unix::process::CommandExt;
        let child = Self::spawn(&[], disk, mnt, extra, env, |cmd| {
            cmd.process_group(0);
        });
        let log = mnt.with_extension(format!("log-{}", std::process::id()));
        let mut m = Mount { child, mnt: mnt.to_path_buf(), log };
        wait_until("the mount's server", Duration::from_secs(30), || {
            if let Ok(Some(status)) = m.child.try_wait() {
                panic!("arbor mount exited with {status}: {}", std::fs::read_to_string(&m.log).unwrap_or_default());
            }
            is_mounted(&m.mnt) && arbor(&["status", m.mnt.to_str().expect("utf8"), "--json"]).status.success()
        });
        m
    }

    /// kill -9 of the mount's whole process group (started with
    /// [`Mount::start_in_group`]), as `systemctl restart` or a container's
    /// restart kills every process; returns once none of them is left. The
    /// kernel mount stays (a keeper may hold its connection).
    pub fn kill_group(self) {
        self.signal_group(libc::SIGKILL);
    }

    /// `signal` to the mount's whole process group (SIGTERM: as `systemctl
    /// stop` or `restart` does); returns how the mount process ended, once
    /// none of the group is left.
    pub fn signal_group(mut self, signal: libc::c_int) -> std::process::ExitStatus {
        let pgid = self.child.id() as libc::pid_t;
        // SAFETY: a signal to the process group this test started.
        assert_eq!(unsafe { libc::kill(-pgid, signal) }, 0, "kill -{signal} -{pgid}");
        let status = self.child.wait().expect("wait");
        // SAFETY: signal 0 only asks whether a process of the group is left.
        wait_until("every process of the group to die", Duration::from_secs(10), || unsafe {
            libc::kill(-pgid, 0) != 0
        });
        std::mem::forget(self);
        status
    }

    fn spawn(
        wrapper: &[&str],
        disk: &str,
        mnt: &Path,
        extra: &[&str],
        env: &[(&str, String)],
        adjust: impl FnOnce(&mut Command),
    ) -> Child {
        let log = mnt.with_extension(format!("log-{}", std::process::id()));
        let log_file = std::fs::File::create(&log).expect("log");
        let bin = arbor_bin();
        let (program, before): (&OsStr, &[&str]) = match wrapper.split_first() {
            Some((first, rest)) => (OsStr::new(*first), rest),
            None => (bin.as_os_str(), &[]),
        };
        let mut cmd = Command::new(program);
        cmd.args(before);
        if !wrapper.is_empty() {
            cmd.arg(&bin);
        }
        cmd.args(["mount", disk, mnt.to_str().expect("utf8"), "--foreground"])
            .args(extra)
            .envs(env.iter().map(|(k, v)| (*k, v)))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log"))
            .stderr(log_file);
        adjust(&mut cmd);
        cmd.spawn().expect("spawn arbor mount")
    }

    /// kill -9: no flush, no unmount; the mountpoint is left stale.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The kernel keeps a killed mount's dead connection mounted: it is
        // detached, as an operator would, so that nothing the test started
        // outlives it.
        let _ = Command::new("fusermount3").arg("-uz").arg(&self.mnt).output();
        std::mem::forget(self);
    }

    /// `arbor unmount`, and the server must exit cleanly.
    pub fn unmount(self) {
        self.unmount_env(&[]);
    }

    pub fn unmount_env(mut self, env: &[(&str, String)]) {
        arbor_env_ok(&["unmount", self.mnt.to_str().expect("utf8")], env);
        let status = self.child.wait().expect("wait");
        assert!(
            status.success(),
            "server exit: {status}; log: {}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
        std::mem::forget(self);
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new(arbor_bin()).args(["unmount", self.mnt.to_str().unwrap_or("")]).output();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `arbor keeper` on a socket in `dir`; killed on drop.
pub struct Keeper {
    child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Keeper {
    pub fn start(dir: &Path) -> Keeper {
        let socket = dir.join("keeper.sock");
        let log = dir.join("keeper.log");
        let child = Command::new(arbor_bin())
            .args(["keeper", "--socket", socket.to_str().expect("utf8")])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).expect("log"))
            .stderr(std::fs::OpenOptions::new().append(true).open(&log).expect("log"))
            .spawn()
            .expect("spawn arbor keeper");
        let mut k = Keeper { child, socket, log };
        wait_until("arbor keeper to listen", Duration::from_secs(20), || {
            if let Ok(Some(status)) = k.child.try_wait() {
                panic!("arbor keeper exited with {status}: {}", std::fs::read_to_string(&k.log).unwrap_or_default());
            }
            arbor(&["keeper", "--socket", k.socket_str(), "--list"]).status.success()
        });
        k
    }

    pub fn socket_str(&self) -> &str {
        self.socket.to_str().expect("utf8")
    }

    /// The mount points whose connections it holds.
    pub fn held(&self) -> Vec<String> {
        serde_json::from_str(&arbor_ok(&["keeper", "--socket", self.socket_str(), "--list"])).expect("a JSON list")
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a Python client script from `tests/clients` with arguments.
pub fn python(script: &str, args: &[&str]) -> Output {
    let path = manifest_dir().join("clients").join(script);
    Command::new("python3").arg(path).args(args).output().expect("python3")
}

/// Whether numpy is importable; in CI it must be.
pub fn numpy_available() -> bool {
    let ok = Command::new("python3").args(["-c", "import numpy"]).status().is_ok_and(|s| s.success());
    if !ok {
        if std::env::var_os("CI").is_some() {
            panic!("numpy must be installed in CI");
        }
        eprintln!("SKIPPED: numpy is not installed");
    }
    ok
}

/// A real S3-compatible server (s3s-fs on 127.0.0.1), the environment that
/// points arbor at it, and a folder for mountpoints and this node's caches.
pub struct S3World {
    _server: arbor_engine::testkit::S3Server,
    data: tempfile::TempDir,
    pub dir: tempfile::TempDir,
    pub env: Vec<(&'static str, String)>,
}

impl S3World {
    /// `None` (the test skips) where FUSE or s3s-fs is missing outside CI.
    pub fn start() -> Option<S3World> {
        use arbor_engine::testkit::{S3Server, S3_KEY, S3_SECRET};
        if !fuse_available() {
            return None;
        }
        let data = tempfile::tempdir().expect("tempdir");
        let server = S3Server::start(data.path()).expect("s3s-fs")?;
        let dir = tempfile::Builder::new().prefix("arbs3").tempdir().expect("tempdir");
        let env = vec![
            ("AWS_ACCESS_KEY_ID", S3_KEY.to_string()),
            ("AWS_SECRET_ACCESS_KEY", S3_SECRET.to_string()),
            ("AWS_ENDPOINT_URL", server.endpoint()),
            ("AWS_REGION", "us-east-1".to_string()),
            ("XDG_CACHE_HOME", dir.path().join("cache").display().to_string()),
        ];
        Some(S3World { _server: server, data, dir, env })
    }

    /// The objects under `prefix` of the test bucket, as s3s-fs keeps them
    /// (one file each in its data folder), counted without asking arbor.
    pub fn objects_under(&self, prefix: &str) -> usize {
        self.objects_and_bytes_under(prefix).0
    }

    /// How many objects under `prefix` of the test bucket, and their bytes
    /// (an object's file appears whole, renamed into place by s3s-fs).
    pub fn objects_and_bytes_under(&self, prefix: &str) -> (usize, u64) {
        let root = self.data.path().join(arbor_engine::testkit::S3_BUCKET).join(prefix);
        let (mut n, mut bytes) = (0, 0);
        let mut stack = vec![root];
        while let Some(p) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&p) else { continue };
            for e in rd.flatten() {
                match e.file_type() {
                    Ok(t) if t.is_dir() => stack.push(e.path()),
                    Ok(_) => {
                        n += 1;
                        bytes += e.metadata().map_or(0, |m| m.len());
                    }
                    Err(_) => {}
                }
            }
        }
        (n, bytes)
    }

    /// Puts `body` at `key` of the test bucket the way s3s-fs keeps
    /// objects (one file in its data folder): many objects quickly, as a
    /// team's own tools would have put them.
    pub fn put_as_file(&self, key: &str, body: &[u8]) {
        let p = self.data.path().join(arbor_engine::testkit::S3_BUCKET).join(key);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, body).expect("write");
    }

    /// The test bucket, reached directly (objects a team put there
    /// without arbor).
    pub fn bucket(&self) -> arbor_engine::bucket::S3Store {
        arbor_engine::bucket::S3Store::open(&self._server.config("")).expect("open the test bucket")
    }

    /// Where the S3 server listens.
    pub fn s3_addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self._server.port))
    }

    /// The environment with the bucket reached through `endpoint` instead.
    pub fn env_via(&self, endpoint: &str) -> Vec<(&'static str, String)> {
        let mut env = self.env.clone();
        for (k, v) in env.iter_mut() {
            if *k == "AWS_ENDPOINT_URL" {
                *v = endpoint.to_string();
            }
        }
        env
    }

    /// A folder for a mountpoint.
    pub fn mnt(&self, name: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::create_dir_all(&p).expect("mkdir");
        p
    }

    /// Every cache this node has: gone, as with a replaced node.
    pub fn lose_the_cache(&self) {
        std::fs::remove_dir_all(self.dir.path().join("cache")).expect("rm cache");
    }
}

/// Creates `path` with `bytes` and fsyncs it.
pub fn write_synced(path: &Path, bytes: &[u8]) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).expect("create");
    f.write_all(bytes).expect("write");
    f.sync_all().expect("fsync");
}

/// `len` bytes that differ with `seed` and with position.
pub fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 11) as u8).collect()
}

pub use arbor_engine::testkit::{bytes_under, http_get, Proxy};

/// A 127.0.0.1 port nothing listens on (see `testkit::free_port`).
pub fn free_port() -> u16 {
    arbor_engine::testkit::free_port().expect("a free 127.0.0.1 port")
}

/// `arbor serve --foreground` as a child process on 127.0.0.1; killed on drop.
pub struct Serve {
    pub child: Child,
    pub addr: String,
    pub log: PathBuf,
    /// The program and its arguments, to start it again.
    argv: Vec<String>,
    env: Vec<(String, String)>,
}

impl Serve {
    /// `arbor serve DISK --listen 127.0.0.1:<port> ARGS… --foreground`,
    /// logging to `log`; returns once it accepts connections.
    pub fn start(disk: &str, port: u16, args: &[&str], env: &[(&str, String)], log: &Path) -> Serve {
        Self::start_on(None, None, disk, port, args, env, log)
    }

    /// The same as a process of another host: with `host`, in a UTS
    /// namespace of its own of that name (`unshare -u`), so that a lease it
    /// takes is judged by its expiry, as one taken on another node is; with
    /// `net`, in that network namespace, listening on its address.
    pub fn start_on(
        net: Option<&NetNs>,
        host: Option<&str>,
        disk: &str,
        port: u16,
        args: &[&str],
        env: &[(&str, String)],
        log: &Path,
    ) -> Serve {
        let addr = format!("{}:{port}", net.map_or("127.0.0.1", |n| n.ip.as_str()));
        let mut argv: Vec<String> = match net {
            Some(n) => ["ip", "netns", "exec", &n.name].iter().map(|s| s.to_string()).collect(),
            None => Vec::new(),
        };
        if let Some(h) = host {
            argv.extend(
                ["unshare", "-u", "sh", "-c", &format!("hostname {h} && exec \"$0\" \"$@\"")]
                    .iter()
                    .map(|s| s.to_string()),
            );
        }
        argv.push(arbor_bin().to_str().expect("utf8").into());
        argv.extend(["serve", disk, "--listen", &addr].iter().map(|s| s.to_string()));
        argv.extend(args.iter().map(|s| s.to_string()));
        argv.push("--foreground".into());
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        let before = Self::ready_lines(log);
        let child = Self::spawn(&argv, &env, log);
        let mut s = Serve { child, addr, log: log.to_path_buf(), argv, env };
        s.wait_ready(before);
        s
    }

    fn spawn(argv: &[String], env: &[(String, String)], log: &Path) -> Child {
        let log_file = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("log");
        Command::new(&argv[0])
            .args(&argv[1..])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log"))
            .stderr(log_file)
            .spawn()
            .expect("spawn arbor serve")
    }

    /// Times the log says `arbor serve` is ready (it listens before it has
    /// taken and recorded its branches, then logs this line).
    fn ready_lines(log: &Path) -> usize {
        std::fs::read_to_string(log).unwrap_or_default().matches(" serving disk=").count()
    }

    /// Waits until the process started `before` ready lines ago logs one
    /// more and accepts connections.
    fn wait_ready(&mut self, before: usize) {
        wait_until("arbor serve to be ready", Duration::from_secs(30), || {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("arbor serve exited with {status}: {}", std::fs::read_to_string(&self.log).unwrap_or_default());
            }
            Self::ready_lines(&self.log) > before && std::net::TcpStream::connect(&self.addr).is_ok()
        });
    }

    /// kill -9, then the same command again on the same port.
    pub fn kill9_and_restart(&mut self) {
        self.kill9_only();
        let before = Self::ready_lines(&self.log);
        self.child = Self::spawn(&self.argv, &self.env, &self.log);
        self.wait_ready(before);
    }

    /// SIGTERM (a clean stop, which must succeed), then the same command
    /// again on the same port.
    pub fn term_and_restart(&mut self) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "arbor serve exit: {status}");
        let before = Self::ready_lines(&self.log);
        self.child = Self::spawn(&self.argv, &self.env, &self.log);
        self.wait_ready(before);
    }

    /// The same command again (after [`Serve::kill9_only`]), waiting until
    /// it is ready.
    pub fn start_again(&mut self) {
        let before = Self::ready_lines(&self.log);
        self.child = Self::spawn(&self.argv, &self.env, &self.log);
        self.wait_ready(before);
    }

    /// kill -9, and nothing else.
    pub fn kill9_only(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and the server must exit cleanly.
    pub fn stop(mut self) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let status = self.child.wait().expect("wait");
        assert!(
            status.success(),
            "arbor serve exit: {status}; log: {}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The token shared-branch tests give owners and clients.
pub const TOKEN: &str = "shared-branch-token";

/// A disk whose branch `main` is owned by `arbor serve --branch main`,
/// for client mounts to write through.
pub struct SharedWorld {
    pub s: Scratch,
    pub token: PathBuf,
    pub owner: Serve,
}

impl SharedWorld {
    /// An owner with its default options (`None` where FUSE cannot run).
    pub fn start() -> Option<SharedWorld> {
        Self::start_with(&[])
    }

    /// An owner started with `extra` arguments too.
    pub fn start_with(extra: &[&str]) -> Option<SharedWorld> {
        if !fuse_available() {
            return None;
        }
        let s = Scratch::new();
        let token = s.dir.path().join("token");
        std::fs::write(&token, format!("{TOKEN}\n")).expect("token");
        let owner = Self::owner(&s, &token, free_port(), extra);
        Some(SharedWorld { s, token, owner })
    }

    pub fn owner(s: &Scratch, token: &Path, port: u16, extra: &[&str]) -> Serve {
        let log = s.dir.path().join(format!("owner-{port}.log"));
        let mut args = vec!["--branch", "main", "--token-file", token.to_str().expect("utf8")];
        args.extend_from_slice(extra);
        Serve::start(s.disk_str(), port, &args, &[], &log)
    }

    /// A client mount at `<scratch>/<name>`, finding the owner through the disk.
    pub fn client(&self, name: &str) -> Mount {
        self.client_with(name, &[])
    }

    pub fn client_with(&self, name: &str, extra: &[&str]) -> Mount {
        let mnt = self.s.dir.path().join(name);
        std::fs::create_dir_all(&mnt).expect("mkdir");
        let mut args = vec!["--token-file", self.token.to_str().expect("utf8")];
        args.extend_from_slice(extra);
        Mount::start(self.s.disk_str(), &mnt, &args)
    }
}

/// The errno of a failed call (0 if it succeeded).
pub fn errno_of<T>(r: std::io::Result<T>) -> i32 {
    r.err().and_then(|e| e.raw_os_error()).unwrap_or(0)
}

/// Lets every user reach `path` through its parent folders (search
/// permission on each), as tests that act as other users need.
pub fn let_others_reach(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for dir in path.ancestors().skip(1) {
        if let Ok(m) = std::fs::metadata(dir) {
            let mode = m.permissions().mode() & 0o7777;
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o001));
        }
    }
}

/// An S3 server that keeps object versions (moto, on a free 127.0.0.1
/// port, in memory), for what s3s-fs cannot show: a bucket with
/// versioning on. Stopped when dropped.
pub struct VersionedS3 {
    child: Child,
    pub port: u16,
}

impl VersionedS3 {
    /// `None` (the test skips, loudly) where moto is not installed outside
    /// CI; in CI it must be (.ci/run installs it).
    pub fn start() -> Option<VersionedS3> {
        let found =
            Command::new("python3").args(["-c", "import moto.server, boto3"]).status().is_ok_and(|s| s.success());
        if !found {
            if std::env::var_os("CI").is_some() {
                panic!("moto must be installed in CI (python3 -m pip install 'moto[server]')");
            }
            eprintln!("SKIPPED: this test needs moto (python3 -m pip install 'moto[server]')");
            return None;
        }
        let (child, port) = arbor_engine::testkit::start_http_child("moto", Duration::from_secs(30), |port| {
            Command::new("python3")
                .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
        })
        .expect("moto");
        let server = VersionedS3 { child, port };
        Some(server)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Runs `tests/clients/versioned_bucket.py` against this server; its
    /// output, trimmed.
    pub fn client(&self, args: &[&str]) -> String {
        let endpoint = self.endpoint();
        let out = python("versioned_bucket.py", &[&[endpoint.as_str()], args].concat());
        assert!(out.status.success(), "versioned_bucket.py {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for VersionedS3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A network namespace joined to this one by a veth pair: another host as
/// far as addresses go (`ip netns`; root). Deleted, with its link, when
/// dropped.
pub struct NetNs {
    pub name: String,
    /// Its address, which this namespace reaches over the pair.
    pub ip: String,
}

impl NetNs {
    /// A namespace with the address 10.79.N.2 (this side 10.79.N.1), or why
    /// one cannot be made here.
    pub fn create(tag: &str) -> Result<NetNs, String> {
        let id = std::process::id();
        let name = format!("arbt-{tag}-{id}");
        let (here, there) = (format!("at{id}h"), format!("at{id}n"));
        let n = id % 250 + 1;
        let ns = NetNs { name: name.clone(), ip: format!("10.79.{n}.2") };
        let run = |args: &[&str]| -> Result<(), String> {
            let out =
                Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("{}: {e}", args.join(" ")))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!("{}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
            }
        };
        run(&["ip", "netns", "add", &name])?;
        // From here on, dropping `ns` deletes the namespace and its link.
        run(&["ip", "link", "add", &here, "type", "veth", "peer", "name", &there])?;
        run(&["ip", "link", "set", &there, "netns", &name])?;
        run(&["ip", "addr", "add", &format!("10.79.{n}.1/30"), "dev", &here])?;
        run(&["ip", "link", "set", &here, "up"])?;
        run(&["ip", "netns", "exec", &name, "ip", "addr", "add", &format!("{}/30", ns.ip), "dev", &there])?;
        run(&["ip", "netns", "exec", &name, "ip", "link", "set", &there, "up"])?;
        run(&["ip", "netns", "exec", &name, "ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // The veth pair goes with the namespace that holds one end; if the
        // pair was made but not moved, remove it here.
        let id = std::process::id();
        let _ = Command::new("ip").args(["link", "del", &format!("at{id}h")]).output();
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// Runs `sh -c script` as the unprivileged user `pjdtest`, if there is one.
pub fn as_unprivileged(script: &str) -> Option<std::process::ExitStatus> {
    let exists = Command::new("id").arg("pjdtest").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !exists.is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED part of this test: no user pjdtest (.ci/run creates it)");
        return None;
    }
    Some(Command::new("su").args(["pjdtest", "-s", "/bin/sh", "-c", script]).status().expect("su"))
}

/// A number from `arbor status MNT --json`.
pub fn status_number(mnt: &Path, key: &str) -> u64 {
    let out = arbor_ok(&["status", mnt.to_str().expect("utf8"), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("status json");
    v[key].as_u64().unwrap_or_else(|| panic!("status has no {key}: {out}"))
}

/// Writes and a change of owner clear the set-user-ID and set-group-ID
/// bits of `f` (a file on a mount made with `--allow-other`, its folder
/// open to all) as the kernel would: a root write keeps them, a write by
/// another user clears them (set-group-ID only where group-executable),
/// and a chown clears them whoever makes it. Leaves `f` at mode 0755.
pub fn assert_writes_and_chown_clear_set_id_bits(f: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o7777;
    let set = |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).expect("chmod");
    // Root (CAP_FSETID) keeps the bits when it writes.
    set(f, 0o6777);
    std::fs::OpenOptions::new()
        .append(true)
        .open(f)
        .and_then(|mut h| std::io::Write::write_all(&mut h, b"# root\n"))
        .expect("append");
    assert_eq!(mode(f), 0o6777);
    let path = f.to_str().expect("utf8");
    if let Some(st) = as_unprivileged(&format!("echo '# user' >> {path}")) {
        assert!(st.success(), "write as pjdtest");
        assert_eq!(mode(f), 0o0777, "a write by another user clears set-user-ID and set-group-ID");
        // Set-group-ID without group execute is not an exec bit: it stays.
        set(f, 0o6767);
        assert!(as_unprivileged(&format!("echo '# again' >> {path}")).is_some_and(|s| s.success()));
        assert_eq!(mode(f), 0o2767);
    }
    // Giving a file away clears the bits, whoever does it.
    set(f, 0o6755);
    std::os::unix::fs::chown(f, Some(65534), None).expect("chown");
    assert_eq!(mode(f), 0o0755);
}

/// This package's folder: where cargo says when it runs the test (the
/// build may have been made in another clone of the repository).
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// A command prefix that runs a program with its clock 40 s ahead
/// (libfaketime preloaded; the `faketime` wrapper's named semaphore can
/// clash with one a killed run left behind), or `None` where libfaketime
/// is not installed.
pub fn clock_40s_ahead() -> Option<Vec<String>> {
    let lib = std::fs::read_dir("/usr/lib").ok()?.flatten().find_map(|d| {
        let p = d.path().join("faketime/libfaketime.so.1");
        p.exists().then_some(p)
    })?;
    Some(vec!["env".into(), format!("LD_PRELOAD={}", lib.display()), "FAKETIME=+40s".into()])
}

// ---- Mounts whose serving process is killed under a process using them. ----

/// The pid of the process serving `mnt`, once `arbor status` answers and it
/// is not `not`.
pub fn serving_pid(mnt: &Path, not: Option<i64>) -> i64 {
    let mut pid = None;
    wait_until("a serving process", Duration::from_secs(30), || {
        let out = arbor(&["status", mnt.to_str().expect("utf8"), "--json"]);
        let p = serde_json::from_slice::<serde_json::Value>(&out.stdout).ok().and_then(|s| s["pid"].as_i64());
        pid = p.filter(|p| Some(*p) != not);
        pid.is_some()
    });
    pid.expect("pid")
}

/// Records the first errno a `statfs` of the mount point gives while it
/// runs (a statfs stalls while nobody serves; it must never fail).
pub struct Watcher {
    stop: Arc<AtomicBool>,
    errno: Arc<AtomicI32>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watcher {
    pub fn start(mnt: &Path) -> Watcher {
        let (stop, errno) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicI32::new(0)));
        let (s, e, mnt) = (stop.clone(), errno.clone(), mnt.to_path_buf());
        let thread = std::thread::spawn(move || {
            // Bounded: the loop stops with the test, at most ten minutes.
            let deadline = Instant::now() + Duration::from_secs(600);
            while !s.load(Ordering::SeqCst) && Instant::now() < deadline {
                if !statfs_ok(&mnt) {
                    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(-1);
                    let _ = e.compare_exchange(0, errno, Ordering::SeqCst, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Watcher { stop, errno, thread: Some(thread) }
    }

    /// The first errno seen (0: none).
    pub fn finish(mut self) -> i32 {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.errno.load(Ordering::SeqCst)
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// `clients/hold_open_loop.py` on `file`: a file held open and written,
/// fsynced and read back round after round; killed on drop.
pub struct HoldOpenLoop(Child);

impl HoldOpenLoop {
    /// Starts the loop for `seconds`, and returns once its first round is done.
    pub fn start(file: &Path, seconds: u32) -> (HoldOpenLoop, BufReader<std::process::ChildStdout>) {
        let script = manifest_dir().join("clients/hold_open_loop.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args([file.to_str().expect("utf8"), &seconds.to_string(), "1000000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("read");
        assert_eq!(line.trim(), "ready", "the loop did not start");
        (HoldOpenLoop(child), out)
    }

    pub fn running(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }

    /// Waits for the end (bounded: two minutes) and returns (rounds, worst
    /// round in ms); fails on any error the loop saw.
    pub fn finish(mut self, mut out: BufReader<std::process::ChildStdout>) -> (u64, u64) {
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(s) = self.0.try_wait().expect("wait") {
                break s;
            }
            assert!(Instant::now() < deadline, "the loop on the mount hangs");
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut err = String::new();
        if let Some(mut e) = self.0.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        assert!(status.success(), "the loop on the mount saw an error ({status}):\n{err}");
        let mut line = String::new();
        out.read_line(&mut line).expect("read");
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.first(), Some(&"ok"), "{line}");
        (f[1].parse().expect("rounds"), f[2].parse().expect("ms"))
    }
}

impl Drop for HoldOpenLoop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Checks the small files `hold_open_loop.py` made beside `file` in
/// `rounds` rounds: each there, with its own name as its bytes.
pub fn check_hold_open_files(file: &Path, rounds: u64) {
    for i in (0..rounds).step_by(32) {
        let small = PathBuf::from(format!("{}.{i}", file.display()));
        let name = small.file_name().and_then(|n| n.to_str()).expect("name").to_string();
        let got = std::fs::read_to_string(&small).unwrap_or_else(|e| panic!("{}: {e}", small.display()));
        assert_eq!(got, name, "{}", small.display());
    }
}

/// What `hold_open_loop.py` leaves in its file after `rounds` rounds.
pub fn hold_open_expected(rounds: u64) -> Vec<u8> {
    const SLOTS: u64 = 1024;
    let slots = rounds.min(SLOTS);
    let mut v = vec![0u8; (slots * 4096) as usize];
    for s in 0..slots {
        // The last round that wrote slot s.
        let i = s + (rounds - 1 - s) / SLOTS * SLOTS;
        let at = (s * 4096) as usize;
        v[at..at + 8].copy_from_slice(&i.to_le_bytes());
        v[at + 8..at + 4096].fill((i % 251) as u8);
    }
    v
}

/// Bytes a folder holds, everything under it: how much a disk's folder
/// grew, for tests that an operation shared bytes instead of writing them.
pub fn folder_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).expect("read dir").flatten() {
        let meta = entry.metadata().expect("metadata");
        total += if meta.is_dir() { folder_bytes(&entry.path()) } else { meta.len() };
    }
    total
}
