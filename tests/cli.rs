//! The `radixgate` binary as a user runs it: `check-config` on good and bad files,
//! `demo` answering a chat completion on the port it prints, `serve`'s access log,
//! and signals: SIGHUP reloads the config file (refusing an invalid one), SIGTERM
//! stops with exit 0, and the access lines of requests answered just before it are
//! all written (the log thread buffers its lines).

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
    // The workload features: an image (only sim-0 takes it), a RAG request, a workflow.
    let image = common::Client::connect(addr).post(
        "/v1/chat/completions",
        r#"{"model":"sim","max_tokens":2,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://example.com/a.png"}},{"type":"text","text":"what is it?"}]}]}"#,
        &[],
    );
    let rag = common::Client::connect(addr).post(
        "/v1/chat/completions",
        r#"{"model":"sim","max_tokens":2,"rag":{"chunks":["a","b"],"query":"q"}}"#,
        &[],
    );
    let workflow = common::Client::connect(addr).post(
        "/v1/workflows",
        r#"{"nodes":[{"id":"a","model":"sim","prompt":"x","params":{"max_tokens":2}},{"id":"b","model":"sim","parents":["a"],"prompt":"y {{a}}","params":{"max_tokens":2}}]}"#,
        &[],
    );
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["object"], "chat.completion");
    assert_eq!(image.status, 200, "{}", image.text());
    assert_eq!(image.header("x-router-backend"), Some("sim-0"));
    assert_eq!(rag.status, 200, "{}", rag.text());
    assert_eq!(rag.header("x-router-chunks"), Some("2"));
    assert_eq!(workflow.status, 200, "{}", workflow.text());
    assert_eq!(
        workflow.json()["status"],
        "succeeded",
        "{}",
        workflow.text()
    );
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
    // Stopped however the test ends (a failed assertion included).
    let child = Spawned(child);
    let mut next_json = || -> serde_json::Value {
        let line = lines.next().expect("a log line").unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
    };
    // (Shard threads log `shard started` as they start, possibly first.)
    let started = loop {
        let v = next_json();
        if v["message"] == "radixgate listening" {
            break v;
        }
    };
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
    drop(child);
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

/// The log thread buffers its lines: a burst answered right before SIGTERM is still
/// written out in full before the process exits.
#[test]
fn access_lines_answered_before_sigterm_are_all_written() {
    use std::io::Read;
    use std::time::{Duration, Instant};
    let up = common::ScriptedUpstream::start(common::Script::Reply(vec![
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
            .to_vec(),
    ]));
    let mut toml = serve_config("round_robin", &[("b0", up.url())]);
    toml = toml.replace("access = false", "access = true");
    let file = common::temp_file("sigterm-log.toml", &toml);
    let (child, mut stderr, addr) = serve_logging(&file);
    // Each request's record reaches the log thread before its response goes out.
    const N: usize = 200;
    let mut c = common::Client::connect(addr);
    for i in 0..N {
        let id = format!("burst-{i}");
        let r = c.post(
            "/v1/chat/completions",
            &common::chat_body("hi", false),
            &[("X-Request-Id", &id)],
        );
        assert_eq!(r.status, 200);
    }
    signal(&child.0, "TERM");
    let sent = Instant::now();
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    let mut child = child;
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status:?}");
    // The log thread ended with the shards, not on the stop's time limit.
    assert!(
        sent.elapsed() < Duration::from_secs(5),
        "{:?}",
        sent.elapsed()
    );
    std::fs::remove_file(&file).ok();
    let logged: Vec<String> = rest
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "request")
        .map(|v| v["request_id"].as_str().unwrap_or_default().to_string())
        .collect();
    let expected: Vec<String> = (0..N).map(|i| format!("burst-{i}")).collect();
    assert_eq!(logged, expected);
}

/// Stops a spawned gateway by its PID however the test ends.
struct Spawned(std::process::Child);

