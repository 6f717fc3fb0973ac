//! `arbor serve` behind TLS, with real sockets on 127.0.0.1: certificates
//! made here (rcgen), an owner and a cache server with them, and clients
//! that trust the CA, pin the certificate, show a certificate of their
//! own, or trust the wrong thing. What goes on the wire is recorded by a
//! forwarder between client and owner.

use arbor_engine::bucket::{MemObjectStore, ObjectStore};
use arbor_engine::chunks::ChunkSource;
use arbor_engine::device::SimDevice;
use arbor_engine::env::TestEnv;
use arbor_engine::files::Files;
use arbor_engine::head::HeadDevice;
use arbor_engine::tier::{BucketDevice, SegmentCache, TierConfig};
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_net::wire::tls::{ClientFiles, ServerFiles, Trust};
use arbor_net::{
    metric_sample, BranchClient, BranchClientOptions, CacheClient, CacheServer, ClientOptions, ClientTls, ConnLimits,
    Running, ServerOptions, ServerTls, SharedBranch,
};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN: &str = "tok-7f3a9c1e5b2d4a60";
const MIB: usize = 1 << 20;

/// Taken by every test: one counts this process's threads.
static ONE_AT_A_TIME: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// The files of a small PKI: a CA and the server's certificate for
/// 127.0.0.1 it signed; a client CA and a client certificate it signed;
/// another CA and a client certificate that one signed.
struct Pki {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_ca: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    other_ca: PathBuf,
    stranger_cert: PathBuf,
    stranger_key: PathBuf,
    /// The SHA-256 of the server's certificate.
    server_sha256: [u8; 32],
}

fn ca(name: &str) -> rcgen::CertifiedIssuer<'static, rcgen::KeyPair> {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.distinguished_name.push(rcgen::DnType::CommonName, name);
    params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
    rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().expect("key")).expect("ca")
}

/// A certificate for `names` signed by `issuer`, written as `name`.pem and
/// `name`.key under `dir`.
fn leaf(
    dir: &Path,
    name: &str,
    names: &[&str],
    issuer: &rcgen::CertifiedIssuer<'_, rcgen::KeyPair>,
    not_after: Option<(i32, u8, u8)>,
) -> (PathBuf, PathBuf, Vec<u8>) {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params =
        rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("params");
    params.distinguished_name.push(rcgen::DnType::CommonName, name);
    if let Some((y, m, d)) = not_after {
        params.not_before = rcgen::date_time_ymd(2019, 1, 1);
        params.not_after = rcgen::date_time_ymd(y, m, d);
    }
    let cert = params.signed_by(&key, issuer).expect("sign");
    let (c, k) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
    std::fs::write(&c, cert.pem()).expect("write cert");
    std::fs::write(&k, key.serialize_pem()).expect("write key");
    (c, k, cert.der().to_vec())
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let (server_ca, client_ca, other_ca) = (ca("arbor test CA"), ca("arbor client CA"), ca("another CA"));
        let write = |name: &str, pem: String| {
            let p = d.join(name);
            std::fs::write(&p, pem).expect("write");
            p
        };
        let (server_cert, server_key, der) = leaf(d, "server", &["127.0.0.1", "localhost"], &server_ca, None);
        let (client_cert, client_key, _) = leaf(d, "client", &["node-a"], &client_ca, None);
        let (stranger_cert, stranger_key, _) = leaf(d, "stranger", &["node-b"], &other_ca, None);
        let sha = arbor_net::wire::tls::fingerprint(&der);
        let server_sha256 = arbor_net::wire::tls::parse_fingerprint(&sha).expect("fingerprint");
        Pki {
            ca: write("ca.pem", server_ca.pem()),
            client_ca: write("client-ca.pem", client_ca.pem()),
            other_ca: write("other-ca.pem", other_ca.pem()),
            server_cert,
            server_key,
            client_cert,
            client_key,
            stranger_cert,
            stranger_key,
            server_sha256,
            _dir: dir,
        }
    }

    fn server(&self, client_ca: bool) -> ServerTls {
        ServerTls::load(&ServerFiles {
            cert: self.server_cert.clone(),
            key: self.server_key.clone(),
            client_ca: client_ca.then(|| self.client_ca.clone()),
        })
        .expect("server tls")
    }

    fn client(&self, trust: Trust, identity: Option<(&Path, &Path)>) -> ClientTls {
        let identity = identity.map(|(c, k)| (c.to_path_buf(), k.to_path_buf()));
        ClientTls::load(&ClientFiles { trust, identity }).expect("client tls")
    }

    fn trusting(&self) -> ClientTls {
        self.client(Trust::Ca(self.ca.clone()), None)
    }
}

