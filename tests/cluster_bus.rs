//! `deploy/cluster/bus`: for each bus it prints the `[cluster] url` as its first
//! line, serves on 127.0.0.1:PORT, and stops when its PID is killed (the script
//! execs the server). It installs the server with apt-get when missing, so the
//! first run on a fresh machine takes longer.

// The test thread waits for the bus; no shard runs here.
#![allow(clippy::disallowed_methods)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Starts the bus, returns it and the first line it printed.
fn start(kind: Option<&str>, port: u16) -> (Child, String) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/cluster/bus");
    let mut cmd = Command::new(script);
    cmd.arg(port.to_string());
    if let Some(k) = kind {
        cmd.arg(k);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("deploy/cluster/bus runs");
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    out.read_line(&mut line).expect("a first line");
    // Keep draining (Redis logs to stdout).
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = out.read_to_end(&mut sink);
    });
    (child, line.trim().to_string())
}

fn connect(port: u16) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => {
                s.set_read_timeout(Some(Duration::from_secs(5)))
                    .expect("timeout");
                return s;
            }
            Err(e) if Instant::now() > deadline => panic!("bus not listening on {port}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn stop(mut child: Child, port: u16) {
    // SAFETY: kill(2) on our own child's PID.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "bus did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} still served after the PID was killed"
    );
}

#[test]
fn redis_bus_is_the_default_and_answers_ping() {
    let port = free_port();
    let (child, url) = start(None, port);
    assert_eq!(url, format!("redis://127.0.0.1:{port}"));
    let mut s = connect(port);
    s.write_all(b"PING\r\n").expect("write");
    let mut reply = [0u8; 7];
    s.read_exact(&mut reply).expect("reply");
    assert_eq!(&reply, b"+PONG\r\n");
    drop(s);
    stop(child, port);
}

#[test]
fn nats_bus_sends_its_info_with_jetstream() {
    let port = free_port();
    let (child, url) = start(Some("nats"), port);
    assert_eq!(url, format!("nats://127.0.0.1:{port}"));
    let s = connect(port);
    let mut info = String::new();
    BufReader::new(&s).read_line(&mut info).expect("INFO line");
    assert!(info.starts_with("INFO {"), "{info}");
    assert!(info.contains("\"jetstream\":true"), "{info}");
    drop(s);
    stop(child, port);
}

#[test]
fn a_bad_port_is_refused() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/cluster/bus");
    let status = Command::new(script)
        .args(["notaport"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("runs");
    assert_eq!(status.code(), Some(2));
}
