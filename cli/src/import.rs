//! `arbor import`: the objects under an S3 prefix become files of a branch,
//! copying no data. Each file is one external extent naming its object
//! (bucket, key, size, ETag, and the version id where the bucket keeps
//! versions); reads are ranged GETs of it, conditional on the ETag, of
//! that version.
//!
//! Keys map to paths by their `/`-separated parts. A key that cannot be a
//! path (an empty, `.` or `..` part, a part longer than 255 bytes, a key
//! that is also the prefix of other keys) is reported and skipped, never
//! renamed. A zero-byte key ending in `/` is a folder marker: its folder is
//! made. A path that already exists is left alone: skipped quietly when it
//! is the same object (a second run, or one after a crash, completes the
//! first), reported as a conflict otherwise.
//!
//! A refresh (`--refresh`) lists again and applies what changed in the
//! bucket as ordinary operations: new objects are imported, a file whose
//! object has a new ETag or version is pointed at it (one intent), a file whose object
//! is gone is unlinked. Only files that still read exactly their object
//! are touched; one the branch wrote on, truncated or replaced is left
//! alone and reported as a conflict.

use anyhow::{anyhow, bail, Result};
use arbor_engine::bucket::{open_s3, ObjectInfo, ObjectStore, RetryPolicy, S3Config};
use arbor_engine::env::Timestamp;
use arbor_engine::source::Source;
use arbor_engine::volume::{FileKind, Volume, NAME_MAX, ROOT_INO};
use arbor_snapshot::disk::Location;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// An `s3://bucket[/prefix]` source: the bucket and the key prefix its
/// objects are listed under (empty, or ending in `/`).
pub fn parse_source(url: &str) -> Result<(String, String)> {
    if !url.starts_with("s3://") {
        bail!("the source must be s3://bucket/prefix (got {url})");
    }
    // The same rules as an s3:// disk's URL.
    let Location::S3 { bucket, prefix } = arbor_snapshot::disk::parse(url)?.1 else {
        bail!("the source must be s3://bucket/prefix (got {url})");
    };
    let prefix = if prefix.is_empty() { prefix } else { format!("{prefix}/") };
    Ok((bucket.to_string(), prefix))
}

/// The bucket of a source, reached with the environment's S3 settings.
pub fn open_bucket(bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    Ok(open_s3(&S3Config::from_env(bucket, ""), RetryPolicy::with_attempts(arbor_node::settings::get().s3_retries))?)
}

