//! `arbor keeper --socket PATH`: holds the `/dev/fuse` file of mounts that
//! run elsewhere, keyed by mount point, so that a mount process killed
//! with everything around it (`systemctl restart`, a container's restart)
//! comes back on the same kernel mount: its successor takes the file from
//! here and the connection over (`arbor_fs::resume`).
//!
//! It opens no disk and serves no request of a mount. A file is dropped
//! when its mount is gone (the mount point no longer in this process's
//! mount table with the device it had, or the connection aborted), on a
//! `release`, or when a new mount at the same path deposits its own; a
//! dead connection is never handed out, nor one whose mount table cannot
//! be read (it is kept), nor one a process that deposited it still lives
//! to serve (its pidfd says so).

use super::fds;
use super::protocol::{HELLO, VERSION};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How often held files are checked against the mount table.
pub const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// How long a connection may stay silent before the keeper hangs up.
const IDLE: i64 = 30;

/// `/dev/fuse`'s device number (misc 229).
const FUSE_MAJOR: u32 = 10;
const FUSE_MINOR: u32 = 229;

/// A mount's connection, the device its mount had when it came, and the
/// processes that deposited it (each may still serve it).
struct Held {
    dev: OwnedFd,
    device: String,
    servers: Vec<Peer>,
}

/// A client process, as the keeper sees it: its pid (in the keeper's PID
/// namespace) and a pidfd, which says when that very process has exited
/// however its pid is reused or whichever namespace it runs in.
struct Peer {
    pid: i32,
    pidfd: Option<OwnedFd>,
}

impl Peer {
    /// The process at the other end of `conn`: `SO_PEERPIDFD` (Linux 6.5),
    /// else a pidfd opened from its pid, which a pid reused between the
    /// connect and this call would fool.
    fn of(conn: &OwnedFd) -> Peer {
        let pid = nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::PeerCredentials).map_or(0, |c| c.pid());
        let pidfd = fds::peer_pidfd(conn).ok().or_else(|| fds::pidfd_open(pid).ok());
        Peer { pid, pidfd }
    }

    fn try_clone(&self) -> Peer {
        Peer { pid: self.pid, pidfd: self.pidfd.as_ref().and_then(|f| f.try_clone().ok()) }
    }

    /// Whether the process has not exited. Without a pidfd, a pid that
    /// answers signal 0.
    fn alive(&self) -> bool {
        match &self.pidfd {
            Some(fd) => !fds::exited(fd, 0),
            // SAFETY: signal 0 only asks whether the process exists.
            None => self.pid > 0 && unsafe { libc::kill(self.pid, 0) } == 0,
        }
    }
}

/// How long `get` waits for a previous server that is dying (a kill -9 in
/// flight) before it refuses.
const DYING: Duration = Duration::from_secs(2);

type Table = Arc<parking_lot::Mutex<HashMap<PathBuf, Held>>>;

/// Serves until SIGTERM or SIGINT; the files it holds close with it (their
/// mounts go on, served by their processes, without a keeper).
pub fn run(socket: &Path) -> Result<()> {
    let listener = bind(socket)?;
    let bound = file_id(socket)?;
    let table: Table = Default::default();
    let t = table.clone();
    std::thread::Builder::new().name("arbor-keeper-sweep".into()).spawn(move || loop {
        std::thread::sleep(SWEEP_EVERY);
        sweep(&t);
    })?;
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM])?;
    let path = socket.to_path_buf();
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            remove_if_bound(&path, bound);
            tracing::info!("stopped; the mounts it held go on without a keeper");
            std::process::exit(0);
        }
    });
    tracing::info!(socket = %socket.display(), version = VERSION, "keeping FUSE connections");
    crate::session::tell_systemd(sd_notify::NotifyState::Ready);
    loop {
        // A failed accept (out of descriptors, say) must not end the
        // keeper: every mount it holds would lose its keeper with it.
        let conn = match fds::accept(listener.as_fd()) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot accept a connection");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let t = table.clone();
        std::thread::spawn(move || {
            if let Err(e) = serve(&conn, &t) {
                tracing::debug!(error = %e, "a connection ended");
            }
        });
    }
}

/// What tells the file at `path` from another there later: device, inode
/// and change time (a freed inode number is soon given to the next file).
type FileId = (u64, u64, i64, i64);

fn file_id(path: &Path) -> std::io::Result<FileId> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Removes the socket at `path` if it is still the one this keeper bound
/// (`bound`): a successor may have replaced it already, and its socket
/// must stay.
fn remove_if_bound(path: &Path, bound: FileId) {
    if file_id(path).is_ok_and(|id| id == bound) {
        let _ = std::fs::remove_file(path);
    }
}

