//! Opt-in real-engine test of disaggregated serving: radixgate's vLLM flow in front
//! of a real vLLM (CPU) prefill instance and a real decode instance that share KV
//! through vLLM's example connector (`ExampleConnector`, files in a shared folder).
//!
//! `deploy/vllm/pd-pool.sh` (with `CONNECTOR=ExampleConnector`) starts the two
//! engines; the test sends a long prompt through an in-process gateway in split mode
//! and checks that the decode engine, which never saw the prompt, served it from
//! the KV its prefill partner stored: its own `cached_tokens` cover the prompt's
//! whole 128-token blocks. Streaming is checked too. The engines are stopped by PID
//! when the test ends (also on failure).
//!
//! Starting two engines takes minutes and about 8 GB of memory, so this runs only
//! with `RADIXGATE_REAL_DISAGG=1`.

#![allow(clippy::disallowed_methods)]

mod common;

use common::{Client, Response};
use radixgate::config::Config;
use radixgate::Gateway;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;

const MODEL: &str = "tiny";

/// The pool started by `pd-pool.sh`; stopped by PID on drop.
struct Pool {
    state: PathBuf,
    prefill: String,
    decode: String,
}

impl Pool {
    fn start() -> Pool {
        let state = std::env::temp_dir().join(format!("radixgate-real-pd-{}", std::process::id()));
        let base = free_port_base();
        let out = Command::new(script())
            .env("CONNECTOR", "ExampleConnector")
            .args([
                "start",
                state.to_str().unwrap(),
                "1",
                "1",
                &base.to_string(),
                MODEL,
            ])
            .output()
            .expect("run deploy/vllm/pd-pool.sh");
        let mut pool = Pool {
            state,
            prefill: String::new(),
            decode: String::new(),
        };
        assert!(
            out.status.success(),
            "pd-pool.sh start failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            match line.split_whitespace().collect::<Vec<_>>()[..] {
                ["prefill", _, addr] => pool.prefill = addr.to_string(),
                ["decode", _, addr] => pool.decode = addr.to_string(),
                _ => {}
            }
        }
        assert!(!pool.prefill.is_empty() && !pool.decode.is_empty());
        pool
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .args(["stop", self.state.to_str().unwrap()])
            .status();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/vllm/pd-pool.sh")
}

/// A base port with base and base+10 free on loopback.
fn free_port_base() -> u16 {
    let start = 21_000 + (std::process::id() % 200) as u16 * 100;
    (0..50u16)
        .map(|k| start.wrapping_add(k * 7) % 40_000 + 20_000)
        .find(|&base| {
            [0, 10]
                .iter()
                .all(|off| TcpListener::bind(("127.0.0.1", base + off)).is_ok())
        })
        .expect("a free port range")
}

fn chat(seed: usize, stream: bool) -> String {
    let text: Vec<String> = (0..60)
        .map(|i| format!("the quick brown fox {seed} jumps over the lazy dog {i}"))
        .collect();
    let mut body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": text.join(" ")}],
        "max_tokens": 4,
        "ignore_eos": true,
        "stream": stream,
    });
    if stream {
        // vLLM refuses stream_options on a request that does not stream.
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    body.to_string()
}

/// The final usage object of a plain or streamed answer.
fn usage(r: &Response) -> serde_json::Value {
    let text = r.text();
    let json = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["usage"].is_object())
        .unwrap_or_else(|| r.json());
    json["usage"].clone()
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let skip = std::env::var("RADIXGATE_REAL_DISAGG").as_deref() != Ok("1");
    if skip {
        eprintln!(
            "real_vllm_split_prefill_decode: skipped (set RADIXGATE_REAL_DISAGG=1 to run it)"
        );
    }
    let trial = libtest_mimic::Trial::test("real_vllm_split_prefill_decode", || {
        real_vllm_split_prefill_decode();
        Ok(())
    })
    .with_ignored_flag(skip);
    libtest_mimic::run(&args, vec![trial]).exit();
}

fn real_vllm_split_prefill_decode() {
    let pool = Pool::start();
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshards = 1\n[models.{MODEL}.disagg]\nprotocol = \"vllm\"\nmode = \"always\"\n\
         [[backends]]\nid = \"prefill-0\"\nurl = \"http://{}\"\nmodels = [\"{MODEL}\"]\nrole = \"prefill\"\n\
         [[backends]]\nid = \"decode-0\"\nurl = \"http://{}\"\nmodels = [\"{MODEL}\"]\nrole = \"decode\"\n",
        pool.prefill, pool.decode
    );
    let gw = Gateway::start(Config::from_toml(&toml).unwrap()).expect("gateway starts");
    let mut c = Client::connect(gw.local_addr());
    for (seed, stream) in [(1, false), (2, true)] {
        let r = c.post("/v1/chat/completions", &chat(seed, stream), &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-router-reason"), Some("disagg-split"));
        assert_eq!(r.header("x-router-prefill"), Some("prefill-0"));
        assert_eq!(r.header("x-router-decode"), Some("decode-0"));
        let u = usage(&r);
        let prompt = u["prompt_tokens"].as_u64().unwrap();
        let cached = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(u["completion_tokens"], 4);
        // The decode engine never saw this prompt: every whole 128-token block came
        // from the prefill engine through the connector.
        assert!(prompt > 1000, "{u}");
        assert!(cached > 0 && cached >= (prompt - 1) / 128 * 128, "{u}");
    }
    gw.shutdown();
}
