//! A mount's side of `arbor keeper`: one connection per call, the hello,
//! one request, one answer.

use super::fds;
use super::protocol::{HELLO, VERSION};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

/// How long a call waits for the keeper.
const WAIT: i64 = 10;

/// The keeper at a socket.
#[derive(Clone, Debug)]
pub struct Client {
    socket: PathBuf,
}

impl Client {
    pub fn new(socket: &Path) -> Client {
        Client { socket: socket.to_path_buf() }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// A copy of the connection the keeper holds for `mountpoint`, if it
    /// holds a live one.
    pub fn get(&self, mountpoint: &Path) -> Result<Option<OwnedFd>> {
        let (answer, fd) = self.call(json!({"op": "get", "mountpoint": mountpoint}), None)?;
        match (answer["held"].as_bool(), fd) {
            (Some(true), Some(fd)) => Ok(Some(fd)),
            (Some(true), None) => {
                bail!("the keeper at {} said it holds {} but sent nothing", self.socket.display(), mountpoint.display())
            }
            _ => Ok(None),
        }
    }

    /// Gives the keeper a copy of the mount's connection.
    pub fn deposit(&self, mountpoint: &Path, device: &str, dev: BorrowedFd<'_>) -> Result<()> {
        self.call(json!({"op": "deposit", "mountpoint": mountpoint, "device": device}), Some(dev)).map(drop)
    }

    /// Tells the keeper to let the connection go; whether it held one.
    pub fn release(&self, mountpoint: &Path) -> Result<bool> {
        let (answer, _) = self.call(json!({"op": "release", "mountpoint": mountpoint}), None)?;
        Ok(answer["held"].as_bool() == Some(true))
    }

    /// The mount points whose connections the keeper holds.
    pub fn list(&self) -> Result<Vec<String>> {
        let (answer, _) = self.call(json!({"op": "list"}), None)?;
        Ok(answer["mountpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m.as_str().map(String::from))
            .collect())
    }

    fn call(&self, req: Value, fd: Option<BorrowedFd<'_>>) -> Result<(Value, Option<OwnedFd>)> {
        let sock = fds::connect(&self.socket)
            .with_context(|| format!("cannot reach the keeper at {}", self.socket.display()))?;
        fds::set_timeouts(&sock, WAIT)?;
        let hello = self.exchange(&sock, json!({"hello": HELLO, "version": VERSION}), None)?.0;
        if hello["version"].as_u64() != Some(VERSION) {
            bail!("the keeper at {} speaks version {}, not {VERSION}", self.socket.display(), hello["version"]);
        }
        self.exchange(&sock, req, fd)
    }

    fn exchange(&self, sock: &OwnedFd, req: Value, fd: Option<BorrowedFd<'_>>) -> Result<(Value, Option<OwnedFd>)> {
        let at = || format!("the keeper at {}", self.socket.display());
        fds::send(sock.as_fd(), req.to_string().as_bytes(), fd).with_context(at)?;
        let (bytes, fd) = fds::receive(sock.as_fd()).with_context(at)?.ok_or_else(|| anyhow!("{} hung up", at()))?;
        let answer: Value = serde_json::from_slice(&bytes).with_context(|| format!("a bad answer from {}", at()))?;
        if answer["ok"] != json!(true) {
            bail!("{}: {}", at(), answer["error"].as_str().unwrap_or("refused"));
        }
        Ok((answer, fd))
    }
}
