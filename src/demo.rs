//! `radixgate demo`: the embedded default. Three simulated engines and the gateway
//! in one process on loopback, ready for curl or any OpenAI client. `sim-0` declares
//! the `image` and `audio` capabilities (the simulated engine takes any content
//! part), so multimodal routing, RAG requests and `/v1/workflows` all work there.
//! With `--disagg`, two prefill and two decode engines instead, and the gateway in
//! split mode. With `--replicas N`, N gateway replicas in cluster mode in front of
//! the same three engines, sharing routing state over a Redis bus that the demo
//! starts with `deploy/cluster/bus` (or `--bus URL`, one already running).
//! With `--tokenizer`, every engine tokenizes as vLLM does with it and answers in
//! its words (token counts a client's tokenizer agrees with).

use crate::config::{Config, IoMode, Protocol, Role};
use crate::engine_sim::{self, EngineConfig, EngineHandle, SimDisagg, SimTokenizer};
use crate::gateway::Gateway;
use crate::runtime::Driver;
use std::io;
use std::net::SocketAddr;

pub const DEMO_MODEL: &str = "sim";

pub struct Demo {
    pub gateway: Gateway,
    /// With `--replicas N`: the other N - 1 replicas (`gateway` is the first).
    pub replicas: Vec<Gateway>,
    pub engines: Vec<EngineHandle>,
    /// The bus the demo started (stopped with the demo).
    pub bus: Option<Bus>,
}

impl Demo {
    /// Stops the replicas, then the bus.
    pub fn shutdown(self) {
        self.gateway.shutdown();
        for r in self.replicas {
            r.shutdown();
        }
        drop(self.bus);
    }
}

/// A bus started by `deploy/cluster/bus`, stopped (by its PID) when dropped.
pub struct Bus {
    child: std::process::Child,
    pub url: String,
}

impl Drop for Bus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `deploy/cluster/bus` (from this source tree) on a free loopback port; it
/// installs Redis first when missing. The bus gets SIGTERM if the demo dies
/// without stopping it.
#[allow(clippy::disallowed_methods)] // start-up, before any shard
pub fn start_bus() -> io::Result<Bus> {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/cluster/bus");
    if !std::path::Path::new(script).exists() {
        return Err(io::Error::other(format!(
            "{script} not found: start a Redis or Valkey and pass --bus redis://HOST:PORT"
        )));
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut cmd = std::process::Command::new(script);
    cmd.arg(port.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    // SAFETY: prctl(2) is async-signal-safe and touches only the child being
    // started; it asks the kernel to send SIGTERM when this process ends.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let mut out = io::BufReader::new(child.stdout.take().expect("piped"));
    let mut url = String::new();
    out.read_line(&mut url)?;
    // Redis logs to stdout: keep draining it.
    std::thread::spawn(move || io::copy(&mut out, &mut io::sink()));
    let bus = Bus {
        child,
        url: url.trim().to_string(),
    };
    // Wait (bounded: the first run may install Redis) until it answers.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if std::time::Instant::now() > deadline {
            return Err(io::Error::other("the bus never listened"));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(bus)
}

/// `[cluster]` for replica `i` of the demo.
fn cluster_section(bus_url: &str, i: usize) -> String {
    format!(
        "\n[cluster]\nurl = \"{bus_url}\"\nnode = \"demo-{i}\"\nchannel = \"radixgate-demo-{}\"\n",
        std::process::id()
    )
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

/// What to start: the policy, split mode, and cluster replicas.
pub struct DemoOptions {
    pub policy: String,
    pub disagg: Option<Protocol>,
    /// Gateway replicas (1: no cluster).
    pub replicas: usize,
    /// The bus for replicas > 1; `None` starts one.
    pub bus: Option<String>,
    /// The engines' tokenizer (`None`: 4 bytes per prompt token, default words).
    pub tokenizer: Option<SimTokenizer>,
}

pub fn start(listen: SocketAddr, options: &DemoOptions) -> io::Result<Demo> {
    let (policy, disagg) = (options.policy.as_str(), options.disagg);
    let driver = Driver::resolve(IoMode::Auto);
    if let Some(protocol) = disagg {
        let (prefill, decode) = start_disagg_engines(protocol, driver, |cfg| {
            cfg.tokenizer = options.tokenizer.clone();
        })?;
        let p: Vec<_> = prefill
            .iter()
            .map(|e| (e.addr(), e.bootstrap_addr()))
            .collect();
        let d: Vec<_> = decode.iter().map(|e| e.addr()).collect();
        let config = Config::from_toml(&demo_disagg_config(listen, &p, &d, protocol))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let gateway = Gateway::start(config)?;
        let engines = prefill.into_iter().chain(decode).collect();
        return Ok(Demo {
            gateway,
            replicas: Vec::new(),
            engines,
            bus: None,
        });
    }
    let mut engines = Vec::new();
    for i in 0..3 {
        let mut cfg = EngineConfig::new(DEMO_MODEL);
        cfg.seed = i + 1;
        cfg.tokenizer = options.tokenizer.clone();
        engines.push(engine_sim::start(
            cfg,
            SocketAddr::from(([127, 0, 0, 1], 0)),
            driver,
        )?);
    }
    let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr()).collect();
    let parse = |toml: String| {
        Config::from_toml(&toml)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))
    };
    if options.replicas <= 1 {
        let gateway = Gateway::start(parse(demo_config(listen, &addrs, policy))?)?;
        return Ok(Demo {
            gateway,
            replicas: Vec::new(),
            engines,
            bus: None,
        });
    }
    let bus = match &options.bus {
        Some(_) => None,
        None => Some(start_bus()?),
    };
    let bus_url = options
        .bus
        .clone()
        .or_else(|| bus.as_ref().map(|b| b.url.clone()))
        .unwrap_or_default();
    // Replica i listens on the given port + i (all on ephemeral ports for port 0).
    let mut gateways = Vec::with_capacity(options.replicas);
    for i in 0..options.replicas {
        let mut at = listen;
        if listen.port() != 0 {
            at.set_port(listen.port() + i as u16);
        }
        let toml = demo_config(at, &addrs, policy) + &cluster_section(&bus_url, i);
        gateways.push(Gateway::start(parse(toml)?)?);
    }
    let gateway = gateways.remove(0);
    Ok(Demo {
        gateway,
        replicas: gateways,
        engines,
        bus,
    })
}
