//! How `arbor mount` and `arbor warm` reach the cache servers (`arbor
//! serve`): the token and TLS they show, the client, and the check that
//! the servers answer.

use anyhow::{bail, Context, Result};
use arbor_net::{CacheClient, ClientOptions};
use std::path::Path;
use std::sync::Arc;

/// How a client proves itself to `arbor serve`: `--token-file`, and TLS
/// (`--tls-ca`/`--tls-fingerprint`, with `--tls-cert`/`--tls-key` a
/// certificate that may stand for the token).
#[derive(Clone, Copy)]
pub struct ClientAuth<'a> {
    pub token_file: Option<&'a Path>,
    pub tls: Option<&'a arbor_net::tls::ClientFiles>,
}

impl ClientAuth<'_> {
    /// The token (empty: none, a client certificate instead) and the TLS
    /// to speak, loaded and checked.
    pub fn load(&self) -> Result<(String, Option<arbor_net::ClientTls>)> {
        let token = match self.token_file {
            Some(f) => arbor_net::read_token(f)?,
            None if crate::tls::has_identity(self.tls) => String::new(),
            None => bail!(
                "give --token-file (or ARBOR_TOKEN_FILE): the servers' shared token (or --tls-cert/--tls-key, for servers started with --tls-client-ca)"
            ),
        };
        let tls = self.tls.map(arbor_net::ClientTls::load).transpose()?;
        Ok((token, tls))
    }
}

/// The client a mount reads through, from `--cache-server`, `--token-file`
/// and the TLS options.
pub fn client(servers: &[String], auth: ClientAuth<'_>) -> Result<Option<Arc<CacheClient>>> {
    let servers: Vec<String> = servers.iter().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    if servers.is_empty() {
        return Ok(None);
    }
    let (token, tls) = auth.load().context("--cache-server")?;
    let timeout = arbor_net::client::timeout_from_env();
    let client = CacheClient::new(ClientOptions { servers, token, timeout, tls })?;
    Ok(Some(Arc::new(client)))
}

/// Asks every cache server whether it answers and takes the token:
/// (how many do, what is wrong with each of the others, as "ADDR PROBLEM").
pub fn check_servers(client: &CacheClient) -> (usize, Vec<String>) {
    let checked = client.check(arbor_net::client::timeout_from_env());
    let ok = checked.iter().filter(|(_, p)| p.is_none()).count();
    let problems = checked.into_iter().filter_map(|(addr, p)| Some(format!("{addr} {}", p?))).collect();
    (ok, problems)
}

/// Says on stderr which cache servers do not answer or refuse the token:
/// their chunks come from the bucket until they do.
pub fn warn_about_servers(problems: &[String]) {
    for p in problems {
        eprintln!("warning: cache server {p}; the chunks it owns come from the bucket until it answers");
    }
}