/// `radixgate serve --config file` with its JSON log on a pipe (stopped however the
/// test ends), and the address from its `radixgate listening` line (shard threads
/// log `shard started` as they start, possibly first).
fn serve_logging(
    file: &std::path::Path,
) -> (
    Spawned,
    BufReader<std::process::ChildStderr>,
    std::net::SocketAddr,
) {
    let mut child = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(file)
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let child = Spawned(child);
    let started = loop {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "no start line");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        if v["message"] == "radixgate listening" {
            break v;
        }
    };
    let addr = started["addr"].as_str().unwrap().parse().unwrap();
    (child, stderr, addr)
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &std::process::Child, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

fn serve_config(policy: &str, backends: &[(&str, String)]) -> String {
    let mut toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshards = 1\nio = \"epoll\"\n\
         [routing]\npolicy = \"{policy}\"\n[log]\nformat = \"json\"\naccess = false\n"
    );
    for (id, url) in backends {
        toml.push_str(&format!(
            "[[backends]]\nid = \"{id}\"\nurl = \"{url}\"\nmodels = [\"sim\"]\n"
        ));
    }
    toml
}

#[test]
fn sighup_reloads_the_config_file_and_sigterm_exits_zero() {
    use radixgate::engine_sim::EngineConfig;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    let e0 = common::start_engine("epoll", EngineConfig::instant("sim"));
    let e1 = common::start_engine("epoll", EngineConfig::instant("sim"));
    let file = common::temp_file(
        "sighup.toml",
        &serve_config("round_robin", &[("e0", e0.url())]),
    );
    let mut child = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&file)
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let child = Spawned(child);
    let log = Arc::new(Mutex::new(Vec::<serde_json::Value>::new()));
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if let Ok(v) = serde_json::from_str(&line) {
                sink.lock().unwrap().push(v);
            }
        }
    });
    let logged = |message: &str| -> Option<serde_json::Value> {
        log.lock()
            .unwrap()
            .iter()
            .find(|v| v["message"] == message)
            .cloned()
    };
    let mut started = None;
    assert!(common::eventually(Duration::from_secs(10), || {
        started = logged("radixgate listening");
        started.is_some()
    }));
    let addr: std::net::SocketAddr = started.unwrap()["addr"].as_str().unwrap().parse().unwrap();
    let ask = || {
        common::Client::connect(addr).post(
            "/v1/chat/completions",
            &common::chat_body("hi", false),
            &[],
        )
    };
    assert_eq!(ask().header("x-router-backend"), Some("e0"));

    // Valid edit: e0 out, e1 in, another policy.
    std::fs::write(&file, serve_config("least_loaded", &[("e1", e1.url())])).unwrap();
    signal(&child.0, "HUP");
    let mut reloaded = None;
    assert!(common::eventually(Duration::from_secs(10), || {
        reloaded = logged("SIGHUP: config reloaded");
        reloaded.is_some()
    }));
    // The log line names each changed key with its status.
    assert_eq!(
        reloaded.unwrap()["keys"],
        "backends.e0 (applied), backends.e1 (applied), routing.policy (applied)"
    );
    let r = ask();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-router-backend"), Some("e1"));
    assert_eq!(r.header("x-router-reason"), Some("least-loaded"));

    // Invalid edit: refused and logged with its key paths; e1 keeps serving.
    std::fs::write(&file, serve_config("smartest", &[("e1", e1.url())])).unwrap();
    signal(&child.0, "HUP");
    let mut refused = None;
    assert!(common::eventually(Duration::from_secs(10), || {
        refused = logged("SIGHUP: config reload refused");
        refused.is_some()
    }));
    let error = refused.unwrap()["error"].as_str().unwrap_or("").to_string();
    assert!(error.contains("routing.policy"), "{error}");
    let r = ask();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-router-backend"), Some("e1"));

    // SIGTERM: a graceful stop, exit 0.
    let mut child = child;
    signal(&child.0, "TERM");
    let mut exited = None;
    assert!(common::eventually(Duration::from_secs(10), || {
        exited = child.0.try_wait().unwrap();
        exited.is_some()
    }));
    assert!(exited.unwrap().success(), "{exited:?}");
    std::fs::remove_file(&file).ok();
}

