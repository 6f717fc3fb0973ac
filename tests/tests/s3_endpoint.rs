//! `arbor serve --s3`: the disk as an S3 endpoint, end to end. The real
//! binary owns branch `main` of a local-folder disk and of an s3:// disk
//! (on s3s-fs), and a real S3 client (aws-sdk-s3) puts, gets, lists and
//! deletes through it; a real FUSE mount of the same branch, through the
//! same owner, reads every object back and writes a file S3 then reads.

use arbor_tests::*;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::{ByteStream, DateTime};
use aws_sdk_s3::Client;
use futures::StreamExt;
use std::collections::BTreeSet;
use std::path::Path;

const AK: &str = "arbor-s3-test-key";
const SK: &str = "arbor-s3-test-secret";

fn client(endpoint: &str, key: &str, secret: &str) -> Client {
    client_with(endpoint, key, secret, aws_sdk_s3::config::retry::RetryConfig::standard())
}

/// A client that does not send a request again when its connection dies
/// (the server killed under it).
fn client_once(endpoint: &str) -> Client {
    client_with(endpoint, AK, SK, aws_sdk_s3::config::retry::RetryConfig::disabled())
}

fn client_with(endpoint: &str, key: &str, secret: &str, retry: aws_sdk_s3::config::retry::RetryConfig) -> Client {
    let creds = aws_sdk_s3::config::Credentials::new(key, secret, None, None, "test");
    let conf = aws_sdk_s3::Config::builder()
        .behavior_version_latest()
        .endpoint_url(endpoint)
        .region(aws_sdk_s3::config::Region::new("us-east-1"))
        .credentials_provider(creds)
        .force_path_style(true)
        .retry_config(retry)
        .build();
    Client::from_conf(conf)
}