/// An owner of branch `main` on a port of its own.
fn owner(tls: Option<ServerTls>, token: &str, limits: ConnLimits) -> (Arc<Volume>, Running) {
    let cfg = Config { commit_interval: None, env: TestEnv::new(3), ..Config::default() };
    let vol = Volume::open(Arc::new(SimDevice::new()), cfg).expect("open");
    let branch = SharedBranch::new("main", vol.clone(), None, arbor_net::branch::policy::Policy::default());
    let opts = ServerOptions { token: token.into(), limits, tls, ..Default::default() };
    let running = CacheServer::owner(None, vec![branch], opts).spawn("127.0.0.1:0").expect("serve");
    (vol, running)
}

fn remote(addr: &str, tls: Option<ClientTls>, token: &str) -> Result<BranchClient, String> {
    let addr = addr.to_string();
    BranchClient::connect(BranchClientOptions {
        branch: "main".into(),
        token: token.into(),
        locate: Arc::new(move || Some(addr.clone())),
        timeout: Some(Duration::from_secs(5)),
        segments: None,
        tls,
    })
    .map_err(|e| e.to_string())
}

/// Creates `name`, writes `data`, syncs, and reads it back through `c`;
/// the owner's volume holds it too.
fn write_sync_read(c: &BranchClient, vol: &Volume, name: &[u8], data: &[u8]) {
    let f = c.create_open(ROOT_INO, name, libc::S_IFREG | 0o644, 0, 0).expect("create");
    assert_eq!(c.write(f.ino, 0, data).expect("write"), data.len());
    c.fsync(f.ino).expect("fsync");
    assert_eq!(c.read(f.ino, 0, data.len() + 10).expect("read"), data);
    assert_eq!(vol.read(f.ino, 0, data.len() + 10).expect("owner's read"), data);
    c.release(f.ino).expect("release");
}

#[test]
fn a_client_trusting_the_ca_writes_syncs_and_reads_back_through_a_tls_owner() {
    let _turn = ONE_AT_A_TIME.lock();
    let pki = Pki::new();
    let (vol, server) = owner(Some(pki.server(false)), TOKEN, ConnLimits::default());
    let c = remote(&server.addr.to_string(), Some(pki.trusting()), TOKEN).expect("connect");
    let data: Vec<u8> = (0..3 * MIB as u32 + 17).map(|i| (i * 31 + 7) as u8).collect();
    write_sync_read(&c, &vol, b"over-tls", &data);
    // The token is still asked for inside TLS.
    let e = remote(&server.addr.to_string(), Some(pki.trusting()), "wrong").err().expect("refused");
    assert!(e.contains("refused our token"), "{e}");
}

#[test]
fn a_pinned_fingerprint_is_trusted_and_any_other_refused() {
    let _turn = ONE_AT_A_TIME.lock();
    let pki = Pki::new();
    let (vol, server) = owner(Some(pki.server(false)), TOKEN, ConnLimits::default());
    let addr = server.addr.to_string();
    let pinned = pki.client(Trust::Fingerprint(pki.server_sha256), None);
    write_sync_read(&remote(&addr, Some(pinned), TOKEN).expect("pinned"), &vol, b"pinned", b"by its sha-256");
    let mut other = pki.server_sha256;
    other[0] ^= 1;
    let e = remote(&addr, Some(pki.client(Trust::Fingerprint(other), None)), TOKEN).err().expect("refused");
    assert!(e.contains("not the --tls-fingerprint"), "{e}");
}