#[test]
#[allow(clippy::disallowed_methods)] // procfs from the test thread, not a shard
fn serve_logs_where_each_shard_runs() {
    use std::time::Duration;
    let e0 = common::start_engine("epoll", radixgate::engine_sim::EngineConfig::instant("sim"));
    let core = core_affinity::get_core_ids()
        .and_then(|ids| ids.last().map(|c| c.id))
        .expect("the process may run on some core");
    let file = common::temp_file(
        "shard-log.toml",
        &serve_config("round_robin", &[("e0", e0.url())])
            .replace("shards = 1\n", &format!("shards = 2\ncores = [{core}]\n")),
    );
    let mut child = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&file)
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let child = Spawned(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                if v["message"] == "shard started" && tx.send(v).is_err() {
                    return;
                }
            }
        }
    });
    let mut seen = Vec::new();
    for _ in 0..2 {
        seen.push(
            rx.recv_timeout(Duration::from_secs(10))
                .expect("a `shard started` line per shard"),
        );
    }
    seen.sort_by_key(|v| v["shard"].as_u64());
    for (k, v) in seen.iter().enumerate() {
        assert_eq!(v["shard"], k, "{v}");
        assert_eq!(v["core"], core, "{v}");
        assert_eq!(v["pinned"], true, "{v}");
        assert_eq!(v["driver"], "epoll", "{v}");
        assert_eq!(v["cpus_allowed"], core.to_string(), "{v}");
        // The logged thread id is that shard's thread in the serving process, and
        // the kernel has it pinned to the core.
        let task = format!("/proc/{}/task/{}", child.0.id(), v["thread_id"]);
        let comm = std::fs::read_to_string(format!("{task}/comm")).expect("the thread exists");
        // The kernel keeps 15 bytes of a thread's name.
        assert_eq!(comm.trim(), &format!("radixgate-shard-{k}")[..15]);
        let status = std::fs::read_to_string(format!("{task}/status")).unwrap();
        assert!(
            status.contains(&format!("Cpus_allowed_list:\t{core}\n")),
            "{status}"
        );
    }
    drop(child);
    std::fs::remove_file(&file).ok();
}

/// A client that leaves before its answer is complete is logged as `status=499`,
/// `outcome="client_closed"`, on both drivers: a non-streaming request left while
/// the engine works on it, and a stream left after its first event (logged 200
/// before issue 22).
#[test]
fn departed_clients_are_logged_499_client_closed() {
    use radixgate::engine_sim::EngineConfig;
    use std::io::Read;
    use std::time::Duration;
    for io in ["epoll", "io_uring"] {
        let mut cfg = EngineConfig::instant("sim");
        cfg.decode_per_token = Duration::from_millis(20);
        let engine = common::start_engine(io, cfg);
        let toml = serve_config("round_robin", &[("b0", engine.url())])
            .replace("io = \"epoll\"", &format!("io = \"{io}\""))
            .replace("access = false", "access = true");
        let file = common::temp_file(&format!("client-closed-{io}.toml"), &toml);
        let (child, mut stderr, addr) = serve_logging(&file);
        let running = |n: f64| {
            common::eventually(Duration::from_secs(5), || {
                let m = common::Client::connect(engine.addr())
                    .get("/metrics")
                    .text();
                common::metric(&m, "vllm:num_requests_running") == Some(n)
            })
        };
        let whole =
            r#"{"model":"sim","max_tokens":1000,"messages":[{"role":"user","content":"x"}]}"#;
        let mut c = common::Client::connect(addr);
        c.send(&common::post_bytes(
            "/v1/chat/completions",
            whole,
            &[("X-Request-Id", "left-waiting")],
        ));
        assert!(running(1.0), "{io}: the request never ran");
        drop(c);
        assert!(running(0.0), "{io}: the engine kept the request");
        let streamed = r#"{"model":"sim","stream":true,"max_tokens":1000,"messages":[{"role":"user","content":"x"}]}"#;
        let mut c = common::Client::connect(addr);
        c.send(&common::post_bytes(
            "/v1/chat/completions",
            streamed,
            &[("X-Request-Id", "left-streaming")],
        ));
        assert_eq!(c.read_head().0, 200);
        drop(c);
        assert!(running(0.0), "{io}: the engine kept the stream");
        let r = common::Client::connect(addr).post(
            "/v1/chat/completions",
            &common::chat_body("done", false),
            &[("X-Request-Id", "served")],
        );
        assert_eq!(r.status, 200);
        signal(&child.0, "TERM");
        let mut rest = String::new();
        stderr.read_to_string(&mut rest).unwrap();
        drop(child);
        std::fs::remove_file(&file).ok();
        let records: Vec<serde_json::Value> = rest
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["message"] == "request")
            .collect();
        let find = |id: &str| {
            records
                .iter()
                .find(|v| v["request_id"] == id)
                .unwrap_or_else(|| panic!("{io}: no record of {id} in {records:?}"))
        };
        for id in ["left-waiting", "left-streaming"] {
            let r = find(id);
            assert_eq!(r["status"], 499, "{io}: {r}");
            assert_eq!(r["outcome"], "client_closed", "{io}: {r}");
            assert_eq!(r["backend"], "b0", "{io}: {r}");
        }
        let r = find("served");
        assert_eq!(
            (r["status"].as_u64(), r["outcome"].as_str()),
            (Some(200), Some("completed"))
        );
    }
}

