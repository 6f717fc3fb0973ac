//! The catalog commands: checkpoints, branches, diff, gc, prefetch, fsck.
//! Each works on a mountpoint (through its control socket where the live
//! state matters) or directly on an unmounted DISK.

use crate::control;
use crate::json::{addr_json, compact_json};
use anyhow::{anyhow, bail, Context, Result};
use arbor_engine::env::Timestamp;
use arbor_engine::format::{Addr, SegId};
use arbor_engine::head::FixedRootDevice;
use arbor_engine::volume::{ChangeKind, Config, Volume};
use arbor_node::disk::{self, quiet_config, Disk};
use arbor_snapshot::{Catalog, Error as CatalogError, Root};
use indicatif::{HumanBytes, HumanDuration, ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// What a TARGET argument names.
pub struct Target {
    pub disk: Disk,
    /// When TARGET is a mountpoint served here: the branch mounted there
    /// (none for a checkpoint mount).
    pub branch: Option<String>,
    /// That mountpoint.
    pub mount: Option<PathBuf>,
}

impl Target {
    /// Where `branch` is mounted and can be asked: TARGET itself when it is
    /// a mount of `branch` (a local one, or a client of the branch's owner,
    /// which forwards the request), else a mount of it on this node.
    fn mount_of(&self, catalog: &Catalog, branch: &str) -> Option<PathBuf> {
        match (&self.mount, &self.branch) {
            (Some(m), Some(b)) if b == branch => Some(m.clone()),
            _ => catalog.holder_of(branch).filter(|h| h.starts_with('/')).map(PathBuf::from),
        }
    }
}

pub fn resolve(arg: &str) -> Result<Target> {
    let path = Path::new(arg);
    if !arg.contains("://") {
        if let Err(e) = std::fs::metadata(path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                bail!("{arg}: {}", arbor_node::disk::io_cause(&e));
            }
        }
    }
    if path.is_dir() {
        if let Ok(s) = control::request(path, json!({"op": "status"})) {
            let disk = s["disk"].as_str().ok_or_else(|| anyhow!("bad status reply"))?;
            return Ok(Target {
                disk: disk::open(disk)?,
                branch: s["branch"].as_str().map(str::to_string),
                mount: Some(path.to_path_buf()),
            });
        }
    }
    Ok(Target { disk: disk::open(arg)?, branch: None, mount: None })
}

fn friendly(e: CatalogError) -> anyhow::Error {
    match e {
        CatalogError::Open(b) => anyhow!("branch {b} is mounted read-write; run this against its mountpoint"),
        e => e.into(),
    }
}

fn addr_from(v: &Value) -> Result<Addr> {
    let n = |k: &str| v[k].as_u64().ok_or_else(|| anyhow!("bad commit in reply"));
    Ok(Addr {
        seg: SegId { writer: n("writer")?, seq: n("seq")? as u32 },
        off: n("off")? as u32,
        len: n("len")? as u32,
    })
}

/// The current commit of `branch`: its mount (anywhere on this node) is
/// asked to commit first; an unmounted branch is settled from the disk.
fn branch_commit(t: &Target, catalog: &Catalog, branch: &str) -> Result<Addr> {
    if let Some(mp) = t.mount_of(catalog, branch) {
        return addr_from(&control::request(&mp, json!({"op": "commit"}))?);
    }
    catalog.settled_commit(branch).map_err(friendly)
}

fn root_commit(t: &Target, catalog: &Catalog, root: &Root) -> Result<Addr> {
    match root {
        Root::Branch(b) => branch_commit(t, catalog, b),
        Root::Checkpoint(_) => Ok(catalog.commit_of(root)?),
    }
}

fn human_time(t: Timestamp) -> String {
    let age = SystemTime::now().duration_since(t.to_system()).unwrap_or_default();
    format!("{} ago", HumanDuration(Duration::from_secs(age.as_secs())))
}

