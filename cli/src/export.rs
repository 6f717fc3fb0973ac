//! `arbor export`: every regular file of a branch or checkpoint becomes one
//! plain object under an S3 prefix (multipart for large ones, streamed:
//! no file is held whole in memory), so any tool can read what the team
//! wrote.
//!
//! A manifest in the disk's own store (`exports/<hash of the destination>`)
//! records what each exported path was (size, mtime, ctime, inode). A run
//! uploads only paths that differ from it and deletes the objects of paths
//! it lists that are gone, so a second run uploads nothing, and a run
//! killed midway continues where its last saved manifest ends (it is saved
//! every few files). `--since CHECKPOINT` asks the tree diff for what
//! changed instead of walking every file.

use anyhow::{anyhow, bail, Context, Result};
use arbor_engine::bucket::ObjectStore;
use arbor_engine::volume::{ChangeKind, FileKind, Volume, ROOT_INO};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Files uploaded at once.
const FILES_AT_ONCE: usize = 4;

/// What a path was when it was exported: size, mtime (s, ns), ctime (s, ns), inode.
type Stamp = (u64, i64, u32, i64, u32, u64);

/// The exported state of one destination.
#[derive(Default)]
pub struct Manifest {
    pub files: BTreeMap<String, Stamp>,
}

impl Manifest {
    pub fn key(dest: &str) -> String {
        format!("exports/{:08x}", arbor_engine::crc::crc32c(dest.as_bytes()))
    }

    pub fn load(store: &dyn ObjectStore, dest: &str) -> Result<Manifest> {
        let body = match store.get(&Self::key(dest)) {
            Ok((b, _)) => b,
            Err(arbor_engine::Error::NoSuchObject(_)) => return Ok(Manifest::default()),
            Err(e) => return Err(e.into()),
        };
        let v: Value = serde_json::from_slice(&body).context("the export manifest is not JSON")?;
        if v["dest"].as_str() != Some(dest) {
            // Another destination with the same hash: start afresh.
            return Ok(Manifest::default());
        }
        let mut files = BTreeMap::new();
        for (path, s) in v["files"].as_object().into_iter().flatten() {
            let n = |i: usize| s[i].as_i64().unwrap_or(-1);
            files.insert(path.clone(), (n(0) as u64, n(1), n(2) as u32, n(3), n(4) as u32, n(5) as u64));
        }
        Ok(Manifest { files })
    }

    pub fn save(&self, store: &dyn ObjectStore, dest: &str) -> Result<()> {
        let files: serde_json::Map<String, Value> =
            self.files.iter().map(|(p, s)| (p.clone(), json!([s.0, s.1, s.2, s.3, s.4, s.5]))).collect();
        let body = serde_json::to_vec(&json!({"dest": dest, "files": files}))?;
        store.put(&Self::key(dest), &body)?;
        Ok(())
    }
}

/// What an export did.
#[derive(Debug, Default)]
pub struct Report {
    pub uploaded: u64,
    pub bytes: u64,
    pub deleted: u64,
    pub unchanged: u64,
    /// Symlinks, devices, FIFOs and sockets, which have no object form.
    pub skipped: u64,
}

/// Every regular file of `vol` (path without the leading `/`, inode),
/// and how many other non-directories there are.
fn walk(vol: &Volume) -> Result<(Vec<(String, u64)>, u64)> {
    let (mut files, mut other) = (Vec::new(), 0);
    let mut stack = vec![(ROOT_INO, String::new())];
    while let Some((dir, path)) = stack.pop() {
        for e in vol.list_dir(dir)? {
            let name = String::from_utf8(e.name.clone())
                .map_err(|_| anyhow!("{path}{}: not UTF-8, which no object key can be", e.name.escape_ascii()))?;
            match e.kind {
                FileKind::Directory => stack.push((e.ino, format!("{path}{name}/"))),
                FileKind::Regular => files.push((format!("{path}{name}"), e.ino)),
                _ => other += 1,
            }
        }
    }
    files.sort();
    Ok((files, other))
}

fn stamp(vol: &Volume, ino: u64) -> Result<Stamp> {
    let a = vol.getattr(ino)?;
    Ok((a.size, a.mtime.secs, a.mtime.nanos, a.ctime.secs, a.ctime.nanos, ino))
}

/// Uploads one file, streamed in the store's parts.
fn upload(vol: &Volume, ino: u64, size: u64, dest: &dyn ObjectStore, key: &str) -> Result<()> {
    dest.put_from(key, size, &mut |off, buf| {
        let mut done = 0;
        while done < buf.len() {
            let got = vol.read(ino, off + done as u64, buf.len() - done)?;
            if got.is_empty() {
                return Err(arbor_engine::Error::Invalid("file shorter than its size"));
            }
            buf[done..done + got.len()].copy_from_slice(&got);
            done += got.len();
        }
        Ok(())
    })?;
    Ok(())
}