/// The HTTP status and S3 error code of a failed call.
fn failure<E: ProvideErrorMetadata + std::fmt::Debug>(
    e: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> (u16, String) {
    let status = e.raw_response().map_or(0, |r| r.status().as_u16());
    (status, e.code().unwrap_or("").to_string())
}

fn md5_hex(data: &[u8]) -> String {
    // The endpoint's ETag of a single-part object: the MD5 of its bytes,
    // checked here against a second implementation (Python's hashlib).
    let out = std::process::Command::new("python3")
        .args(["-c", "import hashlib,sys; print(hashlib.md5(sys.stdin.buffer.read()).hexdigest())"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().expect("stdin").write_all(data)?;
            c.wait_with_output()
        })
        .expect("python3");
    String::from_utf8(out.stdout).expect("utf8").trim().to_string()
}

/// The ETag S3 gives an object of `parts`: the MD5 of their MD5s, and
/// their count.
fn multipart_etag(parts: &[&[u8]]) -> String {
    let md5s: Vec<String> = parts.iter().map(|p| md5_hex(p)).collect();
    let out = std::process::Command::new("python3")
        .args(["-c", "import hashlib,sys; print(hashlib.md5(bytes.fromhex(''.join(sys.argv[1:]))).hexdigest())"])
        .args(&md5s)
        .output()
        .expect("python3");
    format!("\"{}-{}\"", String::from_utf8(out.stdout).expect("utf8").trim(), parts.len())
}

async fn upload_part(c: &Client, key: &str, id: &str, n: i32, body: &[u8]) -> String {
    let r = c.upload_part().bucket("main").key(key).upload_id(id).part_number(n);
    let r = r.body(ByteStream::from(body.to_vec())).send().await.expect("upload part");
    r.e_tag().expect("etag").to_string()
}

fn completed(parts: &[(i32, &str)]) -> aws_sdk_s3::types::CompletedMultipartUpload {
    let parts = parts
        .iter()
        .map(|(n, e)| aws_sdk_s3::types::CompletedPart::builder().part_number(*n).e_tag(*e).build())
        .collect();
    aws_sdk_s3::types::CompletedMultipartUpload::builder().set_parts(Some(parts)).build()
}

/// Multipart uploads, copies and batch deletes.
async fn multipart_copy_and_batch_delete(c: &Client, big: &[u8], big_etag: &str) {
    let key = "mp/big.bin";
    let up = c.create_multipart_upload().bucket("main").key(key).content_type("application/x-test").send().await;
    let id = up.expect("create upload").upload_id().expect("id").to_string();
    let p1 = pattern(5 << 20, 1);
    let p2 = pattern((5 << 20) + 7, 2);
    let p3 = pattern(100_003, 3);
    // Out of order, and part 2 sent twice (the second one counts).
    upload_part(c, key, &id, 2, &p3).await;
    let e2 = &upload_part(c, key, &id, 2, &p2).await;
    let e3 = upload_part(c, key, &id, 3, &p3).await;
    let e1 = upload_part(c, key, &id, 1, &p1).await;
    assert_eq!(e1, format!("\"{}\"", md5_hex(&p1)));
    let parts = c.list_parts().bucket("main").key(key).upload_id(&id).send().await.expect("list parts");
    let listed: Vec<(i32, i64)> =
        parts.parts().iter().map(|p| (p.part_number().unwrap_or(0), p.size().unwrap_or(0))).collect();
    assert_eq!(listed, [(1, p1.len() as i64), (2, p2.len() as i64), (3, p3.len() as i64)]);
    let uploads = c.list_multipart_uploads().bucket("main").send().await.expect("list uploads");
    let ids: Vec<&str> = uploads.uploads().iter().filter_map(|u| u.upload_id()).collect();
    assert_eq!(ids, [id.as_str()]);
    // Not an object before it is completed, nor listed.
    let before = c.head_object().bucket("main").key(key).send().await;
    assert_eq!(failure(before.expect_err("not yet")).0, 404);
    let r = c.list_objects_v2().bucket("main").prefix("mp").send().await.expect("list");
    assert_eq!(r.key_count(), Some(0));
    // A wrong ETag, and a small part before the last, are refused.
    let bad = c.complete_multipart_upload().bucket("main").key(key).upload_id(&id);
    let bad = bad.multipart_upload(completed(&[(1, &e1), (2, "\"00\""), (3, &e3)])).send().await;
    assert_eq!(failure(bad.expect_err("wrong etag")), (400, "InvalidPart".to_string()));
    let small = c.complete_multipart_upload().bucket("main").key(key).upload_id(&id);
    let small = small.multipart_upload(completed(&[(3, &e3), (4, &e3)])).send().await;
    assert_eq!(failure(small.expect_err("unknown part")).0, 400);
    let small = c.complete_multipart_upload().bucket("main").key(key).upload_id(&id);
    let small = small.multipart_upload(completed(&[(1, &e1), (3, &e3), (2, e2)])).send().await;
    assert_eq!(failure(small.expect_err("out of order")).0, 400);
    let done = c.complete_multipart_upload().bucket("main").key(key).upload_id(&id);
    let done = done.multipart_upload(completed(&[(1, &e1), (2, e2), (3, &e3)])).send().await.expect("complete");
    let want_etag = multipart_etag(&[&p1, &p2, &p3]);
    assert_eq!(done.e_tag(), Some(want_etag.as_str()));
    let got = c.get_object().bucket("main").key(key).send().await.expect("get");
    assert_eq!(got.e_tag(), Some(want_etag.as_str()));
    assert_eq!(got.content_type(), Some("application/x-test"));
    let whole = [p1.as_slice(), &p2, &p3].concat();
    assert!(got.body.collect().await.expect("body").into_bytes()[..] == whole[..]);
    let uploads = c.list_multipart_uploads().bucket("main").send().await.expect("list uploads");
    assert!(uploads.uploads().is_empty(), "a completed upload is gone");

    // Aborted: gone, and its parts refused.
    let up = c.create_multipart_upload().bucket("main").key("mp/aborted").send().await.expect("create upload");
    let id = up.upload_id().expect("id").to_string();
    upload_part(c, "mp/aborted", &id, 1, b"abc").await;
    c.abort_multipart_upload().bucket("main").key("mp/aborted").upload_id(&id).send().await.expect("abort");
    let late = c.upload_part().bucket("main").key("mp/aborted").upload_id(&id).part_number(2);
    let late = late.body(ByteStream::from_static(b"x")).send().await;
    assert_eq!(failure(late.expect_err("aborted")), (404, "NoSuchUpload".to_string()));
    assert_eq!(failure(c.head_object().bucket("main").key("mp/aborted").send().await.expect_err("none")).0, 404);

    // Copies: an object, its metadata kept or replaced, a range as a part.
    let r = c.copy_object().bucket("main").key("copies/big.bin").copy_source("main/data/big.bin").send().await;
    let r = r.expect("copy");
    assert_eq!(r.copy_object_result().and_then(|c| c.e_tag()), Some(big_etag));
    let got = c.get_object().bucket("main").key("copies/big.bin").send().await.expect("get copy");
    assert!(got.body.collect().await.expect("body").into_bytes()[..] == big[..]);
    let r = c.copy_object().bucket("main").key("copies/typed").copy_source("main/mp/big.bin").send().await;
    assert_eq!(
        r.expect("copy").copy_object_result().and_then(|c| c.e_tag()),
        Some(format!("\"{}\"", md5_hex(&whole)).as_str())
    );
    let head = c.head_object().bucket("main").key("copies/typed").send().await.expect("head");
    assert_eq!(head.content_type(), Some("application/x-test"), "metadata copied");
    let r = c.copy_object().bucket("main").key("copies/typed").copy_source("main/copies/typed");
    let r = r.metadata_directive(aws_sdk_s3::types::MetadataDirective::Replace).content_type("text/plain").send().await;
    r.expect("copy onto itself with new metadata");
    let head = c.head_object().bucket("main").key("copies/typed").send().await.expect("head");
    assert_eq!((head.content_type(), head.content_length()), (Some("text/plain"), Some(whole.len() as i64)));
    let missing = c.copy_object().bucket("main").key("copies/x").copy_source("main/nothing/here").send().await;
    assert_eq!(failure(missing.expect_err("no source")).0, 404);
    let cond = c.copy_object().bucket("main").key("copies/x").copy_source("main/data/big.bin");
    let cond = cond.copy_source_if_match("\"00\"").send().await;
    assert_eq!(failure(cond.expect_err("condition")).0, 412);
    let up = c.create_multipart_upload().bucket("main").key("copies/ranged").send().await.expect("create upload");
    let id = up.upload_id().expect("id").to_string();
    let part = c.upload_part_copy().bucket("main").key("copies/ranged").upload_id(&id).part_number(1);
    let part = part.copy_source("main/data/big.bin").copy_source_range("bytes=10-1048585").send().await;
    let pe = part.expect("part copy").copy_part_result().and_then(|r| r.e_tag()).expect("etag").to_string();
    let done = c.complete_multipart_upload().bucket("main").key("copies/ranged").upload_id(&id);
    done.multipart_upload(completed(&[(1, &pe)])).send().await.expect("complete");
    let got = c.get_object().bucket("main").key("copies/ranged").send().await.expect("get");
    assert!(got.body.collect().await.expect("body").into_bytes()[..] == big[10..1_048_586]);

    // A batch delete: objects, a missing key, a key that cannot be one.
    let del = |k: &str| aws_sdk_s3::types::ObjectIdentifier::builder().key(k).build().expect("id");
    let batch = aws_sdk_s3::types::Delete::builder()
        .objects(del("copies/typed"))
        .objects(del("copies/ranged"))
        .objects(del("copies/none"))
        .objects(del("a//b"))
        .build()
        .expect("delete");
    let r = c.delete_objects().bucket("main").delete(batch).send().await.expect("delete objects");
    let mut deleted: Vec<&str> = r.deleted().iter().filter_map(|d| d.key()).collect();
    deleted.sort();
    assert_eq!(deleted, ["copies/none", "copies/ranged", "copies/typed"]);
    assert_eq!(r.errors().iter().filter_map(|e| e.key()).collect::<Vec<_>>(), ["a//b"]);
    let r = c.list_objects_v2().bucket("main").prefix("copies/").send().await.expect("list");
    assert_eq!(r.contents().iter().filter_map(|o| o.key()).collect::<Vec<_>>(), ["copies/big.bin"]);
}

/// Keys whose byte order is not a folder walk's: `-`, `.`, `!`, ` ` and
/// `+` sort before `/`, so `a-b` comes before `a/b` though folder `a`
/// sorts before file `a-b` by name.
fn tricky_keys(n: usize) -> Vec<String> {
    let mut keys = vec![
        "a".to_string() + "-b",
        "a/b".into(),
        "a.b/c".into(),
        "a!".into(),
        "a /x".into(),
        "a+/y".into(),
        "a0".into(),
        "a/b-c/d".into(),
        "a/b/c".into(),
        "a/b.c".into(),
        "b".into(),
        "é/ü €".into(),
        "z/z/z/z/deep".into(),
    ];
    let seps = ["-", ".", "/", "_", "!", " "];
    let mut i = 0;
    while keys.len() < n {
        let d = seps[i % seps.len()];
        let e = seps[(i / 7) % seps.len()];
        keys.push(format!("d{}{d}k{:03}{e}f{}", i % 11, i % 97, i));
        i += 1;
    }
    // Drop keys that would need a file and a folder of one name.
    let mut out: Vec<String> = Vec::new();
    for k in keys {
        let clash = out.iter().any(|o| k.starts_with(&format!("{o}/")) || o.starts_with(&format!("{k}/")));
        if !clash && !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

/// What a ListObjectsV2 with `prefix` and `delimiter` must give over `keys`.
fn expected_listing(keys: &BTreeSet<String>, prefix: &str, delimiter: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for k in keys.iter().filter(|k| k.starts_with(prefix)) {
        let entry = match k[prefix.len()..].find(delimiter) {
            Some(i) => k[..prefix.len() + i + delimiter.len()].to_string(),
            None => k.clone(),
        };
        if out.last() != Some(&entry) {
            out.push(entry);
        }
    }
    out
}

/// Every key and common prefix of a listing, page by page of `page` entries.
async fn list_all(c: &Client, bucket: &str, prefix: &str, delimiter: Option<&str>, page: i32) -> Vec<String> {
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut req = c.list_objects_v2().bucket(bucket).prefix(prefix).max_keys(page);
        if let Some(d) = delimiter {
            req = req.delimiter(d);
        }
        if let Some(t) = &token {
            req = req.continuation_token(t);
        }
        let r = req.send().await.expect("list");
        let mut got: Vec<String> = r.contents().iter().filter_map(|o| o.key().map(str::to_owned)).collect();
        got.extend(r.common_prefixes().iter().filter_map(|p| p.prefix().map(str::to_owned)));
        got.sort();
        assert!(got.len() <= page as usize, "a page holds at most max-keys entries");
        out.extend(got);
        if r.is_truncated() != Some(true) {
            return out;
        }
        token = Some(r.next_continuation_token().expect("a truncated page has a token").to_string());
    }
}

fn body_of(i: usize, key: &str) -> Vec<u8> {
    let mut b = format!("object {i} at {key}\n").into_bytes();
    b.extend(pattern(i % 300, i as u32));
    b
}

/// One endpoint's world: an owner of `main` with --s3, and the keys.
struct Endpoint {
    serve: Serve,
    s3: String,
    token: String,
}

fn start_endpoint(disk: &str, dir: &Path, env: &[(&str, String)]) -> Endpoint {
    let token = dir.join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("token");
    let keys = dir.join("s3-keys");
    std::fs::write(&keys, format!("# keys of the test\n{AK} {SK}\nother-key other-secret\n")).expect("keys");
    let s3_port = free_port();
    let s3 = format!("127.0.0.1:{s3_port}");
    let token = token.to_str().expect("utf8").to_string();
    let k = keys.to_str().expect("utf8").to_string();
    let args = ["--branch", "main", "--token-file", &token, "--s3", &s3, "--s3-keys", &k];
    // A keys file others can read is refused.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let out = arbor_env(
        &["serve", disk, "--listen", &format!("127.0.0.1:{}", free_port()), "--foreground"]
            .iter()
            .chain(args.iter())
            .copied()
            .collect::<Vec<_>>(),
        env,
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("chmod 600"), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let serve = Serve::start(disk, free_port(), &args, env, &dir.join("owner.log"));
    Endpoint { serve, s3: format!("http://{s3}"), token }
}

/// Everything one endpoint must do; `keys`: how many objects to list.
async fn exercise(disk: &str, dir: &Path, env: &[(&str, String)], nkeys: usize) {
    let e = start_endpoint(disk, dir, env);
    let c = client(&e.s3, AK, SK);

    // Buckets: the owned branch.
    let buckets = c.list_buckets().send().await.expect("list buckets");
    let names: Vec<&str> = buckets.buckets().iter().filter_map(|b| b.name()).collect();
    assert_eq!(names, ["main"]);
    c.head_bucket().bucket("main").send().await.expect("head bucket");
    assert_eq!(failure(c.head_bucket().bucket("nope").send().await.expect_err("no bucket")).0, 404);

    // Signatures: a wrong secret and an unknown key are refused.
    let wrong = client(&e.s3, AK, "not-the-secret");
    let (status, code) = failure(wrong.list_buckets().send().await.expect_err("wrong secret"));
    assert_eq!((status, code.as_str()), (403, "SignatureDoesNotMatch"));
    let unknown = client(&e.s3, "who", SK);
    assert_eq!(failure(unknown.list_buckets().send().await.expect_err("unknown key")).0, 403);
    let wrong_put = wrong.put_object().bucket("main").key("x").body(ByteStream::from_static(b"x")).send().await;
    assert_eq!(failure(wrong_put.expect_err("wrong secret")).0, 403);
    // The second key of the file works too.
    client(&e.s3, "other-key", "other-secret").list_buckets().send().await.expect("second key");

    // Put, get, head, range: a body over several engine chunks.
    let big = pattern((3 << 20) + 12_345, 9);
    let put = c.put_object().bucket("main").key("data/big.bin").body(ByteStream::from(big.clone())).send().await;
    let etag = put.expect("put").e_tag().expect("etag").to_string();
    assert_eq!(etag, format!("\"{}\"", md5_hex(&big)));
    let got = c.get_object().bucket("main").key("data/big.bin").send().await.expect("get");
    assert_eq!(got.e_tag(), Some(etag.as_str()));
    let last_modified = *got.last_modified().expect("last modified");
    let bytes = got.body.collect().await.expect("body").into_bytes();
    assert!(bytes[..] == big[..], "the object reads back byte for byte");
    let head = c.head_object().bucket("main").key("data/big.bin").send().await.expect("head");
    assert_eq!(head.content_length(), Some(big.len() as i64));
    assert_eq!(head.e_tag(), Some(etag.as_str()));
    for (range, from, to) in [
        ("bytes=1048570-1048600", 1_048_570usize, 1_048_601usize),
        ("bytes=0-0", 0, 1),
        ("bytes=-100", big.len() - 100, big.len()),
        ("bytes=3145000-", 3_145_000, big.len()),
    ] {
        let r = c.get_object().bucket("main").key("data/big.bin").range(range).send().await.expect("range");
        assert_eq!(r.content_length(), Some((to - from) as i64), "{range}");
        assert_eq!(r.body.collect().await.expect("body").into_bytes()[..], big[from..to], "{range}");
    }
    let past = c.get_object().bucket("main").key("data/big.bin").range("bytes=99999999-").send().await;
    assert_eq!(failure(past.expect_err("past the end")).0, 416);

    // Conditional gets.
    let cond = |r: aws_sdk_s3::operation::get_object::builders::GetObjectFluentBuilder| async move {
        match r.send().await {
            Ok(_) => 200,
            Err(e) => failure(e).0,
        }
    };
    let g = || c.get_object().bucket("main").key("data/big.bin");
    let later = DateTime::from_secs(last_modified.secs() + 3600);
    let earlier = DateTime::from_secs(last_modified.secs() - 3600);
    assert_eq!(cond(g().if_match(&etag)).await, 200);
    assert_eq!(cond(g().if_match("\"0123\"")).await, 412);
    assert_eq!(cond(g().if_none_match(&etag)).await, 304);
    assert_eq!(cond(g().if_none_match("\"0123\"")).await, 200);
    assert_eq!(cond(g().if_modified_since(later)).await, 304);
    assert_eq!(cond(g().if_modified_since(last_modified)).await, 304);
    assert_eq!(cond(g().if_modified_since(earlier)).await, 200);
    assert_eq!(cond(g().if_unmodified_since(earlier)).await, 412);
    assert_eq!(cond(g().if_unmodified_since(later)).await, 200);
    // If-Match wins over If-Unmodified-Since; If-None-Match over If-Modified-Since.
    assert_eq!(cond(g().if_match(&etag).if_unmodified_since(earlier)).await, 200);
    assert_eq!(cond(g().if_none_match("\"0123\"").if_modified_since(later)).await, 200);
    let missing = c.get_object().bucket("main").key("data/missing").send().await;
    let (status, code) = failure(missing.expect_err("missing"));
    assert_eq!((status, code.as_str()), (404, "NoSuchKey"));
    // A conditional PUT: only if absent.
    let again =
        c.put_object().bucket("main").key("data/big.bin").if_none_match("*").body(ByteStream::from_static(b"x"));
    assert_eq!(failure(again.send().await.expect_err("exists")).0, 412);

    // Keys that cannot be files.
    let p = |k: &'static str| c.put_object().bucket("main").key(k).body(ByteStream::from_static(b"x")).send();
    let (status, code) = failure(p("data/big.bin/inside").await.expect_err("under an object"));
    assert_eq!((status, code.as_str()), (409, "KeyConflict"));
    assert_eq!(failure(p("data").await.expect_err("a folder of objects")).0, 409);
    for bad in ["a//b", "x/../y", "./x", ".arbor-s3/tmp/x"] {
        let r = c.put_object().bucket("main").key(bad).body(ByteStream::from_static(b"x")).send().await;
        assert_eq!(failure(r.expect_err(bad)).0, 400, "{bad}");
    }

    // Many keys, listed in byte order, page by page.
    let keys = tricky_keys(nkeys);
    let started = std::time::Instant::now();
    let puts = futures::stream::iter(keys.iter().enumerate().map(|(i, k)| {
        let c = c.clone();
        let body = body_of(i, k);
        async move {
            c.put_object().bucket("main").key(k.as_str()).body(ByteStream::from(body)).send().await.expect("put key");
        }
    }))
    .buffer_unordered(32)
    .collect::<Vec<_>>();
    puts.await;
    println!("{} PUTs in {:?}", keys.len(), started.elapsed());
    let mut all: BTreeSet<String> = keys.iter().cloned().collect();
    all.insert("data/big.bin".into());
    let sorted: Vec<String> = all.iter().cloned().collect();
    assert!(sorted.windows(2).all(|w| w[0].as_bytes() < w[1].as_bytes()));
    assert_eq!(list_all(&c, "main", "", None, 1000).await, sorted, "every key, in byte order, 1000 a page");
    assert_eq!(list_all(&c, "main", "", None, 7).await, sorted, "7 a page");
    for (prefix, delim, page) in
        [("", "/", 1000), ("", "/", 3), ("a", "/", 2), ("a/", "/", 1), ("d1", "-", 5), ("d", "k0", 4)]
    {
        let want = expected_listing(&all, prefix, delim);
        let mut got = list_all(&c, "main", prefix, Some(delim), page).await;
        got.sort();
        let mut want_sorted = want.clone();
        want_sorted.sort();
        assert_eq!(got, want_sorted, "prefix {prefix:?} delimiter {delim:?} {page} a page");
    }
    // ListObjects (V1) pages by marker, a common prefix included.
    let mut v1 = Vec::new();
    let mut marker: Option<String> = None;
    loop {
        let mut r = c.list_objects().bucket("main").delimiter("/").max_keys(2);
        if let Some(m) = &marker {
            r = r.marker(m);
        }
        let r = r.send().await.expect("list v1");
        let mut page: Vec<String> = r.contents().iter().filter_map(|o| o.key().map(str::to_owned)).collect();
        page.extend(r.common_prefixes().iter().filter_map(|p| p.prefix().map(str::to_owned)));
        page.sort();
        v1.extend(page);
        if r.is_truncated() != Some(true) {
            break;
        }
        marker = Some(r.next_marker().expect("a truncated V1 page has a marker").to_string());
    }
    assert_eq!(v1, expected_listing(&all, "", "/"), "ListObjects V1, 2 a page");
    // StartAfter.
    let r = c.list_objects_v2().bucket("main").start_after("a/b").max_keys(3).send().await.expect("list");
    let got: Vec<&str> = r.contents().iter().filter_map(|o| o.key()).collect();
    let want: Vec<&str> = sorted.iter().filter(|k| k.as_str() > "a/b").take(3).map(String::as_str).collect();
    assert_eq!(got, want);
    // A listing's entries carry sizes and ETags.
    let r = c.list_objects_v2().bucket("main").prefix("data/").send().await.expect("list");
    assert_eq!(r.contents()[0].size(), Some(big.len() as i64));
    assert_eq!(r.contents()[0].e_tag(), Some(etag.as_str()));

    multipart_copy_and_batch_delete(&c, &big, &etag).await;
    all.insert("mp/big.bin".into());
    all.insert("copies/big.bin".into());

    // A folder marker.
    c.put_object().bucket("main").key("empty/").body(ByteStream::from_static(b"")).send().await.expect("marker");
    let r = c.list_objects_v2().bucket("main").prefix("empty").send().await.expect("list");
    assert_eq!(r.contents().iter().filter_map(|o| o.key()).collect::<Vec<_>>(), ["empty/"]);

    // A FUSE mount of the branch, through the same owner, reads every
    // object back; a file it writes is a GET away.
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let m = Mount::start_env(disk, &mnt, &["--token-file", &e.token], env);
    assert_eq!(std::fs::read(mnt.join("data/big.bin")).expect("read big")[..], big[..]);
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(std::fs::read(mnt.join(k)).unwrap_or_else(|e| panic!("read {k}: {e}")), body_of(i, k), "{k}");
    }
    assert!(mnt.join("empty").is_dir());
    assert!(
        !mnt.join(".arbor-s3/tmp").exists() || std::fs::read_dir(mnt.join(".arbor-s3/tmp")).expect("ls").count() == 0
    );
    // Overwritten through S3 while the mount has read it: its next open
    // sees the new bytes (close-to-open).
    c.put_object().bucket("main").key("a/b").body(ByteStream::from_static(b"replaced")).send().await.expect("put");
    assert_eq!(std::fs::read(mnt.join("a/b")).expect("read"), b"replaced");
    let written = pattern(200_000, 5);
    std::fs::write(mnt.join("from-the-mount.bin"), &written).expect("write on the mount");
    let got = c.get_object().bucket("main").key("from-the-mount.bin").send().await.expect("get mount's file");
    let mount_etag = got.e_tag().expect("etag").to_string();
    assert_eq!(got.body.collect().await.expect("body").into_bytes()[..], written[..]);
    // A file the mount changes gets a new ETag.
    std::fs::write(mnt.join("from-the-mount.bin"), b"changed").expect("rewrite");
    let head = c.head_object().bucket("main").key("from-the-mount.bin").send().await.expect("head");
    assert_ne!(head.e_tag(), Some(mount_etag.as_str()));
    assert_eq!(head.content_length(), Some(7));
    // A file put through S3 and changed on the mount loses its MD5 ETag.
    std::fs::write(mnt.join("b"), b"changed on the mount").expect("rewrite");
    let head = c.head_object().bucket("main").key("b").send().await.expect("head");
    assert_ne!(head.e_tag().map(str::to_owned), Some(format!("\"{}\"", md5_hex(&body_of(10, "b")))));

    // Deleted through S3: gone on the mount, and its folders with it.
    c.delete_object().bucket("main").key("z/z/z/z/deep").send().await.expect("delete");
    all.remove("z/z/z/z/deep");
    assert!(!mnt.join("z/z/z/z/deep").exists());
    assert!(!mnt.join("z").exists(), "folders that only held the object go");
    c.delete_object().bucket("main").key("z/never").send().await.expect("deleting nothing succeeds");

    // A checkpoint of the branch is a read-only bucket.
    let out = arbor_env_ok(&["checkpoints", "create", mnt.to_str().expect("utf8"), "step-9000"], env);
    assert!(out.contains("step-9000"), "{out}");
    let buckets = c.list_buckets().send().await.expect("list buckets");
    let names: Vec<&str> = buckets.buckets().iter().filter_map(|b| b.name()).collect();
    assert_eq!(names, ["main", "main--step-9000"]);
    let cp = "main--step-9000";
    let got = c.get_object().bucket(cp).key("data/big.bin").send().await.expect("get from the checkpoint");
    assert_eq!(got.body.collect().await.expect("body").into_bytes()[..], big[..]);
    assert_eq!(
        list_all(&c, cp, "", None, 1000).await.len(),
        all.len() + 2,
        "every key, the marker and the mount's file"
    );
    let denied = c.put_object().bucket(cp).key("x").body(ByteStream::from_static(b"x")).send().await;
    let (status, code) = failure(denied.expect_err("read-only"));
    assert_eq!((status, code.as_str()), (403, "AccessDenied"));
    let denied = c.delete_object().bucket(cp).key("data/big.bin").send().await;
    assert_eq!(failure(denied.expect_err("read-only")).1, "AccessDenied");
    assert_eq!(failure(c.head_bucket().bucket("main--nope").send().await.expect_err("no checkpoint")).0, 404);
    assert_eq!(failure(c.head_bucket().bucket("other--step-9000").send().await.expect_err("another branch")).0, 404);

    m.unmount_env(env);
    e.serve.stop();
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

#[test]
fn a_local_folder_disk_served_as_s3() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    runtime().block_on(exercise(s.disk_str(), s.dir.path(), &[], 2500));
}

#[test]
fn an_s3_disk_served_as_s3() {
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{}/disks/served", arbor_engine::testkit::S3_BUCKET);
    arbor_env_ok(&["init", &disk], &w.env);
    runtime().block_on(exercise(&disk, w.dir.path(), &w.env, 1200));
}

/// Whether boto3 and the AWS CLI are here; in CI they must be.
fn python_s3_clients() -> bool {
    let boto3 = std::process::Command::new("python3").args(["-c", "import boto3"]).status().is_ok_and(|s| s.success());
    let cli = std::process::Command::new("aws").arg("--version").output().is_ok_and(|o| o.status.success());
    if !(boto3 && cli) {
        if std::env::var_os("CI").is_some() {
            panic!("boto3 and the AWS CLI must be installed in CI");
        }
        eprintln!("SKIPPED: boto3 or the AWS CLI is not installed");
    }
    boto3 && cli
}

#[test]
fn boto3_with_checksum_trailers_and_aws_s3_sync() {
    if !python_s3_clients() || !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
    let work = s.dir.path().join("py");
    let mnt = s.dir.path().join("mnt");
    std::fs::create_dir_all(&work).expect("mkdir");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let m = Mount::start(s.disk_str(), &mnt, &["--token-file", &e.token]);
    let out = python("s3_endpoint.py", &[&e.s3, AK, SK, work.to_str().expect("utf8"), mnt.to_str().expect("utf8")]);
    let said = String::from_utf8_lossy(&out.stdout);
    println!("{said}");
    assert!(
        out.status.success() && said.contains("all checks passed"),
        "{said}\n{}\nlog: {}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&e.serve.log).unwrap_or_default()
    );
    m.unmount();
    e.serve.stop();
}

/// The Python that has torch, fsspec's s3fs and MosaicML Streaming (a
/// virtual environment of their own: torch's and s3fs's pins must not
/// meet the system's boto3): `ARBOR_ML_PYTHON`, or the one `.ci/run`
/// makes. In CI it must be there.
fn ml_python() -> Option<String> {
    let py = std::env::var("ARBOR_ML_PYTHON").unwrap_or_else(|_| "/var/tmp/arbor-ml-venv/bin/python".into());
    let ok = std::process::Command::new(&py)
        .args(["-c", "import torch, s3fs, streaming"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        if std::env::var_os("CI").is_some() {
            panic!("{py} must have torch, s3fs and mosaicml-streaming in CI");
        }
        eprintln!("SKIPPED: {py} lacks torch, s3fs or mosaicml-streaming");
    }
    ok.then_some(py)
}

/// MosaicML Streaming's `MDSWriter` and torch distributed checkpoint's
/// writer (fsspec's s3fs) upload through the endpoint; `StreamingDataset`
/// and `torch.distributed.checkpoint.load` read the results in place on a
/// FUSE mount of the same branch, through the same owner.
#[test]
fn mds_writer_and_torch_dcp_write_through_s3_and_read_on_a_mount() {
    let Some(py) = ml_python() else { return };
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
    let mnt = s.dir.path().join("mnt");
    let work = s.dir.path().join("py");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    std::fs::create_dir_all(&work).expect("mkdir");
    let m = Mount::start(s.disk_str(), &mnt, &["--token-file", &e.token]);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/ml_s3_writers.py");
    let out = std::process::Command::new(&py)
        .arg(script)
        .args([&e.s3, AK, SK, mnt.to_str().expect("utf8"), work.to_str().expect("utf8")])
        .env("TMPDIR", &work)
        .output()
        .expect("python");
    let said = String::from_utf8_lossy(&out.stdout);
    println!("{said}");
    assert!(
        out.status.success() && said.contains("all checks passed"),
        "{said}\n{}\nlog: {}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&e.serve.log).unwrap_or_default()
    );
    m.unmount();
    e.serve.stop();
    let fsck = arbor(&["fsck", s.disk_str()]);
    assert!(fsck.status.success(), "fsck: {}", String::from_utf8_lossy(&fsck.stdout));
}

/// Whether `key` is absent, or whole with exactly `want`: never part of it.
async fn absent_or_whole(c: &Client, key: &str, want: &[u8]) -> bool {
    match c.get_object().bucket("main").key(key).send().await {
        Ok(r) => {
            let got = r.body.collect().await.expect("body").into_bytes();
            assert!(got[..] == want[..], "{key}: {} bytes, not the {} put", got.len(), want.len());
            true
        }
        Err(e) => {
            assert_eq!(failure(e).0, 404, "{key}");
            false
        }
    }
}

#[test]
fn a_server_killed_mid_upload_leaves_no_partial_object() {
    let s = Scratch::new();
    let mut e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
    let rt = runtime();
    let c = client(&e.s3, AK, SK);
    let part = |n: u32| pattern(5 << 20, n);

    // Two parts in, killed before the upload completes: no object, and
    // the upload is still there after the restart.
    let id = rt.block_on(async {
        let up = c.create_multipart_upload().bucket("main").key("ckpt/a.bin").send().await.expect("create");
        let id = up.upload_id().expect("id").to_string();
        upload_part(&c, "ckpt/a.bin", &id, 1, &part(1)).await;
        upload_part(&c, "ckpt/a.bin", &id, 2, &part(2)).await;
        id
    });
    e.serve.kill9_and_restart();
    rt.block_on(async {
        assert!(!absent_or_whole(&c, "ckpt/a.bin", b"").await, "no object before its upload completes");
        let ups = c.list_multipart_uploads().bucket("main").send().await.expect("uploads");
        assert_eq!(ups.uploads().iter().filter_map(|u| u.upload_id()).collect::<Vec<_>>(), [id.as_str()]);
        let parts = c.list_parts().bucket("main").key("ckpt/a.bin").upload_id(&id).send().await.expect("parts");
        assert_eq!(parts.parts().len(), 2, "acknowledged parts survive a kill -9");
    });

    // Killed while completing a large upload, and while a PUT's body is
    // arriving: each key is absent or whole.
    let whole: Vec<u8> = (1..=8).flat_map(part).collect();
    let big_put = pattern(48 << 20, 99);
    let (etags, id) = rt.block_on(async {
        let up = c.create_multipart_upload().bucket("main").key("ckpt/b.bin").send().await.expect("create");
        let id = up.upload_id().expect("id").to_string();
        let mut etags = Vec::new();
        for n in 1..=8 {
            etags.push(upload_part(&c, "ckpt/b.bin", &id, n as i32, &part(n)).await);
        }
        (etags, id)
    });
    let parts: Vec<(i32, &str)> = etags.iter().enumerate().map(|(i, e)| (i as i32 + 1, e.as_str())).collect();
    let complete = {
        let c = client_once(&e.s3);
        let done = completed(&parts);
        let id = id.clone();
        rt.spawn(async move {
            c.complete_multipart_upload()
                .bucket("main")
                .key("ckpt/b.bin")
                .upload_id(id)
                .multipart_upload(done)
                .send()
                .await
        })
    };
    let put = {
        let c = client_once(&e.s3);
        let body = big_put.clone();
        rt.spawn(
            async move { c.put_object().bucket("main").key("ckpt/c.bin").body(ByteStream::from(body)).send().await },
        )
    };
    std::thread::sleep(std::time::Duration::from_millis(150));
    e.serve.kill9_and_restart();
    let (completed_before, _) = rt.block_on(async { (complete.await.expect("join"), put.await.expect("join")) });
    rt.block_on(async {
        let b = absent_or_whole(&c, "ckpt/b.bin", &whole).await;
        let c_done = absent_or_whole(&c, "ckpt/c.bin", &big_put).await;
        println!(
            "after the kill: the completed upload is {}, the PUT {}",
            if b { "there" } else { "absent" },
            if c_done { "there" } else { "absent" }
        );
        if !b {
            // Not completed: its parts are all there, and it completes now.
            assert!(completed_before.is_err(), "an upload answered 200 is there after a kill -9");
            let done = c.complete_multipart_upload().bucket("main").key("ckpt/b.bin").upload_id(&id);
            done.multipart_upload(completed(&parts)).send().await.expect("complete after the restart");
            assert!(absent_or_whole(&c, "ckpt/b.bin", &whole).await);
        }
    });

    // Nothing half-written is left in the hidden folder either.
    if fuse_available() {
        let mnt = s.dir.path().join("mnt-after");
        std::fs::create_dir_all(&mnt).expect("mkdir");
        let m = Mount::start(s.disk_str(), &mnt, &["--token-file", &e.token]);
        let tmp = mnt.join(".arbor-s3/tmp");
        let left: Vec<_> =
            std::fs::read_dir(&tmp).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
        assert!(left.is_empty(), "temporary files left: {left:?}");
        assert_eq!(std::fs::read(mnt.join("ckpt/b.bin")).expect("read")[..], whole[..]);
        m.unmount();
    }
    e.serve.stop();
    // And the disk the kills left is whole.
    let fsck = arbor(&["fsck", s.disk_str()]);
    assert!(fsck.status.success(), "fsck after the kills: {}", String::from_utf8_lossy(&fsck.stdout));
}

/// A copy within a bucket and a completed multipart upload share their
/// bytes' extents instead of writing the bytes again: the disk grows by
/// a few records, not by the object.
#[test]
fn copies_and_completed_uploads_share_bytes_instead_of_writing_them() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    runtime().block_on(async {
        let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
        let c = client(&e.s3, AK, SK);
        let body = pattern(24 << 20, 7);
        c.put_object().bucket("main").key("src/big.bin").body(body.clone().into()).send().await.expect("put");
        let before = folder_bytes(Path::new(s.disk_str()));
        let copy = c.copy_object().bucket("main").key("dst/copy.bin").copy_source("main/src/big.bin");
        let etag = copy.send().await.expect("copy").copy_object_result().and_then(|r| r.e_tag()).map(str::to_string);
        let grown = folder_bytes(Path::new(s.disk_str())) - before;
        assert!(grown < 4 << 20, "a copy of 24 MiB grew the disk by {grown} bytes");
        assert_eq!(etag, Some(format!("\"{}\"", md5_hex(&body))));
        // A ranged part copy reads its range for the part's MD5, and
        // shares the bytes too.
        let got = c.get_object().bucket("main").key("dst/copy.bin").send().await.expect("get");
        assert_eq!(got.body.collect().await.expect("body").into_bytes().as_ref(), &body[..]);

        let key = "mp/joined.bin";
        let up = c.create_multipart_upload().bucket("main").key(key).send().await.expect("create");
        let id = up.upload_id().expect("id").to_string();
        let (p1, p2) = (pattern(8 << 20, 8), pattern((6 << 20) + 5, 9));
        let e1 = upload_part(&c, key, &id, 1, &p1).await;
        let e2 = upload_part(&c, key, &id, 2, &p2).await;
        let before = folder_bytes(Path::new(s.disk_str()));
        let done = c.complete_multipart_upload().bucket("main").key(key).upload_id(&id);
        done.multipart_upload(completed(&[(1, &e1), (2, &e2)])).send().await.expect("complete");
        let grown = folder_bytes(Path::new(s.disk_str())).saturating_sub(before);
        assert!(grown < 4 << 20, "joining 14 MiB of parts grew the disk by {grown} bytes");
        let got = c.get_object().bucket("main").key(key).send().await.expect("get");
        let joined = got.body.collect().await.expect("body").into_bytes();
        assert_eq!(joined.len(), p1.len() + p2.len());
        assert!(joined[..p1.len()] == p1[..] && joined[p1.len()..] == p2[..], "the joined object differs");
        drop(e);
    });
}

/// A browser form upload (POST of multipart/form-data, signed or not)
/// is answered 501 before its body is read: s3s would otherwise hold
/// the form's file in memory before checking who sent it.
#[test]
fn form_uploads_are_refused_before_their_bodies_are_read() {
    use std::io::{Read, Write};
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
    let addr = e.s3.trim_start_matches("http://").to_string();
    let mut sock = std::net::TcpStream::connect(&addr).expect("connect");
    sock.set_read_timeout(Some(std::time::Duration::from_secs(10))).expect("timeout");
    let b = "arbor-form-boundary";
    let head = format!(
        "POST /main HTTP/1.1\r\nHost: {addr}\r\nContent-Type: multipart/form-data; boundary={b}\r\n\
         Content-Length: {}\r\n\r\n--{b}\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nposted\r\n\
         --{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n",
        64 << 20
    );
    sock.write_all(head.as_bytes()).expect("send the head");
    sock.write_all(&[7u8; 64 << 10]).expect("send some of the file");
    // The answer comes while almost all of the 64 MiB is unsent.
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = sock.read(&mut buf).expect("an answer before the body is sent");
        assert!(n > 0, "closed without an answer: {}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&buf[..n]);
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 501"), "{answer}");
    drop(sock);
    runtime().block_on(async {
        let c = client(&e.s3, AK, SK);
        let err = c.head_object().bucket("main").key("posted").send().await.expect_err("no object");
        assert_eq!(failure(err).0, 404);
    });
}

/// No byte range of an empty object is satisfiable: a suffix range of
/// one (`bytes=-1`) is 416 as `bytes=0-` is, on a GET and a HEAD, of an
/// empty file and of a folder marker.
#[test]
fn ranges_of_empty_objects_are_unsatisfiable() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    runtime().block_on(async {
        let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
        let c = client(&e.s3, AK, SK);
        c.put_object().bucket("main").key("empty").body(Vec::new().into()).send().await.expect("put empty");
        c.put_object().bucket("main").key("dir/").body(Vec::new().into()).send().await.expect("put folder");
        for key in ["empty", "dir/"] {
            for range in ["bytes=-1", "bytes=-100", "bytes=0-"] {
                let got = c.get_object().bucket("main").key(key).range(range).send().await;
                assert_eq!(failure(got.expect_err("get")), (416, "InvalidRange".into()), "GET {key} {range}");
                let got = c.head_object().bucket("main").key(key).range(range).send().await;
                assert_eq!(failure(got.expect_err("head")).0, 416, "HEAD {key} {range}");
            }
            let whole = c.get_object().bucket("main").key(key).send().await.expect("get whole");
            assert_eq!(whole.content_length(), Some(0));
        }
        let got = c.get_object().bucket("main").key("empty").range("bytes=-1").send().await;
        assert!(got.is_err());
        c.put_object().bucket("main").key("one").body(b"x".to_vec().into()).send().await.expect("put");
        let got = c.get_object().bucket("main").key("one").range("bytes=-5").send().await.expect("suffix");
        assert_eq!(got.content_range(), Some("bytes 0-0/1"));
    });
}

/// A client that sends half a request head is disconnected once the
/// head-read timeout (30 s) passes, instead of holding a connection and
/// a task forever.
#[test]
fn a_connection_sending_half_a_head_is_closed() {
    use std::io::{Read, Write};
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
    let addr = e.s3.trim_start_matches("http://").to_string();
    let mut sock = std::net::TcpStream::connect(&addr).expect("connect");
    sock.write_all(format!("GET /main HTTP/1.1\r\nHost: {addr}\r\nX-Half: ").as_bytes()).expect("send half a head");
    let started = std::time::Instant::now();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(60))).expect("timeout");
    let mut buf = [0u8; 1024];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("still open after {:?}: {e}", started.elapsed()),
        }
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(45), "closed after {:?}", started.elapsed());
}

