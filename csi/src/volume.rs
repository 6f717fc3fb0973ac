//! What a volume is: a PersistentVolume's `volumeAttributes` and the keys
//! of its secrets, checked and turned into the `arbor mount` that serves it.

use std::collections::{BTreeMap, HashMap};

/// `volumeAttributes` keys.
pub const DISK: &str = "disk";
pub const BRANCH: &str = "branch";
pub const CHECKPOINT: &str = "checkpoint";
pub const SERVER: &str = "server";
pub const CACHE_SERVERS: &str = "cacheServers";
pub const DURABILITY: &str = "durability";
pub const CACHE_SIZE: &str = "cacheSize";
pub const CACHE_MEMORY: &str = "cacheMemory";
const ATTRIBUTES: [&str; 8] = [DISK, BRANCH, CHECKPOINT, SERVER, CACHE_SERVERS, DURABILITY, CACHE_SIZE, CACHE_MEMORY];

/// Secret keys.
pub const TOKEN: &str = "token";
pub const AWS_ACCESS_KEY_ID: &str = "awsAccessKeyId";
pub const AWS_SECRET_ACCESS_KEY: &str = "awsSecretAccessKey";
const SECRETS: [&str; 3] = [TOKEN, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY];

/// Which root of the disk a volume mounts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Root {
    /// Read-write, through the branch's owner (`arbor serve --branch`).
    Branch(String),
    /// Read-only.
    Checkpoint(String),
}

/// A volume's attributes, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeSpec {
    pub disk: String,
    pub root: Root,
    pub server: Option<String>,
    pub cache_servers: Option<String>,
    pub durability: Option<String>,
    pub cache_size: Option<String>,
    pub cache_memory: Option<String>,
}

/// The secrets a volume brought, checked.
#[derive(Clone, Default)]
pub struct Secrets {
    pub token: Option<String>,
    /// Access key id and secret key, both or neither.
    pub aws: Option<(String, String)>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secrets").field("token", &self.token.is_some()).field("aws", &self.aws.is_some()).finish()
    }
}

