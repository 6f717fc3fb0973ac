//! `arbor serve` end to end: real processes, a real S3 server (s3s-fs) whose
//! bytes sent are counted by a proxy of the test's own, real FUSE mounts
//! reading through the shared cache.

use arbor_engine::bucket::ObjectStore;
use arbor_engine::testkit::S3_BUCKET;
use arbor_tests::*;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const TOKEN: &str = "cache-token-for-tests";
const FILES: usize = 4;
const FILE_LEN: usize = 12 << 20;

/// `arbor serve --foreground` as a child process; killed on drop.
struct Serve {
    child: Child,
    addr: String,
    log: PathBuf,
}

impl Serve {
    fn start(w: &S3World, env: &[(&str, String)], disk: &str, cache: &Path, extra: &[&str]) -> Serve {
        let port = free_port();
        Self::start_on(w, env, disk, cache, port, extra)
    }

    fn start_on(w: &S3World, env: &[(&str, String)], disk: &str, cache: &Path, port: u16, extra: &[&str]) -> Serve {
        let addr = format!("127.0.0.1:{port}");
        let log = w.dir.path().join(format!("serve-{port}.log"));
        let log_file = std::fs::OpenOptions::new().create(true).append(true).open(&log).expect("log");
        let child = Command::new(arbor_bin())
            .args(["serve", disk, "--listen", &addr, "--cache-dir", cache.to_str().expect("utf8"), "--foreground"])
            .args(["--token-file", token_file(w).to_str().expect("utf8")])
            .args(extra)
            .envs(env.iter().map(|(k, v)| (*k, v)))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log"))
            .stderr(log_file)
            .spawn()
            .expect("spawn arbor serve");
        let mut s = Serve { child, addr, log };
        wait_until("arbor serve to listen", Duration::from_secs(30), || {
            if let Ok(Some(status)) = s.child.try_wait() {
                panic!("arbor serve exited with {status}: {}", std::fs::read_to_string(&s.log).unwrap_or_default());
            }
            std::net::TcpStream::connect(&s.addr).is_ok()
        });
        s
    }

    fn port(&self) -> u16 {
        self.addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port")
    }

    /// A sample of the server's /metrics.
    fn metric(&self, name: &str) -> u64 {
        let (status, body) = http_get(&self.addr, "/metrics", Some(&format!("Bearer {TOKEN}"))).expect("GET");
        assert!(status.contains(" 200 "), "{status}");
        arbor_net::metric_sample(&body, name).unwrap_or_else(|| panic!("no {name} in {body}")) as u64
    }

    fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn token_file(w: &S3World) -> PathBuf {
    let p = w.dir.path().join("token");
    if !p.exists() {
        std::fs::write(&p, format!("{TOKEN}\n")).expect("token");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    }
    p
}

fn expected(i: usize) -> Vec<u8> {
    pattern(FILE_LEN, 100 + i as u32)
}

/// Reads every file of the dataset under `mnt` and checks every byte.
fn read_all(mnt: &Path) {
    for i in 0..FILES {
        let got = std::fs::read(mnt.join(format!("shard-{i}.bin"))).expect("read");
        assert!(got == expected(i), "shard-{i}: wrong bytes");
    }
}

/// A client mount of checkpoint v1 with its own empty cache.
fn client(w: &S3World, env: &[(&str, String)], disk: &str, name: &str, servers: &[&str]) -> Mount {
    client_with(w, env, disk, name, servers, &[])
}

fn client_with(w: &S3World, env: &[(&str, String)], disk: &str, name: &str, servers: &[&str], extra: &[&str]) -> Mount {
    let mnt = w.mnt(name);
    let cache = w.dir.path().join("client-caches").join(name);
    let mut args = vec!["--checkpoint", "v1", "--cache-dir", cache.to_str().expect("utf8")];
    args.extend(extra);
    let list = servers.join(",");
    let token = token_file(w);
    if !servers.is_empty() {
        args.extend(["--cache-server", &list, "--token-file", token.to_str().expect("utf8")]);
    }
    let m = Mount::start_env(disk, &mnt, &args, env);
    std::mem::drop(args);
    m
}

fn status_json(mnt: &Path, env: &[(&str, String)]) -> String {
    arbor_env_ok(&["status", mnt.to_str().expect("utf8"), "--json"], env)
}

#[test]
fn one_warm_dataset_for_every_node_and_job() {
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{S3_BUCKET}/disks/shared");
    arbor_env_ok(&["init", &disk], &w.env);
    let main = w.mnt("main");
    let m = Mount::start_env(&disk, &main, &[], &w.env);
    for i in 0..FILES {
        write_synced(&main.join(format!("shard-{i}.bin")), &expected(i));
    }
    arbor_env_ok(&["checkpoints", "create", main.to_str().expect("utf8"), "v1"], &w.env);
    m.unmount_env(&w.env);
    let dataset = (FILES * FILE_LEN) as u64;

    // Every process reaches the bucket through a proxy that counts.
    let proxy = Proxy::start(w.s3_addr(), Duration::ZERO).expect("proxy");
    let mut env = w.env_via(&proxy.endpoint());
    // A busy CI machine must not turn a slow answer into a bucket read here:
    // this test counts bucket bytes. (A killed server refuses at once.)
    env.push(("ARBOR_CACHE_TIMEOUT_MS", "30000".into()));

    // Without a server: each of four clients pulls the whole dataset.
    let before = proxy.sent();
    for n in 0..4 {
        let c = client(&w, &env, &disk, &format!("alone-{n}"), &[]);
        read_all(&c.mnt);
        c.unmount_env(&env);
    }
    let alone = proxy.sent() - before;
    assert!(alone >= 4 * dataset, "four clients alone pulled {alone} bytes of a {dataset}-byte dataset");

    // One server, four clients reading at once.
    let server_cache = w.dir.path().join("server-cache");
    let server = Serve::start(&w, &env, &disk, &server_cache, &[]);
    let before = proxy.sent();
    let clients: Vec<Mount> = (0..4).map(|n| client(&w, &env, &disk, &format!("job1-{n}"), &[&server.addr])).collect();
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(|| read_all(&c.mnt));
        }
    });
    let shared = proxy.sent() - before;
    let fetched = server.metric("arbor_cache_bucket_bytes_total");
    eprintln!(
        "dataset {dataset} B: 4 clients alone pulled {alone} B, through one server {shared} B (server: {fetched} B)"
    );
    assert!(shared <= dataset + dataset / 10, "through the server the bucket sent {shared} bytes");
    assert!(fetched >= dataset && fetched <= dataset + dataset / 20, "the server fetched {fetched} bytes");
    let st = status_json(&clients[0].mnt, &env);
    assert!(st.contains("\"cache_servers\":[{"), "{st}");
    for c in clients {
        c.unmount_env(&env);
    }

    // A second job: new client processes, empty caches, nothing from the bucket.
    let before = proxy.sent();
    let c = client(&w, &env, &disk, "job2", &[&server.addr]);
    read_all(&c.mnt);
    let second = proxy.sent() - before;
    assert!(second < dataset / 50, "the second job pulled {second} bytes from the bucket");
    c.unmount_env(&env);

    // A request without the token gets nothing, not even whether a chunk exists.
    for auth in [None, Some("Bearer wrong")] {
        let (status, body) = http_get(&server.addr, "/metrics", auth).expect("GET");
        assert!(status.contains(" 401 ") && !body.contains("arbor"), "{status}: {body}");
    }
    let (status, _) = http_get(&server.addr, "/v1/chunks/seg-0000000000000001-00000001/0", None).expect("GET");
    assert!(status.contains(" 401 "), "{status}");
    // A client given another token is told so when it mounts, and reads
    // everything from the bucket, every byte still right.
    let wrong = w.dir.path().join("other-token");
    std::fs::write(&wrong, "not-the-servers-token\n").expect("token");
    std::fs::set_permissions(&wrong, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
    let (mnt, cache) = (w.mnt("wrong-token"), w.dir.path().join("client-caches/wrong-token"));
    let (mnt_s, cache_s, wrong_s) =
        (mnt.to_str().expect("utf8"), cache.to_str().expect("utf8"), wrong.to_str().expect("utf8"));
    let args = ["mount", &disk, mnt_s, "--checkpoint", "v1", "--cache-dir", cache_s, "--cache-server", &server.addr];
    let out = arbor_env(&[&args[..], &["--token-file", wrong_s]].concat(), &env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains(&format!("warning: cache server {} refused our token", server.addr)), "{err}");
    read_all(&mnt);
    arbor_env_ok(&["unmount", mnt_s], &env);

    // kill -9 the server in the middle of a client's reads: the client
    // reads on from the bucket; the restarted server finds its cache.
    let port = server.port();
    // No read-ahead, so that most chunks are still to be read after the kill.
    let c = client_with(&w, &env, &disk, "job3", &[&server.addr], &["--read-ahead", "0"]);
    let mut first = vec![0u8; 1 << 20];
    std::fs::File::open(c.mnt.join("shard-0.bin")).and_then(|mut f| f.read_exact(&mut first)).expect("read");
    assert!(first[..] == expected(0)[..1 << 20]);
    server.kill9();
    read_all(&c.mnt);
    let st = status_json(&c.mnt, &env);
    assert!(!st.contains("\"fallback_error\":0,") || !st.contains("\"fallback_down\":0,"), "{st}");
    let parsed: serde_json::Value = serde_json::from_str(&st).expect("status json");
    let fetched = parsed["cache"]["fetched_bytes"].as_u64();
    assert!(fetched.is_some_and(|n| n > 0), "the rest came from the bucket: {st}");
    c.unmount_env(&env);
    let server = Serve::start_on(&w, &env, &disk, &server_cache, port, &[]);
    let c = client(&w, &env, &disk, "job4", &[&server.addr]);
    read_all(&c.mnt);
    assert_eq!(server.metric("arbor_cache_bucket_bytes_total"), 0, "the restarted server served its own cache");
    assert!(server.metric("arbor_cache_hits_total") >= (dataset >> 20), "every chunk was a hit");
    c.unmount_env(&env);

    // `arbor warm` without a mount: a fresh server is filled, and the job
    // that follows pulls nothing from the bucket.
    let fresh = Serve::start(&w, &env, &disk, &w.dir.path().join("fresh-cache"), &[]);
    let tok = token_file(&w);
    let warm_args = [
        "warm",
        &disk,
        "--checkpoint",
        "v1",
        "/",
        "--cache-server",
        &fresh.addr,
        "--token-file",
        tok.to_str().expect("utf8"),
    ];
    let out = arbor_env_ok(&warm_args, &env);
    assert!(out.contains(&format!("warmed {FILES} files")), "{out}");
    assert!(out.contains(", 0 read from the bucket instead"), "{out}");
    // Whole chunks are counted apart from parts (the tree's small reads):
    // at least one per MiB of the files.
    let whole: u64 = out
        .split_once("through 1 server: ")
        .and_then(|(_, rest)| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no chunk count: {out}"));
    assert!(whole >= dataset >> 20 && whole <= (dataset >> 20) + 8, "{whole} chunks for {dataset} B: {out}");
    // A warm whose servers do not answer warmed nothing, and says so.
    let nobody = format!("127.0.0.1:{}", free_port());
    let failed = arbor_env(&warm_args.map(|a| if a == fresh.addr { nobody.as_str() } else { a }), &env);
    let err = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success() && err.contains("no cache server answered") && err.contains(&nobody), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let warmed = fresh.metric("arbor_cache_bucket_bytes_total");
    assert!(warmed >= dataset, "arbor warm filled the server with {warmed} bytes");
    let before = proxy.sent();
    let c = client(&w, &env, &disk, "after-warm", &[&fresh.addr]);
    read_all(&c.mnt);
    assert!(proxy.sent() - before < dataset / 50, "after arbor warm the job pulled {} bytes", proxy.sent() - before);
    c.unmount_env(&env);
    drop(fresh);

    // A client without a local SSD: chunks in memory only, nothing on disk.
    let mut mem_env = env.clone();
    let mem_node = w.dir.path().join("memory-node");
    mem_env.retain(|(k, _)| *k != "XDG_CACHE_HOME");
    mem_env.push(("XDG_CACHE_HOME", mem_node.display().to_string()));
    let tok = token_file(&w);
    let mem_args = ["--cache-dir", "none", "--cache-memory", "8M", "--token-file", tok.to_str().expect("utf8")];
    // (Without the token: a mount given one and no cache server means to go
    // through the branch's owner, and waits for one.)
    let refused = arbor_env(
        &["mount", &disk, w.mnt("mem-branch").to_str().expect("utf8"), "--cache-dir", "none", "--cache-memory", "8M"],
        &mem_env,
    );
    assert!(!refused.status.success(), "a memory-only branch mount is refused");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("for checkpoint mounts"), "{refused:?}");
    let mnt = w.mnt("mem");
    let args = [&["--checkpoint", "v1", "--cache-server", &server.addr][..], &mem_args].concat();
    let m = Mount::start_env(&disk, &mnt, &args, &mem_env);
    read_all(&mnt);
    let st = status_json(&mnt, &mem_env);
    assert!(st.contains(&format!("\"capacity\":{}", 8 << 20)), "{st}");
    let on_disk = bytes_under(&mem_node);
    assert!(on_disk < 1 << 20, "a memory-only client wrote {on_disk} bytes under its node folder");
    m.unmount_env(&mem_env);

    // Without --foreground the server goes to the background, says where
    // it logs, and answers once the command returns.
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let bg_cache = w.dir.path().join("bg-cache");
    let out = arbor_env_ok(
        &[
            "serve",
            &disk,
            "--listen",
            &listen,
            "--cache-dir",
            bg_cache.to_str().expect("utf8"),
            "--token-file",
            tok.to_str().expect("utf8"),
        ],
        &env,
    );
    let pid: i32 = out
        .split("(pid ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {out:?}"));
    let (status, body) = http_get(&listen, "/v1/health", Some(&format!("Bearer {TOKEN}"))).expect("GET");
    // SAFETY: a signal to the server this test started.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(status.contains(" 200 ") && body.contains("ok"), "{status} {body}");
    wait_until("the background server to stop", Duration::from_secs(20), || {
        // Gone, or a zombie waiting for a parent that is not this test.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map_or(true, |st| st.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z')))
    });

    // A server that corrupts what it sends: clients notice, read the bucket, say so.
    let bad = Serve::start(&w, &env, &disk, &w.dir.path().join("bad-cache"), &["--fault", "corrupt"]);
    let c = client(&w, &env, &disk, "job5", &[&bad.addr]);
    read_all(&c.mnt);
    let st = status_json(&c.mnt, &env);
    assert!(!st.contains("\"rejected\":0"), "{st}");
    let text = arbor_env_ok(&["status", c.mnt.to_str().expect("utf8")], &env);
    assert!(text.contains("rejected (bad checksum)"), "{text}");
    c.unmount_env(&env);
}

