//! `arbor serve`: a shared cache of a disk's segment chunks for every node
//! that mounts it, and the owner of the branches it is given; the server
//! itself is `arbor_node::serve`. Here: its signals, its log lines, the
//! service manager, and starting it in the background.

use crate::json::addr_json;
use anyhow::{bail, Context, Result};
use arbor_node::disk;
use arbor_node::serve::{self, ServeOptions};
use arbor_snapshot::CheckpointInfo;
use serde_json::json;
use std::path::PathBuf;

/// What a client's checkpoint request through an owner is answered with
/// (its mount hands it on as the `checkpoint` control reply).
pub fn checkpoint_reply(c: &CheckpointInfo) -> String {
    json!({"name": c.name, "commit": addr_json(c.commit)}).to_string()
}

/// The source objects the disk's imports name, for the server's scope.
pub fn imported_prefixes(
    store: &dyn arbor_engine::bucket::ObjectStore,
) -> std::result::Result<Vec<(String, String)>, String> {
    crate::import::imported_prefixes(store).map_err(|e| format!("{e:#}"))
}

/// An owner that stepped down exits, so that a supervisor starts it anew
/// and it claims the branch again (or finds the new owner holds it).
pub fn exit_on_step_down(branch: &str) {
    tracing::error!(branch = %branch, "no longer the branch's owner; exiting so that a supervisor starts this owner again");
    std::process::exit(75);
}

/// Runs the server (and with `s3`, its S3 endpoint) until SIGINT or SIGTERM.
pub fn run_foreground(opts: &ServeOptions, s3: Option<&arbor_s3::Options>) -> Result<()> {
    if let Some(s3) = s3 {
        arbor_s3::check(s3)?;
    }
    let server = serve::start(opts)?;
    let endpoint = match s3 {
        Some(s3) => match arbor_s3::start(s3, server.roots()) {
            Ok(e) => {
                tracing::info!(listen = %e.addr(), buckets = ?e.branch_buckets(), "serving S3");
                Some(e)
            }
            Err(e) => {
                let _ = server.stop();
                return Err(e.into());
            }
        },
        None => None,
    };
    if let Some(f) = opts.fault {
        tracing::warn!(fault = ?f, "serving with a fault switched on: clients will reject what they get");
    }
    // The handlers are in place before anyone is told the server is
    // ready, so that a SIGTERM sent right after is a clean stop.
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM])?;
    // Said once the stop signals are handled (tests and supervisors wait
    // for this line before they may stop it).
    let tls =
        opts.auth.tls.as_ref().map_or("off", |t| if t.client_ca.is_some() { "on, client certificates" } else { "on" });
    tracing::info!(
        disk = %server.disk_url(),
        listen = %server.addr(),
        cache = %server.cache_place(),
        size = %disk::Size(opts.cache_size),
        objects = %disk::Size(opts.object_memory),
        branches = ?opts.owner.branches,
        tls,
        "serving"
    );
    crate::session::tell_systemd(sd_notify::NotifyState::Ready);
    signals.forever().next();
    crate::session::tell_systemd(sd_notify::NotifyState::Stopping);
    // Requests in flight are answered before the branches close.
    if let Some(e) = endpoint {
        e.stop();
    }
    server.stop()?;
    tracing::info!("stopped");
    Ok(())
}

/// Starts the server as a background process and returns once it accepts
/// connections: (pid, log).
pub fn spawn_background(opts: &ServeOptions, s3: Option<&arbor_s3::Options>) -> Result<(u32, PathBuf)> {
    // Refuse what the child would refuse, here, with the message on the terminal.
    serve::check(opts)?;
    if let Some(s3) = s3 {
        arbor_s3::check(s3)?;
        if s3.listen.rsplit(':').next() == Some("0") {
            bail!("--s3 {}: give a port (port 0 is for --foreground, which logs the one it got)", s3.listen);
        }
        drop(std::net::TcpListener::bind(&s3.listen).with_context(|| format!("--s3: cannot listen on {}", s3.listen))?);
    }
    let log_path = disk::open(&opts.disk)?.log_path("serve");
    for b in &opts.owner.branches {
        arbor_snapshot::check_name(b)?;
    }
    // The process started below is ready once something answers at the
    // address, so the address must be free now: a server already there
    // would look like this one started.
    if opts.listen.rsplit(':').next() == Some("0") {
        bail!("--listen {}: give a port (port 0 is for --foreground, which logs the one it got)", opts.listen);
    }
    drop(std::net::TcpListener::bind(&opts.listen).with_context(|| format!("cannot listen on {}", opts.listen))?);
    let pid = crate::session::spawn_detached(&log_path, "arbor serve", &[], || {
        std::net::TcpStream::connect(&opts.listen).is_ok()
            && s3.is_none_or(|s3| std::net::TcpStream::connect(&s3.listen).is_ok())
    })?;
    Ok((pid, log_path))
}