#[test]
fn a_wrong_ca_clear_text_and_tls_to_a_clear_server_are_refused_with_their_reason() {
    let _turn = ONE_AT_A_TIME.lock();
    let pki = Pki::new();
    let (_vol, server) = owner(Some(pki.server(false)), TOKEN, ConnLimits::default());
    let addr = server.addr.to_string();
    let wrong = pki.client(Trust::Ca(pki.other_ca.clone()), None);
    let e = remote(&addr, Some(wrong), TOKEN).err().expect("wrong CA refused");
    assert!(e.contains("not signed by the CA"), "{e}");
    let e = remote(&addr, None, TOKEN).err().expect("clear text refused");
    assert!(e.contains("speaks TLS"), "{e}");
    // No fallback the other way: a TLS client of a clear-text owner.
    let (_vol2, clear) = owner(None, TOKEN, ConnLimits::default());
    let e = remote(&clear.addr.to_string(), Some(pki.trusting()), TOKEN).err().expect("no fallback");
    assert!(e.contains("does not speak TLS"), "{e}");
    // Each failure is one line.
    assert!(!e.contains('\n'), "{e}");
}

#[test]
fn a_client_certificate_from_the_client_ca_stands_for_the_token() {
    let _turn = ONE_AT_A_TIME.lock();
    let pki = Pki::new();
    // No token at all: the client certificate is the authentication.
    let (vol, server) = owner(Some(pki.server(true)), "", ConnLimits::default());
    let addr = server.addr.to_string();
    let known = pki.client(Trust::Ca(pki.ca.clone()), Some((&pki.client_cert, &pki.client_key)));
    write_sync_read(&remote(&addr, Some(known), "").expect("certified"), &vol, b"mtls", b"no token needed");
    let e = remote(&addr, Some(pki.trusting()), "").err().expect("no certificate, no token");
    assert!(e.contains("refused our token"), "{e}");
    let e = remote(&addr, Some(pki.trusting()), "guess").err().expect("no certificate, a guessed token");
    assert!(e.contains("refused our token"), "{e}");
    let stranger = pki.client(Trust::Ca(pki.ca.clone()), Some((&pki.stranger_cert, &pki.stranger_key)));
    assert!(remote(&addr, Some(stranger), "").is_err(), "a certificate another CA signed");
    // With a token too, either is enough.
    let (vol, both) = owner(Some(pki.server(true)), TOKEN, ConnLimits::default());
    let addr = both.addr.to_string();
    write_sync_read(&remote(&addr, Some(pki.trusting()), TOKEN).expect("token"), &vol, b"by-token", b"token");
    let known = pki.client(Trust::Ca(pki.ca.clone()), Some((&pki.client_cert, &pki.client_key)));
    write_sync_read(&remote(&addr, Some(known), "").expect("certificate"), &vol, b"by-cert", b"cert");
}