/// Exports `vol` to `dest` (whose keys are paths inside the tree),
/// keeping `manifest` (saved to `disk` as it goes). `changed`: the paths a
/// diff says changed (`--since`), else every file is compared.
pub fn run(
    vol: &Volume,
    dest: &dyn ObjectStore,
    disk: &Arc<dyn ObjectStore>,
    dest_url: &str,
    changed: Option<Vec<(String, ChangeKind)>>,
    progress: &mut (dyn FnMut(u64) + Send),
) -> Result<Report> {
    let mut manifest = Manifest::load(disk.as_ref(), dest_url)?;
    let mut report = Report::default();
    // (path, inode) to compare, and paths to delete.
    let (todo, gone): (Vec<(String, u64)>, Vec<String>) = match changed {
        None => {
            let (files, other) = walk(vol)?;
            report.skipped = other;
            let live: std::collections::HashSet<&str> = files.iter().map(|(p, _)| p.as_str()).collect();
            let gone = manifest.files.keys().filter(|p| !live.contains(p.as_str())).cloned().collect();
            (files, gone)
        }
        Some(changes) => {
            let (mut todo, mut gone) = (Vec::new(), Vec::new());
            for (path, kind) in changes {
                let path = path.trim_start_matches('/').to_string();
                match kind {
                    ChangeKind::Removed => gone.push(path),
                    _ => match vol.lookup_path(&path) {
                        Ok(a) if a.kind == FileKind::Regular => todo.push((path, a.ino)),
                        Ok(_) => {}
                        Err(arbor_engine::Error::NotFound) => gone.push(path),
                        Err(e) => return Err(e.into()),
                    },
                }
            }
            (todo, gone)
        }
    };
    // Files go up FILES_AT_ONCE at a time (each in parts, four in flight);
    // the manifest is saved every 64 files or 4 GiB.
    let mut upload_list = Vec::new();
    for (path, ino) in todo {
        let now = stamp(vol, ino)?;
        if manifest.files.get(&path) == Some(&now) {
            report.unchanged += 1;
            progress(now.0);
        } else {
            upload_list.push((path, ino, now));
        }
    }
    struct Shared<'a> {
        next: usize,
        manifest: &'a mut Manifest,
        report: &'a mut Report,
        progress: &'a mut (dyn FnMut(u64) + Send),
        since_save: u64,
        failed: Option<anyhow::Error>,
    }
    let shared = parking_lot::Mutex::new(Shared {
        next: 0,
        manifest: &mut manifest,
        report: &mut report,
        progress,
        since_save: 0,
        failed: None,
    });
    std::thread::scope(|scope| {
        for _ in 0..FILES_AT_ONCE.min(upload_list.len()) {
            scope.spawn(|| loop {
                let (path, ino, now) = {
                    let mut sh = shared.lock();
                    if sh.failed.is_some() || sh.next >= upload_list.len() {
                        return;
                    }
                    sh.next += 1;
                    &upload_list[sh.next - 1]
                };
                let done = upload(vol, *ino, now.0, dest, path).with_context(|| format!("cannot export /{path}"));
                let mut sh = shared.lock();
                if let Err(e) = done {
                    sh.failed.get_or_insert(e);
                    return;
                }
                sh.manifest.files.insert(path.clone(), *now);
                sh.report.uploaded += 1;
                sh.report.bytes += now.0;
                (sh.progress)(now.0);
                sh.since_save += 1 + now.0 / (64 << 20);
                if sh.since_save >= 64 {
                    sh.since_save = 0;
                    if let Err(e) = sh.manifest.save(disk.as_ref(), dest_url) {
                        sh.failed.get_or_insert(e);
                        return;
                    }
                }
            });
        }
    });
    let failed = shared.into_inner().failed;
    if let Some(e) = failed {
        // What went up is recorded, so the next run does not send it again.
        manifest.save(disk.as_ref(), dest_url)?;
        return Err(e);
    }
    for path in gone {
        if manifest.files.remove(&path).is_some() {
            dest.delete(&path)?;
            report.deleted += 1;
        }
    }
    manifest.save(disk.as_ref(), dest_url)?;
    Ok(report)
}

/// `s3://bucket/prefix` → the store its objects go to (keys are paths
/// under the prefix).
pub fn open_dest(url: &str) -> Result<Arc<dyn ObjectStore>> {
    let (bucket, prefix) = crate::import::parse_source(url)?;
    if prefix.is_empty() {
        bail!("{url}: export to a prefix of a bucket (s3://bucket/prefix), not the whole bucket");
    }
    let cfg = arbor_engine::bucket::S3Config::from_env(&bucket, prefix.trim_end_matches('/'));
    Ok(arbor_engine::bucket::open_s3(
        &cfg,
        arbor_engine::bucket::RetryPolicy::with_attempts(arbor_node::settings::get().s3_retries),
    )?)
}