fn non_empty(ctx: &HashMap<String, String>, key: &str) -> Option<String> {
    ctx.get(key).map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

impl VolumeSpec {
    /// Checks `volumeAttributes`; the error says which key is wrong.
    pub fn parse(ctx: &HashMap<String, String>) -> Result<VolumeSpec, String> {
        if let Some(unknown) =
            ctx.keys().find(|k| !ATTRIBUTES.contains(&k.as_str()) && !k.starts_with("csi.storage.k8s.io/"))
        {
            return Err(format!("unknown volume attribute {unknown:?} (known: {})", ATTRIBUTES.join(", ")));
        }
        let disk =
            non_empty(ctx, DISK).ok_or("volume attribute \"disk\" is missing (s3://bucket/prefix or a folder)")?;
        if disk.starts_with('-') {
            return Err(format!("volume attribute \"disk\" is {disk:?}: s3://bucket/prefix or a folder"));
        }
        let root = match (non_empty(ctx, BRANCH), non_empty(ctx, CHECKPOINT)) {
            (Some(b), None) => Root::Branch(b),
            (None, Some(c)) => Root::Checkpoint(c),
            (Some(_), Some(_)) => return Err("give volume attribute \"branch\" or \"checkpoint\", not both".into()),
            (None, None) => return Err("volume attribute \"branch\" or \"checkpoint\" is missing".into()),
        };
        let spec = VolumeSpec {
            disk,
            root,
            server: non_empty(ctx, SERVER),
            cache_servers: non_empty(ctx, CACHE_SERVERS),
            durability: non_empty(ctx, DURABILITY),
            cache_size: non_empty(ctx, CACHE_SIZE),
            cache_memory: non_empty(ctx, CACHE_MEMORY),
        };
        if matches!(spec.root, Root::Checkpoint(_)) && spec.server.is_some() {
            return Err(
                "volume attribute \"server\" is for branch volumes (a checkpoint is read without an owner)".into()
            );
        }
        if let Some(d) = &spec.durability {
            if d != "local" && d != "bucket" {
                return Err(format!("volume attribute \"durability\" is {d:?}: local or bucket"));
            }
        }
        Ok(spec)
    }

    pub fn read_only(&self) -> bool {
        matches!(self.root, Root::Checkpoint(_))
    }

    /// Whether the chunk cache lives in memory only (`cacheMemory` given).
    pub fn memory_only(&self) -> bool {
        self.cache_memory.is_some()
    }
}

impl Secrets {
    /// Checks the secrets' keys (values are never shown).
    pub fn parse(secrets: &HashMap<String, String>) -> Result<Secrets, String> {
        if let Some(unknown) = secrets.keys().find(|k| !SECRETS.contains(&k.as_str())) {
            return Err(format!("unknown secret key {unknown:?} (known: {})", SECRETS.join(", ")));
        }
        let get = |k: &str| secrets.get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let aws = match (get(AWS_ACCESS_KEY_ID), get(AWS_SECRET_ACCESS_KEY)) {
            (Some(id), Some(key)) => Some((id, key)),
            (None, None) => None,
            _ => return Err("give both secret keys awsAccessKeyId and awsSecretAccessKey, or neither".into()),
        };
        Ok(Secrets { token: get(TOKEN), aws })
    }

    /// A digest of the values, to tell a changed secret from the same one
    /// without keeping it in the state records.
    pub fn digest(&self) -> String {
        let mut h = blake3::Hasher::new();
        for part in
            [self.token.as_deref(), self.aws.as_ref().map(|a| a.0.as_str()), self.aws.as_ref().map(|a| a.1.as_str())]
        {
            h.update(&[part.is_some() as u8]);
            let v = part.unwrap_or("");
            h.update(&(v.len() as u64).to_le_bytes());
            h.update(v.as_bytes());
        }
        h.finalize().to_hex()[..16].to_string()
    }
}

/// The attributes that decide what is mounted, sorted (the kubelet's own
/// `csi.storage.k8s.io/…` pod details left out), for comparing two stage
/// requests of one volume.
pub fn attributes_key(ctx: &HashMap<String, String>) -> BTreeMap<String, String> {
    ctx.iter().filter(|(k, _)| !k.starts_with("csi.storage.k8s.io/")).map(|(k, v)| (k.clone(), v.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn a_branch_or_a_checkpoint_and_a_disk() {
        let s = VolumeSpec::parse(&ctx(&[(DISK, "s3://b/p"), (BRANCH, "main"), (SERVER, "owner:7070")])).expect("ok");
        assert_eq!(s.root, Root::Branch("main".into()));
        assert!(!s.read_only());
        let c = VolumeSpec::parse(&ctx(&[(DISK, "/d"), (CHECKPOINT, "v1"), (CACHE_MEMORY, "1G")])).expect("ok");
        assert!(c.read_only() && c.memory_only());
        for bad in [
            ctx(&[(BRANCH, "main")]),
            ctx(&[(DISK, "/d")]),
            ctx(&[(DISK, "/d"), (BRANCH, "a"), (CHECKPOINT, "b")]),
            ctx(&[(DISK, "/d"), (CHECKPOINT, "b"), (SERVER, "x:1")]),
            ctx(&[(DISK, "/d"), (BRANCH, "a"), ("cachesize", "1G")]),
            ctx(&[(DISK, "/d"), (BRANCH, "a"), (DURABILITY, "fast")]),
            ctx(&[(DISK, "--help"), (BRANCH, "a")]),
        ] {
            assert!(VolumeSpec::parse(&bad).is_err(), "{bad:?}");
        }
        // The kubelet's pod details (podInfoOnMount) are not attributes.
        let with_pod = ctx(&[(DISK, "/d"), (BRANCH, "a"), ("csi.storage.k8s.io/pod.name", "p")]);
        assert!(VolumeSpec::parse(&with_pod).is_ok());
        assert_eq!(attributes_key(&with_pod).len(), 2);
    }

    #[test]
    fn secrets_come_in_known_keys_and_aws_pairs_and_never_print() {
        let s = Secrets::parse(&ctx(&[(TOKEN, "t0ken-value")])).expect("ok");
        assert!(!format!("{s:?}").contains("t0ken"));
        assert!(Secrets::parse(&ctx(&[(AWS_ACCESS_KEY_ID, "id")])).is_err());
        assert!(Secrets::parse(&ctx(&[("password", "x")])).is_err());
        let a = Secrets::parse(&ctx(&[(TOKEN, "a")])).expect("ok");
        let b = Secrets::parse(&ctx(&[(TOKEN, "b")])).expect("ok");
        assert_ne!(a.digest(), b.digest());
        assert_eq!(a.digest(), Secrets::parse(&ctx(&[(TOKEN, "a")])).expect("ok").digest());
    }
}