/// Requests racing on one key or folder, in bounded rounds: a folder
/// marker PUT racing a DELETE that prunes its folder stays once
/// acknowledged; a PUT under a folder being pruned and a listing while
/// folders are pruned never answer 404.
#[test]
fn requests_racing_on_one_namespace() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    runtime().block_on(async {
        let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
        let c = client(&e.s3, AK, SK);
        let put = |key: &str, body: Vec<u8>| c.put_object().bucket("main").key(key).body(body.into()).send();
        let del = |key: &str| c.delete_object().bucket("main").key(key).send();
        for round in 0..100 {
            put("race/b", b"x".to_vec()).await.expect("put race/b");
            let (d, p) = tokio::join!(del("race/b"), put("race/", Vec::new()));
            d.expect("delete race/b");
            p.expect("put race/");
            let marker = c.head_object().bucket("main").key("race/").send().await;
            assert!(marker.is_ok(), "round {round}: the acknowledged marker race/ is gone: {marker:?}");
            del("race/").await.expect("delete race/");

            put("p/x", b"x".to_vec()).await.expect("put p/x");
            let (d, p) = tokio::join!(del("p/x"), put("p/y", b"y".to_vec()));
            d.expect("delete p/x");
            assert!(p.is_ok(), "round {round}: a PUT under a folder being pruned failed: {p:?}");
            del("p/y").await.expect("delete p/y");
        }

        for i in 0..60 {
            put(&format!("l/k{i:02}/o"), b"o".to_vec()).await.expect("put");
        }
        let deleting = async {
            for i in 0..60 {
                del(&format!("l/k{i:02}/o")).await.expect("delete");
            }
        };
        let listing = async {
            for _ in 0..60 {
                let l = c.list_objects_v2().bucket("main").prefix("l/").send().await;
                assert!(l.is_ok(), "a listing while folders are pruned failed: {l:?}");
            }
        };
        tokio::join!(deleting, listing);
    });
}