/// A bucket holding one file of `mib` MiB on branch main, its bytes.
fn bucket_with_file(dir: &Path, mib: usize) -> (Arc<MemObjectStore>, Vec<u8>) {
    let store = Arc::new(MemObjectStore::new());
    let dyn_store: Arc<dyn ObjectStore> = store.clone();
    let data: Vec<u8> = (0..(mib * MIB) as u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    let dev = BucketDevice::open(dyn_store.clone(), &dir.join("writer"), TierConfig::default()).expect("device");
    let cfg = Config { commit_interval: None, env: TestEnv::new(3), ..Config::default() };
    let vol = Volume::open(HeadDevice::new(dev, dyn_store, "main"), cfg).expect("volume");
    let ino = vol.create(ROOT_INO, b"data", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    for (i, part) in data.chunks(MIB).enumerate() {
        vol.write(ino, (i * MIB) as u64, part).expect("write");
    }
    vol.close().expect("close");
    (store, data)
}

/// Reads branch main's file `data` through a fresh cache folder and `client`.
fn read_through(store: &Arc<MemObjectStore>, cache: &Path, client: Arc<CacheClient>) -> Vec<u8> {
    let dyn_store: Arc<dyn ObjectStore> = store.clone();
    let tier = TierConfig { peers: Some(client as Arc<dyn ChunkSource>), ..TierConfig::default() };
    let dev = BucketDevice::open(dyn_store.clone(), cache, tier).expect("device");
    let cfg = Config { commit_interval: None, read_only: true, env: TestEnv::new(3), ..Config::default() };
    let vol = Volume::open(HeadDevice::new(dev, dyn_store, "main"), cfg).expect("volume");
    let ino = vol.lookup(ROOT_INO, b"data").expect("lookup").ino;
    let size = vol.getattr(ino).expect("getattr").size as usize;
    let mut got = Vec::with_capacity(size);
    while got.len() < size {
        let part = vol.read(ino, got.len() as u64, MIB).expect("read");
        assert!(!part.is_empty(), "short file");
        got.extend_from_slice(&part);
    }
    got
}

fn cache_client(addr: &str, tls: Option<ClientTls>) -> Arc<CacheClient> {
    let opts = ClientOptions { servers: vec![addr.into()], token: TOKEN.into(), timeout: Duration::from_secs(5), tls };
    Arc::new(CacheClient::new(opts).expect("client"))
}

#[test]
fn a_read_through_a_tls_cache_server_gets_every_chunk_from_it() {
    let _turn = ONE_AT_A_TIME.lock();
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, data) = bucket_with_file(dir.path(), 6);
    let cache = SegmentCache::open(store.clone(), &dir.path().join("server"), 1 << 30).expect("cache");
    let opts = ServerOptions { token: TOKEN.into(), tls: Some(pki.server(false)), ..ServerOptions::default() };
    let server = CacheServer::new(cache, opts).spawn("127.0.0.1:0").expect("serve");
    let addr = server.addr.to_string();
    // Cold, then warm: the health check over HTTP/2, chunks over chunk
    // connections (footers come from the bucket itself).
    for round in 0..2 {
        let c = cache_client(&addr, Some(pki.trusting()));
        assert_eq!(c.check(Duration::from_secs(5)), vec![(addr.clone(), None)], "health over HTTP/2 in TLS");
        let got = read_through(&store, &dir.path().join(format!("reader{round}")), c.clone());
        assert!(got == data, "every byte read through the server is the file's");
        let s = &c.stats()[0];
        assert!(s.bytes >= data.len() as u64, "the server gave the file: {s:?}");
        assert_eq!(s.footers, 0, "footers come from the bucket, never a server: {s:?}");
        assert_eq!(s.fallback_error + s.fallback_timeout + s.rejected, 0, "{s:?}");
    }
    let hits = metric_sample(&server.server.metrics_text(), "arbor_cache_hits_total").expect("hits");
    assert!(hits > 0.0, "the second reader was served from the cache");
    // Clients that do not trust it, or speak clear text, are told why.
    let wrong = cache_client(&addr, Some(pki.client(Trust::Ca(pki.other_ca.clone()), None)));
    let problem = wrong.check(Duration::from_secs(5)).remove(0).1.expect("a problem");
    assert!(problem.contains("not signed by the CA"), "{problem}");
    let clear = cache_client(&addr, None);
    let problem = clear.check(Duration::from_secs(5)).remove(0).1.expect("a problem");
    assert!(problem.contains("speaks TLS"), "{problem}");
    // And their reads come from the bucket, whole.
    assert!(read_through(&store, &dir.path().join("clear"), clear.clone()) == data);
    assert_eq!(clear.stats()[0].bytes, 0);
}

#[test]
fn a_cache_server_takes_a_client_certificate_instead_of_the_token_on_both_protocols() {
    let _turn = ONE_AT_A_TIME.lock();
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, data) = bucket_with_file(dir.path(), 3);
    let cache = SegmentCache::open(store.clone(), &dir.path().join("server"), 1 << 30).expect("cache");
    let opts = ServerOptions { token: String::new(), tls: Some(pki.server(true)), ..ServerOptions::default() };
    let server = CacheServer::new(cache, opts).spawn("127.0.0.1:0").expect("serve");
    let addr = server.addr.to_string();
    let client = |tls: ClientTls| {
        let opts = ClientOptions {
            servers: vec![addr.clone()],
            token: String::new(),
            timeout: Duration::from_secs(5),
            tls: Some(tls),
        };
        Arc::new(CacheClient::new(opts).expect("client"))
    };
    // With the certificate: the health check (HTTP/2) answers and every
    // chunk (framed) comes from the server.
    let known = client(pki.client(Trust::Ca(pki.ca.clone()), Some((&pki.client_cert, &pki.client_key))));
    assert_eq!(known.check(Duration::from_secs(5)), vec![(addr.clone(), None)]);
    assert!(read_through(&store, &dir.path().join("known"), known.clone()) == data);
    let s = &known.stats()[0];
    assert!(s.bytes >= data.len() as u64, "{s:?}");
    assert_eq!(s.fallback_error + s.fallback_timeout, 0, "{s:?}");
    // Without one (and no token): refused on both, read from the bucket.
    let unknown = client(pki.trusting());
    let problem = unknown.check(Duration::from_secs(5)).remove(0).1.expect("refused");
    assert!(problem.contains("refused our token"), "{problem}");
    assert!(read_through(&store, &dir.path().join("unknown"), unknown.clone()) == data);
    assert_eq!(unknown.stats()[0].bytes, 0);
}

