//! `radixgate demo`: the embedded default. Three simulated engines and the gateway
//! in one process on loopback, ready for curl or any OpenAI client. `sim-0` declares
//! the `image` and `audio` capabilities (the simulated engine takes any content
//! part), so multimodal routing, RAG requests and `/v1/workflows` all work there.

use crate::config::{Config, IoMode};
use crate::engine_sim::{self, EngineConfig, EngineHandle};
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

pub fn start(listen: SocketAddr, policy: &str) -> io::Result<Demo> {
    let driver = Driver::resolve(IoMode::Auto);
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
