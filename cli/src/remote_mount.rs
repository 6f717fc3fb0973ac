//! `arbor mount` of a branch another process owns (`arbor serve
//! --branch`): the client `arbor_node` connected, mounted, and its control
//! requests answered until it is unmounted or signalled.

use crate::control;
use crate::json::{addr_json, cache_servers_json, with_fuse};
use crate::session::{serve_until_stopped, unmount_request};
use anyhow::{Context, Result};
use arbor_engine::files::Files;
use arbor_fs::MountOptions;
use arbor_net::{BranchClient, CacheClient};
use arbor_node::disk::Disk;
use serde_json::json;
use std::path::Path;
use std::sync::Arc;

/// Where a client mount goes: its disk, its mount point, the `/dev/fuse`
/// file of a live mount to take over, and who else holds its connection
/// (see `keeper/`).
pub struct At<'a> {
    pub disk: &'a Arc<Disk>,
    pub mountpoint: &'a Path,
    pub resume: Option<std::os::fd::OwnedFd>,
    pub holder: &'a crate::keeper::Holder,
}

/// Mounts branch `name` through its owner (`files`, the client connected
/// to it), and serves until unmounted or signalled.
pub fn mount(
    at: At<'_>,
    name: String,
    files: Arc<BranchClient>,
    opts: &MountOptions,
    cache_client: Option<Arc<CacheClient>>,
    metrics: Option<std::net::SocketAddr>,
) -> Result<()> {
    let (d, mountpoint) = (at.disk, at.mountpoint);
    let control = control::Server::bind(mountpoint)?;
    let fuse_counters = Arc::new(std::sync::OnceLock::new());
    let sources = crate::mount_metrics::Sources {
        fuse: fuse_counters.clone(),
        disk: d.clone(),
        vol: None,
        servers: cache_client.clone(),
    };
    let endpoint = metrics.map(|addr| sources.serve(addr)).transpose()?;
    if opts.restartable {
        // A write answered while on its way would die with this process.
        files.write_synchronously();
    }
    let resuming = at.resume.is_some();
    let handle = match at.resume {
        Some(dev) => arbor_fs::resume(files.clone(), dev, mountpoint, opts)
            .with_context(|| format!("cannot take the mount at {} over", mountpoint.display()))?,
        None => arbor_fs::mount(files.clone(), mountpoint, opts)
            .with_context(|| format!("cannot mount at {}", mountpoint.display()))?,
    };
    if let Some(dev) = handle.device() {
        at.holder.hand_over(mountpoint, dev, resuming)?;
    }
    let _ = fuse_counters.set(handle.counters().clone());
    files.follow(handle.invalidator())?;
    let owner = files.stats().owner.unwrap_or_default();
    let fuse = (handle.transport().clone(), handle.counters().clone());
    tracing::info!(mountpoint = %mountpoint.display(), disk = %d.url, branch = %name, %owner, fuse = %fuse.0.describe(), resuming, "mounted through the owner");
    let (url, mp, view) = (d.url.clone(), mountpoint.to_path_buf(), files.clone());
    let keeper_socket = match at.holder {
        crate::keeper::Holder::Keeper(k) => Some(k.socket().to_path_buf()),
        _ => None,
    };
    // Each write was answered once the owner had it (`write_synchronously`).
    let hand_over = at.holder.on_term(mountpoint, handle.device(), || Ok(()));
    let stopped = serve_until_stopped(handle, control, hand_over, move |req, tx| match req["op"].as_str() {
        Some("status") => {
            let s = view.stats();
            let mut result = json!({
                "mountpoint": mp,
                "disk": url,
                "branch": name,
                "pid": std::process::id(),
                "keeper_pid": crate::keeper::keeper_pid(),
                "keeper_socket": keeper_socket,
                "read_only": false,
                "owner": s.owner,
                "owner_retries": s.retries,
                "owner_lookups": s.owner_lookups,
                "owner_sessions": s.sessions,
                "open_files": s.open_files,
                "reads": {
                    "from_segments": s.direct_reads,
                    "from_segments_bytes": s.direct_bytes,
                    "from_owner": s.owner_reads,
                    "from_owner_bytes": s.owner_bytes,
                    "locates": s.locates,
                    "segment_reads_failed": s.direct_failed,
                },
                "cache_servers": cache_servers_json(cache_client.as_deref()),
            });
            with_fuse(&mut result, &fuse);
            (json!({"ok": true, "result": result}), false)
        }
        Some("unmount") => unmount_request(tx),
        Some("commit") => match view.commit() {
            Ok(a) => (json!({"ok": true, "result": addr_json(a)}), false),
            Err(e) => (json!({"ok": false, "error": e.to_string()}), false),
        },
        Some("checkpoint") => {
            let Some(cp) = req["name"].as_str() else { return (json!({"ok": false, "error": "no name"}), false) };
            match view.checkpoint(cp) {
                Ok(made) => {
                    (json!({"ok": true, "result": serde_json::from_str::<serde_json::Value>(&made).ok()}), false)
                }
                Err(e) => (json!({"ok": false, "error": e}), false),
            }
        }
        Some(op) => (
            json!({"ok": false, "error": format!(
                "this mount writes through the owner at {}; run {op} against the disk on the owner's node",
                view.stats().owner.unwrap_or_default()
            )}),
            false,
        ),
        None => (json!({"ok": false, "error": "no op"}), false),
    })?;
    at.holder.released(mountpoint);
    drop(endpoint);
    let closed = Files::close(&*files);
    stopped.report(closed.as_ref().map(|_| ()).map_err(|e| e.to_string()));
    closed?;
    d.remove_own_cache();
    tracing::info!("unmounted cleanly");
    Ok(())
}
