//! The bus client, plain (`redis://`) or over TLS (`rediss://`): both cluster
//! threads open their connections through [`client`].
//!
//! TLS is redis-rs's rustls backend. rustls needs a process-wide crypto provider,
//! which redis-rs leaves to the application: ring is installed here, once, before
//! the first TLS connection (an application that embeds the gateway and installed
//! its own keeps it).

use crate::config::ClusterConfig;
use std::sync::Once;

/// The client for `config`'s bus, with its credentials and, for `rediss://`, the
/// CA bundle and client certificate read at start.
pub fn client(config: &ClusterConfig) -> redis::RedisResult<redis::Client> {
    use redis::IntoConnectionInfo;
    let mut info = config.url.as_str().into_connection_info()?;
    let mut settings = info.redis_settings().clone();
    if let Some(user) = &config.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = &config.password {
        settings = settings.set_password(password);
    }
    info = info.set_redis_settings(settings);
    match &config.tls {
        None => redis::Client::open(info),
        Some(tls) => {
            install_provider();
            redis::Client::build_with_tls(info, tls.certificates())
        }
    }
}

fn install_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err: another provider is installed already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A hint for a failed connection, when it looks like the TLS configuration
/// rather than the network.
pub fn hint(config: &ClusterConfig, error: &str) -> Option<&'static str> {
    config.tls.as_ref()?;
    let e = error.to_ascii_lowercase();
    if e.contains("certificaterequired") || e.contains("alert") {
        Some("the bus ended the TLS handshake: does it require a client certificate (cluster.cert_file, cluster.key_file), or refuse this one?")
    } else if e.contains("certificate") || e.contains("unknownissuer") {
        Some("the bus's certificate is not trusted: check cluster.ca_file (the CA that signed it) and that the URL's host is in the certificate")
    } else if e.contains("handshake") || e.contains("tls") {
        Some("the TLS handshake with the bus failed: is it a TLS port?")
    } else {
        None
    }
}
