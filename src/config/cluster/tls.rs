//! `[cluster]` with a `rediss://` URL: the CA bundle to trust and the client
//! certificate to present, read and checked once at start (the connection itself
//! is [`crate::cluster::tls`]).
//!
//! Every file is read here, so a missing or unreadable one, or one that is not
//! PEM, is a config error naming its key, never a bus outage found later.

#[derive(Clone)]
pub struct BusTls {
    /// The PEM CA bundle of `ca_file`; `None` = the system's roots.
    pub ca: Option<Vec<u8>>,
    /// The PEM certificate chain and private key of `cert_file` and `key_file`.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for BusTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusTls")
            .field(
                "ca",
                &self.ca.as_ref().map_or("system roots", |_| "ca_file"),
            )
            .field("client_cert", &self.client.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl BusTls {
    /// The certificates in the form redis-rs takes them.
    pub fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca.clone(),
        }
    }
}

const PEM_CERTIFICATE: &str = "-----BEGIN CERTIFICATE-----";

/// Reads the TLS files for the `rediss://` URL `url`; every problem goes to `errors`
/// with its key.
#[allow(clippy::disallowed_methods)] // read once at start-up, off the shards
pub(super) fn read(
    url: &str,
    ca_file: &str,
    cert_file: &str,
    key_file: &str,
    errors: &mut Vec<String>,
) -> Option<BusTls> {
    let before = errors.len();
    if url.contains('#') {
        errors.push(
            "cluster.url: a fragment (such as #insecure, which skips the certificate check) \
             is refused; give cluster.ca_file the CA that signed the bus's certificate"
                .into(),
        );
    }
    let mut file = |key: &str, path: &str| -> Option<Vec<u8>> {
        match std::fs::read(path) {
            Ok(bytes) => Some(bytes),
            Err(e) => {
                errors.push(format!("cluster.{key}: cannot read `{path}`: {e}"));
                None
            }
        }
    };
    let ca = match ca_file {
        "" => None,
        path => file("ca_file", path),
    };
    let client = match (cert_file, key_file) {
        ("", "") => None,
        (cert, "") | ("", cert) if !cert.is_empty() => {
            errors.push(
                "cluster.cert_file, cluster.key_file: a client certificate needs both".into(),
            );
            None
        }
        (cert, key) => match (file("cert_file", cert), file("key_file", key)) {
            (Some(c), Some(k)) => Some((c, k)),
            _ => None,
        },
    };
    if let Some(ca) = &ca {
        if !String::from_utf8_lossy(ca).contains(PEM_CERTIFICATE) {
            errors.push(format!(
                "cluster.ca_file: `{ca_file}` holds no PEM certificate (`{PEM_CERTIFICATE}`)"
            ));
        }
    }
    if let Some((cert, _)) = &client {
        if !String::from_utf8_lossy(cert).contains(PEM_CERTIFICATE) {
            errors.push(format!(
                "cluster.cert_file: `{cert_file}` holds no PEM certificate (`{PEM_CERTIFICATE}`)"
            ));
        }
    }
    if errors.len() > before {
        return None;
    }
    let tls = BusTls { ca, client };
    // redis-rs parses the PEM when the client is built: one build per file, so a
    // file it cannot parse is named.
    let parse = |certificates: redis::TlsCertificates| {
        redis::Client::build_with_tls(url, certificates).map_err(|e| e.to_string())
    };
    if tls.ca.is_some() {
        if let Err(e) = parse(
            BusTls {
                client: None,
                ..tls.clone()
            }
            .certificates(),
        ) {
            errors.push(format!("cluster.ca_file: `{ca_file}`: {e}"));
        }
    }
    if tls.client.is_some() {
        if let Err(e) = parse(
            BusTls {
                ca: None,
                ..tls.clone()
            }
            .certificates(),
        ) {
            match e.contains("private key") {
                true => errors.push(format!("cluster.key_file: `{key_file}`: {e}")),
                false => errors.push(format!("cluster.cert_file: `{cert_file}`: {e}")),
            }
        }
    }
    (errors.len() == before).then_some(tls)
}
