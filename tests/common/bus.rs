//! The cluster bus for tests: `deploy/cluster/bus` (Redis) on a free port, stopped
//! by its PID when dropped, and a raw RESP client to poke it. A TLS bus
//! ([`Bus::start_tls`]) carries the paths of its throwaway CA and client
//! certificate, and is pinged over TLS.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Bus {
    child: Option<Child>,
    pub port: u16,
    pub url: String,
    /// A TLS bus's CA (the script's second line); client.crt and client.key lie
    /// beside it.
    pub ca: Option<PathBuf>,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl Bus {
    /// Starts a bus on a free port and waits until it answers.
    pub fn start() -> Bus {
        Bus::start_on(free_port())
    }

    /// Starts a bus on `port` (a restart keeps the port, as an operator's would).
    pub fn start_on(port: u16) -> Bus {
        Bus::start_with(port, &[])
    }

    /// Starts a TLS-only bus on a free port (`--tls`), or one that also requires a
    /// client certificate (`--mtls`).
    pub fn start_tls(mutual: bool) -> Bus {
        Bus::start_with(free_port(), &[if mutual { "--mtls" } else { "--tls" }])
    }

    fn start_with(port: u16, flags: &[&str]) -> Bus {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/cluster/bus");
        let mut child = Command::new(script)
            .arg(port.to_string())
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("deploy/cluster/bus runs");
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut url = String::new();
        out.read_line(&mut url).expect("the bus prints its url");
        let ca = url.starts_with("rediss://").then(|| {
            let mut ca = String::new();
            out.read_line(&mut ca).expect("a TLS bus prints its CA");
            PathBuf::from(ca.trim())
        });
        // Keep draining (Redis logs to stdout).
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = out.read_to_end(&mut sink);
        });
        let bus = Bus {
            child: Some(child),
            port,
            url: url.trim().to_string(),
            ca,
        };
        let deadline = Instant::now() + Duration::from_secs(180);
        while !bus.answers() {
            assert!(Instant::now() < deadline, "bus on {port} never answered");
            std::thread::sleep(Duration::from_millis(20));
        }
        bus
    }

    /// A handle on a bus another handle started (it does not stop it).
    pub fn attach(port: u16) -> Bus {
        Bus {
            child: None,
            port,
            url: format!("redis://127.0.0.1:{port}"),
            ca: None,
        }
    }

    /// A file beside a TLS bus's CA: `client.crt`, `client.key`.
    pub fn tls_file(&self, name: &str) -> String {
        let ca = self.ca.as_ref().expect("a TLS bus");
        ca.with_file_name(name).display().to_string()
    }

    /// PING answered: in plain RESP, or for a TLS bus over TLS (trusting its CA and
    /// presenting its client certificate).
    fn answers(&self) -> bool {
        let Some(ca) = &self.ca else {
            return self.command(&[b"PING"]).is_some();
        };
        let _ = rustls::crypto::ring::default_provider().install_default();
        let read = |p: &str| std::fs::read(p).expect("the bus's certificates");
        let certificates = redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read(&self.tls_file("client.crt")),
                client_key: read(&self.tls_file("client.key")),
            }),
            root_cert: Some(std::fs::read(ca).expect("the bus's CA")),
        };
        redis::Client::build_with_tls(self.url.as_str(), certificates)
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }

    /// One command over a fresh connection; the raw reply.
    pub fn command(&self, args: &[&[u8]]) -> Option<Vec<u8>> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let mut req = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            req.extend_from_slice(a);
            req.extend_from_slice(b"\r\n");
        }
        s.write_all(&req).ok()?;
        let mut reply = vec![0u8; 4096];
        let n = s.read(&mut reply).ok()?;
        (n > 0).then(|| reply[..n].to_vec())
    }

    /// Publishes raw bytes on a channel (a foreign or forged message).
    pub fn publish(&self, channel: &str, payload: &[u8]) {
        self.command(&[b"PUBLISH", channel.as_bytes(), payload])
            .expect("publish answered");
    }

    /// Kills the bus with SIGKILL, as a crash would, and waits until it is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "bus still listening after SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