/// Conditional writes racing: of two uploads completed at once onto an
/// absent key with If-None-Match: *, one succeeds and the other is 412;
/// of two PUTs with the same If-Match, one is 412.
#[test]
fn racing_conditional_writes_are_atomic() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    runtime().block_on(async {
        let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
        let c = client(&e.s3, AK, SK);
        for round in 0..20 {
            let key = format!("cond/k{round}");
            let mut done = Vec::new();
            for n in 0..2u32 {
                let up = c.create_multipart_upload().bucket("main").key(&key).send().await.expect("create");
                let id = up.upload_id().expect("id").to_string();
                let etag = upload_part(&c, &key, &id, 1, &pattern(1000, n)).await;
                done.push((id, etag));
            }
            let complete = |(id, etag): &(String, String)| {
                let r = c.complete_multipart_upload().bucket("main").key(&key).upload_id(id);
                r.multipart_upload(completed(&[(1, etag)])).if_none_match("*").send()
            };
            let (x, y) = tokio::join!(complete(&done[0]), complete(&done[1]));
            let failed: Vec<u16> =
                [x.err().map(|e| failure(e).0), y.err().map(|e| failure(e).0)].into_iter().flatten().collect();
            assert_eq!(failed, [412], "round {round}: both or neither completed");

            let base = c.put_object().bucket("main").key(&key).body(b"base".to_vec().into()).send().await;
            let etag = base.expect("put base").e_tag().expect("etag").to_string();
            let put = |body: &'static [u8]| {
                c.put_object().bucket("main").key(&key).if_match(&etag).body(body.to_vec().into()).send()
            };
            let (x, y) = tokio::join!(put(b"one"), put(b"two"));
            let failed: Vec<u16> =
                [x.err().map(|e| failure(e).0), y.err().map(|e| failure(e).0)].into_iter().flatten().collect();
            assert_eq!(failed, [412], "round {round}: both or neither If-Match PUT placed");
        }
        let missing = c.put_object().bucket("main").key("cond/none").if_match("\"abc\"").body(b"x".to_vec().into());
        assert_eq!(failure(missing.send().await.expect_err("no key")), (404, "NoSuchKey".into()));
    });
}