#[test]
fn imported_files_are_pulled_from_their_bucket_once_through_the_server() {
    let Some(w) = S3World::start() else { return };
    let body = pattern((10 << 20) + 4321, 77);
    w.bucket().put("corpus/tokens.bin", &body).expect("put");
    let disk = format!("s3://{S3_BUCKET}/disks/imported");
    arbor_env_ok(&["init", &disk], &w.env);
    arbor_env_ok(&["import", &disk, &format!("s3://{S3_BUCKET}/corpus")], &w.env);
    let main = w.mnt("main");
    let m = Mount::start_env(&disk, &main, &[], &w.env);
    arbor_env_ok(&["checkpoints", "create", main.to_str().expect("utf8"), "v1"], &w.env);
    m.unmount_env(&w.env);

    let proxy = Proxy::start(w.s3_addr(), Duration::ZERO).expect("proxy");
    let mut env = w.env_via(&proxy.endpoint());
    env.push(("ARBOR_CACHE_TIMEOUT_MS", "30000".into()));
    let server = Serve::start(&w, &env, &disk, &w.dir.path().join("server-cache"), &[]);
    let (len, chunks) = (body.len() as u64, body.len().div_ceil(1 << 20) as u64);
    // Two client mounts in turn, each with an empty cache: the object's
    // bytes leave the bucket once, for the server.
    for n in 0..2 {
        let before = proxy.sent();
        let c = client(&w, &env, &disk, &format!("reader-{n}"), &[&server.addr]);
        assert!(std::fs::read(c.mnt.join("tokens.bin")).expect("read") == body, "reader {n}: the object's bytes");
        let st: serde_json::Value = serde_json::from_str(&status_json(&c.mnt, &env)).expect("status json");
        let imported = &st["imported"];
        assert_eq!(imported["fetched_bytes"], 0, "reader {n} read nothing from the bucket itself: {imported}");
        assert_eq!(imported["from_servers"], chunks, "reader {n}: every chunk from the server: {imported}");
        c.unmount_env(&env);
        let pulled = proxy.sent() - before;
        eprintln!("reader {n}: the bucket sent {pulled} B for a {len} B object");
        if n == 0 {
            assert!(pulled >= len && pulled < len + len / 10, "the first reader's server pulled {pulled} B");
        } else {
            assert!(pulled < len / 20, "the second reader pulled {pulled} B from the bucket");
        }
    }
    // (The disk's own metadata chunks count here too.)
    assert!(server.metric("arbor_cache_hits_total") >= chunks, "the second reader's chunks were hits");

    // A restarted server finds the chunks in its cache folder.
    let port = server.port();
    drop(server);
    let server = Serve::start_on(&w, &env, &disk, &w.dir.path().join("server-cache"), port, &[]);
    let c = client(&w, &env, &disk, "reader-2", &[&server.addr]);
    assert!(std::fs::read(c.mnt.join("tokens.bin")).expect("read") == body, "after a restart: the object's bytes");
    c.unmount_env(&env);
    let refetched = server.metric("arbor_cache_bucket_bytes_total");
    assert!(refetched < len / 20, "the restarted server fetched {refetched} B");

    // The first reader again, with no server: its cache folder kept the
    // chunks (and checks each one before it is used).
    drop(server);
    let before = proxy.sent();
    let c = client(&w, &env, &disk, "reader-0", &[]);
    assert!(std::fs::read(c.mnt.join("tokens.bin")).expect("read") == body, "again: the object's bytes");
    let st: serde_json::Value = serde_json::from_str(&status_json(&c.mnt, &env)).expect("status json");
    let imported = &st["imported"];
    assert_eq!(
        (imported["from_disk"].as_u64(), imported["fetched_bytes"].as_u64()),
        (Some(chunks), Some(0)),
        "{imported}"
    );
    assert!(imported["disk_bytes"].as_u64() > Some(len), "{imported}");
    c.unmount_env(&env);
    assert!(proxy.sent() - before < len / 20, "from its own disk, not the bucket");
}

