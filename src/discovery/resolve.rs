//! One `[[discovery]]` name resolved to socket addresses with hickory-resolver.
//!
//! hickory-resolver has no blocking API, so the discovery thread owns a
//! current-thread tokio runtime and blocks on each lookup there: no tokio thread
//! besides it, nothing on a shard. The resolver's cache is cleared before every
//! round (the thread schedules rounds by the records' TTLs itself), so a changed
//! record is seen at the next round.

use crate::config::{DiscoveryConfig, DiscoveryLookup};
use hickory_resolver::config::{
    ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::TokioResolver;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How long one query waits for its answer (the thread checks for a stop only
/// between rounds, so this bounds how long a stop can wait).
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// What one good round found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub addrs: BTreeSet<SocketAddr>,
    /// The shortest TTL left among the records used.
    pub ttl: Duration,
}

/// One name's resolver on the discovery thread's runtime.
pub struct NameResolver {
    resolver: TokioResolver,
    name: String,
    lookup: DiscoveryLookup,
}

impl NameResolver {
    /// A resolver for `config`: its `resolver` server (UDP, TCP for a truncated
    /// answer), or the system's
    /// `/etc/resolv.conf` and `/etc/hosts`. Must run inside `runtime`.
    pub fn new(
        config: &DiscoveryConfig,
        runtime: &tokio::runtime::Runtime,
    ) -> Result<Self, String> {
        let _entered = runtime.enter();
        let provider = TokioRuntimeProvider::default();
        let mut builder = match config.resolver {
            Some(server) => {
                // UDP first; TCP when an answer comes back truncated (many SRV
                // records).
                let mut udp = ConnectionConfig::udp();
                udp.port = server.port();
                let mut tcp = ConnectionConfig::tcp();
                tcp.port = server.port();
                let ns = NameServerConfig::new(server.ip(), true, vec![udp, tcp]);
                let mut builder = TokioResolver::builder_with_config(
                    ResolverConfig::from_name_servers(vec![ns]),
                    provider,
                );
                let opts = builder.options_mut();
                opts.use_hosts_file = ResolveHosts::Never;
                opts.attempts = 1;
                builder
            }
            None => TokioResolver::builder(provider)
                .map_err(|e| format!("reading the system's resolver configuration: {e}"))?,
        };
        let opts: &mut ResolverOpts = builder.options_mut();
        opts.timeout = opts.timeout.min(QUERY_TIMEOUT);
        let resolver = builder.build().map_err(|e| e.to_string())?;
        Ok(Self {
            resolver,
            name: config.name.clone(),
            lookup: config.lookup,
        })
    }

    /// Resolves the name once: every address found, or why none was. An answer
    /// with no usable address is an error too (the caller keeps its last set).
    pub fn resolve(&self, runtime: &tokio::runtime::Runtime) -> Result<Found, String> {
        self.resolver.clear_cache();
        let found = runtime.block_on(async {
            match self.lookup {
                DiscoveryLookup::Address { port } => self.addresses(&self.name, port).await,
                DiscoveryLookup::Srv => self.srv().await,
            }
        })?;
        if found.addrs.is_empty() {
            return Err("the answer holds no address".into());
        }
        Ok(found)
    }

    async fn addresses(&self, name: &str, port: u16) -> Result<Found, String> {
        let ips = self
            .resolver
            .lookup_ip(name)
            .await
            .map_err(|e| e.to_string())?;
        Ok(Found {
            addrs: ips.iter().map(|ip| SocketAddr::new(ip, port)).collect(),
            ttl: left(ips.valid_until()),
        })
    }

    async fn srv(&self) -> Result<Found, String> {
        let records = self
            .resolver
            .srv_lookup(self.name.as_str())
            .await
            .map_err(|e| e.to_string())?;
        let mut found = Found {
            addrs: BTreeSet::new(),
            ttl: left(records.valid_until()),
        };
        let mut failed = None;
        for record in records.answers() {
            let RData::SRV(srv) = &record.data else {
                continue;
            };
            // A target of "." says the service is not offered there.
            if srv.target.is_root() {
                continue;
            }
            let target = srv.target.to_ascii();
            // A target that does not resolve is left out; the others stand.
            match self.addresses(&target, srv.port).await {
                Ok(one) => {
                    found.addrs.extend(one.addrs);
                    found.ttl = found.ttl.min(one.ttl);
                }
                Err(e) => failed = Some(format!("SRV target {target}: {e}")),
            }
        }
        match failed {
            Some(e) if found.addrs.is_empty() => Err(e),
            _ => Ok(found),
        }
    }
}

fn left(valid_until: Instant) -> Duration {
    valid_until.saturating_duration_since(Instant::now())
}