/// ListObjects (V1) with the prefix itself as the marker lists what is
/// under the prefix: a marker is taken as a common prefix (everything
/// under it skipped) only if the listing could have given it as one.
#[test]
fn a_v1_marker_equal_to_the_prefix_skips_nothing() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    runtime().block_on(async {
        let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
        let c = client(&e.s3, AK, SK);
        for key in ["a/", "a/x", "a/y/z"] {
            c.put_object().bucket("main").key(key).body(Vec::new().into()).send().await.expect("put");
        }
        let page = c.list_objects().bucket("main").prefix("a/").delimiter("/").max_keys(1).send().await;
        let page = page.expect("page 1");
        let keys: Vec<&str> = page.contents().iter().filter_map(|o| o.key()).collect();
        assert_eq!(keys, ["a/"]);
        let marker = page.next_marker().expect("a next marker").to_string();
        let page = c.list_objects().bucket("main").prefix("a/").delimiter("/").marker(&marker).send().await;
        let page = page.expect("page 2");
        let keys: Vec<&str> = page.contents().iter().filter_map(|o| o.key()).collect();
        let prefixes: Vec<&str> = page.common_prefixes().iter().filter_map(|p| p.prefix()).collect();
        assert_eq!((keys, prefixes), (vec!["a/x"], vec!["a/y/"]));
    });
}