/// The query of a `/v1/objects/…` request (quotes and slashes escaped).
fn object_query(bucket: &str, key: &str, etag: &str, size: usize) -> String {
    let esc = |v: &str| v.replace('%', "%25").replace('"', "%22").replace('/', "%2F").replace('&', "%26");
    format!("bucket={}&key={}&etag={}&size={size}", esc(bucket), esc(key), esc(etag))
}

#[test]
fn a_server_fetches_only_objects_an_import_of_its_disk_names() {
    let Some(w) = S3World::start() else { return };
    let body = "the tokens of an imported corpus\n";
    let etag = w.bucket().put("corpus/tokens.txt", body.as_bytes()).expect("put");
    let secret = "not imported by anyone\n";
    let secret_etag = w.bucket().put("private/keys.txt", secret.as_bytes()).expect("put");
    let disk = format!("s3://{S3_BUCKET}/disks/scoped");
    arbor_env_ok(&["init", &disk], &w.env);
    arbor_env_ok(&["import", &disk, &format!("s3://{S3_BUCKET}/corpus")], &w.env);
    let server = Serve::start(&w, &w.env, &disk, &w.dir.path().join("server-cache"), &[]);
    let auth = format!("Bearer {TOKEN}");
    let get = |bucket: &str, key: &str, etag: &str, size: usize| {
        let path = format!("/v1/objects/0?{}", object_query(bucket, key, etag, size));
        http_get(&server.addr, &path, Some(&auth)).expect("GET")
    };
    let (status, got) = get(S3_BUCKET, "corpus/tokens.txt", &etag, body.len());
    assert!(status.contains(" 200 "), "an imported object is served: {status} {got}");
    assert_eq!(got, body);
    // A key of the same bucket that no import names: refused, one line.
    let (status, why) = get(S3_BUCKET, "private/keys.txt", &secret_etag, secret.len());
    assert!(status.contains(" 403 "), "{status} {why}");
    assert!(why.contains("is not under an import") && why.trim_end().lines().count() == 1, "{why}");
    assert!(!why.contains(secret.trim_end()));
    // A sibling prefix that merely starts like the imported one, and
    // another bucket.
    let (status, _) = get(S3_BUCKET, "corpus-private/keys.txt", &secret_etag, secret.len());
    assert!(status.contains(" 403 "), "{status}");
    let (status, why) = get("another-bucket", "corpus/tokens.txt", &etag, body.len());
    assert!(status.contains(" 403 ") && why.contains("s3://another-bucket/corpus/tokens.txt"), "{status} {why}");
    assert_eq!(server.metric("arbor_cache_refused_objects_total"), 3);
}

