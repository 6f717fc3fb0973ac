//! Staging: one `arbor mount` process per volume per node, at the staging
//! path, started with the volume's secrets as files (never in its argv or
//! environment), and `arbor unmount` to undo it.

use crate::state::{private_dir, write_private, State};
use crate::volume::{Root, Secrets, VolumeSpec};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// How a staging step failed.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The disk, branch or checkpoint does not exist.
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Failed(String),
}

/// The files a volume's secrets were written to.
#[derive(Debug, Default)]
pub struct SecretFiles {
    pub token: Option<PathBuf>,
    pub aws_credentials: Option<PathBuf>,
}

const TOKEN_FILE: &str = "token";
const AWS_CREDENTIALS_FILE: &str = "aws-credentials";

/// Writes the secrets under the volume's secrets folder (0700, files 0600),
/// replacing what an earlier stage left.
pub fn write_secrets(state: &State, volume_id: &str, secrets: &Secrets) -> std::io::Result<SecretFiles> {
    let dir = state.secrets_dir(volume_id);
    private_dir(&dir)?;
    let mut files = SecretFiles::default();
    if let Some(token) = &secrets.token {
        let p = dir.join(TOKEN_FILE);
        write_private(&p, format!("{token}\n").as_bytes())?;
        files.token = Some(p);
    }
    if let Some((id, key)) = &secrets.aws {
        let p = dir.join(AWS_CREDENTIALS_FILE);
        let ini = format!("[default]\naws_access_key_id = {id}\naws_secret_access_key = {key}\n");
        write_private(&p, ini.as_bytes())?;
        files.aws_credentials = Some(p);
    }
    Ok(files)
}

/// The secret files an earlier stage of the volume wrote.
pub fn secret_files(state: &State, volume_id: &str) -> SecretFiles {
    let dir = state.secrets_dir(volume_id);
    let there = |name: &str| Some(dir.join(name)).filter(|p| p.exists());
    SecretFiles { token: there(TOKEN_FILE), aws_credentials: there(AWS_CREDENTIALS_FILE) }
}

