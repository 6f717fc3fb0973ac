//! The control socket of a running mount: one JSON request per connection,
//! one JSON reply. Only the user who mounted (and root) may talk to it.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::hash::{Hash, Hasher};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

fn runtime_dir() -> PathBuf {
    // SAFETY: plain syscall.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        return PathBuf::from("/run/arbor");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("arbor"),
        None => PathBuf::from(format!("/tmp/arbor-{uid}")),
    }
}

/// The socket of the mount at `mountpoint`.
pub fn socket_path(mountpoint: &Path) -> Result<PathBuf> {
    let abs = arbor_fs::mount_path(mountpoint);
    let mut h = std::hash::DefaultHasher::new();
    abs.hash(&mut h);
    Ok(runtime_dir().join(format!("{:016x}.sock", h.finish())))
}

/// The uid of the process at the other end of `stream`.
fn peer_uid(stream: &UnixStream) -> Result<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid for getsockopt to fill.
    let rc = unsafe {
        libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &mut len)
    };
    if rc != 0 {
        bail!("cannot read peer credentials: {}", std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

pub struct Server {
    listener: UnixListener,
    path: PathBuf,
    owner: u32,
}

impl Server {
    pub fn bind(mountpoint: &Path) -> Result<Server> {
        let path = socket_path(mountpoint)?;
        let dir = path.parent().ok_or_else(|| anyhow!("bad socket path"))?;
        arbor_engine::private::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(arbor_engine::private::DIR_MODE))?;
        if path.exists() {
            if UnixStream::connect(&path).is_ok() {
                bail!("{} is already served by a running arbor", mountpoint.display());
            }
            std::fs::remove_file(&path)?;
        }
        let listener = UnixListener::bind(&path).with_context(|| format!("cannot bind {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        // SAFETY: plain syscall.
        let owner = unsafe { libc::geteuid() };
        Ok(Server { listener, path, owner })
    }

    /// Serves requests with `handle`, each connection on its own thread
    /// (so `status` answers while an `unmount` waits for uploads), until
    /// `handle` says stop.
    pub fn serve(&self, handle: impl Fn(&Value) -> (Value, bool) + Sync) {
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for stream in self.listener.incoming() {
                if stop.load(std::sync::atomic::Ordering::Acquire) {
                    break;
                }
                let Ok(mut stream) = stream else { continue };
                let uid = peer_uid(&stream).unwrap_or(u32::MAX);
                if uid != self.owner && uid != 0 {
                    tracing::warn!(uid, "refused a control request from another user");
                    let _ = writeln!(stream, "{}", json!({"ok": false, "error": "permission denied"}));
                    continue;
                }
                let (handle, stop, path) = (&handle, &stop, &self.path);
                s.spawn(move || {
                    let mut line = String::new();
                    if BufReader::new(&stream).read_line(&mut line).is_err() {
                        return;
                    }
                    let (reply, done) = match serde_json::from_str::<Value>(&line) {
                        Ok(req) => handle(&req),
                        Err(e) => (json!({"ok": false, "error": format!("bad request: {e}")}), false),
                    };
                    let _ = writeln!(stream, "{reply}");
                    if done {
                        stop.store(true, std::sync::atomic::Ordering::Release);
                        // Wake the accept loop so it sees the flag.
                        let _ = UnixStream::connect(path);
                    }
                });
            }
        });
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How long a mount has to answer `status`: a process that takes longer
/// (stopped, wedged) is alive but unresponsive, and whoever asked must not
/// wait on it forever (the node plugin holds a volume's lock meanwhile).
/// Other requests (an unmount's flush, a checkpoint) take what they take.
pub const STATUS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Said in the error of a request a live mount did not answer in time.
pub const UNRESPONSIVE: &str = "alive but unresponsive";

fn answer_within(req: &Value) -> Option<std::time::Duration> {
    (req["op"] == "status").then_some(STATUS_TIMEOUT)
}

/// Sends one request to the mount at `mountpoint` and returns its result.
pub fn request(mountpoint: &Path, req: Value) -> Result<Value> {
    let path = socket_path(mountpoint)?;
    let mut stream = UnixStream::connect(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
            anyhow!("{} is not an arbor mount served on this node", mountpoint.display())
        }
        _ => anyhow!("cannot reach the arbor mount at {}: {}", mountpoint.display(), arbor_node::disk::io_cause(&e)),
    })?;
    let limit = answer_within(&req);
    stream.set_read_timeout(limit)?;
    stream.set_write_timeout(limit)?;
    let unresponsive = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => anyhow!(
            "the arbor mount at {} does not answer (waited {:?}): {UNRESPONSIVE}",
            mountpoint.display(),
            limit.unwrap_or_default()
        ),
        _ => e.into(),
    };
    writeln!(stream, "{req}").map_err(unresponsive)?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(unresponsive)?;
    let reply: Value = serde_json::from_str(&line).context("bad reply from the mount")?;
    if reply["ok"] == json!(true) {
        Ok(reply["result"].clone())
    } else {
        bail!("{}", reply["error"].as_str().unwrap_or("request failed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_request_to_a_mount_that_never_answers_fails_in_time() {
        let mountpoint = std::env::temp_dir().join(format!("arbor-control-silent-{}", std::process::id()));
        let path = socket_path(&mountpoint).expect("path");
        arbor_engine::private::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        let _ = std::fs::remove_file(&path);
        // Accepts (the kernel does, into the backlog) and never answers.
        let listener = UnixListener::bind(&path).expect("bind");
        let t = std::time::Instant::now();
        let err = request(&mountpoint, json!({"op": "status"})).expect_err("no answer");
        let _ = std::fs::remove_file(&path);
        drop(listener);
        assert!(format!("{err:#}").contains(UNRESPONSIVE), "{err:#}");
        assert!(t.elapsed() < STATUS_TIMEOUT * 2, "waited {:?}", t.elapsed());
    }
}