/// A node without a local SSD writes a branch: `--cache-dir none` with
/// `--durability bucket` keeps the log in memory (a tmpfs) only until the
/// bucket has it, reads what went up through the memory cache, leaves
/// nothing on disk, and loses nothing fsynced to kill -9.
#[test]
fn a_memory_only_branch_mount_writes_through_to_the_bucket_and_keeps_nothing_on_disk() {
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{S3_BUCKET}/disks/memory-writer");
    arbor_env_ok(&["init", &disk], &w.env);
    let node = w.dir.path().join("memory-node");
    let mut env = w.env.clone();
    env.retain(|(k, _)| *k != "XDG_CACHE_HOME");
    env.push(("XDG_CACHE_HOME", node.display().to_string()));
    let mnt = w.mnt("memory-writer");
    let memory = ["--cache-dir", "none", "--cache-memory", "8M"];
    let refused = arbor_env(&[&["mount", &disk, mnt.to_str().expect("utf8")][..], &memory].concat(), &env);
    assert!(!refused.status.success(), "with local durability a memory-only branch mount is refused");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--durability bucket"), "{refused:?}");

    let args = [&memory[..], &["--durability", "bucket", "--segment-size", "1M"]].concat();
    let m = Mount::start_env(&disk, &mnt, &args, &env);
    let data = pattern(24 << 20, 5);
    write_synced(&mnt.join("big"), &data);
    // Sealed segments went up and left memory: reading them back goes
    // through the 8 MiB memory cache and the bucket.
    assert!(std::fs::read(mnt.join("big")).expect("read") == data);
    // SAFETY: getuid cannot fail.
    let shm = PathBuf::from(format!("/dev/shm/arbor-{}", unsafe { libc::getuid() }));
    let in_memory = bytes_under(&shm);
    assert!(in_memory < 8 << 20, "{in_memory} bytes of log kept in {}", shm.display());
    let on_disk = bytes_under(&node);
    assert!(on_disk < 1 << 20, "a memory-only writer put {on_disk} bytes under its node folder");

    // kill -9: a mount on another node (its own empty cache) has every byte.
    m.kill9();
    let _ = Command::new("fusermount3").args(["-uz", mnt.to_str().expect("utf8")]).status();
    let elsewhere = w.dir.path().join("other-node");
    let mut other = w.env.clone();
    other.retain(|(k, _)| *k != "XDG_CACHE_HOME");
    other.push(("XDG_CACHE_HOME", elsewhere.display().to_string()));
    let after = w.mnt("after-kill");
    let m2 = Mount::start_env(&disk, &after, &[], &other);
    assert!(std::fs::read(after.join("big")).expect("read after kill -9") == data, "fsynced bytes lost");
    m2.unmount_env(&other);

    // The killed writer's memory folder goes with the next memory-only
    // writer on the node, and that one's with its clean unmount.
    let m3 = Mount::start_env(&disk, &mnt, &args, &env);
    write_synced(&mnt.join("small"), b"again");
    m3.unmount_env(&env);
    // This disk's folder there (named as its node folder is).
    let disk_dir = std::fs::read_dir(node.join("arbor")).expect("node folder").flatten().next().expect("disk folder");
    let mine = shm.join(disk_dir.file_name());
    let left: Vec<_> = std::fs::read_dir(&mine).into_iter().flatten().flatten().map(|e| e.path()).collect();
    assert!(left.is_empty(), "left in {}: {left:?}", mine.display());
}