/// A checkpoint's bucket follows the checkpoint: deleted, it is
/// NoSuchBucket; made again under the same name, it serves the new
/// checkpoint's objects, not the old tree the server had open.
#[test]
fn a_checkpoint_bucket_follows_its_checkpoint() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
    let mnt = s.dir.path().join("mnt");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let m = Mount::start(s.disk_str(), &mnt, &["--token-file", &e.token]);
    let at = mnt.to_str().expect("utf8");
    runtime().block_on(async {
        let c = client(&e.s3, AK, SK);
        let put = |body: &'static [u8]| c.put_object().bucket("main").key("k").body(body.to_vec().into()).send();
        let get = || async {
            let got = c.get_object().bucket("main--cp").key("k").send().await;
            got.expect("get from the checkpoint").body.collect().await.expect("body").into_bytes().to_vec()
        };
        put(b"first").await.expect("put");
        arbor_ok(&["checkpoints", "create", at, "cp"]);
        assert_eq!(get().await, b"first");
        arbor_ok(&["checkpoints", "delete", at, "cp"]);
        let gone = c.get_object().bucket("main--cp").key("k").send().await.expect_err("deleted");
        assert_eq!(failure(gone), (404, "NoSuchBucket".into()));
        put(b"second").await.expect("put");
        arbor_ok(&["checkpoints", "create", at, "cp"]);
        assert_eq!(get().await, b"second");
    });
    m.unmount();
    e.serve.stop();
}

