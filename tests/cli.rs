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