pub fn checkpoint_create(target: &str, name: &str, branch: Option<&str>) -> Result<()> {
    let t = resolve(target)?;
    let started = Instant::now();
    let catalog = t.disk.catalog()?;
    let branch = branch.map(str::to_string).or(t.branch.clone()).unwrap_or_else(|| "main".into());
    match t.mount_of(&catalog, &branch) {
        // The mount checkpoints its live volume, unsynced writes included.
        Some(mp) => drop(control::request(&mp, json!({"op": "checkpoint", "name": name}))?),
        None => {
            let commit = catalog.settled_commit(&branch).map_err(friendly)?;
            catalog.create_checkpoint(name, &branch, commit).map_err(friendly)?;
        }
    }
    println!("created checkpoint {name} of branch {branch} in {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
    Ok(())
}

pub fn checkpoint_list(target: &str, json_out: bool) -> Result<()> {
    let list = resolve(target)?.disk.catalog()?.list_checkpoints()?;
    if json_out {
        let v: Vec<Value> = list
            .iter()
            .map(|c| json!({"name": c.name, "branch": c.branch, "created_unix": c.created.secs, "commit": addr_json(c.commit)}))
            .collect();
        println!("{}", Value::Array(v));
    } else if list.is_empty() {
        println!("no checkpoints");
    } else {
        for c in list {
            println!("{:<32} from {:<20} {}", c.name, c.branch, human_time(c.created));
        }
    }
    Ok(())
}

pub fn checkpoint_delete(target: &str, name: &str) -> Result<()> {
    resolve(target)?.disk.catalog()?.delete_checkpoint(name)?;
    println!("deleted checkpoint {name} (its data goes at the next gc)");
    Ok(())
}

pub fn branch_create(target: &str, name: &str, from_checkpoint: Option<&str>, from_branch: Option<&str>) -> Result<()> {
    let t = resolve(target)?;
    let started = Instant::now();
    let catalog = t.disk.catalog()?;
    let (commit, from) = match (from_checkpoint, from_branch) {
        (Some(c), None) => (catalog.checkpoint(c)?.commit, format!("checkpoint {c}")),
        (None, Some(b)) => (branch_commit(&t, &catalog, b)?, format!("branch {b}")),
        _ => bail!("give exactly one of --from-checkpoint and --from-branch"),
    };
    catalog.create_branch(name, commit)?;
    println!("created branch {name} from {from} in {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
    Ok(())
}

pub fn branch_list(target: &str, json_out: bool) -> Result<()> {
    let catalog = resolve(target)?.disk.catalog()?;
    let mut rows = Vec::new();
    for b in catalog.list_branches()? {
        let mounted = matches!(catalog.lock_branch(&b.name), Err(CatalogError::Open(_)));
        rows.push((b.name, mounted));
    }
    if json_out {
        let v: Vec<Value> = rows.iter().map(|(n, m)| json!({"name": n, "mounted": m})).collect();
        println!("{}", Value::Array(v));
    } else {
        for (n, m) in rows {
            println!("{n}{}", if m { "  (mounted read-write)" } else { "" });
        }
    }
    Ok(())
}

pub fn branch_delete(target: &str, name: &str) -> Result<()> {
    resolve(target)?.disk.catalog()?.delete_branch(name).map_err(friendly)?;
    println!("deleted branch {name} (its data goes at the next gc)");
    Ok(())
}

pub fn branch_reset(target: &str, name: &str, checkpoint: &str) -> Result<()> {
    let catalog = resolve(target)?.disk.catalog()?;
    let cp = catalog.checkpoint(checkpoint)?;
    catalog.reset_branch(name, cp.commit).map_err(friendly)?;
    println!("reset branch {name} to checkpoint {checkpoint}");
    Ok(())
}

pub fn branch_rename(target: &str, old: &str, new: &str) -> Result<()> {
    resolve(target)?.disk.catalog()?.rename_branch(old, new).map_err(friendly)?;
    println!("renamed branch {old} to {new}");
    Ok(())
}

/// `checkpoint:NAME`, `branch:NAME`, or a bare name (a checkpoint if one
/// has it, else a branch).
fn parse_root(catalog: &Catalog, s: &str) -> Result<Root> {
    if let Some(c) = s.strip_prefix("checkpoint:") {
        return Ok(Root::Checkpoint(c.into()));
    }
    if let Some(b) = s.strip_prefix("branch:") {
        return Ok(Root::Branch(b.into()));
    }
    match catalog.checkpoint(s) {
        Ok(_) => Ok(Root::Checkpoint(s.into())),
        Err(CatalogError::NotFound(..)) => match catalog.branch_head(s) {
            Ok(_) => Ok(Root::Branch(s.into())),
            Err(CatalogError::NotFound(..)) => bail!("no checkpoint or branch named {s:?}"),
            Err(e) => Err(e.into()),
        },
        Err(e) => Err(e.into()),
    }
}

pub fn diff(target: &str, from: &str, to: &str, json_out: bool) -> Result<()> {
    let t = resolve(target)?;
    let catalog = t.disk.catalog()?;
    let (a, b) = (parse_root(&catalog, from)?, parse_root(&catalog, to)?);
    // A mounted branch's newest state is in memory: its mount commits it first.
    let (ca, cb) = (root_commit(&t, &catalog, &a)?, root_commit(&t, &catalog, &b)?);
    let started = Instant::now();
    let changes = catalog.diff_between(ca, cb)?;
    let took = started.elapsed();
    if json_out {
        let v: Vec<Value> = changes
            .iter()
            .map(|c| {
                let kind = match c.kind {
                    ChangeKind::Added => "added",
                    ChangeKind::Removed => "removed",
                    ChangeKind::Modified => "modified",
                };
                json!({"path": c.path, "change": kind, "size_before": c.size_before, "size_after": c.size_after})
            })
            .collect();
        println!("{}", Value::Array(v));
        return Ok(());
    }
    for c in &changes {
        let size = |s: Option<u64>| s.map(|n| HumanBytes(n).to_string()).unwrap_or_default();
        match c.kind {
            ChangeKind::Added => println!("A {}  ({})", c.path, size(c.size_after)),
            ChangeKind::Removed => println!("D {}  ({})", c.path, size(c.size_before)),
            ChangeKind::Modified => println!("M {}  ({} -> {})", c.path, size(c.size_before), size(c.size_after)),
        }
    }
    eprintln!("{} changes in {:.1} ms", changes.len(), took.as_secs_f64() * 1e3);
    Ok(())
}

pub fn gc(target: &str, grace: u64) -> Result<()> {
    let catalog = resolve(target)?.disk.catalog()?;
    let bar = ProgressBar::new_spinner().with_style(ProgressStyle::with_template("{spinner} gc: {msg}")?);
    bar.enable_steady_tick(Duration::from_millis(100));
    bar.set_message("marking what every branch and checkpoint reaches");
    let plan = catalog.gc_plan()?;
    bar.set_message("deleting unreachable segments");
    let report = catalog.gc_sweep(plan, Duration::from_secs(grace))?;
    bar.finish_and_clear();
    println!(
        "{} segments: {} reachable, {} kept for live writers, {} deleted",
        report.segments,
        report.reachable,
        report.kept_for_writers,
        report.deleted.len()
    );
    Ok(())
}

/// Moves a branch's live bytes out of mostly dead segments, through
/// its mount if it is mounted, else by opening it here.
pub fn compact(target: &str, branch: Option<&str>, max_live: f64) -> Result<()> {
    if !(0.0..=1.0).contains(&max_live) {
        bail!("--max-live must be a fraction between 0 and 1, not {max_live}");
    }
    let t = resolve(target)?;
    let catalog = t.disk.catalog()?;
    let branch = branch.map(str::to_string).or(t.branch.clone()).unwrap_or_else(|| "main".into());
    let report = match t.mount_of(&catalog, &branch) {
        Some(mp) => control::request(&mp, json!({"op": "compact", "max_live": max_live}))?,
        None => {
            let (vol, _lock) = catalog.open_branch(&branch, quiet_config()).map_err(friendly)?;
            let report = vol.compact(max_live)?;
            vol.close()?;
            compact_json(report)
        }
    };
    let (segments, nodes) = (report["segments"].as_u64().unwrap_or(0), report["nodes"].as_u64().unwrap_or(0));
    let bytes = |k: &str| HumanBytes(report[k].as_u64().unwrap_or(0));
    println!(
        "branch {branch}: moved {} of file data and {nodes} tree nodes ({}); {segments} segments no longer reached by it (`arbor gc` deletes them once no checkpoint or branch does)",
        bytes("data_bytes"),
        bytes("bytes")
    );
    Ok(())
}

pub fn prefetch(mountpoint: &Path, paths: &[PathBuf]) -> Result<()> {
    control::request(mountpoint, json!({"op": "status"}))?;
    let full: Vec<PathBuf> =
        paths.iter().map(|p| if p.is_absolute() { p.clone() } else { mountpoint.join(p) }).collect();
    for p in &full {
        if !p.starts_with(mountpoint) {
            bail!("{} is not inside {}", p.display(), mountpoint.display());
        }
        std::fs::symlink_metadata(p).with_context(|| format!("cannot prefetch {}", p.display()))?;
    }
    let (files, total) = crate::prefetch::total_bytes(&full);
    let bar = ProgressBar::new(total)
        .with_style(ProgressStyle::with_template("prefetch {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")?);
    let (read, bytes) = crate::prefetch::warm(&full, &mut |n| bar.inc(n));
    bar.finish_and_clear();
    println!("prefetched {read} of {files} files, {}", HumanBytes(bytes));
    Ok(())
}

pub fn import(target: &str, source: &str, at: &str, branch: Option<&str>, refresh: bool, json_out: bool) -> Result<()> {
    let mode = if refresh { crate::import::Mode::Refresh } else { crate::import::Mode::Import };
    let (bucket, prefix) = crate::import::parse_source(source)?;
    if !at.starts_with('/') {
        bail!("--at must be an absolute path inside the branch, like /datasets (got {at})");
    }
    let t = resolve(target)?;
    let catalog = t.disk.catalog()?;
    let branch = branch.map(str::to_string).or(t.branch.clone()).unwrap_or_else(|| "main".into());
    // SAFETY: plain syscalls without arguments.
    let owner = unsafe { (libc::getuid(), libc::getgid()) };
    let started = Instant::now();
    let report = match t.mount_of(&catalog, &branch) {
        Some(mp) => control::request(
            &mp,
            json!({"op": "import", "source": source, "at": at, "uid": owner.0, "gid": owner.1, "refresh": refresh}),
        )?,
        None => {
            let spinner = ProgressBar::new_spinner().with_message(format!("listing {source}"));
            spinner.enable_steady_tick(Duration::from_millis(200));
            let objects = crate::import::open_bucket(&bucket)?
                .list_objects(&prefix)
                .with_context(|| format!("cannot list {source}"))?;
            spinner.finish_and_clear();
            let plan = crate::import::plan(&prefix, objects);
            let bar = ProgressBar::new(plan.files.len() as u64)
                .with_style(ProgressStyle::with_template("import {bar:40} {pos}/{len} files {per_sec} eta {eta}")?);
            let (vol, _lock) = catalog.open_branch(&branch, quiet_config()).map_err(friendly)?;
            let report = crate::import::apply(&vol, at, &bucket, &prefix, &plan, owner, mode, &mut |_| bar.inc(1));
            bar.finish_and_clear();
            let report = report?;
            vol.close()?;
            report.json(&plan)
        }
    };
    // A mount of this branch started with --refresh-source repeats it.
    crate::import::record(t.disk.store().as_ref(), &branch, source, at, owner)?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    for s in report["skipped"].as_array().into_iter().flatten() {
        eprintln!("skipped {}: {}", s["key"].as_str().unwrap_or("?"), s["why"].as_str().unwrap_or("?"));
    }
    for c in report["conflicts"].as_array().into_iter().flatten() {
        eprintln!("left alone: {}", c.as_str().unwrap_or("?"));
    }
    let n = |k: &str| report[k].as_u64().unwrap_or(0);
    let refreshed =
        if refresh { format!(", {} changed, {} deleted", n("changed"), n("deleted")) } else { String::new() };
    println!(
        "branch {branch}: imported {} files ({}) and {} folders from {source} under {at} in {}{refreshed}; {} already there, {} skipped, {} conflicts",
        n("added"),
        HumanBytes(n("bytes")),
        n("dirs"),
        HumanDuration(started.elapsed()),
        n("already"),
        report["skipped"].as_array().map_or(0, Vec::len),
        report["conflicts"].as_array().map_or(0, Vec::len),
    );
    Ok(())
}

pub fn export(
    target: &str,
    branch: Option<&str>,
    checkpoint: Option<&str>,
    dest_url: &str,
    since: Option<&str>,
    json_out: bool,
) -> Result<()> {
    let dest = crate::export::open_dest(dest_url)?;
    let t = resolve(target)?;
    let catalog = t.disk.catalog()?;
    let root = match checkpoint {
        Some(c) => Root::Checkpoint(c.into()),
        None => Root::Branch(branch.map(str::to_string).or(t.branch.clone()).unwrap_or_else(|| "main".into())),
    };
    // A mounted branch's newest state is in memory: its mount commits it first.
    let commit = root_commit(&t, &catalog, &root)?;
    let changed = match since {
        Some(cp) => {
            let from = catalog.checkpoint(cp)?.commit;
            Some(catalog.diff_between(from, commit)?.into_iter().map(|c| (c.path, c.kind)).collect())
        }
        None => None,
    };
    let vol = Volume::open(FixedRootDevice::new(catalog.segments().clone(), commit), quiet_read_only())?;
    let started = Instant::now();
    let bar = ProgressBar::new_spinner()
        .with_style(ProgressStyle::with_template("export {spinner} {bytes} {bytes_per_sec} {elapsed}")?);
    let report = crate::export::run(&vol, dest.as_ref(), t.disk.store(), dest_url, changed, &mut |n| bar.inc(n));
    bar.finish_and_clear();
    let r = report?;
    if json_out {
        let v = json!({"uploaded": r.uploaded, "bytes": r.bytes, "deleted": r.deleted, "unchanged": r.unchanged, "skipped": r.skipped});
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "exported {} files ({}) to {dest_url} in {}; {} deleted, {} unchanged, {} not regular files skipped",
        r.uploaded,
        HumanBytes(r.bytes),
        HumanDuration(started.elapsed()),
        r.deleted,
        r.unchanged,
        r.skipped
    );
    Ok(())
}

/// A read-only open of a committed root by a command.
fn quiet_read_only() -> Config {
    Config { read_only: true, ..quiet_config() }
}

pub fn fsck(disk_arg: &str, json_out: bool, offline: bool) -> Result<()> {
    let d = disk::open(disk_arg)?;
    let catalog = d.catalog()?;
    // A record being written would look torn to a reader running beside it.
    for b in catalog.list_branches()? {
        if let Some(at) = catalog.holder_of(&b.name).filter(|h| !h.is_empty()) {
            bail!("branch {} is open at {at}; unmount it (or stop its server) before fsck", b.name);
        }
    }
    let bar = ProgressBar::new_spinner().with_style(ProgressStyle::with_template("{spinner} fsck {msg}")?);
    bar.enable_steady_tick(Duration::from_millis(100));
    let mut report =
        arbor_engine::fsck::check_segments(catalog.segments().clone(), &mut |s| bar.set_message(s.to_string()))?;
    let mut roots: Vec<(String, Addr)> =
        catalog.list_branches()?.into_iter().map(|b| (format!("branch {}", b.name), b.commit)).collect();
    roots.extend(catalog.list_checkpoints()?.into_iter().map(|c| (format!("checkpoint {}", c.name), c.commit)));
    for (what, commit) in &roots {
        bar.set_message(what.clone());
        let ro = Config { read_only: true, ..quiet_config() };
        match Volume::open(FixedRootDevice::new(catalog.segments().clone(), *commit), ro) {
            Ok(vol) => arbor_engine::fsck::check_files_with(&vol, &mut report, !offline)?,
            Err(e) => report.problems.push(format!("{what}: {e}")),
        }
    }
    bar.finish_and_clear();
    if json_out {
        println!(
            "{}",
            json!({"segments": report.segments, "records": report.records, "roots": roots.len(), "files": report.files,
                   "directories": report.directories, "bytes_verified": report.bytes_verified, "problems": report.problems})
        );
    } else {
        println!(
            "{} segments, {} records, {} roots, {} files, {} directories, {} verified",
            report.segments,
            report.records,
            roots.len(),
            report.files,
            report.directories,
            HumanBytes(report.bytes_verified)
        );
        for p in &report.problems {
            println!("PROBLEM: {p}");
        }
    }
    if !report.problems.is_empty() {
        bail!("{} problems found", report.problems.len());
    }
    Ok(())
}