/// As S3: a copy of an object onto itself that keeps its metadata is
/// 400 InvalidRequest; a GET or HEAD by partNumber is refused (501), not
/// answered with the whole object.
#[test]
fn self_copies_without_new_metadata_and_part_gets_are_refused() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    runtime().block_on(async {
        let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
        let c = client(&e.s3, AK, SK);
        c.put_object().bucket("main").key("k").body(b"bytes".to_vec().into()).send().await.expect("put");
        let copy = c.copy_object().bucket("main").key("k").copy_source("main/k").send().await;
        assert_eq!(failure(copy.expect_err("onto itself")), (400, "InvalidRequest".into()));
        let got = c.get_object().bucket("main").key("k").part_number(1).send().await;
        assert_eq!(failure(got.expect_err("by part")), (501, "NotImplemented".into()));
        let got = c.head_object().bucket("main").key("k").part_number(1).send().await;
        assert_eq!(failure(got.expect_err("by part")).0, 501);
    });
}

/// A DeleteObjects of more than 1000 keys is refused (MalformedXML, as
/// S3) and deletes nothing; one of 1000 deletes them all.
#[test]
fn delete_objects_names_at_most_1000_keys() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    runtime().block_on(async {
        let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
        let c = client(&e.s3, AK, SK);
        c.put_object().bucket("main").key("d/0").body(b"x".to_vec().into()).send().await.expect("put");
        let ids = |n: usize| {
            let objects = (0..n)
                .map(|i| aws_sdk_s3::types::ObjectIdentifier::builder().key(format!("d/{i}")).build().expect("id"));
            aws_sdk_s3::types::Delete::builder().set_objects(Some(objects.collect())).build().expect("delete")
        };
        let many = c.delete_objects().bucket("main").delete(ids(1001)).send().await;
        assert_eq!(failure(many.expect_err("1001 keys")), (400, "MalformedXML".into()));
        c.head_object().bucket("main").key("d/0").send().await.expect("still there");
        let done = c.delete_objects().bucket("main").delete(ids(1000)).send().await.expect("1000 keys");
        assert_eq!(done.deleted().len(), 1000);
        let gone = c.head_object().bucket("main").key("d/0").send().await;
        assert_eq!(failure(gone.expect_err("deleted")).0, 404);
    });
}

