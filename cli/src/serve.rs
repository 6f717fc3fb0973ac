//! `arbor mount`: the process that serves one branch of a disk.

use crate::control;
use crate::disk::{self, Disk};
use anyhow::{bail, Context, Result};
use arbor_engine::device::FileDevice;
use arbor_engine::io::IoMode;
use arbor_engine::volume::{Config, Volume};
use arbor_engine::Error;
use arbor_fs::MountOptions;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub struct MountArgs {
    pub disk: String,
    pub mountpoint: PathBuf,
    pub branch: String,
    pub cache_dir: Option<PathBuf>,
    pub read_ahead: u32,
    pub allow_other: bool,
}

enum Event {
    Stop(&'static str),
    Unmount(mpsc::Sender<()>),
}

struct Prepared {
    disk: Disk,
    mountpoint: PathBuf,
    cache_dir: PathBuf,
}

fn prepare(args: &MountArgs) -> Result<Prepared> {
    disk::check_branch_name(&args.branch)?;
    let disk = Disk::open(&args.disk)?;
    let mountpoint = std::path::absolute(&args.mountpoint)?;
    arbor_fs::recover_stale_mount(&mountpoint)?;
    if !mountpoint.is_dir() {
        bail!("mountpoint {} is not a directory", mountpoint.display());
    }
    if disk::is_mountpoint(&mountpoint) {
        bail!("{} is busy: something is already mounted there", mountpoint.display());
    }
    let cache_dir = match &args.cache_dir {
        Some(d) => std::path::absolute(d)?,
        None => disk.default_cache_dir(&args.branch),
    };
    if args.branch != "main" && !cache_dir.join("superblock").exists() {
        bail!("no branch {:?} on {} (branches other than main are not built yet)", args.branch, disk.root.display());
    }
    Ok(Prepared { disk, mountpoint, cache_dir })
}

fn status(p: &Prepared, branch: &str, vol: &Volume) -> Value {
    let s = vol.stats();
    json!({
        "mountpoint": p.mountpoint,
        "disk": p.disk.root,
        "branch": branch,
        "cache_dir": p.cache_dir,
        "pid": std::process::id(),
        "read_only": s.read_only,
        "poisoned": s.poisoned,
        "io_backend": s.io_backend,
        "writer": format!("{:016x}", s.writer),
        "last_seq": s.last_seq,
        "durable_seq": s.durable_seq,
        "ops_since_commit": s.ops_since_commit,
        "inodes_allocated": s.inodes_allocated,
        "node_cache_bytes": s.node_cache_bytes,
        "segment": s.log_position.map(|(seg, off)| json!({"name": seg.file_name(), "bytes": off})),
        "pending_upload_bytes": 0,
    })
}

/// Mounts and serves until unmounted, signalled, or asked to stop.
pub fn run_foreground(args: &MountArgs) -> Result<()> {
    let p = prepare(args)?;
    let device = FileDevice::open_exclusive(&p.cache_dir, IoMode::Auto).map_err(|e| match e {
        Error::Busy(msg) => anyhow::anyhow!("branch {} is already mounted read-write ({msg})", args.branch),
        e => anyhow::Error::from(e).context(format!("cannot open the cache directory {}", p.cache_dir.display())),
    })?;
    let vol = Volume::open(device, Config::default()).context("cannot open the volume")?;
    let control = control::Server::bind(&p.mountpoint)?;
    let opts = MountOptions { allow_other: args.allow_other, read_ahead: args.read_ahead, ..MountOptions::default() };
    let handle = arbor_fs::mount(vol.clone(), &p.mountpoint, &opts)
        .with_context(|| format!("cannot mount at {}", p.mountpoint.display()))?;
    tracing::info!(mountpoint = %p.mountpoint.display(), disk = %p.disk.root.display(), branch = %args.branch, "mounted");

    let (tx, rx) = mpsc::channel();
    let sig_tx = tx.clone();
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM, libc::SIGHUP])?;
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            let _ = sig_tx.send(Event::Stop("signal"));
        }
    });
    let ctl_vol = vol.clone();
    let branch = args.branch.clone();
    let p2 =
        Prepared { disk: Disk::open(&args.disk)?, mountpoint: p.mountpoint.clone(), cache_dir: p.cache_dir.clone() };
    let (replied_tx, replied_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        control.serve(|req| match req["op"].as_str() {
            Some("status") => (json!({"ok": true, "result": status(&p2, &branch, &ctl_vol)}), false),
            Some("sync") => match ctl_vol.sync_all().and_then(|_| ctl_vol.commit()) {
                Ok(()) => (json!({"ok": true, "result": null}), false),
                Err(e) => (json!({"ok": false, "error": e.to_string()}), false),
            },
            Some("unmount") => {
                let (ack_tx, ack_rx) = mpsc::channel();
                let _ = tx.send(Event::Unmount(ack_tx));
                let _ = ack_rx.recv_timeout(Duration::from_secs(600));
                (json!({"ok": true, "result": null}), true)
            }
            other => (json!({"ok": false, "error": format!("unknown request {other:?}")}), false),
        });
        // The unmount reply is written: the process may exit now.
        let _ = replied_tx.send(());
    });

    let mut ack = None;
    let unmount = loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(Event::Stop(why)) => {
                tracing::info!(why, "unmounting");
                break true;
            }
            Ok(Event::Unmount(a)) => {
                ack = Some(a);
                break true;
            }
            Err(mpsc::RecvTimeoutError::Timeout) if handle.is_finished() => break false,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break true,
        }
    };
    let ended = if unmount { handle.unmount() } else { handle.join() };
    if let Err(e) = ended {
        tracing::warn!(error = %e, "session ended with an error");
    }
    let closed = vol.close();
    drop(vol);
    if let Some(a) = ack {
        let _ = a.send(());
        let _ = replied_rx.recv_timeout(Duration::from_secs(5));
    }
    closed.context("final commit failed")?;
    tracing::info!("unmounted cleanly");
    Ok(())
}

/// Starts `arbor mount … --foreground` in the background, logging to a
/// file, and returns once the file system answers.
pub fn spawn_background(args: &MountArgs) -> Result<PathBuf> {
    use std::os::unix::process::CommandExt;
    let p = prepare(args)?;
    std::fs::create_dir_all(&p.cache_dir)?;
    let log_path = p.cache_dir.join("arbor.log");
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path)?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1)).arg("--foreground");
    cmd.stdin(std::process::Stdio::null()).stdout(log.try_clone()?).stderr(log);
    // SAFETY: setsid is async-signal-safe; it detaches the server from our terminal.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("cannot start the mount process")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            bail!("mount failed ({status}): {}", last_line(&log_path));
        }
        if disk::is_mountpoint(&p.mountpoint) && control::request(&p.mountpoint, json!({"op": "status"})).is_ok() {
            return Ok(log_path);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    bail!("mount did not answer within 60 s; see {}", log_path.display())
}

fn last_line(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no log output");
    line.split_once("arbor: ").map_or(line, |(_, msg)| msg).to_string()
}

/// Unmounts through the control socket (which waits for the final
/// commit), or detaches a mount whose server is gone.
pub fn unmount(mountpoint: &Path) -> Result<()> {
    match control::request(mountpoint, json!({"op": "unmount"})) {
        Ok(_) => {}
        Err(e) => {
            if !disk::is_mountpoint(mountpoint) {
                return Err(e);
            }
            arbor_fs::recover_stale_mount(mountpoint)?;
            if disk::is_mountpoint(mountpoint) {
                bail!("{} is mounted but not served by arbor on this node", mountpoint.display());
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while disk::is_mountpoint(mountpoint) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