/// What an import will add.
#[derive(Debug, Default)]
pub struct Plan {
    /// Folders to make (folder markers and every file's parents), parents first.
    pub dirs: Vec<Vec<String>>,
    /// (path parts, object).
    pub files: Vec<(Vec<String>, ObjectInfo)>,
    /// (key, why it is not a file).
    pub skipped: Vec<(String, &'static str)>,
}

/// Maps a listing of `prefix` to paths.
pub fn plan(prefix: &str, objects: Vec<ObjectInfo>) -> Plan {
    let mut plan = Plan::default();
    let mut keys: Vec<(Vec<String>, ObjectInfo)> = Vec::new();
    let mut markers: Vec<Vec<String>> = Vec::new();
    for o in objects {
        let Some(rel) = o.key.strip_prefix(prefix) else { continue };
        if rel.is_empty() {
            plan.skipped.push((o.key.clone(), "the prefix itself"));
            continue;
        }
        let (rel, marker) = match rel.strip_suffix('/') {
            Some(r) if o.size == 0 => (r, true),
            _ => (rel, false),
        };
        let parts: Vec<String> = rel.split('/').map(str::to_string).collect();
        let why = if parts.iter().any(|p| p.is_empty()) {
            Some("an empty path part")
        } else if parts.iter().any(|p| p == "." || p == "..") {
            Some("a . or .. path part")
        } else if parts.iter().any(|p| p.len() > NAME_MAX) {
            Some("a path part longer than 255 bytes")
        } else if parts.iter().any(|p| p.contains('\0')) {
            Some("a NUL byte")
        } else {
            None
        };
        match why {
            Some(why) => plan.skipped.push((o.key.clone(), why)),
            None if marker => markers.push(parts),
            None => keys.push((parts, o)),
        }
    }
    // Every folder some file or marker needs.
    let mut folders: HashSet<Vec<String>> = HashSet::new();
    for parts in keys.iter().map(|(p, _)| &p[..p.len() - 1]).chain(markers.iter().map(|m| &m[..])) {
        for n in 1..=parts.len() {
            folders.insert(parts[..n].to_vec());
        }
    }
    for (parts, o) in keys {
        if folders.contains(&parts) {
            plan.skipped.push((o.key.clone(), "both an object and the prefix of others"));
        } else {
            plan.files.push((parts, o));
        }
    }
    plan.dirs = folders.into_iter().collect();
    plan.dirs.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
    plan
}

/// What an import did.
#[derive(Debug, Default)]
pub struct Report {
    pub added: u64,
    pub bytes: u64,
    pub already: u64,
    /// Refresh: files pointed at a new version of their object.
    pub changed: u64,
    /// Refresh: files whose object is gone, unlinked.
    pub deleted: u64,
    pub dirs: u64,
    /// Paths that exist as something else, left alone.
    pub conflicts: Vec<String>,
    /// Names added or removed: (folder inode, name), for a mount to drop
    /// from the kernel's caches.
    pub names: Vec<(u64, Vec<u8>)>,
    /// Files whose bytes changed (refreshed), likewise.
    pub rewritten: Vec<u64>,
}

impl Report {
    pub fn json(&self, plan: &Plan) -> Value {
        json!({
            "added": self.added,
            "bytes": self.bytes,
            "already": self.already,
            "changed": self.changed,
            "deleted": self.deleted,
            "dirs": self.dirs,
            "conflicts": self.conflicts,
            "skipped": plan.skipped.iter().map(|(k, why)| json!({"key": k, "why": why})).collect::<Vec<_>>(),
        })
    }
}

/// The folder `at` (`/a/b`) of `vol`, made where missing.
fn folder(vol: &Volume, at: &str, owner: (u32, u32), report: &mut Report) -> Result<u64> {
    let mut ino = ROOT_INO;
    for part in at.split('/').filter(|p| !p.is_empty()) {
        ino = child_dir(vol, ino, part, owner, report)?.ok_or_else(|| anyhow!("{at}: {part} is not a folder"))?;
    }
    Ok(ino)
}

/// Folder `name` in `parent`, made if missing; `None` if something else
/// has that name.
fn child_dir(vol: &Volume, parent: u64, name: &str, owner: (u32, u32), report: &mut Report) -> Result<Option<u64>> {
    match vol.lookup(parent, name.as_bytes()) {
        Ok(a) if a.kind == FileKind::Directory => Ok(Some(a.ino)),
        Ok(_) => Ok(None),
        Err(arbor_engine::Error::NotFound) => {
            report.dirs += 1;
            report.names.push((parent, name.as_bytes().to_vec()));
            Ok(Some(vol.mkdir(parent, name.as_bytes(), 0o755, owner.0, owner.1)?.ino))
        }
        Err(e) => Err(e.into()),
    }
}

fn timestamp(t: Option<std::time::SystemTime>) -> Timestamp {
    Timestamp::from_system(t.unwrap_or_else(std::time::SystemTime::now))
}

/// How [`apply`] treats what is already in the branch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Add what is missing.
    Import,
    /// Also follow changed and deleted objects (of keys under `prefix`).
    Refresh,
}

