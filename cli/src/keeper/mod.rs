//! Who holds a mount's `/dev/fuse` file besides the process serving it,
//! so that a successor can take the live connection over
//! (`arbor_fs::resume`) when that process dies:
//!
//! - [`parent`]: the in-process keeper of `arbor mount --foreground
//!   --restartable`, the serving process's parent, which restarts it. It
//!   dies with its process tree (a `systemctl restart`, a container's).
//! - [`service`]: `arbor keeper --socket PATH`, a process of its own that
//!   holds the files of every mount started with `--keeper PATH`
//!   ([`client`] is their side). A mount started again after its whole
//!   process tree was killed takes its connection from there.
//!
//! [`Holder`] is the one seam `arbor mount` sees: where a live connection
//! to take over comes from, and where a new one is handed. Both speak
//! [`fds`] (`SCM_RIGHTS`).

pub mod client;
pub mod fds;
mod parent;
pub mod protocol;
pub mod service;

pub use parent::{is_child, keeper_pid, run, tell_keeper, wanted};

use anyhow::{bail, Result};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

/// How often a mount hands `arbor keeper` its connection again, so that a
/// keeper restarted since (holding nothing) learns it.
pub const DEPOSIT_EVERY: Duration = Duration::from_secs(5);

/// Where a mount's FUSE connection is held outside its serving process.
pub enum Holder {
    /// Nowhere: the mount dies with its process.
    Nobody,
    /// The in-process keeper, this process's parent.
    Parent,
    /// `arbor keeper` at a socket.
    Keeper(client::Client),
}

impl Holder {
    /// The holder of this process's mount: its parent if it is a keeper's
    /// serving child, else the keeper at `socket` if one is given.
    pub fn of(socket: Option<&Path>) -> Holder {
        match socket {
            _ if is_child() => Holder::Parent,
            Some(s) => Holder::Keeper(client::Client::new(s)),
            None => Holder::Nobody,
        }
    }

    /// Whether the mount may be taken over by another process (it is then
    /// served on `/dev/fuse`, each change answered once it outlives this
    /// process).
    pub fn restartable(&self) -> bool {
        !matches!(self, Holder::Nobody)
    }

    /// What SIGTERM does when the mount may outlive its whole process tree
    /// (`arbor keeper` holds it): hand the keeper the connection `dev`
    /// again and, once it answers that it holds it, run `flush` and leave
    /// the mount in place for the next process. `None` otherwise.
    pub fn on_term(
        &self,
        mountpoint: &Path,
        dev: Option<BorrowedFd<'_>>,
        flush: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) -> Option<crate::session::HandOver> {
        use crate::session::Handed;
        let Holder::Keeper(k) = self else { return None };
        let dev = dev?.try_clone_to_owned().ok()?;
        let device = mount_device(mountpoint).ok()?;
        let (k, mp) = (k.clone(), mountpoint.to_path_buf());
        Some(Box::new(move || match k.deposit(&mp, &device, dev.as_fd()) {
            Ok(()) => Handed::Kept(flush()),
            Err(e) => Handed::NotHeld(format!("{e:#}")),
        }))
    }

    /// The live connection of the mount at `mountpoint` this process is to
    /// take over, if there is one. A mount some running arbor still
    /// serves is refused: two servers on one connection would be one too
    /// many.
    pub fn take_over(&self, mountpoint: &Path) -> Result<Option<OwnedFd>> {
        match self {
            Holder::Nobody => Ok(None),
            Holder::Parent => Ok(parent::resume_device()),
            Holder::Keeper(k) => {
                refuse_if_served(mountpoint)?;
                k.get(mountpoint)
            }
        }
    }

    /// Hands a copy of the mount's connection to the holder (`resuming`:
    /// this process took it over from the holder).
    pub fn hand_over(&self, mountpoint: &Path, dev: BorrowedFd<'_>, resuming: bool) -> Result<()> {
        match self {
            Holder::Nobody => Ok(()),
            Holder::Parent if resuming => Ok(()),
            Holder::Parent => parent::hand_over(dev),
            // Again when resuming, and every DEPOSIT_EVERY: a keeper
            // restarted since holds nothing.
            Holder::Keeper(k) => {
                let device = mount_device(mountpoint)?;
                k.deposit(mountpoint, &device, dev)?;
                tracing::info!("the keeper holds the FUSE connection: this mount survives its process");
                let (k, mp, dev) = (k.clone(), mountpoint.to_path_buf(), dev.try_clone_to_owned()?);
                std::thread::Builder::new()
                    .name("arbor-deposit".into())
                    .spawn(move || deposit_again(&k, &mp, &device, &dev))?;
                Ok(())
            }
        }
    }

    /// After a clean unmount: the holder lets the connection go at once
    /// (an external keeper would see the mount gone a moment later).
    pub fn released(&self, mountpoint: &Path) {
        if let Holder::Keeper(k) = self {
            if let Err(e) = k.release(mountpoint) {
                tracing::warn!(error = %format!("{e:#}"), "cannot tell the keeper the mount is gone");
            }
        }
    }
}

/// Fails if an arbor of this node answers on the mount's control socket,
/// or it cannot be told: only a socket that is not there, or that nobody
/// listens on, means no server here. (The keeper refuses as well while a
/// process that deposited the connection lives, whatever its socket.)
fn refuse_if_served(mountpoint: &Path) -> Result<()> {
    use std::io::ErrorKind::{ConnectionRefused, NotFound};
    let path = crate::control::socket_path(mountpoint)?;
    match std::os::unix::net::UnixStream::connect(&path) {
        Err(e) if matches!(e.kind(), NotFound | ConnectionRefused) => Ok(()),
        Err(e) => {
            bail!("cannot tell whether a running arbor serves {} ({}: {e})", mountpoint.display(), path.display())
        }
        Ok(_) => match crate::control::request(mountpoint, serde_json::json!({"op": "status"})) {
            Ok(s) => bail!("{} is already served by a running arbor (pid {})", mountpoint.display(), s["pid"]),
            Err(e) => bail!("{} is already served by a running arbor ({e:#})", mountpoint.display()),
        },
    }
}

/// Set once this process starts to unmount: its connection is no longer
/// to be handed to anyone.
static UNMOUNTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Stops handing the keeper the connection: the mount is being unmounted.
pub fn unmounting() {
    UNMOUNTING.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// The device (`MAJOR:MINOR`) of this process's FUSE mount at
/// `mountpoint`, sent with each deposit so that the keeper files the
/// connection under this mount and no other.
fn mount_device(mountpoint: &Path) -> Result<String> {
    match service::fuse_device(mountpoint) {
        Ok(Some(d)) => Ok(d),
        Ok(None) => bail!("no FUSE mount at {}", mountpoint.display()),
        Err(e) => bail!("{e}"),
    }
}

/// Hands the keeper the connection every [`DEPOSIT_EVERY`] until this
/// process starts to unmount. Says once when the keeper is away, and when
/// it is back.
fn deposit_again(k: &client::Client, mountpoint: &Path, device: &str, dev: &OwnedFd) {
    let mut away = false;
    loop {
        std::thread::sleep(DEPOSIT_EVERY);
        if UNMOUNTING.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        match k.deposit(mountpoint, device, dev.as_fd()) {
            Ok(()) if away => {
                tracing::info!("the keeper holds the FUSE connection again");
                away = false;
            }
            Ok(()) => {}
            Err(e) if !away => {
                tracing::warn!(error = %format!("{e:#}"), "the keeper does not hold the FUSE connection: this mount dies with its process until it is back");
                away = true;
            }
            Err(_) => {}
        }
    }
}