/// A GET or HEAD racing PUTs that overwrite its key never answers 404,
/// and a GET streams one whole version: the file it opened stays
/// readable after a rename replaces it, until the GET releases it (the
/// engine must keep a replaced file that is open, as it keeps an
/// unlinked one).
#[test]
fn a_get_while_its_key_is_overwritten_gives_one_whole_version() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    runtime().block_on(async {
        let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
        let c = client(&e.s3, AK, SK);
        let put = |key: &str, body: Vec<u8>| c.put_object().bucket("main").key(key).body(body.into()).send();
        let (a, b) = (pattern(300 << 10, 1), pattern(300 << 10, 2));
        put("ow", a.clone()).await.expect("put ow");
        let writing = async {
            for i in 0..60 {
                put("ow", if i % 2 == 0 { b.clone() } else { a.clone() }).await.expect("overwrite");
            }
        };
        let reading = async {
            for _ in 0..60 {
                let got = c.get_object().bucket("main").key("ow").send().await;
                let got = got.unwrap_or_else(|e| panic!("a GET of a key being overwritten failed: {e:?}"));
                let bytes = got.body.collect().await.expect("body").into_bytes();
                assert!(bytes[..] == a[..] || bytes[..] == b[..], "a GET gave neither version");
                let head = c.head_object().bucket("main").key("ow").send().await.expect("head");
                let etag = head.e_tag().unwrap_or("").trim_matches('"').to_string();
                assert!(etag == md5_hex(&a) || etag == md5_hex(&b), "HEAD gave ETag {etag}");
            }
        };
        tokio::join!(writing, reading);
    });
}

/// A PUT whose body stops arriving is answered 400 RequestTimeout once
/// it has paused 60 s, instead of holding its connection and temporary
/// file for as long as the client keeps the socket; nothing is placed.
#[test]
fn a_put_whose_body_stalls_times_out() {
    use std::io::{Read, Write};
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let e = start_endpoint(s.disk_str(), s.dir.path(), &[]);
    let c = client(&e.s3, AK, SK);
    let conf = aws_sdk_s3::presigning::PresigningConfig::expires_in(std::time::Duration::from_secs(600)).expect("conf");
    let url = runtime()
        .block_on(c.put_object().bucket("main").key("stalled").presigned(conf))
        .expect("presign")
        .uri()
        .to_string();
    let path = url.strip_prefix(&e.s3).expect("a URL of the endpoint");
    let addr = e.s3.trim_start_matches("http://").to_string();
    let mut sock = std::net::TcpStream::connect(&addr).expect("connect");
    let head = format!("PUT {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 100\r\n\r\n0123456789");
    sock.write_all(head.as_bytes()).expect("send");
    let started = std::time::Instant::now();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(120))).expect("timeout");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = sock.read(&mut buf).unwrap_or_else(|e| panic!("no answer after {:?}: {e}", started.elapsed()));
        assert!(n > 0, "closed without an answer");
        answer.extend_from_slice(&buf[..n]);
    }
    let answer = String::from_utf8_lossy(&answer).to_string();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let waited = started.elapsed();
    assert!((50..90).contains(&waited.as_secs()), "answered after {waited:?}: {answer}");
    runtime().block_on(async {
        let gone = c.head_object().bucket("main").key("stalled").send().await;
        assert_eq!(failure(gone.expect_err("nothing placed")).0, 404);
    });
}