/// Adds `plan` under folder `at` of `vol`; `progress` is called with each
/// file's size.
#[allow(clippy::too_many_arguments)]
pub fn apply(
    vol: &Volume,
    at: &str,
    bucket: &str,
    prefix: &str,
    plan: &Plan,
    owner: (u32, u32),
    mode: Mode,
    progress: &mut dyn FnMut(u64),
) -> Result<Report> {
    let mut report = Report::default();
    let base = folder(vol, at, owner, &mut report)?;
    let mut dirs: HashMap<&[String], u64> = HashMap::new();
    let path = |parts: &[String]| format!("{}/{}", at.trim_end_matches('/'), parts.join("/"));
    for d in &plan.dirs {
        let Some((name, up)) = d.split_last() else { continue };
        let parent = if up.is_empty() { Some(base) } else { dirs.get(up).copied() };
        // A parent that is a file here already was reported as a conflict.
        let Some(parent) = parent else { continue };
        match child_dir(vol, parent, name, owner, &mut report)? {
            Some(ino) => drop(dirs.insert(&d[..], ino)),
            None => report.conflicts.push(format!("{} (exists and is not a folder)", path(d))),
        }
    }
    for (parts, o) in &plan.files {
        let (name, folder) = parts.split_last().ok_or_else(|| anyhow!("empty path"))?;
        let parent = if folder.is_empty() { Some(base) } else { dirs.get(folder).copied() };
        let Some(parent) = parent else { continue };
        let source = Source {
            bucket: bucket.to_string(),
            key: o.key.clone(),
            size: o.size,
            etag: o.etag.clone(),
            version: o.version.clone(),
        };
        match vol.lookup(parent, name.as_bytes()) {
            Ok(a) => {
                let recorded = vol.source(a.ino)?.filter(|s| s.bucket == source.bucket && s.key == source.key);
                match recorded {
                    Some(s) if s.is_listed(&source) => report.already += 1,
                    Some(_) if mode == Mode::Refresh && vol.pristine_source(a.ino)?.is_some() => {
                        vol.reimport(a.ino, source, timestamp(o.modified))?;
                        report.rewritten.push(a.ino);
                        report.changed += 1;
                        report.bytes += o.size;
                    }
                    Some(_) if mode == Mode::Refresh => {
                        report.conflicts.push(format!("{} (changed in the branch and in the bucket)", path(parts)))
                    }
                    _ => report.conflicts.push(format!("{} (exists)", path(parts))),
                }
            }
            Err(arbor_engine::Error::NotFound) => {
                vol.import(parent, name.as_bytes(), 0o644, owner, source, timestamp(o.modified))?;
                report.names.push((parent, name.as_bytes().to_vec()));
                report.added += 1;
                report.bytes += o.size;
            }
            Err(e) => return Err(e.into()),
        }
        progress(o.size);
    }
    if mode == Mode::Refresh {
        let listed: HashSet<&str> = plan.files.iter().map(|(_, o)| o.key.as_str()).collect();
        unlink_gone(vol, base, &format!("{}/", at.trim_end_matches('/')), bucket, prefix, &listed, &mut report)?;
    }
    Ok(report)
}

/// Refresh: unlinks the files under folder `dir` (path `path`) whose
/// object, a key under `prefix`, is no longer listed, if they still read
/// exactly it.
fn unlink_gone(
    vol: &Volume,
    dir: u64,
    path: &str,
    bucket: &str,
    prefix: &str,
    listed: &HashSet<&str>,
    report: &mut Report,
) -> Result<()> {
    for e in vol.list_dir(dir)? {
        let name = String::from_utf8_lossy(&e.name).into_owned();
        if e.kind == FileKind::Directory {
            unlink_gone(vol, e.ino, &format!("{path}{name}/"), bucket, prefix, listed, report)?;
            continue;
        }
        let Some(src) = vol.source(e.ino)? else { continue };
        if src.bucket != bucket || !src.key.starts_with(prefix) || listed.contains(src.key.as_str()) {
            continue;
        }
        if vol.pristine_source(e.ino)?.is_some() {
            vol.unlink(dir, &e.name)?;
            report.names.push((dir, e.name));
            report.deleted += 1;
        } else {
            report.conflicts.push(format!("{path}{name} (changed in the branch, deleted in the bucket)"));
        }
    }
    Ok(())
}

/// An import a mount of `branch` can repeat on its own
/// (`--refresh-source`): kept in the disk's store as
/// `imports/<branch>/<crc32c of the folder>`, JSON.
pub struct Recorded {
    pub source: String,
    pub at: String,
    pub owner: (u32, u32),
}

fn record_key(branch: &str, at: &str) -> String {
    format!("imports/{branch}/{:08x}", arbor_engine::crc::crc32c(at.as_bytes()))
}

/// Remembers that `source` was imported under `at` of `branch`.
pub fn record(store: &dyn ObjectStore, branch: &str, source: &str, at: &str, owner: (u32, u32)) -> Result<()> {
    let body = json!({"source": source, "at": at, "uid": owner.0, "gid": owner.1});
    store.put(&record_key(branch, at), body.to_string().as_bytes())?;
    Ok(())
}