/// A forwarder from a port of its own to `upstream` that keeps every byte
/// it passes, both ways.
struct Recorder {
    addr: SocketAddr,
    seen: Arc<parking_lot::Mutex<Vec<u8>>>,
}

impl Recorder {
    fn start(upstream: SocketAddr) -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen: Arc<parking_lot::Mutex<Vec<u8>>> = Arc::default();
        let kept = seen.clone();
        std::thread::spawn(move || {
            // Ends with the test process.
            for down in listener.incoming().flatten() {
                let Ok(up) = TcpStream::connect(upstream) else { continue };
                for (from, to) in [(down.try_clone(), up.try_clone()), (up.try_clone(), down.try_clone())] {
                    let (Ok(mut from), Ok(mut to)) = (from, to) else { continue };
                    let kept = kept.clone();
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 64 << 10];
                        // Ends when either side closes.
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 || to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            kept.lock().extend_from_slice(&buf[..n]);
                        }
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        Recorder { addr, seen }
    }

    fn saw(&self, needle: &[u8]) -> bool {
        self.seen.lock().windows(needle.len()).any(|w| w == needle)
    }
}

#[test]
fn nothing_crosses_the_wire_in_clear_with_tls_and_everything_does_without() {
    let _turn = ONE_AT_A_TIME.lock();
    let pki = Pki::new();
    let content = b"arbor-wire-secret: the quick brown fox 0xC0FFEE".repeat(100);
    for tls in [false, true] {
        let (vol, server) = owner(tls.then(|| pki.server(false)), TOKEN, ConnLimits::default());
        let proxy = Recorder::start(server.addr);
        let c = remote(&proxy.addr.to_string(), tls.then(|| pki.trusting()), TOKEN).expect("connect");
        write_sync_read(&c, &vol, b"secret.txt", &content);
        drop(c);
        let recorded = proxy.seen.lock().len();
        assert!(recorded > content.len(), "the proxy carried the write: {recorded} bytes");
        // The control: in clear, both are there to read, so the check can fail.
        assert_eq!(proxy.saw(TOKEN.as_bytes()), !tls, "the token, tls={tls}");
        assert_eq!(proxy.saw(&content[..64]), !tls, "the file's bytes, tls={tls}");
        assert_eq!(proxy.saw(b"secret.txt"), !tls, "the file's name, tls={tls}");
    }
}

/// This process's threads.
fn threads() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let line = status.lines().find(|l| l.starts_with("Threads:")).expect("field");
    line["Threads:".len()..].trim().parse().expect("number")
}