/// An owner told to stop while its bucket is away stops within its
/// `--stop-timeout` and says what it left; what a client fsynced is in the
/// bucket (bucket durability, an owner's default), where the next owner
/// finds it.
#[test]
fn an_owner_told_to_stop_while_its_bucket_is_away_stops_in_bounded_time() {
    use arbor_tests::faults::{FaultProxy, Mode};
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{S3_BUCKET}/disks/stopping");
    arbor_env_ok(&["init", &disk], &w.env);
    let proxy = FaultProxy::start(w.s3_addr());
    let env = w.env_via(&format!("http://{}", proxy.addr));
    let tok = token_file(&w);
    let tok = tok.to_str().expect("utf8");
    let owner =
        Serve::start(&w, &env, &disk, &w.dir.path().join("owner-cache"), &["--branch", "main", "--stop-timeout", "3s"]);
    let mnt = w.mnt("client");
    let c = Mount::start_env(&disk, &mnt, &["--token-file", tok], &env);
    write_synced(&mnt.join("kept"), b"fsynced through the owner");
    std::fs::write(mnt.join("unsynced"), pattern(4 << 20, 7)).expect("write");

    // The bucket goes away; the owner is told to stop.
    proxy.set(Mode::Partition);
    proxy.cut_all();
    let told = std::time::Instant::now();
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(owner.child.id() as libc::pid_t, libc::SIGTERM) };
    let mut owner = owner;
    let status = loop {
        if let Some(st) = owner.child.try_wait().expect("wait") {
            break st;
        }
        assert!(told.elapsed() < Duration::from_secs(60), "the owner ignored SIGTERM with its bucket away");
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = told.elapsed();
    let log = std::fs::read_to_string(&owner.log).unwrap_or_default();
    println!("the owner stopped {took:?} after SIGTERM: {status}");
    assert!(!status.success(), "it could not close its branch: {log}");
    assert!(log.contains("stopping without the last upload"), "{log}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    c.kill9();

    // The bucket back, a new owner: what was fsynced is there.
    proxy.set(Mode::Pass);
    let owner = Serve::start(&w, &w.env, &disk, &w.dir.path().join("owner-cache-2"), &["--branch", "main"]);
    let again = w.mnt("again");
    let c = Mount::start_env(&disk, &again, &["--token-file", tok], &w.env);
    assert_eq!(std::fs::read(again.join("kept")).expect("read"), b"fsynced through the owner");
    c.unmount_env(&w.env);
    drop(owner);
}

/// A stand-in for a bucket that ignores conditional writes: a proxy in
/// front of the S3 server that turns every "412 Precondition Failed" into
/// "200 OK", so a PUT whose condition failed is reported as done (the
/// request itself reaches the server as signed). Stops with the test.
fn conditions_ignored(upstream: std::net::SocketAddr) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(client) = conn else { continue };
            let Ok(server) = std::net::TcpStream::connect(upstream) else { continue };
            let (Ok(mut c2), Ok(mut s2)) = (client.try_clone(), server.try_clone()) else { continue };
            let (mut client, mut server) = (client, server);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut client, &mut s2);
                let _ = s2.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                use std::io::Write;
                let mut buf = vec![0u8; 1 << 16];
                // Bytes of a refused answer's body still to drop.
                let mut skip = 0usize;
                while let Ok(n) = server.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let mut text = &buf[..n];
                    let dropped = skip.min(text.len());
                    text = &text[dropped..];
                    skip -= dropped;
                    let out = if text.starts_with(b"HTTP/1.1 412 ") {
                        // The whole answer becomes an empty success.
                        let head_end = text.windows(4).position(|w| w == b"\r\n\r\n").map_or(text.len(), |p| p + 4);
                        let head = String::from_utf8_lossy(&text[..head_end]).to_ascii_lowercase();
                        let len = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        let body_here = (text.len() - head_end).min(len);
                        skip = len - body_here;
                        let rest = &text[head_end + body_here..];
                        let ok = b"HTTP/1.1 200 OK\r\nETag: \"0123456789abcdef0123456789abcdef\"\r\nContent-Length: 0\r\n\r\n";
                        [ok.as_slice(), rest].concat()
                    } else {
                        text.to_vec()
                    };
                    if c2.write_all(&out).is_err() {
                        break;
                    }
                }
                let _ = c2.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    format!("http://{addr}")
}

