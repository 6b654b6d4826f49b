//! TLS on the data plane: the client listener (`[server.tls]`) and `https://`
//! backends, with rustls on ring.
//!
//! [`Stream`] is what the HTTP code reads and writes: a plain `TcpStream` or a
//! [`TlsStream`] (boxed, so the plain variant stays the size of a socket). The plain
//! path pays one match per I/O call and nothing else. The rustls configurations are
//! built here from PEM bytes (the config module reads the files and names the key
//! on an error); shards find the server's in their fleet snapshot, so a reload's
//! new certificate serves new handshakes while open connections keep theirs.

pub mod stream;

pub use stream::TlsStream;

use monoio::buf::{IoBuf, IoBufMut, IoVecBuf, IoVecBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use monoio::net::TcpStream;
use monoio::BufResult;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::io;
use std::sync::Arc;

/// The one application protocol offered and accepted.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// A connection of the data plane, in the clear or over TLS.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream>),
}

impl From<TcpStream> for Stream {
    fn from(s: TcpStream) -> Self {
        Stream::Plain(s)
    }
}

impl Stream {
    /// The socket underneath (its fd, readiness, peer).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.tcp(),
        }
    }

    /// Resolves when a read would not wait (for TLS, also when plaintext is already
    /// decrypted and waiting).
    pub async fn readable(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.readable(false).await,
            Stream::Tls(s) => s.readable().await,
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }
}

impl AsyncReadRent for Stream {
    #[inline]
    async fn read<T: IoBufMut>(&mut self, buf: T) -> BufResult<usize, T> {
        match self {
            Stream::Plain(s) => s.read(buf).await,
            Stream::Tls(s) => s.read(buf).await,
        }
    }

    #[inline]
    async fn readv<T: IoVecBufMut>(&mut self, buf: T) -> BufResult<usize, T> {
        match self {
            Stream::Plain(s) => s.readv(buf).await,
            Stream::Tls(s) => s.readv(buf).await,
        }
    }
}

impl AsyncWriteRent for Stream {
    #[inline]
    async fn write<T: IoBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        match self {
            Stream::Plain(s) => s.write(buf).await,
            Stream::Tls(s) => s.write(buf).await,
        }
    }

    #[inline]
    async fn writev<T: IoVecBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        match self {
            Stream::Plain(s) => s.writev(buf).await,
            Stream::Tls(s) => s.writev(buf).await,
        }
    }

    async fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush().await,
            Stream::Tls(s) => s.flush().await,
        }
    }

    async fn shutdown(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.shutdown().await,
            Stream::Tls(s) => s.shutdown().await,
        }
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The listener's configuration: the chain in `cert_pem` (leaf first), its key in
/// `key_pem`, ALPN http/1.1. The error says which of the two is wrong.
pub fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<ServerConfig, ServerTlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ServerTlsError::Cert(format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(ServerTlsError::Cert("holds no PEM certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| ServerTlsError::Key(format!("no PEM private key: {e}")))?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| ServerTlsError::Cert(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| ServerTlsError::Key(format!("does not fit the certificate: {e}")))?;
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(config)
}

/// What is wrong with a listener's certificate or key.
#[derive(Debug, PartialEq, Eq)]
pub enum ServerTlsError {
    Cert(String),
    Key(String),
}

/// A client configuration trusting the CA certificates of `ca_pem`, ALPN http/1.1.
pub fn client_config(ca_pem: &[u8]) -> Result<ClientConfig, String> {
    let mut roots = RootCertStore::empty();
    let mut any = false;
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| format!("not a PEM certificate bundle: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("unusable CA certificate: {e}"))?;
        any = true;
    }
    if !any {
        return Err("holds no PEM certificate".into());
    }
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(config)
}