/// Binds `socket` (0600): a stale file is replaced, a live keeper refused.
fn bind(socket: &Path) -> Result<OwnedFd> {
    if let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) {
        arbor_engine::private::create_dir_all(dir)?;
    }
    if socket.exists() {
        if fds::connect(socket).is_ok() {
            bail!("a keeper already serves {}", socket.display());
        }
        std::fs::remove_file(socket)?;
    }
    let listener = fds::listen(socket).with_context(|| format!("cannot bind {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// One connection: the hello, then requests until the client hangs up.
fn serve(conn: &OwnedFd, table: &Table) -> std::io::Result<()> {
    fds::set_timeouts(conn, IDLE)?;
    // SAFETY: plain syscall.
    let me = unsafe { libc::geteuid() };
    let uid = fds::peer_uid(conn)?;
    if uid != 0 && uid != me {
        tracing::warn!(uid, "refused a connection from another user");
        return fds::send(conn.as_fd(), refusal("permission denied").as_bytes(), None);
    }
    let peer = Peer::of(conn);
    let mut greeted = false;
    loop {
        let (bytes, fd) = match fds::receive(conn.as_fd()) {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(()),
            // Too many descriptors, or more than fit: refused, and the
            // connection goes on.
            Err(e)
                if matches!(e.kind(), std::io::ErrorKind::InvalidInput) || e.raw_os_error() == Some(libc::ENOBUFS) =>
            {
                fds::send(conn.as_fd(), refusal(&format!("bad request: {e}")).as_bytes(), None)?;
                continue;
            }
            Err(e) => return Err(e),
        };
        let (answer, give) = match serde_json::from_slice::<Value>(&bytes) {
            Err(e) => (json!({"ok": false, "error": format!("bad request: {e}")}), None),
            Ok(req) if !greeted => match hello(&req) {
                Ok(a) => {
                    greeted = true;
                    (a, None)
                }
                Err(e) => {
                    return fds::send(conn.as_fd(), refusal(&e).as_bytes(), None);
                }
            },
            Ok(req) => handle(&req, fd, &peer, table),
        };
        let dev = give.as_ref().map(|d: &OwnedFd| d.as_fd());
        fds::send(conn.as_fd(), answer.to_string().as_bytes(), dev)?;
    }
}

fn refusal(error: &str) -> String {
    json!({"ok": false, "error": error}).to_string()
}

fn hello(req: &Value) -> Result<Value, String> {
    if req["hello"].as_str() != Some(HELLO) {
        return Err(format!("expected a hello ({{\"hello\":\"{HELLO}\",\"version\":{VERSION}}}) first"));
    }
    match req["version"].as_u64() {
        Some(VERSION) => Ok(json!({"ok": true, "version": VERSION, "pid": std::process::id()})),
        v => Err(format!("this keeper speaks version {VERSION}, not {v:?}")),
    }
}

/// Answers one request; the descriptor to send with the answer, if any.
fn handle(req: &Value, fd: Option<OwnedFd>, peer: &Peer, table: &Table) -> (Value, Option<OwnedFd>) {
    let done = match req["op"].as_str() {
        Some("list") => {
            let mut held: Vec<String> = table.lock().keys().map(|p| p.display().to_string()).collect();
            held.sort();
            Ok((json!({"ok": true, "mountpoints": held}), None))
        }
        Some(op @ ("deposit" | "get" | "release")) => mountpoint(req).and_then(|mp| match op {
            "deposit" => deposit(table, mp, req["device"].as_str(), fd, peer).map(|()| (json!({"ok": true}), None)),
            "get" => Ok(get(table, &mp)),
            _ => Ok((json!({"ok": true, "held": table.lock().remove(&mp).is_some()}), None)),
        }),
        other => Err(format!("unknown request {other:?}")),
    };
    done.unwrap_or_else(|e| (json!({"ok": false, "error": e}), None))
}

fn mountpoint(req: &Value) -> Result<PathBuf, String> {
    let p = req["mountpoint"].as_str().ok_or("no mountpoint")?;
    let p = Path::new(p);
    if !p.is_absolute() {
        return Err(format!("mountpoint {p:?} is not an absolute path"));
    }
    Ok(p.to_path_buf())
}

/// Keeps `fd` for the mount at `mp`: it must be `/dev/fuse`, and `mp` a
/// FUSE mount this process sees, of the device the depositor's mount has
/// (`claimed`: a connection is never filed under another mount that came
/// to the path since). `peer` is counted among its servers.
fn deposit(table: &Table, mp: PathBuf, claimed: Option<&str>, fd: Option<OwnedFd>, peer: &Peer) -> Result<(), String> {
    let dev = fd.ok_or("a deposit carries the mount's /dev/fuse descriptor")?;
    let st = nix::sys::stat::fstat(&dev).map_err(|e| format!("fstat: {e}"))?;
    let fuse = libc::makedev(FUSE_MAJOR, FUSE_MINOR);
    if st.st_mode & libc::S_IFMT != libc::S_IFCHR || st.st_rdev != fuse {
        return Err("the descriptor is not /dev/fuse".into());
    }
    let device =
        fuse_device(&mp)?.ok_or_else(|| format!("no FUSE mount at {} in the keeper's mount table", mp.display()))?;
    same_mount(&mp, claimed, &device)?;
    if !connected(&dev) {
        return Err("the connection is already over".into());
    }
    let mut t = table.lock();
    // Mounts deposit again now and then (for a keeper started since):
    // the same connection again is no news.
    let mut servers = match t.remove(&mp) {
        Some(h) if h.device == device => h.servers,
        _ => {
            tracing::info!(mountpoint = %mp.display(), device, "holding");
            Vec::new()
        }
    };
    servers.retain(|s| s.pid != peer.pid && s.alive());
    servers.push(peer.try_clone());
    t.insert(mp, Held { dev, device, servers });
    Ok(())
}

/// Whether the mount at `mp` (of device `found`) is the depositor's,
/// whose device it `claimed`.
fn same_mount(mp: &Path, claimed: Option<&str>, found: &str) -> Result<(), String> {
    match claimed {
        None => Err("a deposit names its mount's device".into()),
        Some(c) if c == found => Ok(()),
        Some(c) => Err(format!("the mount at {} is device {found}, not the depositor's {c}", mp.display())),
    }
}

/// A copy of the connection held for `mp`, if it is still live and none
/// of the processes that deposited it is alive: two servers reading one
/// connection would each answer half of its requests. The control socket
/// cannot tell (it is per user and per mount namespace); the pidfds can.
fn get(table: &Table, mp: &Path) -> (Value, Option<OwnedFd>) {
    let servers: Vec<Peer> =
        table.lock().get(mp).map_or_else(Vec::new, |h| h.servers.iter().map(Peer::try_clone).collect());
    let deadline = std::time::Instant::now() + DYING;
    for s in &servers {
        let wait = deadline.saturating_duration_since(std::time::Instant::now());
        let exited = s
            .pidfd
            .as_ref()
            .map_or_else(|| !s.alive(), |fd| fds::exited(fd, wait.as_millis().min(u128::from(u16::MAX)) as u16));
        if !exited {
            tracing::warn!(mountpoint = %mp.display(), pid = s.pid, "refused the connection: its server is alive");
            let error = format!("{} is still served by pid {} (as the keeper sees it)", mp.display(), s.pid);
            return (json!({"ok": false, "error": error}), None);
        }
    }
    let mut t = table.lock();
    match t.get(mp).map(|h| live(mp, h)) {
        Some(Live::Dead(why)) => {
            tracing::info!(mountpoint = %mp.display(), why, "dropping a dead connection");
            t.remove(mp);
        }
        Some(Live::Unknown(why)) => return (json!({"ok": false, "error": why}), None),
        Some(Live::Yes) | None => {}
    }
    match t.get(mp).map(|h| h.dev.try_clone()) {
        Some(Ok(copy)) => {
            tracing::info!(mountpoint = %mp.display(), "handing the connection to a new server");
            (json!({"ok": true, "held": true}), Some(copy))
        }
        Some(Err(e)) => (json!({"ok": false, "error": format!("cannot copy the descriptor: {e}")}), None),
        None => (json!({"ok": true, "held": false}), None),
    }
}

/// Drops every connection whose mount is gone.
fn sweep(table: &Table) {
    table.lock().retain(|mp, h| match live(mp, h) {
        Live::Yes => true,
        Live::Unknown(why) => {
            tracing::warn!(mountpoint = %mp.display(), why, "keeping a connection it cannot check");
            true
        }
        Live::Dead(why) => {
            tracing::info!(mountpoint = %mp.display(), why, "dropping a connection");
            false
        }
    });
}

/// Whether a held connection still serves its mount.
enum Live {
    Yes,
    /// Its mount is gone (why): the connection is dropped.
    Dead(String),
    /// The mount table cannot be read (why): the connection is kept, and
    /// handed to no one until it can be checked.
    Unknown(String),
}

/// Whether the connection held for `mp` still serves the mount there.
fn live(mp: &Path, h: &Held) -> Live {
    judge(h, fuse_device(mp))
}

/// [`live`], given what the mount table says is at the path now.
fn judge(h: &Held, now: Result<Option<String>, String>) -> Live {
    if !connected(&h.dev) {
        return Live::Dead("the connection was aborted".into());
    }
    match now {
        Err(e) => Live::Unknown(e),
        Ok(Some(d)) if d == h.device => Live::Yes,
        Ok(Some(d)) => Live::Dead(format!("another file system ({d}) is mounted there now")),
        Ok(None) => Live::Dead("unmounted".into()),
    }
}

/// The device of the FUSE mount on top at `mp` (`MAJOR:MINOR`), if any.
pub fn fuse_device(mp: &Path) -> Result<Option<String>, String> {
    let at = arbor_csi::mounts::mounts_at(mp).map_err(|e| format!("reading the mount table: {e}"))?;
    Ok(at.last().filter(|m| m.fs_type.starts_with("fuse")).map(|m| m.device.clone()))
}

/// False once the kernel ended the connection (an unmount, an abort):
/// `poll` then reports an error on `/dev/fuse`.
fn connected(dev: &OwnedFd) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut p = [PollFd::new(dev.as_fd(), PollFlags::POLLIN)];
    match poll(&mut p, PollTimeout::ZERO) {
        Ok(_) => !p[0].revents().is_some_and(|r| r.intersects(PollFlags::POLLERR | PollFlags::POLLHUP)),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_kept_while_the_mount_table_cannot_be_read() {
        let file = tempfile::tempfile().expect("tempfile");
        let h = Held { dev: file.into(), device: "0:41".into(), servers: Vec::new() };
        assert!(matches!(judge(&h, Err("EMFILE".into())), Live::Unknown(_)));
        assert!(matches!(judge(&h, Ok(Some("0:41".into()))), Live::Yes));
        assert!(matches!(judge(&h, Ok(Some("0:42".into()))), Live::Dead(_)));
        assert!(matches!(judge(&h, Ok(None)), Live::Dead(_)));
    }

    #[test]
    fn a_stopping_keeper_removes_its_own_socket_and_no_successor_s() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keeper.sock");
        let ours = bind(&path).expect("bind");
        let bound = file_id(&path).expect("id");
        // A successor replaced it (this keeper looked stale to it).
        drop(ours);
        std::fs::remove_file(&path).expect("rm");
        let _theirs = bind(&path).expect("bind again");
        remove_if_bound(&path, bound);
        assert!(path.exists(), "the successor's socket was removed");
        remove_if_bound(&path, file_id(&path).expect("id"));
        assert!(!path.exists(), "its own socket was left");
    }

    #[test]
    fn hellos_and_requests_that_are_refused() {
        assert!(hello(&json!({"hello": HELLO, "version": VERSION})).is_ok());
        assert!(hello(&json!({"hello": HELLO, "version": VERSION + 1})).is_err());
        assert!(hello(&json!({"op": "list"})).is_err());
        let table: Table = Default::default();
        let me = Peer { pid: 0, pidfd: None };
        let refused = |req: Value| handle(&req, None, &me, &table).0["error"].as_str().map(String::from);
        assert!(refused(json!({"op": "nope"})).is_some_and(|e| e.contains("unknown")));
        assert!(refused(json!({"op": "get"})).is_some_and(|e| e.contains("no mountpoint")));
        assert!(refused(json!({"op": "get", "mountpoint": "rel/ative"})).is_some_and(|e| e.contains("absolute")));
        assert!(refused(json!({"op": "deposit", "mountpoint": "/mnt"})).is_some_and(|e| e.contains("/dev/fuse")));
        // Not /dev/fuse.
        let file = tempfile::tempfile().expect("tempfile");
        let (a, _) = handle(&json!({"op": "deposit", "mountpoint": "/mnt"}), Some(file.into()), &me, &table);
        assert!(a["error"].as_str().is_some_and(|e| e.contains("not /dev/fuse")), "{a}");
        let mnt = Path::new("/mnt");
        assert!(same_mount(mnt, Some("0:41"), "0:41").is_ok());
        assert!(same_mount(mnt, Some("0:41"), "0:42").is_err_and(|e| e.contains("not the depositor's 0:41")));
        assert!(same_mount(mnt, None, "0:41").is_err());
        let (a, fd) = handle(&json!({"op": "get", "mountpoint": "/mnt"}), None, &me, &table);
        assert_eq!((a, fd.is_none()), (json!({"ok": true, "held": false}), true));
        assert_eq!(handle(&json!({"op": "list"}), None, &me, &table).0, json!({"ok": true, "mountpoints": []}));
    }
}
