//! What the plugin has done, kept as one small JSON file per staged volume
//! and per published target in its state folder, so that a restarted
//! plugin answers a repeated call as the first one was answered.
//!
//! ```text
//! STATE/stage/<blake3(volume_id)>.json      a StageRecord
//! STATE/publish/<blake3(target_path)>.json  a PublishRecord
//! STATE/secrets/<blake3(volume_id)>/        token, aws-credentials (0600)
//! STATE/cache/<blake3(volume_id)>/          the chunk cache of an s3:// volume
//! ```
//!
//! Records are written to a temporary file and renamed into place: a crash
//! leaves the old record or the new one.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// A volume staged on this node: one `arbor mount` at `staging_path`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRecord {
    pub volume_id: String,
    pub staging_path: PathBuf,
    /// The volume attributes it was staged with.
    pub attributes: BTreeMap<String, String>,
    /// The access mode and mount flags it was staged with.
    pub capability: String,
    /// A digest of the secrets' values (never the values).
    pub secrets_digest: String,
    /// Staged without the secrets its mount needs: it is mounted at the
    /// first publish, with that call's secrets (`nodePublishSecretRef`).
    #[serde(default)]
    pub waiting_for_secrets: bool,
}

/// A staged volume bound into a pod's target path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishRecord {
    pub volume_id: String,
    pub target_path: PathBuf,
    pub staging_path: PathBuf,
    pub read_only: bool,
    pub capability: String,
}

/// The state folder.
#[derive(Clone, Debug)]
pub struct State {
    dir: PathBuf,
}

/// A name for a file from an arbitrary key (a volume id, a path).
pub fn key_name(key: &str) -> String {
    blake3::hash(key.as_bytes()).to_hex()[..32].to_string()
}

/// Creates `dir` (and its parents) readable by root only.
pub fn private_dir(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

/// Writes `bytes` to `path` (mode 0600) through a temporary file and a rename.
pub fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

fn remove_if_there(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

impl State {
    pub fn open(dir: &Path) -> io::Result<State> {
        for sub in ["stage", "publish", "secrets", "cache"] {
            private_dir(&dir.join(sub))?;
        }
        Ok(State { dir: dir.to_path_buf() })
    }

    fn stage_file(&self, volume_id: &str) -> PathBuf {
        self.dir.join("stage").join(format!("{}.json", key_name(volume_id)))
    }

    fn publish_file(&self, target: &Path) -> PathBuf {
        self.dir.join("publish").join(format!("{}.json", key_name(&target.to_string_lossy())))
    }

    /// The folder of a volume's secret files.
    pub fn secrets_dir(&self, volume_id: &str) -> PathBuf {
        self.dir.join("secrets").join(key_name(volume_id))
    }

    /// The chunk cache folder of a volume.
    pub fn cache_dir(&self, volume_id: &str) -> PathBuf {
        self.dir.join("cache").join(key_name(volume_id))
    }

    pub fn stage(&self, volume_id: &str) -> io::Result<Option<StageRecord>> {
        read(&self.stage_file(volume_id))
    }

    pub fn put_stage(&self, r: &StageRecord) -> io::Result<()> {
        write(&self.stage_file(&r.volume_id), r)
    }

    pub fn remove_stage(&self, volume_id: &str) -> io::Result<()> {
        remove_if_there(&self.stage_file(volume_id))
    }

    pub fn publish(&self, target: &Path) -> io::Result<Option<PublishRecord>> {
        read(&self.publish_file(target))
    }

    pub fn put_publish(&self, r: &PublishRecord) -> io::Result<()> {
        write(&self.publish_file(&r.target_path), r)
    }

    pub fn remove_publish(&self, target: &Path) -> io::Result<()> {
        remove_if_there(&self.publish_file(target))
    }

    /// Every staged volume's record.
    pub fn stages(&self) -> io::Result<Vec<StageRecord>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(self.dir.join("stage"))? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "json") {
                out.extend(read::<StageRecord>(&path)?);
            }
        }
        Ok(out)
    }

    /// Every target recorded as published for `volume_id`.
    pub fn publishes_of(&self, volume_id: &str) -> io::Result<Vec<PublishRecord>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(self.dir.join("publish"))? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "json") {
                if let Some(r) = read::<PublishRecord>(&path)? {
                    if r.volume_id == volume_id {
                        out.push(r);
                    }
                }
            }
        }
        Ok(out)
    }
}

fn read<T: for<'de> Deserialize<'de>>(path: &Path) -> io::Result<Option<T>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn write<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    let bytes = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    write_private(path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_a_reopen_and_removal_is_idempotent() {
        let dir = std::env::temp_dir().join(format!("arbor-csi-state-{}", std::process::id()));
        let s = State::open(&dir).expect("open");
        let r = StageRecord {
            volume_id: "vol/1".into(),
            staging_path: "/stage".into(),
            attributes: [("disk".to_string(), "/d".to_string())].into(),
            capability: "rw".into(),
            secrets_digest: "x".into(),
            waiting_for_secrets: false,
        };
        s.put_stage(&r).expect("put");
        assert_eq!(State::open(&dir).expect("reopen").stage("vol/1").expect("read"), Some(r.clone()));
        assert_eq!(s.stages().expect("list"), [r]);
        s.remove_stage("vol/1").expect("remove");
        s.remove_stage("vol/1").expect("again");
        assert_eq!(s.stage("vol/1").expect("read"), None);
        std::fs::remove_dir_all(&dir).expect("clean");
    }
}
