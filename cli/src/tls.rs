//! The TLS options: `arbor serve`'s certificate (and the CA of the client
//! certificates it takes instead of the token), and how the commands that
//! talk to it (`arbor mount`, `arbor warm`) trust it. See `arbor_net::wire::tls`.

use anyhow::{bail, Result};
use arbor_net::wire::tls::{ClientFiles, ServerFiles, Trust};
use clap::Args;
use std::path::PathBuf;

/// How a client of `arbor serve` (its cache servers, a branch's owner)
/// speaks TLS to it. Given, it never speaks clear text.
#[derive(Args, Clone, Default)]
pub struct ClientTlsArgs {
    /// Speak TLS to arbor serve (cache servers and a branch's owner),
    /// trusting the certificates this CA (PEM) signed; a server's
    /// certificate must name the host as given (DNS name or IP address).
    #[arg(long, env = "ARBOR_TLS_CA", conflicts_with = "tls_fingerprint")]
    pub tls_ca: Option<PathBuf>,
    /// Speak TLS to arbor serve, trusting only the certificate whose SHA-256
    /// is this (64 hex digits, colons allowed: `openssl x509 -noout
    /// -fingerprint -sha256 -in CERT`).
    #[arg(long, env = "ARBOR_TLS_FINGERPRINT")]
    pub tls_fingerprint: Option<String>,
    /// With --tls-ca or --tls-fingerprint: this node's certificate (PEM),
    /// shown to a server started with --tls-client-ca, where it stands for
    /// the token.
    #[arg(long, env = "ARBOR_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "ARBOR_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl ClientTlsArgs {
    /// The files to load, or `None` for clear text.
    pub fn files(&self) -> Result<Option<ClientFiles>> {
        let trust = match (&self.tls_ca, &self.tls_fingerprint) {
            (Some(ca), _) => Trust::Ca(std::path::absolute(ca)?),
            (None, Some(fp)) => Trust::Fingerprint(arbor_net::wire::tls::parse_fingerprint(fp)?),
            (None, None) if self.tls_cert.is_some() => {
                bail!("--tls-cert needs --tls-ca or --tls-fingerprint: how this node trusts the server")
            }
            (None, None) => return Ok(None),
        };
        let identity = match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Some((std::path::absolute(c)?, std::path::absolute(k)?)),
            _ => None,
        };
        Ok(Some(ClientFiles { trust, identity }))
    }
}

/// `arbor serve`'s own certificate.
#[derive(Args, Clone, Default)]
pub struct ServerTlsArgs {
    /// Speak TLS 1.3 on every connection (file operations, chunks, HTTP),
    /// with this certificate (PEM, the chain after it); clear-text clients
    /// are refused.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// With --tls-cert: take a client certificate this CA (PEM) signed
    /// instead of the token (a client may show either); without
    /// --token-file, a certificate is the only way in.
    #[arg(long, requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

impl ServerTlsArgs {
    pub fn files(&self) -> Result<Option<ServerFiles>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else { return Ok(None) };
        Ok(Some(ServerFiles {
            cert: std::path::absolute(cert)?,
            key: std::path::absolute(key)?,
            client_ca: self.tls_client_ca.as_ref().map(std::path::absolute).transpose()?,
        }))
    }
}