#[test]
fn a_bucket_that_ignores_conditional_writes_is_refused_by_init_and_by_a_branch_owner() {
    let Some(w) = S3World::start() else { return };
    let ignoring = w.env_via(&conditions_ignored(w.s3_addr()));
    // arbor init probes the bucket before it makes the disk.
    let out = arbor_env(&["init", &format!("s3://{S3_BUCKET}/disks/never")], &ignoring);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("does not honour conditional writes"), "{err}");
    // A disk made where the bucket honours them, then served through one
    // that does not: a plain cache server starts (it writes nothing), an
    // owner of a branch refuses to, with one line and a non-zero exit.
    let disk = format!("s3://{S3_BUCKET}/disks/owned");
    arbor_env_ok(&["init", &disk], &w.env);
    let cache = Serve::start(&w, &ignoring, &disk, &w.dir.path().join("plain-cache"), &[]);
    drop(cache);
    let listen = format!("127.0.0.1:{}", free_port());
    let token = token_file(&w);
    let owner_cache = w.dir.path().join("owner-cache");
    // (Under `timeout`: an owner that did start would serve until killed.)
    let out = Command::new("timeout")
        .arg("60")
        .arg(arbor_bin())
        .args([
            "serve",
            &disk,
            "--listen",
            &listen,
            "--token-file",
            token.to_str().expect("utf8"),
            "--cache-dir",
            owner_cache.to_str().expect("utf8"),
            "--branch",
            "main",
            "--foreground",
        ])
        .envs(ignoring.iter().map(|(k, v)| (*k, v)))
        .output()
        .expect("run arbor serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an owner started on a bucket that ignores conditional writes: {err}");
    let lines: Vec<&str> =
        err.lines().filter(|l| l.starts_with("arbor: ") && l.contains("does not honour conditional writes")).collect();
    assert_eq!(lines.len(), 1, "one line says why: {err}");
    assert!(lines[0].contains("If-None-Match"), "{err}");
    assert_eq!(w.objects_under("disks/owned/probe"), 0, "the probe objects are removed");
    // Where the bucket honours them, the same owner starts.
    let owner = Serve::start(&w, &w.env, &disk, &owner_cache, &["--branch", "main"]);
    drop(owner);
}
