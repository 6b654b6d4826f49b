//! `radixgate demo`: the embedded default. Three simulated engines and the gateway
//! in one process on loopback, ready for curl or any OpenAI client. `sim-0` declares
//! the `image` and `audio` capabilities (the simulated engine takes any content
//! part), so multimodal routing, RAG requests and `/v1/workflows` all work there.
//! With `--disagg`, two prefill and two decode engines instead, and the gateway in
//! split mode.

use crate::config::{Config, IoMode, Protocol, Role};
use crate::engine_sim::{self, EngineConfig, EngineHandle, SimDisagg};
use crate::gateway::Gateway;
use crate::runtime::Driver;
use std::io;
use std::net::SocketAddr;

pub const DEMO_MODEL: &str = "sim";

pub struct Demo {
    pub gateway: Gateway,
    pub engines: Vec<EngineHandle>,
}

/// The demo's config: written as TOML so it goes through the same validation as a
/// user's file.
pub fn demo_config(listen: SocketAddr, engines: &[SocketAddr], policy: &str) -> String {
    let mut toml = format!(
        "[server]\nlisten = \"{listen}\"\nshards = 2\nio = \"auto\"\n\n[routing]\npolicy = \"{policy}\"\nallow_policy_header = true\n\n[health]\ninterval_ms = 1000\n"
    );
    for (i, addr) in engines.iter().enumerate() {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"sim-{i}\"\nurl = \"http://{addr}\"\nmodels = [\"{DEMO_MODEL}\"]\ncache_blocks = {}\ncapabilities = {}\n",
            EngineConfig::new(DEMO_MODEL).cache_blocks,
            if i == 0 {
                r#"["text", "image", "audio"]"#
            } else {
                r#"["text"]"#
            }
        ));
    }
    toml
}

/// The split demo's config: `prefill` engines (with their SGLang bootstrap address)
/// and `decode` engines for one model served with `protocol`.
pub fn demo_disagg_config(
    listen: SocketAddr,
    prefill: &[(SocketAddr, Option<SocketAddr>)],
    decode: &[SocketAddr],
    protocol: Protocol,
) -> String {
    // min_uncached_tokens = 0: even a short curl prompt goes through both legs.
    let mut toml = format!(
        "[server]\nlisten = \"{listen}\"\nshards = 2\nio = \"auto\"\n\n[health]\ninterval_ms = 1000\n\n[models.{DEMO_MODEL}.disagg]\nprotocol = \"{}\"\nmin_uncached_tokens = 0\n",
        protocol.as_str()
    );
    for (i, (addr, bootstrap)) in prefill.iter().enumerate() {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"prefill-{i}\"\nurl = \"http://{addr}\"\nmodels = [\"{DEMO_MODEL}\"]\nrole = \"prefill\"\n"
        ));
        if let Some(b) = bootstrap {
            toml.push_str(&format!("bootstrap_port = {}\n", b.port()));
        }
    }
    for (i, addr) in decode.iter().enumerate() {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"decode-{i}\"\nurl = \"http://{addr}\"\nmodels = [\"{DEMO_MODEL}\"]\nrole = \"decode\"\n"
        ));
    }
    toml
}

/// Two prefill and two decode simulated engines speaking `protocol`.
pub fn start_disagg_engines(
    protocol: Protocol,
    driver: Driver,
    tune: impl Fn(&mut EngineConfig),
) -> io::Result<(Vec<EngineHandle>, Vec<EngineHandle>)> {
    let start = |role: Role, seed: u64| {
        let mut cfg = EngineConfig::new(DEMO_MODEL);
        cfg.seed = seed;
        cfg.disagg = Some(SimDisagg::new(role, protocol));
        if role == Role::Prefill && protocol == Protocol::Sglang {
            cfg.bootstrap_port = Some(0);
        }
        tune(&mut cfg);
        engine_sim::start(cfg, SocketAddr::from(([127, 0, 0, 1], 0)), driver)
    };
    let prefill = vec![start(Role::Prefill, 1)?, start(Role::Prefill, 2)?];
    let decode = vec![start(Role::Decode, 3)?, start(Role::Decode, 4)?];
    Ok((prefill, decode))
}

pub fn start(listen: SocketAddr, policy: &str, disagg: Option<Protocol>) -> io::Result<Demo> {
    let driver = Driver::resolve(IoMode::Auto);
    if let Some(protocol) = disagg {
        let (prefill, decode) = start_disagg_engines(protocol, driver, |_| {})?;
        let p: Vec<_> = prefill
            .iter()
            .map(|e| (e.addr(), e.bootstrap_addr()))
            .collect();
        let d: Vec<_> = decode.iter().map(|e| e.addr()).collect();
        let config = Config::from_toml(&demo_disagg_config(listen, &p, &d, protocol))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let gateway = Gateway::start(config)?;
        let engines = prefill.into_iter().chain(decode).collect();
        return Ok(Demo { gateway, engines });
    }
    let mut engines = Vec::new();
    for i in 0..3 {
        let mut cfg = EngineConfig::new(DEMO_MODEL);
        cfg.seed = i + 1;
        engines.push(engine_sim::start(
            cfg,
            SocketAddr::from(([127, 0, 0, 1], 0)),
            driver,
        )?);
    }
    let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr()).collect();
    let config = Config::from_toml(&demo_config(listen, &addrs, policy))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    let gateway = Gateway::start(config)?;
    Ok(Demo { gateway, engines })
}
