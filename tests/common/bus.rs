//! The cluster bus for tests: `deploy/cluster/bus` (Redis) on a free port, stopped
//! by its PID when dropped, and a raw RESP client to poke it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Bus {
    child: Option<Child>,
    pub port: u16,
    pub url: String,
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
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/cluster/bus");
        let mut child = Command::new(script)
            .arg(port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("deploy/cluster/bus runs");
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut url = String::new();
        out.read_line(&mut url).expect("the bus prints its url");
        // Keep draining (Redis logs to stdout).
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = out.read_to_end(&mut sink);
        });
        let bus = Bus {
            child: Some(child),
            port,
            url: url.trim().to_string(),
        };
        let deadline = Instant::now() + Duration::from_secs(180);
        while bus.command(&[b"PING"]).is_none() {
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
        }
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
