//! How this node reaches the cache servers (`arbor serve`) and a branch's
//! owner: the token and TLS it shows, the cache client, and the check
//! that the servers answer.

use crate::error::{Context, Error, Result};
use arbor_net::wire::tls::ClientFiles;
use arbor_net::{CacheClient, ClientOptions};
use std::path::PathBuf;
use std::sync::Arc;

/// How a client proves itself to `arbor serve`: a token file, and TLS
/// (a CA or a fingerprint to trust, and maybe a certificate of its own
/// that may stand for the token).
#[derive(Clone, Default)]
pub struct ClientAuth {
    pub token_file: Option<PathBuf>,
    pub tls: Option<ClientFiles>,
}

impl ClientAuth {
    /// The token (empty: none, a client certificate instead) and the TLS
    /// to speak, loaded and checked.
    pub fn load(&self) -> Result<(String, Option<arbor_net::ClientTls>)> {
        let token = match &self.token_file {
            Some(f) => arbor_net::read_token(f)?,
            None if self.has_identity() => String::new(),
            None => return Err(Error::Invalid(
                "give --token-file (or ARBOR_TOKEN_FILE): the servers' shared token (or --tls-cert/--tls-key, for servers started with --tls-client-ca)".into(),
            )),
        };
        let tls = self.tls.as_ref().map(arbor_net::ClientTls::load).transpose()?;
        Ok((token, tls))
    }

    /// Whether the client shows a certificate of its own (which may stand
    /// for the token).
    pub fn has_identity(&self) -> bool {
        has_identity(self.tls.as_ref())
    }

    /// Whether the client has anything to show a branch's owner: a token
    /// or a certificate.
    pub fn has_credentials(&self) -> bool {
        self.token_file.is_some() || self.has_identity()
    }
}

/// Whether a client shows a certificate of its own (which may stand for
/// the token).
pub fn has_identity(tls: Option<&ClientFiles>) -> bool {
    tls.is_some_and(|t| t.identity.is_some())
}

/// The client a mount reads through, from the cache servers' addresses
/// (`None`: none given) and how to prove itself to them.
pub fn client(servers: &[String], auth: &ClientAuth) -> Result<Option<Arc<CacheClient>>> {
    let servers: Vec<String> = servers.iter().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    if servers.is_empty() {
        return Ok(None);
    }
    let (token, tls) = auth.load().context("--cache-server")?;
    let settings = crate::settings::get();
    let client = CacheClient::new(ClientOptions { servers, token, timeout: settings.cache_timeout, tls })?;
    client.set_framed(settings.cache_framed);
    Ok(Some(Arc::new(client)))
}

/// Asks every cache server whether it answers and takes the token:
/// (how many do, what is wrong with each of the others, as "ADDR PROBLEM").
pub fn check_servers(client: &CacheClient) -> (usize, Vec<String>) {
    let checked = client.check(crate::settings::get().cache_timeout);
    let ok = checked.iter().filter(|(_, p)| p.is_none()).count();
    let problems = checked.into_iter().filter_map(|(addr, p)| Some(format!("{addr} {}", p?))).collect();
    (ok, problems)
}