/// Removes a volume's secret files and their folder.
pub fn remove_secrets(state: &State, volume_id: &str) -> std::io::Result<()> {
    match std::fs::remove_dir_all(state.secrets_dir(volume_id)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The arguments of `arbor mount` for a volume (after `mount DISK STAGING`);
/// `keeper`: the socket of the `arbor keeper` that holds its connection.
pub fn mount_args(
    spec: &VolumeSpec,
    files: &SecretFiles,
    cache_dir: &Path,
    keeper: Option<&Path>,
) -> Result<Vec<OsString>, String> {
    let mut a: Vec<OsString> = Vec::new();
    // `--flag=value`: a value is never taken for a flag of its own.
    let mut push = |k: &str, v: &std::ffi::OsStr| {
        let mut arg = OsString::from(format!("{k}="));
        arg.push(v);
        a.push(arg);
    };
    match &spec.root {
        Root::Branch(b) => {
            // Many nodes write one branch only through its owner, which
            // needs the token.
            let Some(token) = &files.token else {
                return Err(
                    "a branch volume mounts through its owner (arbor serve --branch): the secret needs a \"token\""
                        .into(),
                );
            };
            push("--branch", b.as_ref());
            push("--token-file", token.as_os_str());
            if let Some(s) = &spec.server {
                push("--server", s.as_ref());
            }
        }
        Root::Checkpoint(c) => {
            push("--checkpoint", c.as_ref());
            if let Some(token) = &files.token {
                push("--token-file", token.as_os_str());
            }
        }
    }
    if let Some(servers) = &spec.cache_servers {
        if files.token.is_none() {
            return Err("volume attribute \"cacheServers\" needs the secret key \"token\"".into());
        }
        push("--cache-server", servers.as_ref());
    }
    if let Some(d) = &spec.durability {
        push("--durability", d.as_ref());
    }
    if let Some(m) = &spec.cache_memory {
        push("--cache-dir", "none".as_ref());
        push("--cache-memory", m.as_ref());
    } else if spec.disk.starts_with("s3://") {
        push("--cache-dir", cache_dir.as_os_str());
    }
    if let Some(s) = &spec.cache_size {
        push("--cache-size", s.as_ref());
    }
    // A pod's open files outlive the process serving them: a keeper holds
    // the FUSE connection, outside the plugin's container if given one.
    let keeper = keeper.map(|k| {
        let mut arg = OsString::from("--keeper=");
        arg.push(k);
        arg
    });
    // Pods run as any user.
    a.push("--allow-other".into());
    a.push(keeper.unwrap_or_else(|| "--restartable".into()));
    Ok(a)
}

/// Runs `arbor mount DISK STAGING ARGS…`, which returns once the file
/// system answers (the mount process goes on in the background).
pub fn mount(
    arbor: &Path,
    spec: &VolumeSpec,
    staging: &Path,
    args: &[OsString],
    files: &SecretFiles,
) -> Result<(), StageError> {
    let mut cmd = Command::new(arbor);
    cmd.arg("mount").arg(&spec.disk).arg(staging).args(args);
    if let Some(creds) = &files.aws_credentials {
        cmd.env("AWS_SHARED_CREDENTIALS_FILE", creds).env("AWS_PROFILE", "default");
        cmd.env_remove("AWS_ACCESS_KEY_ID").env_remove("AWS_SECRET_ACCESS_KEY").env_remove("AWS_SESSION_TOKEN");
    }
    run(cmd, "arbor mount")
}

/// Runs `arbor unmount STAGING`: flush, wait until everything is durable, unmount.
pub fn unmount(arbor: &Path, staging: &Path, keeper: Option<&Path>) -> Result<(), StageError> {
    let mut cmd = Command::new(arbor);
    cmd.arg("unmount").arg(staging);
    if let Some(k) = keeper {
        cmd.arg("--keeper").arg(k);
    }
    run(cmd, "arbor unmount")
}

/// How long `served` waits for `arbor status` (which itself gives the
/// mount 5 s to answer).
pub const STATUS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether an arbor mount process serves `staging` (its control socket
/// answers `arbor status`). Unlike a `statfs`, this never waits on a
/// mount whose connection a keeper holds and nobody serves. A process
/// that does not answer in time counts as serving: alive, unresponsive,
/// and never to be replaced by a second server.
pub fn served(arbor: &Path, staging: &Path) -> bool {
    served_within(arbor, staging, STATUS_WAIT)
}

fn served_within(arbor: &Path, staging: &Path, wait: std::time::Duration) -> bool {
    let child = Command::new(arbor)
        .arg("status")
        .arg(staging)
        .arg("--json")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else { return false };
    let deadline = std::time::Instant::now() + wait;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return true,
            Ok(Some(_)) => {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                return err.contains("alive but unresponsive");
            }
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            Ok(None) | Err(_) => {
                tracing::warn!(staging = %staging.display(), "arbor status does not answer: the mount process counts as alive");
                let _ = child.kill();
                let _ = child.wait();
                return true;
            }
        }
    }
}

fn run(mut cmd: Command, what: &str) -> Result<(), StageError> {
    let out = cmd.stdin(Stdio::null()).output().map_err(|e| StageError::Failed(format!("cannot start {what}: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output").trim();
    let msg = format!("{what} failed ({}): {line}", out.status);
    if looks_missing(line) {
        Err(StageError::NotFound(msg))
    } else {
        Err(StageError::Failed(msg))
    }
}

/// Whether arbor's one-line error says the disk, branch or checkpoint is not there.
fn looks_missing(line: &str) -> bool {
    let l = line.to_lowercase();
    ["no such branch", "no such checkpoint", "no branch", "no checkpoint", "not an arbor disk", "does not exist"]
        .iter()
        .any(|m| l.contains(m))
        && !l.contains("mountpoint")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A stand-in for `arbor` that runs `body` as a shell script.
    fn fake_arbor(name: &str, body: &str) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("arbor-csi-{name}-{}", std::process::id()));
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    #[test]
    fn a_mount_that_does_not_answer_counts_as_served_and_is_not_waited_on() {
        let cases = [
            ("hangs", "exec sleep 30", true),
            (
                "slow",
                "echo 'arbor: the arbor mount at /s does not answer (waited 5s): alive but unresponsive' >&2; exit 1",
                true,
            ),
            ("gone", "echo 'arbor: /s is not an arbor mount served on this node' >&2; exit 1", false),
            ("serves", "echo '{}'", true),
        ];
        for (name, body, served) in cases {
            let arbor = fake_arbor(name, body);
            let t = std::time::Instant::now();
            let got = served_within(&arbor, Path::new("/s"), std::time::Duration::from_millis(500));
            let _ = std::fs::remove_file(&arbor);
            assert_eq!(got, served, "{name}");
            assert!(t.elapsed() < std::time::Duration::from_secs(10), "{name}: waited {:?}", t.elapsed());
        }
    }

    fn spec(pairs: &[(&str, &str)]) -> VolumeSpec {
        let ctx: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        VolumeSpec::parse(&ctx).expect("valid")
    }

    #[test]
    fn a_branch_mounts_through_its_owner_with_the_token_file() {
        let files = SecretFiles { token: Some("/s/token".into()), aws_credentials: None };
        let a = mount_args(
            &spec(&[("disk", "s3://b/p"), ("branch", "main"), ("server", "o:7070")]),
            &files,
            Path::new("/c"),
            None,
        )
        .expect("args");
        let a: Vec<String> = a.iter().map(|s| s.to_string_lossy().into_owned()).collect();
        assert_eq!(
            a,
            [
                "--branch=main",
                "--token-file=/s/token",
                "--server=o:7070",
                "--cache-dir=/c",
                "--allow-other",
                "--restartable"
            ]
        );
        let none = SecretFiles::default();
        assert!(mount_args(&spec(&[("disk", "/d"), ("branch", "main")]), &none, Path::new("/c"), None).is_err());
    }

    #[test]
    fn a_checkpoint_in_memory_only() {
        let a = mount_args(
            &spec(&[("disk", "/d"), ("checkpoint", "v1"), ("cacheMemory", "256M")]),
            &SecretFiles::default(),
            Path::new("/c"),
            None,
        )
        .expect("args");
        let a: Vec<String> = a.iter().map(|s| s.to_string_lossy().into_owned()).collect();
        assert_eq!(a, ["--checkpoint=v1", "--cache-dir=none", "--cache-memory=256M", "--allow-other", "--restartable"]);
    }

    #[test]
    fn with_a_keeper_the_mount_hands_it_its_connection() {
        let spec = spec(&[("disk", "/d"), ("checkpoint", "v1")]);
        let a =
            mount_args(&spec, &SecretFiles::default(), Path::new("/c"), Some(Path::new("/run/k.sock"))).expect("args");
        let a: Vec<String> = a.iter().map(|s| s.to_string_lossy().into_owned()).collect();
        assert_eq!(a, ["--checkpoint=v1", "--allow-other", "--keeper=/run/k.sock"]);
    }
}
