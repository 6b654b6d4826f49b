//! TLS over real sockets: a chat completion through an HTTPS listener, certificate
//! rotation by reload (open connections keep theirs, new ones get the new one), a
//! malformed certificate refused at reload (the old one stays) and at start (a
//! config error naming the key), and an `https://` backend.
//!
//! Certificates are made here: one CA, leaves for 127.0.0.1 signed by it.

mod common;

use common::*;
use radixgate::config::Config;
use radixgate::engine_sim::EngineConfig;
use rustls::pki_types::{CertificateDer, ServerName};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;

struct Pki {
    ca_pem: String,
    ca_der: CertificateDer<'static>,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

struct Leaf {
    cert_pem: String,
    key_pem: String,
    der: CertificateDer<'static>,
}

impl Pki {
    fn new() -> Pki {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&key).unwrap();
        Pki {
            ca_pem: ca.pem(),
            ca_der: ca.der().clone(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    fn leaf(&self) -> Leaf {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }

    fn client_config(&self) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca_der.clone()).unwrap();
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

/// The leaf's files, under `tag`; returns (cert path, key path).
fn write_leaf(tag: &str, leaf: &Leaf) -> (PathBuf, PathBuf) {
    (
        temp_file(&format!("{tag}-cert.pem"), &leaf.cert_pem),
        temp_file(&format!("{tag}-key.pem"), &leaf.key_pem),
    )
}

fn tls_table(cert: &std::path::Path, key: &std::path::Path) -> String {
    format!(
        "[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
        cert.display(),
        key.display()
    )
}

type TlsClient = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

fn connect(addr: SocketAddr, pki: &Pki) -> TlsClient {
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let conn = rustls::ClientConnection::new(pki.client_config(), name).unwrap();
    let mut s = rustls::StreamOwned::new(conn, tcp);
    // Completes the handshake.
    s.flush().unwrap();
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock).unwrap();
    }
    s
}

fn peer_leaf(s: &TlsClient) -> CertificateDer<'static> {
    s.conn.peer_certificates().unwrap()[0].clone().into_owned()
}

/// One keep-alive request; the status and the decoded body.
fn request(s: &mut TlsClient, method: &str, path: &str, body: &str) -> (u16, String) {
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s.flush().unwrap();
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).unwrap(), 1, "closed mid-head: {raw:?}");
        raw.push(byte[0]);
    }
    let head = String::from_utf8(raw).unwrap();
    let status: u16 = head[9..12].parse().unwrap();
    let lower = head.to_ascii_lowercase();
    let mut body = Vec::new();
    if let Some(at) = lower.find("content-length:") {
        let n: usize = lower[at + 15..]
            .lines()
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        body.resize(n, 0);
        s.read_exact(&mut body).unwrap();
    } else {
        assert!(lower.contains("transfer-encoding: chunked"), "{head}");
        loop {
            let mut line = Vec::new();
            while !line.ends_with(b"\r\n") {
                s.read_exact(&mut byte).unwrap();
                line.push(byte[0]);
            }
            let size =
                usize::from_str_radix(std::str::from_utf8(&line).unwrap().trim(), 16).unwrap();
            let mut chunk = vec![0u8; size + 2];
            s.read_exact(&mut chunk).unwrap();
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
    (status, String::from_utf8(body).unwrap())
}

fn chat(s: &mut TlsClient) -> (u16, String) {
    request(
        s,
        "POST",
        "/v1/chat/completions",
        &chat_body("hello over tls", false),
    )
}

fn chat_over_tls(io: &str) {
    let pki = Pki::new();
    let (cert, key) = write_leaf(&format!("chat-{io}"), &pki.leaf());
    let engine = start_engine(io, EngineConfig::instant("sim"));
    let gw = start_gateway(
        io,
        2,
        &tls_table(&cert, &key),
        &[("e0", engine.url(), "sim")],
    );
    let mut s = connect(gw.local_addr(), &pki);
    assert_eq!(s.conn.alpn_protocol(), Some(&b"http/1.1"[..]));
    for _ in 0..3 {
        let (status, body) = chat(&mut s);
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("\"choices\""), "{body}");
    }
    // A plain-text client on the TLS port gets no HTTP answer.
    let mut plain = TcpStream::connect(gw.local_addr()).unwrap();
    plain
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    plain
        .write_all(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer);
    assert!(!answer.starts_with(b"HTTP/"), "{answer:?}");
}
both_drivers!(chat_over_tls);

