//! A branch another process owns (`arbor serve --branch`), reached through
//! that owner: finding it (given, or the owner record in the bucket) and
//! connecting `arbor_net`'s client to it (see `arbor_net::files`).

use crate::cache_client::ClientAuth;
use crate::disk::Disk;
use crate::error::{Context, Error, Result};
use arbor_net::branch::client::Locate;
use arbor_net::{BranchClient, BranchClientOptions};
use arbor_snapshot::{Catalog, Owner};
use std::sync::Arc;
use std::time::Duration;

/// How this node reaches a branch's owner.
#[derive(Clone, Default)]
pub struct OwnerOptions {
    /// The owner's `HOST:PORT` (`None`: the one the bucket records, if any).
    pub server: Option<String>,
    /// Fail an operation after this long without an answer (`None`: wait).
    pub timeout: Option<Duration>,
    /// The token and TLS shown to the owner.
    pub auth: ClientAuth,
}

/// The owner to open branch `name` through, if another process serves
/// it (`opts.server`, or an owner record: see below). `cache_servers`:
/// whether this node reads through cache servers.
pub fn owner_of(
    catalog: &Arc<Catalog>,
    name: &str,
    opts: &OwnerOptions,
    cache_servers: bool,
) -> Result<Option<Locate>> {
    if let Some(addr) = &opts.server {
        arbor_net::check_host_port(addr).map_err(|e| Error::Invalid(format!("--server {e}")))?;
    }
    let recorded = match &opts.server {
        Some(_) => None,
        // A branch with an owner record is opened through its owner,
        // whatever its lease says: the owner may be starting (it records
        // itself before it claims the branch) or restarting. Only a clean
        // stop of the owner removes the record.
        None => match catalog.owner_of(name)? {
            Some(o) => Some(o),
            // A node given the owner's credentials and no cache servers
            // (which the token would be for) means to go through an owner:
            // one stopped cleanly (a restart, an upgrade) has no record
            // for a moment, and this node must not become the branch's
            // writer and lock its owner out. It waits for a record.
            None if opts.auth.has_credentials() && !cache_servers => Some(wait_for_owner(
                catalog,
                name,
                opts.timeout.unwrap_or(arbor_net::branch::client::OWNER_START_WAIT),
            )?),
            None => return Ok(None),
        },
    };
    if !opts.auth.has_credentials() {
        let at = opts.server.clone().or(recorded.map(|o| o.addr)).unwrap_or_default();
        return Err(Error::Invalid(format!("branch {name} is served by arbor serve at {at}: give its token with --token-file (or ARBOR_TOKEN_FILE) to mount it through the owner")));
    }
    let catalog = catalog.clone();
    let name = name.to_string();
    Ok(Some(match opts.server.clone() {
        Some(addr) => Arc::new(move || Some(addr.clone())),
        None => Arc::new(move || catalog.owner_of(&name).ok().flatten().map(|o| o.addr)),
    }))
}

/// The owner record of branch `name` once one appears, for up to `wait`.
fn wait_for_owner(catalog: &Catalog, name: &str, wait: Duration) -> Result<Owner> {
    let started = std::time::Instant::now();
    tracing::warn!(branch = %name, wait_s = wait.as_secs(), "the branch has no owner recorded; waiting for one");
    // Bounded by `wait`.
    loop {
        if let Some(o) = catalog.owner_of(name)? {
            return Ok(o);
        }
        if started.elapsed() >= wait {
            return Err(Error::NoOwner(format!(
                "branch {name} has no owner (no arbor serve --branch {name} recorded itself within {} s); \
                 mount it without --token-file to write it from this node",
                wait.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Connects to the owner `locate` finds of branch `name` of disk `d`.
pub fn connect(d: &Disk, name: &str, locate: Locate, opts: &OwnerOptions) -> Result<Arc<BranchClient>> {
    let (token, tls) = opts.auth.load().context("to mount through the owner")?;
    // File bytes already in the bucket (or the disk's folder) are read
    // from there, through this node's chunk cache and cache servers;
    // The read-through-owner setting sends every read to the owner instead.
    let through_owner = crate::settings::get().read_through_owner;
    let segments = if through_owner { None } else { Some(d.catalog()?.segments().clone()) };
    let files = BranchClient::connect(BranchClientOptions {
        branch: name.to_string(),
        token,
        locate,
        timeout: opts.timeout,
        segments,
        tls,
    })?;
    Ok(Arc::new(files))
}
