//! `[server.tls]` (the listener's certificate and key) and the CA bundles of
//! `https://` backends (`upstream.tls_ca`, `backends[].tls_ca`): the files are read
//! and parsed here, at start and at every reload, so a missing, unreadable or
//! malformed file is a config error naming its key (at a reload: the reload is
//! refused and the running certificate stays in force). The rustls configurations
//! built from them travel in the config to the shards ([`crate::tls`]).

use rustls::pki_types::ServerName;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt::{self, Write as _};
use std::sync::Arc;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ServerTlsWire {
    /// PEM certificate chain the listener presents, leaf first.
    cert: String,
    /// PEM private key of the leaf certificate (PKCS#8, PKCS#1 or SEC1).
    key: String,
}

/// The listener's TLS settings: read from `cert` and `key` when the config was
/// loaded (a reload reads them again, so rotated files take effect).
#[derive(Clone)]
pub struct ServerTls {
    pub cert: String,
    pub key: String,
    pub config: Arc<rustls::ServerConfig>,
    /// SHA-256 of the leaf certificate (DER), hex: what a reload reports.
    pub fingerprint: String,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .field("fingerprint", &self.fingerprint)
            .finish()
    }
}

/// Reads `[server.tls]`; every problem goes to `errors` naming its key.
#[allow(clippy::disallowed_methods)] // config loading: the main, admin or signal thread
pub(super) fn server(wire: Option<ServerTlsWire>, errors: &mut Vec<String>) -> Option<ServerTls> {
    let wire = wire?;
    let before = errors.len();
    let mut read = |key: &str, path: &str| -> Vec<u8> {
        if path.is_empty() {
            errors.push(format!("server.tls.{key}: give the path of a PEM file"));
            return Vec::new();
        }
        std::fs::read(path).unwrap_or_else(|e| {
            errors.push(format!("server.tls.{key}: cannot read `{path}`: {e}"));
            Vec::new()
        })
    };
    let cert = read("cert", &wire.cert);
    let key = read("key", &wire.key);
    if errors.len() > before {
        return None;
    }
    match crate::tls::server_config(&cert, &key) {
        Ok(config) => Some(ServerTls {
            fingerprint: leaf_fingerprint(&cert),
            cert: wire.cert,
            key: wire.key,
            config: Arc::new(config),
        }),
        Err(crate::tls::ServerTlsError::Cert(e)) => {
            errors.push(format!("server.tls.cert: `{}` {e}", wire.cert));
            None
        }
        Err(crate::tls::ServerTlsError::Key(e)) => {
            errors.push(format!("server.tls.key: `{}` {e}", wire.key));
            None
        }
    }
}

fn leaf_fingerprint(cert_pem: &[u8]) -> String {
    use rustls::pki_types::pem::PemObject;
    let leaf = rustls::pki_types::CertificateDer::pem_slice_iter(cert_pem)
        .next()
        .and_then(Result::ok);
    let digest = Sha256::digest(leaf.as_deref().unwrap_or_default());
    let mut hex = String::with_capacity(64);
    for b in digest {
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

/// How the gateway speaks TLS to one `https://` backend.
#[derive(Clone)]
pub struct UpstreamTls {
    /// The name its certificate must hold (`tls_server_name`, else the URL's host).
    pub server_name: ServerName<'static>,
    pub config: Arc<rustls::ClientConfig>,
    /// The CA file trusted, and the SHA-256 of its bytes (a changed file is a
    /// changed backend).
    pub ca: String,
    ca_digest: [u8; 32],
}

impl PartialEq for UpstreamTls {
    fn eq(&self, other: &Self) -> bool {
        self.server_name == other.server_name
            && self.ca == other.ca
            && self.ca_digest == other.ca_digest
    }
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("server_name", &self.server_name)
            .field("ca", &self.ca)
            .finish()
    }
}

/// A CA bundle file, read and checked.
pub(super) struct CaFile {
    path: String,
    pem: Vec<u8>,
}

/// Reads and checks `upstream.tls_ca`, once for every backend that uses it.
#[allow(clippy::disallowed_methods)] // config loading: the main, admin or signal thread
pub(super) fn default_ca(path: Option<&str>, errors: &mut Vec<String>) -> Option<CaFile> {
    let path = path?;
    match std::fs::read(path) {
        Ok(pem) => match crate::tls::client_config(&pem) {
            Ok(_) => Some(CaFile {
                path: path.to_string(),
                pem,
            }),
            Err(e) => {
                errors.push(format!("upstream.tls_ca: `{path}` {e}"));
                None
            }
        },
        Err(e) => {
            errors.push(format!("upstream.tls_ca: cannot read `{path}`: {e}"));
            None
        }
    }
}

/// A backend's own TLS keys (`tls_ca`, `tls_server_name`) and its URL's host.
pub(super) struct BackendTlsKeys<'a> {
    pub host: &'a str,
    pub ca: Option<&'a str>,
    pub server_name: Option<&'a str>,
}

/// The TLS settings of the `https://` backend at `at`: its own `tls_ca` or else
/// `default` (`upstream.tls_ca`; `default_set` when that key is set, even if its
/// file was refused and reported already), and its `tls_server_name` or else the
/// URL's host.
#[allow(clippy::disallowed_methods)] // config loading: the main, admin or signal thread
pub(super) fn upstream(
    at: &str,
    keys: BackendTlsKeys<'_>,
    default: Option<&CaFile>,
    default_set: bool,
    errors: &mut Vec<String>,
) -> Option<Arc<UpstreamTls>> {
    let (ca_key, path, pem) = match (keys.ca, default) {
        (Some(ca), _) => match std::fs::read(ca) {
            Ok(pem) => (format!("{at}.tls_ca"), ca.to_string(), pem),
            Err(e) => {
                errors.push(format!("{at}.tls_ca: cannot read `{ca}`: {e}"));
                return None;
            }
        },
        (None, Some(d)) => ("upstream.tls_ca".to_string(), d.path.clone(), d.pem.clone()),
        (None, None) if default_set => return None,
        (None, None) => {
            errors.push(format!(
                "{at}.tls_ca: an https:// backend needs the CA that signed its certificate \
                 ({at}.tls_ca, or upstream.tls_ca for every backend)"
            ));
            return None;
        }
    };
    let host = keys.host;
    let name = keys.server_name.unwrap_or_else(|| {
        host.rsplit_once(':')
            .map_or(host, |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']')
    });
    let Ok(server_name) = ServerName::try_from(name.to_string()) else {
        errors.push(format!(
            "{at}.tls_server_name: `{name}` is not a DNS name or IP address"
        ));
        return None;
    };
    match crate::tls::client_config(&pem) {
        Ok(config) => Some(Arc::new(UpstreamTls {
            server_name,
            config: Arc::new(config),
            ca_digest: Sha256::digest(&pem).into(),
            ca: path,
        })),
        Err(e) => {
            errors.push(format!("{ca_key}: `{path}` {e}"));
            None
        }
    }
}