fn rotation_by_reload(io: &str) {
    let pki = Pki::new();
    let (first, second) = (pki.leaf(), pki.leaf());
    let tag = format!("rotate-{io}");
    let (cert, key) = write_leaf(&tag, &first);
    let engine = start_engine(io, EngineConfig::instant("sim"));
    let file = temp_file(
        &format!("{tag}.toml"),
        &gateway_toml(
            io,
            2,
            &tls_table(&cert, &key),
            &[("e0", engine.url(), "sim")],
        ),
    );
    let gw = start_gateway_file(&file);
    let mut old = connect(gw.local_addr(), &pki);
    assert_eq!(chat(&mut old).0, 200);
    assert_eq!(peer_leaf(&old), first.der);

    // Rotate the files in place, then reload.
    write_leaf(&tag, &second);
    let summary = gw.reload().unwrap_or_else(|e| panic!("{}", e.message));
    assert_eq!(summary["tls"]["changed"], true, "{summary}");
    // Each shard applies the reload's fleet snapshot between requests, so a
    // connection accepted in the same instant may still get the old certificate.
    assert!(
        eventually(std::time::Duration::from_secs(5), || peer_leaf(&connect(
            gw.local_addr(),
            &pki
        )) == second.der),
        "a new connection gets the new cert"
    );
    // The connection opened before the reload carries on with its certificate.
    for _ in 0..2 {
        let (status, body) = chat(&mut old);
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(peer_leaf(&old), first.der);

    // A malformed certificate: the reload is refused, saying why, and the
    // certificate in force stays.
    std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nnot base64 at all\n").unwrap();
    let e = gw.reload().expect_err("a malformed certificate is refused");
    assert!(e.message.contains("server.tls.cert"), "{}", e.message);
    assert!(e.message.contains("stays in force"), "{}", e.message);
    let mut after = connect(gw.local_addr(), &pki);
    assert_eq!(peer_leaf(&after), second.der);
    assert_eq!(chat(&mut after).0, 200);
    // A missing key likewise.
    write_leaf(&tag, &second);
    std::fs::remove_file(&key).unwrap();
    let e = gw.reload().expect_err("a missing key is refused");
    assert!(e.message.contains("server.tls.key"), "{}", e.message);
    assert_eq!(peer_leaf(&connect(gw.local_addr(), &pki)), second.der);
}
both_drivers!(rotation_by_reload);

#[test]
fn bad_files_at_start_are_config_errors_naming_the_key() {
    let pki = Pki::new();
    let leaf = pki.leaf();
    let (cert, key) = write_leaf("start", &leaf);
    let config = |cert: &std::path::Path, key: &std::path::Path| {
        Config::from_toml(&gateway_toml(
            "epoll",
            1,
            &tls_table(cert, key),
            &[("e0", "http://127.0.0.1:9".into(), "m")],
        ))
    };
    assert!(config(&cert, &key).is_ok());
    let garbage = temp_file("start-garbage.pem", "not a certificate\n");
    let e = config(&garbage, &key).unwrap_err().to_string();
    assert!(e.contains("server.tls.cert:"), "{e}");
    let e = config(&cert, &garbage).unwrap_err().to_string();
    assert!(e.contains("server.tls.key:"), "{e}");
    let missing = std::env::temp_dir().join("radixgate-tls-no-such-file.pem");
    let e = config(&missing, &key).unwrap_err().to_string();
    assert!(e.contains("server.tls.cert: cannot read"), "{e}");
    // A key that is not the certificate's.
    let (_, other_key) = write_leaf("start-other", &pki.leaf());
    let e = config(&cert, &other_key).unwrap_err().to_string();
    assert!(e.contains("server.tls.key:"), "{e}");
    // https backends need a CA; tls keys are refused on http ones.
    let e = Config::from_toml(&gateway_toml(
        "epoll",
        1,
        "",
        &[("e0", "https://127.0.0.1:9".into(), "m")],
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("backends[0].tls_ca:"), "{e}");
}

/// A gateway whose backend is `https://`: a second gateway terminating TLS in
/// front of the engine. Health checks and requests both go over TLS.
fn https_backend(io: &str) {
    let pki = Pki::new();
    let (cert, key) = write_leaf(&format!("upstream-{io}"), &pki.leaf());
    let ca = temp_file(&format!("upstream-ca-{io}.pem"), &pki.ca_pem);
    let engine = start_engine(io, EngineConfig::instant("sim"));
    let front = start_gateway(
        io,
        1,
        &tls_table(&cert, &key),
        &[("e0", engine.url(), "sim")],
    );
    let url = format!("https://{}", front.local_addr());
    let gw = start_gateway(
        io,
        1,
        &format!("[upstream]\ntls_ca = \"{}\"\n", ca.display()),
        &[("tls0", url, "sim")],
    );
    let mut c = Client::connect(gw.local_addr());
    for _ in 0..3 {
        let r = c.post("/v1/chat/completions", &chat_body("over https", false), &[]);
        // Its only backend is the https one (whose own answer, from behind the
        // front gateway, names the engine).
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-router-backend"), Some("e0"));
    }
    // The health checks reach it over TLS too.
    let ready = eventually(std::time::Duration::from_secs(5), || {
        Client::connect(gw.local_addr()).get("/ready").status == 200
    });
    assert!(ready);
    // A CA that did not sign the backend's certificate: no request gets through.
    let other = Pki::new();
    let wrong = temp_file(&format!("upstream-wrong-ca-{io}.pem"), &other.ca_pem);
    let toml = gateway_toml(
        io,
        1,
        "",
        &[("tls0", format!("https://{}", front.local_addr()), "sim")],
    )
    .replace(
        "models = [\"sim\"]",
        &format!("models = [\"sim\"]\ntls_ca = \"{}\"", wrong.display()),
    );
    let gw = radixgate::Gateway::start(Config::from_toml(&toml).unwrap()).unwrap();
    let r = Client::connect(gw.local_addr()).post(
        "/v1/chat/completions",
        &chat_body("untrusted", false),
        &[],
    );
    assert!(r.status >= 500, "{} {}", r.status, r.text());
}
both_drivers!(https_backend);
