//! `arbor warm`: a checkpoint's files read through the cache servers
//! ahead of the jobs that need them.

use anyhow::{bail, Context, Result};
use arbor_node::cache_client::{check_servers, client, ClientAuth};
use arbor_node::disk;
use std::sync::Arc;

/// Says on stderr which cache servers do not answer or refuse the token:
/// their chunks come from the bucket until they do.
pub fn warn_about_servers(problems: &[String]) {
    for p in problems {
        eprintln!("warning: cache server {p}; the chunks it owns come from the bucket until it answers");
    }
}

/// `arbor warm`: reads `paths` of checkpoint `checkpoint` through the cache
/// servers, so that each chunk is fetched from the bucket by its owner
/// before a job needs it. Needs no mount; keeps nothing on this node (its
/// own cache is a small one in memory).
pub fn warm(disk_arg: &str, checkpoint: &str, paths: &[String], servers: &[String], auth: &ClientAuth) -> Result<()> {
    use arbor_engine::volume::FileKind;
    use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
    let Some(client) = client(servers, auth)? else {
        bail!("arbor warm needs --cache-server HOST:PORT,… (or ARBOR_CACHE_SERVERS)");
    };
    match check_servers(&client) {
        (0, problems) => bail!("nothing to warm: no cache server answered: {}", problems.join("; ")),
        (_, problems) => warn_about_servers(&problems),
    }
    let cache = disk::CacheOptions {
        size: 256 << 20,
        memory: true,
        peers: Some(client.clone() as Arc<dyn arbor_engine::chunks::ChunkSource>),
        ..disk::CacheOptions::default()
    };
    let d = disk::open_with_cache(disk_arg, cache)?;
    if !d.is_s3() {
        bail!("{} is a local folder: there is no bucket to warm a cache from", d.url);
    }
    let cfg = arbor_engine::Config {
        source_servers: Some(client.clone() as Arc<dyn arbor_engine::chunks::ChunkSource>),
        ..disk::quiet_config()
    };
    let vol = d.catalog()?.open_checkpoint(checkpoint, cfg)?;
    let mut files: Vec<(String, u64, u64)> = Vec::new();
    let mut stack: Vec<(String, u64)> = Vec::new();
    for p in paths {
        let ino = vol.lookup_path(p).with_context(|| format!("{p}: not in checkpoint {checkpoint}"))?.ino;
        stack.push((p.clone(), ino));
    }
    // Bounded by the checkpoint's own tree: every inode is visited once per path.
    while let Some((path, ino)) = stack.pop() {
        let attr = vol.getattr(ino)?;
        match attr.kind {
            FileKind::Regular => files.push((path, ino, attr.size)),
            FileKind::Directory => {
                let mut entries = Vec::new();
                vol.readdir(ino, 0, |e| {
                    if e.name != b"." && e.name != b".." {
                        entries.push(e);
                    }
                    true
                })?;
                for e in entries {
                    stack.push((format!("{path}/{}", String::from_utf8_lossy(&e.name)), e.ino));
                }
            }
            _ => {}
        }
    }
    let total: u64 = files.iter().map(|f| f.2).sum();
    let bar = ProgressBar::new(total)
        .with_style(ProgressStyle::with_template("warm {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")?);
    for (path, ino, size) in &files {
        let mut off = 0;
        while off < *size {
            let n = vol.read(*ino, off, 4 << 20).with_context(|| format!("cannot read {path}"))?.len() as u64;
            if n == 0 {
                break;
            }
            off += n;
            bar.inc(n);
        }
    }
    bar.finish_and_clear();
    let stats = client.stats();
    // `chunks` counts every answer; parts (small reads, such as the
    // tree's blocks) are told apart from whole chunks.
    let (given, parts, hits) = stats.iter().fold((0, 0, 0), |a, s| (a.0 + s.chunks, a.1 + s.parts, a.2 + s.hits));
    // What a server should have taken and did not: its share is not warm.
    // (A server saying it has no such segment is no failure: opening a
    // checkpoint looks for the segment after its last one.)
    let failed = |s: &arbor_net::cache::client::ServerStats| {
        s.fallback_down + s.fallback_timeout + s.fallback_error + s.rejected
    };
    let fallbacks: u64 = stats.iter().map(failed).sum();
    if given == 0 && fallbacks > 0 {
        bail!(
            "nothing was warmed: {}",
            stats.iter().map(|s| format!("{} {}", s.addr, failure_reasons(s))).collect::<Vec<_>>().join("; ")
        );
    }
    for s in stats.iter().filter(|s| failed(s) > 0) {
        eprintln!("warning: cache server {}: {} chunks not warmed ({})", s.addr, failed(s), failure_reasons(s));
    }
    let through = match stats.len() {
        1 => "1 server".to_string(),
        n => format!("{n} servers"),
    };
    println!(
        "warmed {} files, {} of checkpoint {checkpoint} through {through}: {} chunks and {parts} parts of chunks ({hits} already cached there), {fallbacks} read from the bucket instead",
        files.len(),
        HumanBytes(total),
        given - parts,
    );
    Ok(())
}

/// Why a cache server's chunks came from the bucket: "3 down, 1 timed out".
fn failure_reasons(s: &arbor_net::cache::client::ServerStats) -> String {
    let reasons = [
        (s.fallback_down, "down (not answering)"),
        (s.fallback_timeout, "timed out"),
        (s.fallback_error, "errors"),
        (s.rejected, "rejected (bad checksum)"),
    ];
    let said: Vec<String> = reasons.iter().filter(|(n, _)| *n > 0).map(|(n, why)| format!("{n} {why}")).collect();
    if said.is_empty() {
        "answered".into()
    } else {
        said.join(", ")
    }
}
