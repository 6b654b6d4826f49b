//! The L4 spread in front of the cluster bench's replicas: random per request in
//! the load generator itself ([`Spread::Random`]), or HAProxy in TCP mode
//! ([`Spread::Haproxy`]), started per cell through `deploy/cluster/haproxy` and
//! stopped by PID with the cell's other processes.
//!
//! HAProxy balances **connections**, not requests. With keep-alive, each of the
//! load generator's clients would stay on the replica its one connection landed
//! on, which is no spread at all; so through HAProxy every request goes on a new
//! connection (`Connection: close`), and `balance roundrobin` hands consecutive
//! connections to consecutive replicas. Round robin rather than leastconn: with
//! one short connection per request the open-connection counts leastconn reads
//! are mostly 0 or 1, and a load-oblivious spread is the one the random spread
//! stands for (an operator's L4 balancer knows nothing of prefixes).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::cluster::Procs;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    /// Each request to a replica drawn at random; a keep-alive connection per
    /// client and replica.
    Random,
    /// Every request on a new connection to HAProxy (TCP mode, round robin over
    /// the replicas' listeners).
    Haproxy,
}

impl Spread {
    pub fn parse(s: &str) -> Result<Spread, String> {
        match s {
            "random" => Ok(Spread::Random),
            "haproxy" => Ok(Spread::Haproxy),
            other => Err(format!("--spread takes random or haproxy, not {other:?}")),
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Spread::Random => "random replica per request, keep-alive connections",
            Spread::Haproxy => "HAProxy (TCP mode, roundrobin), a new connection per request",
        }
    }
}

/// The HAProxy config: TCP mode, one frontend on `listen`, round robin over
/// `replicas`. One thread: 16 clients on loopback need no more, and the bench
/// machine's cores are the replicas'.
pub fn config(listen: SocketAddr, replicas: &[SocketAddr]) -> String {
    let mut c = String::from(
        "global\n    nbthread 1\n    maxconn 4096\n\n\
         defaults\n    mode tcp\n    timeout connect 2s\n    timeout client 120s\n    timeout server 120s\n\n",
    );
    let _ = write!(
        c,
        "frontend replicas\n    bind {listen}\n    default_backend replicas\n\n\
         backend replicas\n    balance roundrobin\n"
    );
    for (i, r) in replicas.iter().enumerate() {
        let _ = writeln!(c, "    server r{i} {r}");
    }
    c
}

/// Writes the config into `dir`, starts HAProxy through `script` (which installs
/// it when missing) as one of `procs`, and returns its address once it accepts.
pub fn start(
    script: &Path,
    dir: &Path,
    replicas: &[SocketAddr],
    procs: &mut Procs,
) -> Result<SocketAddr, String> {
    let listen = crate::cluster::free_addr()?;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("haproxy.cfg");
    std::fs::write(&path, config(listen, replicas))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let log = crate::cluster::log_file(&dir.join("haproxy.log"))?;
    let child = Command::new(script)
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("{}: {e}", script.display()))?;
    let slot = procs.push(child, format!("haproxy on {listen}"));
    // The first run may install the package.
    crate::cluster::wait_until(Duration::from_secs(300), || {
        procs.exited(slot) || std::net::TcpStream::connect(listen).is_ok()
    })
    .map_err(|_| format!("haproxy is not listening on {listen}"))?;
    if procs.exited(slot) {
        return Err(format!(
            "haproxy exited: {}",
            crate::cluster::tail(&dir.join("haproxy.log"))
        ));
    }
    Ok(listen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_balances_every_replica_in_tcp_mode() {
        let replicas: Vec<SocketAddr> = ["127.0.0.1:9001", "127.0.0.1:9002"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let c = config("127.0.0.1:9000".parse().unwrap(), &replicas);
        assert!(c.contains("mode tcp"));
        assert!(c.contains("bind 127.0.0.1:9000"));
        assert!(c.contains("balance roundrobin"));
        assert!(c.contains("server r0 127.0.0.1:9001\n"));
        assert!(c.contains("server r1 127.0.0.1:9002\n"));
        assert_eq!(Spread::parse("haproxy"), Ok(Spread::Haproxy));
        assert!(Spread::parse("dns").is_err());
    }
}
