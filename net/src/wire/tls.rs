//! TLS for `arbor serve`'s port and its clients: TLS 1.3 only, rustls with
//! the aws-lc-rs provider (already built into arbor for the S3 client).
//!
//! A server with a certificate speaks TLS on every connection of its port:
//! framed connections (file operations, segment chunks) and HTTP alike.
//! The framing inside is unchanged; TLS only wraps the bytes. ALPN tells
//! the two apart: a framed client offers [`ALPN_FRAMES`], an HTTP/2 client
//! `h2` (any other, or none, is HTTP).
//!
//! A client trusts the server by a CA ([`Trust::Ca`], the certificate must
//! name the host the client dials, DNS name or IP address) or by the
//! SHA-256 of the server's certificate ([`Trust::Fingerprint`], any name,
//! no expiry check: the pin is the trust). It may present a certificate of
//! its own: a server given a client CA takes one signed by it instead of
//! the token ([`ServerTls::client_ca`]).
//!
//! This module loads and checks the files and builds rustls' configs; it
//! never falls back to clear text: a client given TLS speaks nothing else.

use crate::Error;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The ALPN name of a framed connection.
pub const ALPN_FRAMES: &[u8] = b"arbor-frames";
const ALPN_H2: &[u8] = b"h2";
const ALPN_HTTP1: &[u8] = b"http/1.1";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A failure with `what` file `path`, as one line.
fn file_error(what: &'static str, path: &Path, cause: impl std::fmt::Display) -> Error {
    Error::Tls { what, path: path.display().to_string(), cause: cause.to_string() }
}

/// The certificates of a PEM file (at least one).
fn load_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(what, path, pem_cause(e)))?
        .collect::<Result<_, _>>()
        .map_err(|e| file_error(what, path, pem_cause(e)))?;
    if certs.is_empty() {
        return Err(file_error(what, path, "holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
    }
    for c in &certs {
        crate::wire::validity::check(c).map_err(|e| file_error(what, path, e))?;
    }
    Ok(certs)
}

fn pem_cause(e: rustls::pki_types::pem::Error) -> String {
    match e {
        rustls::pki_types::pem::Error::Io(e) => e.to_string(),
        rustls::pki_types::pem::Error::NoItemsFound => "holds no PEM item".into(),
        e => format!("is not valid PEM ({e:?})"),
    }
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, Error> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            file_error("TLS key", path, "holds no PEM private key (-----BEGIN PRIVATE KEY-----)")
        }
        e => file_error("TLS key", path, pem_cause(e)),
    })
}

/// The trust anchors of a CA file.
fn load_roots(what: &'static str, path: &Path) -> Result<rustls::RootCertStore, Error> {
    let mut roots = rustls::RootCertStore::empty();
    for c in load_certs(what, path)? {
        roots.add(c).map_err(|e| file_error(what, path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// Where a server's TLS comes from: `--tls-cert`, `--tls-key`,
/// `--tls-client-ca`.
#[derive(Clone, Debug)]
pub struct ServerFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// A server's TLS, loaded and checked.
#[derive(Clone)]
pub struct ServerTls {
    pub(crate) config: Arc<rustls::ServerConfig>,
    /// A client certificate signed by the client CA stands for the token.
    pub client_ca: bool,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("client_ca", &self.client_ca).finish_non_exhaustive()
    }
}

impl ServerTls {
    pub fn load(files: &ServerFiles) -> Result<ServerTls, Error> {
        let provider = provider();
        let certs = load_certs("TLS certificate", &files.cert)?;
        let key = load_key(&files.key)?;
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Config(format!("TLS: {e}")))?;
        let builder = match &files.client_ca {
            Some(ca) => {
                let roots = load_roots("TLS client CA", ca)?;
                // Unauthenticated clients pass the handshake: they may
                // still show the token.
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| file_error("TLS client CA", ca, e))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(certs, key).map_err(|e| {
            file_error("TLS key", &files.key, format!("does not go with {}: {e}", files.cert.display()))
        })?;
        config.alpn_protocols = vec![ALPN_FRAMES.to_vec(), ALPN_H2.to_vec(), ALPN_HTTP1.to_vec()];
        // No resumption: a ticket arriving after the handshake would look
        // to a waiting client like the start of an answer.
        config.send_tls13_tickets = 0;
        Ok(ServerTls { config: Arc::new(config), client_ca: files.client_ca.is_some() })
    }

    pub(crate) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.config.clone())
    }
}

/// How a client trusts the server it dials.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trust {
    /// Certificates signed by the CA in this PEM file (`--tls-ca`).
    Ca(PathBuf),
    /// The certificate whose DER has this SHA-256 (`--tls-fingerprint`).
    Fingerprint([u8; 32]),
}