/// A connection to `to` from loopback address `from`: another peer to the
/// server's caps.
fn connect_from(from: [u8; 4], to: SocketAddr) -> TcpStream {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    s.bind(&SocketAddr::from((from, 0)).into()).expect("bind");
    s.connect_timeout(&to.into(), Duration::from_secs(5)).expect("connect");
    s.into()
}

/// Whether the server closed `s`, looked at without waiting (bytes the
/// server sent first, its half of a handshake, are read past).
fn closed(mut s: &TcpStream) -> bool {
    s.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 4096];
    let r = loop {
        match s.read(&mut buf) {
            Ok(n) if n > 0 => continue,
            r => break r,
        }
    };
    s.set_nonblocking(false).expect("blocking");
    match r {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

#[test]
fn connections_that_stall_before_or_inside_the_handshake_cost_no_thread_and_end_at_the_deadline() {
    let _turn = ONE_AT_A_TIME.lock();
    let pki = Pki::new();
    let (vol, server) = owner(Some(pki.server(false)), TOKEN, ConnLimits::default());
    let before = threads();
    let started = Instant::now();
    // 200 that never say anything.
    let mut held: Vec<TcpStream> = (0..200).map(|_| connect_from([127, 0, 0, 2], server.addr)).collect();
    // 200 that send a ClientHello and then nothing.
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("versions")
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let config = Arc::new(config);
    for _ in 0..200 {
        let mut s = connect_from([127, 0, 0, 3], server.addr);
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
        let mut conn = rustls::ClientConnection::new(config.clone(), name).expect("conn");
        conn.write_tls(&mut s).expect("client hello");
        held.push(s);
    }
    std::thread::sleep(Duration::from_millis(300));
    let open = metric_sample(&server.server.metrics_text(), "arbor_open_connections").expect("open");
    assert_eq!(open, 400.0, "all held, each under the caps");
    let during = threads();
    assert!(during <= before + 4, "threads {before} -> {during} for 400 stalled connections");
    // A real client is served meanwhile.
    let c = remote(&server.addr.to_string(), Some(pki.trusting()), TOKEN).expect("a real client");
    write_sync_read(&c, &vol, b"served", b"while 400 stall");
    assert!(started.elapsed() < Duration::from_secs(2), "all that within the deadline");
    // Every stalled one is closed at the hello's deadline (2 s), and its
    // place given back.
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && !held.iter().all(closed) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(held.iter().all(closed), "a stalled connection outlived its deadline");
    assert!(started.elapsed() >= Duration::from_millis(1900), "closed at the deadline, not before");
    let failed = metric_sample(&server.server.metrics_text(), "arbor_cache_failed_hellos_total");
    assert!(failed.unwrap_or(0.0) >= 400.0, "each counted: {failed:?}");
    drop(c);
}

#[test]
fn garbage_expired_and_mismatched_files_are_refused_naming_the_file() {
    let _turn = ONE_AT_A_TIME.lock();
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "this is not PEM\n").expect("write");
    let bad_body = dir.path().join("bad-body.pem");
    std::fs::write(&bad_body, "-----BEGIN CERTIFICATE-----\naGVsbG8=\n-----END CERTIFICATE-----\n").expect("write");
    let issuer = ca("expired CA");
    let (expired, expired_key, _) = leaf(dir.path(), "expired", &["127.0.0.1"], &issuer, Some((2020, 1, 1)));
    let server = |cert: &Path, key: &Path| {
        ServerTls::load(&ServerFiles { cert: cert.into(), key: key.into(), client_ca: None })
            .err()
            .map(|e| e.to_string())
            .expect("refused")
    };
    let mut said = Vec::new();
    let mut refused = |e: String, file: &str, why: &str| {
        assert!(e.contains(file) && e.contains(why), "{e}");
        said.push(e);
    };
    refused(server(&garbage, &pki.server_key), "garbage.pem", "no PEM certificate");
    refused(server(&bad_body, &pki.server_key), "bad-body.pem", "not an X.509 certificate");
    refused(server(&expired, &expired_key), "expired.pem", "expired on 2020-01-01");
    refused(server(&pki.server_cert, &garbage), "garbage.pem", "private key");
    refused(server(&pki.server_cert, &pki.client_key), "client.key", "does not go with");
    refused(server(&dir.path().join("missing.pem"), &pki.server_key), "missing.pem", "No such file");
    let client = |trust| ClientTls::load(&ClientFiles { trust, identity: None }).err().map(|e| e.to_string());
    refused(client(Trust::Ca(garbage.clone())).expect("refused"), "garbage.pem", "no PEM certificate");
    refused(client(Trust::Ca(expired.clone())).expect("refused"), "expired.pem", "expired on 2020-01-01");
    assert!(said.iter().all(|e| !e.contains('\n')), "each on one line: {said:?}");
}