/// `radixgate demo --replicas 2`: two replicas in cluster mode behind one bus the
/// demo starts; a document sent to one is routed home by the other. Stopped with
/// SIGINT, the demo stops its bus too.
#[test]
fn demo_replicas_share_routing() {
    let mut child = Command::new(BIN)
        .args(["demo", "--listen", "127.0.0.1:0", "--replicas", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut lines = Vec::new();
    while lines.len() < 3 {
        let mut line = String::new();
        if out.read_line(&mut line).unwrap() == 0 {
            break;
        }
        lines.push(line);
    }
    let bus_port: u16 = lines[0]
        .rsplit(':')
        .next()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no bus in {:?}", lines[0]));
    let replicas: Vec<std::net::SocketAddr> = lines[1..]
        .iter()
        .map(|l| {
            l.trim()
                .trim_start_matches("replica http://")
                .parse()
                .unwrap_or_else(|_| panic!("no replica in {l:?}"))
        })
        .collect();
    let doc: String = (0..100)
        .map(|i| format!("Section {i} of the handbook. "))
        .collect();
    let ask = |addr, q: &str| {
        common::Client::connect(addr).post(
            "/v1/chat/completions",
            &common::chat_body(&format!("{doc}{q}"), false),
            &[],
        )
    };
    // Both replicas subscribed and warm (so what follows travels on the bus).
    for r in &replicas {
        assert!(common::eventually(
            std::time::Duration::from_secs(10),
            || common::Client::connect(*r).get("/ready").status == 200
        ));
    }
    let first = ask(replicas[0], "First question?");
    assert_eq!(first.status, 200);
    let home = first.header("x-router-backend").unwrap().to_string();
    // Once the second replica has applied the first one's routing ops, it routes
    // the document home.
    let applied = common::eventually(std::time::Duration::from_secs(5), || {
        let m = common::Client::connect(replicas[1]).get("/metrics").text();
        common::metric(&m, "radixgate_cluster_ops_applied_total").unwrap_or(0.0) >= 1.0
    });
    let second = ask(replicas[1], "Another question?");
    let shared = applied
        && second.header("x-router-reason") == Some("longest-prefix")
        && second.header("x-router-backend") == Some(home.as_str());
    // SAFETY: kill(2) on our own child's PID.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    let status = child.wait().unwrap();
    assert!(
        shared,
        "the second replica never routed the document home: applied {applied}, {:?} {:?} (home {home})",
        second.header("x-router-reason"),
        second.header("x-router-backend")
    );
    assert!(status.success());
    assert!(
        common::eventually(std::time::Duration::from_secs(5), || {
            std::net::TcpStream::connect(("127.0.0.1", bus_port)).is_err()
        }),
        "the demo's bus outlived it"
    );
}