/// A SHA-256 fingerprint from 64 hex digits, with or without `:` between
/// bytes (as `openssl x509 -fingerprint -sha256` prints it).
pub fn parse_fingerprint(s: &str) -> Result<[u8; 32], Error> {
    let hex: String = s.trim().chars().filter(|&c| c != ':').collect();
    let bad = || Error::Config(format!("--tls-fingerprint {s:?}: want the SHA-256 of the certificate, 64 hex digits"));
    if hex.len() != 64 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// The SHA-256 of a certificate's DER, in lowercase hex.
pub fn fingerprint(der: &[u8]) -> String {
    let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, der);
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of the first certificate of a PEM file, in hex.
pub fn fingerprint_of_file(path: &Path) -> Result<String, Error> {
    Ok(fingerprint(&load_certs("TLS certificate", path)?[0]))
}

/// Where a client's TLS comes from: `--tls-ca` or `--tls-fingerprint`,
/// and `--tls-cert` with `--tls-key` for a certificate of its own.
#[derive(Clone, Debug)]
pub struct ClientFiles {
    pub trust: Trust,
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// A client's TLS, loaded and checked: one config for framed connections
/// and one for HTTP/2, which differ in the ALPN they offer.
#[derive(Clone)]
pub struct ClientTls {
    frames: Arc<rustls::ClientConfig>,
    h2: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").finish_non_exhaustive()
    }
}

impl ClientTls {
    pub fn load(files: &ClientFiles) -> Result<ClientTls, Error> {
        let provider = provider();
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Config(format!("TLS: {e}")))?;
        let builder = match &files.trust {
            Trust::Ca(ca) => builder.with_root_certificates(load_roots("TLS CA", ca)?),
            Trust::Fingerprint(sha256) => builder.dangerous().with_custom_certificate_verifier(Arc::new(Pinned {
                sha256: *sha256,
                algorithms: provider.signature_verification_algorithms,
            })),
        };
        let mut config = match &files.identity {
            Some((cert, key)) => builder
                .with_client_auth_cert(load_certs("TLS certificate", cert)?, load_key(key)?)
                .map_err(|e| file_error("TLS key", key, format!("does not go with {}: {e}", cert.display())))?,
            None => builder.with_no_client_auth(),
        };
        config.resumption = rustls::client::Resumption::disabled();
        let mut h2 = config.clone();
        config.alpn_protocols = vec![ALPN_FRAMES.to_vec()];
        h2.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(ClientTls { frames: Arc::new(config), h2: Arc::new(h2) })
    }

    /// TLS over `tcp`, a framed connection to `addr` (`HOST:PORT`), its
    /// handshake done (bounded by `tcp`'s timeouts).
    pub(crate) fn dial(
        &self,
        addr: &str,
        mut tcp: std::net::TcpStream,
    ) -> std::io::Result<crate::wire::stream::Stream> {
        let mut conn = rustls::ClientConnection::new(self.frames.clone(), server_name(addr)?).map_err(tls_io)?;
        // Each round sends or reads part of the handshake, or fails.
        while conn.is_handshaking() {
            conn.complete_io(&mut tcp).map_err(explain)?;
        }
        Ok(crate::wire::stream::Stream::client(tcp, conn))
    }

    /// TLS over `tcp` for HTTP/2 to `addr`, its handshake done.
    pub(crate) async fn connect(
        &self,
        addr: &str,
        tcp: tokio::net::TcpStream,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let connector = tokio_rustls::TlsConnector::from(self.h2.clone());
        connector.connect(server_name(addr)?, tcp).await.map_err(explain)
    }
}

/// The name the server's certificate must carry: the host of `addr`.
fn server_name(addr: &str) -> std::io::Result<ServerName<'static>> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string()).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{host:?} is not a TLS server name"))
    })
}

fn tls_io(e: rustls::Error) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e)
}

/// A failed handshake, said so a person knows what to fix.
pub(crate) fn explain(e: std::io::Error) -> std::io::Error {
    use rustls::{CertificateError, Error as E};
    let Some(tls) = e.get_ref().and_then(|i| i.downcast_ref::<E>()) else {
        return match e.kind() {
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => std::io::Error::new(
                e.kind(),
                format!("TLS: the server closed the connection during the handshake ({e}); does it speak TLS?"),
            ),
            _ => e,
        };
    };
    let said = match tls {
        E::InvalidCertificate(CertificateError::UnknownIssuer) => {
            "the server's certificate is not signed by the CA given with --tls-ca".to_string()
        }
        E::InvalidCertificate(CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. }) => {
            format!("the server's certificate does not name the host dialed ({tls})")
        }
        E::InvalidMessage(_) => {
            "the server does not speak TLS (start arbor serve with --tls-cert, or drop --tls-ca/--tls-fingerprint)"
                .to_string()
        }
        E::AlertReceived(a) => format!("the server refused the TLS handshake ({a:?}): check --tls-cert/--tls-key"),
        other => other.to_string(),
    };
    std::io::Error::new(e.kind(), format!("TLS: {said}"))
}

/// Trusts exactly the certificate with a SHA-256; the handshake's
/// signature is still checked against it.
#[derive(Debug)]
struct Pinned {
    sha256: [u8; 32],
    algorithms: WebPkiSupportedAlgorithms,
}

#[derive(Debug)]
struct PinMismatch(String);

impl std::fmt::Display for PinMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PinMismatch {}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let got = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, end_entity);
        if got.as_ref() == self.sha256 {
            return Ok(ServerCertVerified::assertion());
        }
        let want: String = self.sha256.iter().map(|b| format!("{b:02x}")).collect();
        let why = format!("its SHA-256 is {}, not the --tls-fingerprint {want}", fingerprint(end_entity));
        Err(rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(Arc::new(
            PinMismatch(why),
        )))))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_read_with_or_without_colons_and_nothing_else() {
        let hex = "ab".repeat(32);
        assert_eq!(parse_fingerprint(&hex).expect("plain"), [0xab; 32]);
        let colons = vec!["AB"; 32].join(":");
        assert_eq!(parse_fingerprint(&colons).expect("colons"), [0xab; 32]);
        for bad in ["", "ab", &"zz".repeat(32), &"ab".repeat(33), &"é".repeat(32)] {
            assert!(parse_fingerprint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_server_name_is_the_host_dialed() {
        assert!(matches!(server_name("127.0.0.1:7070").expect("ip"), ServerName::IpAddress(_)));
        assert!(matches!(server_name("[::1]:7070").expect("v6"), ServerName::IpAddress(_)));
        assert!(matches!(server_name("cache-a.example:7070").expect("dns"), ServerName::DnsName(_)));
    }
}