/// An HTTP connection (clear text, or TLS with ALPN h2 / none) that sends
/// no authorized request is bound by the hello's deadline too: it does not
/// keep its place under the caps, and real clients get in.
#[test]
fn idle_http_connections_without_a_token_are_closed_at_the_deadline() {
    let _turn = ONE_AT_A_TIME.lock();
    let pki = Pki::new();
    let limits = ConnLimits { per_peer: 4, total: 4, ..ConnLimits::default() };
    // Clear text: "GET / HTTP/1.1\r\n" and nothing more.
    let (_vol, plain) = owner(None, TOKEN, limits);
    let mut held: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = connect_from([127, 0, 0, 4], plain.addr);
            s.write_all(b"GET /metrics HTTP/1.1\r\n").expect("half a request");
            s
        })
        .collect();
    // TLS: a complete handshake (no client certificate, no token), ALPN h2,
    // then nothing.
    let (_vol2, tls) = owner(Some(pki.server(false)), TOKEN, limits);
    let mut config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("versions")
            .with_root_certificates({
                let mut r = rustls::RootCertStore::empty();
                for c in
                    <rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::pem_file_iter(&pki.ca)
                        .expect("ca")
                {
                    r.add(c.expect("cert")).expect("add");
                }
                r
            })
            .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let config = Arc::new(config);
    let mut tls_held = Vec::new();
    for _ in 0..4 {
        let mut s = connect_from([127, 0, 0, 5], tls.addr);
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
        let mut conn = rustls::ClientConnection::new(config.clone(), name).expect("conn");
        while conn.is_handshaking() {
            conn.complete_io(&mut s).expect("handshake");
        }
        tls_held.push((s, conn));
    }
    std::thread::sleep(Duration::from_secs(5));
    let open = metric_sample(&plain.server.metrics_text(), "arbor_open_connections").expect("open");
    let open_tls = metric_sample(&tls.server.metrics_text(), "arbor_open_connections").expect("open");
    let still = held.iter_mut().filter(|s| !closed(s)).count();
    let still_tls = tls_held.iter_mut().filter(|(s, _)| !closed(s)).count();
    // A real client is refused: every place is held by a peer with no token.
    let refused = remote(&plain.addr.to_string(), None, TOKEN).is_err();
    let refused_tls = remote(&tls.addr.to_string(), Some(pki.trusting()), TOKEN).is_err();
    assert!(
        still == 0 && still_tls == 0 && open == 0.0 && open_tls == 0.0 && !refused && !refused_tls,
        "5 s after connecting, tokenless HTTP connections still open: clear {still} (open {open}), \
         tls {still_tls} (open {open_tls}); a real client refused: clear {refused}, tls {refused_tls}"
    );
}
