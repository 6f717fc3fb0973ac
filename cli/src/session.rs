//! The life of a long-running process (a mount, a server): started in the
//! background as a detached child, told to systemd, and for a mount,
//! answering its control socket until a signal or an unmount stops it.

use crate::control;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub enum Event {
    Stop(&'static str),
    /// SIGTERM to a mount an `arbor keeper` holds: leave it to the keeper.
    HandOver,
    /// Unmount, then report how closing the volume went.
    Unmount(mpsc::Sender<Result<(), String>>),
}

/// How a mount was stopped: who waits to hear how closing went.
pub struct Stopped {
    ack: Option<mpsc::Sender<Result<(), String>>>,
    replied: mpsc::Receiver<()>,
}

impl Stopped {
    /// Tells an `arbor unmount` waiting on the control socket how closing went.
    pub fn report(self, closed: Result<(), String>) {
        if let Some(a) = self.ack {
            let _ = a.send(closed);
            let _ = self.replied.recv_timeout(Duration::from_secs(5));
        }
    }
}

/// What SIGTERM does to a mount whose connection an `arbor keeper` holds:
/// this makes what the process answered durable, and the process then
/// exits without unmounting. The kernel mount stays, held by the keeper,
/// and the next `arbor mount --keeper` there takes it over: a `systemctl
/// restart` restarts the mount in place. (SIGINT, SIGHUP and `arbor
/// unmount` still unmount.)
/// It first hands the keeper the connection again, and unmounts as any
/// signal does unless the keeper says it holds it: a keeper down or
/// restarted since holds nothing, and the mount would be left without a
/// server or a connection (ENOTCONN).
pub type HandOver = Box<dyn FnOnce() -> Handed + Send>;

/// What a [`HandOver`] did.
pub enum Handed {
    /// The keeper holds the connection; the flush's result.
    Kept(Result<(), String>),
    /// The keeper does not hold it (why): the mount is to be unmounted.
    NotHeld(String),
}

/// Answers control requests with `handle` until a signal, an unmount
/// request, or an unmount from outside, then unmounts; or, on SIGTERM
/// with a `hand_over`, runs it and exits leaving the mount in place.
pub fn serve_until_stopped(
    handle: arbor_fs::MountHandle,
    control: control::Server,
    hand_over: Option<HandOver>,
    handle_req: impl Fn(&Value, &mpsc::Sender<Event>) -> (Value, bool) + Send + Sync + 'static,
) -> Result<Stopped> {
    let (tx, rx) = mpsc::channel();
    let sig_tx = tx.clone();
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM, libc::SIGHUP])?;
    let term_hands_over = hand_over.is_some();
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            let _ = sig_tx.send(match sig {
                libc::SIGTERM if term_hands_over => Event::HandOver,
                _ => Event::Stop("signal"),
            });
        }
    });
    let mut hand_over = hand_over;
    let (replied_tx, replied_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        control.serve(|req| handle_req(req, &tx));
        let _ = replied_tx.send(());
    });
    // Mounted, and its control socket bound: `arbor status` answers.
    tell_systemd(sd_notify::NotifyState::Ready);
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
            Ok(Event::HandOver) => {
                let flushed = match hand_over.take().map(|f| f()) {
                    Some(Handed::Kept(flushed)) => flushed,
                    Some(Handed::NotHeld(why)) => {
                        tracing::warn!(why, "SIGTERM: the keeper does not hold the FUSE connection; unmounting");
                        break true;
                    }
                    None => break true,
                };
                match &flushed {
                    Ok(()) => tracing::info!("SIGTERM: everything answered is durable; the keeper keeps the mount"),
                    Err(e) => tracing::error!(error = e, "SIGTERM: a final sync failed; the keeper keeps the mount"),
                }
                // No unmount: the session's handle must not be dropped,
                // and nothing else is left to do.
                std::process::exit(if flushed.is_ok() { 0 } else { 1 });
            }
            Err(mpsc::RecvTimeoutError::Timeout) if handle.is_finished() => break false,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break true,
        }
    };
    tell_systemd(sd_notify::NotifyState::Stopping);
    crate::keeper::unmounting();
    let ended = if unmount { handle.unmount() } else { handle.join() };
    if let Err(e) = ended {
        tracing::warn!(error = %e, "session ended with an error");
    }
    Ok(Stopped { ack, replied: replied_rx })
}

/// Tells the service manager how this foreground process stands, when it
/// runs as a `Type=notify` systemd unit (`NOTIFY_SOCKET` set): ready once
/// it serves, stopping once it begins to close. Nothing otherwise.
pub fn tell_systemd(state: sd_notify::NotifyState<'_>) {
    if crate::keeper::tell_keeper(&state.to_string()) {
        return;
    }
    if let Err(e) = sd_notify::notify(&[state]) {
        tracing::warn!(error = %e, "cannot notify systemd (NOTIFY_SOCKET)");
    }
}

/// The `unmount` control request: unmounts, and answers once closing is done.
pub fn unmount_request(tx: &mpsc::Sender<Event>) -> (Value, bool) {
    let (ack_tx, ack_rx) = mpsc::channel();
    let _ = tx.send(Event::Unmount(ack_tx));
    match ack_rx.recv_timeout(Duration::from_secs(600)) {
        Ok(Ok(())) => (json!({"ok": true, "result": null}), true),
        Ok(Err(e)) => (json!({"ok": false, "error": format!("unmounted, but closing failed: {e}")}), true),
        Err(_) => (
            json!({"ok": false, "error": format!(
                "unmounted, but still uploading after 10 minutes; the server (pid {}) keeps trying: see its log",
                std::process::id()
            )}),
            true,
        ),
    }
}

/// Runs this command again with `--foreground` (and `env`) as a process of
/// its own session, logging to `log_path`, and returns its pid once `ready` says
/// so (within 60 s); a child that exits first fails with its last log line.
pub fn spawn_detached(
    log_path: &Path,
    what: &str,
    env: &[(&str, &str)],
    mut ready: impl FnMut() -> bool,
) -> Result<u32> {
    use std::os::unix::process::CommandExt;
    arbor_engine::private::create_dir_all(log_path.parent().unwrap_or(Path::new(".")))?;
    let log = arbor_engine::private::options().create(true).append(true).open(log_path)?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1)).arg("--foreground").envs(env.iter().copied());
    // The child is not the process a service manager started: readiness
    // is this process's exit (a `Type=forking` unit).
    cmd.env_remove("NOTIFY_SOCKET");
    cmd.stdin(std::process::Stdio::null()).stdout(log.try_clone()?).stderr(log);
    // SAFETY: setsid is async-signal-safe; it detaches the child from our terminal.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().with_context(|| format!("cannot start the {what} process"))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            bail!("{what} failed ({status}): {}", last_line(log_path));
        }
        if ready() {
            return Ok(child.id());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    bail!("{what} did not answer within 60 s; see {}", log_path.display())
}

fn last_line(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no log output");
    line.split_once("arbor: ").map_or(line, |(_, msg)| msg).to_string()
}