/// The imports recorded for `branch`.
pub fn recorded(store: &dyn ObjectStore, branch: &str) -> Result<Vec<Recorded>> {
    records_under(store, &format!("imports/{branch}/"))
}

/// The (bucket, key prefix) of every import recorded for any branch of
/// the disk in `store`: the objects its imported trees may name (a branch
/// or checkpoint made from a branch holds that branch's imports).
pub fn imported_prefixes(store: &dyn ObjectStore) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for r in records_under(store, "imports/")? {
        match parse_source(&r.source) {
            Ok(p) => out.push(p),
            Err(e) => tracing::debug!(source = %r.source, error = %e, "an import record names no source"),
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

fn records_under(store: &dyn ObjectStore, prefix: &str) -> Result<Vec<Recorded>> {
    let mut out = Vec::new();
    for key in store.list(prefix)? {
        let Ok((body, _)) = store.get(&key) else { continue };
        let Ok(v) = serde_json::from_slice::<Value>(&body) else { continue };
        let (Some(source), Some(at)) = (v["source"].as_str(), v["at"].as_str()) else { continue };
        let owner = (v["uid"].as_u64().unwrap_or(0) as u32, v["gid"].as_u64().unwrap_or(0) as u32);
        out.push(Recorded { source: source.into(), at: at.into(), owner });
    }
    Ok(out)
}

/// Runs an import (or refresh) of `source` under `at` on a mount's own
/// volume, commits, and drops what it changed from the kernel's caches
/// (the kernel keeps a file's pages across opens of a tree only this mount
/// writes, so it must be told). The report as JSON.
pub fn into_mount(
    vol: &Volume,
    invalidate: &arbor_fs::Invalidator,
    source: &str,
    at: &str,
    owner: (u32, u32),
    mode: Mode,
) -> Result<Value> {
    let (bucket, prefix) = parse_source(source)?;
    let objects = open_bucket(&bucket)?.list_objects(&prefix)?;
    let plan = plan(&prefix, objects);
    let report = apply(vol, at, &bucket, &prefix, &plan, owner, mode, &mut |_| {})?;
    vol.commit()?;
    for (parent, name) in &report.names {
        invalidate.entry(*parent, name);
    }
    for ino in &report.rewritten {
        invalidate.inode(*ino);
    }
    Ok(report.json(&plan))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(key: &str, size: u64) -> ObjectInfo {
        ObjectInfo { key: key.into(), size, etag: "\"e\"".into(), modified: None, version: None }
    }

    #[test]
    fn sources_parse_or_say_why_not() {
        assert_eq!(parse_source("s3://corpus/raw/v1").expect("ok"), ("corpus".into(), "raw/v1/".into()));
        assert_eq!(parse_source("s3://corpus").expect("ok"), ("corpus".into(), String::new()));
        assert_eq!(parse_source("s3://corpus/raw/").expect("ok"), ("corpus".into(), "raw/".into()));
        for bad in ["corpus/raw", "s3://", "s3://UP/x", "gs://corpus/x"] {
            assert!(parse_source(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn keys_that_cannot_be_paths_are_skipped_with_a_reason() {
        let p = plan(
            "raw/",
            vec![
                obj("raw/a/b.bin", 10),
                obj("raw/a/c/d.bin", 20),
                obj("raw/top", 1),
                obj("raw/empty-marker/", 0),
                obj("raw/x//y", 3),
                obj("raw/./z", 3),
                obj("raw/a/c", 5),
                obj("raw/", 0),
                obj("raw/trailing/", 4),
            ],
        );
        let files: Vec<String> = p.files.iter().map(|(parts, _)| parts.join("/")).collect();
        assert_eq!(files, ["a/b.bin", "a/c/d.bin", "top"]);
        let dirs: Vec<String> = p.dirs.iter().map(|d| d.join("/")).collect();
        assert_eq!(dirs, ["a", "empty-marker", "a/c"]);
        let skipped: Vec<&str> = p.skipped.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(skipped, ["raw/x//y", "raw/./z", "raw/", "raw/trailing/", "raw/a/c"]);
    }
}
