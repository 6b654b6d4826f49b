//! The `radixgate` binary as a user runs it: `check-config` on good and bad files,
//! and `demo` answering a chat completion on the port it prints.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_radixgate");

#[test]
fn check_config_accepts_the_annotated_example() {
    let out = Command::new(BIN)
        .args([
            "check-config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/radixgate.example.toml"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(": ok"));
}

#[test]
fn check_config_lists_every_error_and_fails() {
    let dir = std::env::temp_dir().join(format!("radixgate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad.toml");
    std::fs::write(
        &file,
        "[server]\nlisten = \"x\"\nshards = 0\n[routing]\npolicy = \"best\"\n[[backends]]\nid = \"a\"\nurl = \"ftp://h\"\nmodels = []\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .arg("check-config")
        .arg(&file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for key in [
        "server.listen",
        "server.shards",
        "routing.policy",
        "backends[0].url",
        "backends[0].models",
    ] {
        assert!(err.contains(key), "missing {key}: {err}");
    }
    std::fs::write(&file, "[server]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n").unwrap();
    let out = Command::new(BIN)
        .arg("check-config")
        .arg(&file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bogus"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn demo_serves_a_chat_completion() {
    let mut child = Command::new(BIN)
        .args(["demo", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut first = String::new();
    BufReader::new(stdout).read_line(&mut first).unwrap();
    let url = first
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no URL in {first:?}"));
    let addr = url.trim_start_matches("http://").parse().unwrap();
    let mut c = common::Client::connect(addr);
    let r = c.post("/v1/chat/completions", &common::chat_body("hi", false), &[]);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["object"], "chat.completion");
}

#[test]
fn serve_writes_one_json_line_per_request_without_prompts() {
    let up = common::ScriptedUpstream::start(common::Script::Reply(vec![
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 95\r\n\r\n{\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":3}}}"
            .to_vec(),
    ]));
    let dir = std::env::temp_dir().join(format!("radixgate-cli-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gw.toml");
    std::fs::write(
        &file,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nshards = 1\n[log]\nformat = \"json\"\n[[backends]]\nid = \"b0\"\nurl = \"{}\"\nmodels = [\"sim\"]\n",
            up.url()
        ),
    )
    .unwrap();
    let mut child = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&file)
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut next_json = || -> serde_json::Value {
        let line = lines.next().expect("a log line").unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
    };
    let started = next_json();
    let addr: std::net::SocketAddr = started["addr"]
        .as_str()
        .expect("listening line has addr")
        .parse()
        .unwrap();
    let secret = "my secret prompt text";
    let r = common::Client::connect(addr).post(
        "/v1/chat/completions",
        &common::chat_body(secret, false),
        &[
            ("X-Request-Id", "log-test-1"),
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        ],
    );
    assert_eq!(r.status, 200);
    let access = loop {
        let v = next_json();
        if v["request_id"] == "log-test-1" {
            break v;
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(access["backend"], "b0");
    assert_eq!(access["model"], "sim");
    assert_eq!(access["status"], 200);
    assert_eq!(access["cached_tokens"], 3);
    assert_eq!(access["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(access["policy"], "prefix_aware");
    assert!(access["total_ms"].as_f64().is_some() && access["ttft_ms"].as_f64().is_some());
    assert!(
        !access.to_string().contains(secret),
        "a prompt leaked into the log: {access}"
    );
}
