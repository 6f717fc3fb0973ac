//! `/metrics` of a mount (`arbor mount --metrics ADDR`) and of `arbor
//! serve`, read as Prometheus reads them, and the Grafana dashboard
//! checked against what they export.

use arbor_engine::metrics::{find, parse, Sample};
use arbor_engine::testkit::S3_BUCKET;
use arbor_tests::*;
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// `GET path` from `addr` (HTTP/1.1), with `token` as a bearer token: the body.
fn get(addr: &str, path: &str, token: Option<&str>) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: arbor\r\n{auth}Connection: close\r\n\r\n").expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4"), "{head}");
    // hyper sends a small body in one piece with a length, not chunked.
    body.to_string()
}

fn scrape(addr: &str) -> Vec<Sample> {
    let text = get(addr, "/metrics", None);
    parse(&text).unwrap_or_else(|e| panic!("not Prometheus text: {e}\n{text}"))
}

fn op_count(s: &[Sample], op: &str) -> f64 {
    find(s, "arbor_fuse_request_seconds_count", &[("op", op)]).unwrap_or_else(|| panic!("no count of {op}"))
}

/// Writes `writes` blocks of 4 KiB to a new file at `path`, fsyncing after each.
fn write_and_fsync(path: &Path, writes: u64) {
    let f = std::fs::File::create(path).expect("create");
    for i in 0..writes {
        f.write_all_at(&[i as u8; 4096], i * 4096).expect("write");
        f.sync_all().expect("fsync");
    }
}

#[test]
fn a_mount_counts_its_operations_and_latencies_on_its_metrics_endpoint() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let addr = format!("127.0.0.1:{}", free_port());
    let m = Mount::start(s.disk_str(), &s.mnt, &["--metrics", &addr]);
    let before = scrape(&addr);
    let (writes, fsyncs) = (op_count(&before, "write"), op_count(&before, "fsync"));
    let bucket_le = |s: &[Sample], op: &str, le: &str| {
        find(s, "arbor_fuse_request_seconds_bucket", &[("op", op), ("le", le)]).expect("bucket")
    };
    let inf_before = bucket_le(&before, "write", "+Inf");

    write_and_fsync(&s.mnt.join("a.bin"), 5);
    assert_eq!(std::fs::read(s.mnt.join("a.bin")).expect("read").len(), 5 * 4096);
    std::fs::create_dir(s.mnt.join("d")).expect("mkdir");

    let after = scrape(&addr);
    // The kernel may merge or split writes of its own; with an fsync after
    // each, every 4 KiB write reached the mount before the next.
    assert!(op_count(&after, "write") >= writes + 5.0, "writes: {} then {}", writes, op_count(&after, "write"));
    assert!(op_count(&after, "fsync") >= fsyncs + 5.0, "fsyncs: {} then {}", fsyncs, op_count(&after, "fsync"));
    assert!(op_count(&after, "mkdir") >= 1.0);
    assert!(bucket_le(&after, "write", "+Inf") >= inf_before + 5.0);
    let slowest = bucket_le(&after, "write", "5");
    assert!(slowest <= bucket_le(&after, "write", "+Inf") && slowest >= bucket_le(&after, "write", "0.0001"));
    let sum = find(&after, "arbor_fuse_request_seconds_sum", &[("op", "fsync")]).expect("sum");
    assert!(sum > 0.0, "fsyncs took no time: {sum}");
    let written = find(&after, "arbor_fuse_written_bytes_total", &[]).expect("written bytes");
    assert!(written >= 5.0 * 4096.0, "{written}");
    // Bucket calls are exported whether or not this disk made any yet.
    assert!(find(&after, "arbor_bucket_request_seconds_count", &[("op", "get")]).is_some());
    assert!(get(&addr, "/metrics", None).contains("# TYPE arbor_fuse_request_seconds histogram\n"));
    m.unmount();
    assert!(std::net::TcpStream::connect(&addr).is_err(), "/metrics still answers after the unmount");
}

#[test]
fn a_metrics_address_in_use_fails_the_mount_and_says_why() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = arbor(&["mount", s.disk_str(), s.mnt.to_str().expect("utf8"), "--metrics", &addr, "--foreground"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--metrics"), "{err}");
    assert!(!is_mounted(&s.mnt));
}

/// Every `arbor_…` name in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("arbor_") {
        let preceded = rest[..i].chars().last().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
        let tail = &rest[i..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).unwrap_or(tail.len());
        if !preceded {
            names.push(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

#[test]
fn every_metric_the_dashboard_queries_is_exported_by_a_mount_or_a_cache_server() {
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{S3_BUCKET}/disks/metrics");
    arbor_env_ok(&["init", &disk], &w.env);
    let token = "metrics-token-for-tests";
    let token_file = w.dir.path().join("token");
    std::fs::write(&token_file, token).expect("token");
    let token_arg = token_file.to_str().expect("utf8");
    let cache = w.dir.path().join("server-cache");
    let server_log = w.dir.path().join("serve.log");
    let server_args = ["--cache-dir", cache.to_str().expect("utf8"), "--token-file", token_arg];
    let server = Serve::start(&disk, free_port(), &server_args, &w.env, &server_log);
    let addr = format!("127.0.0.1:{}", free_port());
    let mnt = w.mnt("main");
    let mount_args = ["--metrics", &addr, "--cache-server", &server.addr, "--token-file", token_arg];
    let m = Mount::start_env(&disk, &mnt, &mount_args, &w.env);
    write_and_fsync(&mnt.join("a.bin"), 2);

    let mut exported = BTreeSet::new();
    for text in [get(&addr, "/metrics", None), get(&server.addr, "/metrics", Some(token))] {
        for s in parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}")) {
            exported.insert(s.name);
        }
    }
    let dashboard = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/grafana/arbor.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&dashboard).expect("the dashboard")).expect("JSON");
    let mut all = Vec::new();
    exprs(&json, &mut all);
    assert!(all.len() >= 8, "too few queries found: {all:?}");
    let used: BTreeSet<String> = all.iter().flat_map(|e| metric_names(e)).collect();
    let missing: Vec<_> = used.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(missing.is_empty(), "the dashboard queries {missing:?}, which nothing exports; exported: {exported:?}");
    // The mount's chunk cache and cache-server families are among them.
    for name in
        ["arbor_mount_cache_bucket_bytes_total", "arbor_cache_served_bytes_total", "arbor_bucket_read_bytes_total"]
    {
        assert!(exported.contains(name), "{name} not exported");
    }
    m.unmount();
}

#[test]
fn names_are_taken_from_promql_whole() {
    assert_eq!(
        metric_names("sum(rate(arbor_a_total{job=\"x\"}[5m])) / histogram_quantile(0.9, x_arbor_b + arbor_c_bucket)"),
        ["arbor_a_total", "arbor_c_bucket"]
    );
}
