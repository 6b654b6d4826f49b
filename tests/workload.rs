//! Workload-aware scheduling end to end: multimodal capability routing (images and
//! audio only to backends that take them, 415 when none does, media ids in the prefix
//! chain, capabilities through config and the admin API) and RAG requests (chunks
//! normalised into one canonical prefix, chunk-affinity routing and its header).

mod common;

use common::*;
use radixgate::config::Config;
use radixgate::engine_sim::{EngineConfig, EngineHandle};
use radixgate::Gateway;
use radixgate_orchestrator::rag::{canonical_chunks, chunk_id, render_context};
use std::collections::HashSet;
use std::time::Duration;

/// `(id, capabilities)` backends, each on its own simulated engine serving `sim`.
fn fleet(io: &str, backends: &[(&str, &str)], extra: &str) -> (Vec<EngineHandle>, Gateway) {
    let engines: Vec<_> = backends
        .iter()
        .map(|_| start_engine(io, EngineConfig::instant("sim")))
        .collect();
    let mut toml = gateway_toml(io, 1, extra, &[]);
    for ((id, caps), e) in backends.iter().zip(&engines) {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"{id}\"\nurl = \"{}\"\nmodels = [\"sim\"]\ncapabilities = [{caps}]\n",
            e.url()
        ));
    }
    let config = Config::from_toml(&toml).unwrap_or_else(|e| panic!("bad config: {e}\n{toml}"));
    (engines, Gateway::start(config).expect("gateway starts"))
}

fn image_question(url: &str, q: &str) -> String {
    let preamble: String = (0..30).map(|i| format!("look carefully {i} ")).collect();
    format!(
        r#"{{"model":"sim","max_tokens":2,"messages":[{{"role":"system","content":"{preamble}"}},{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{url}"}}}},{{"type":"text","text":"{q}"}}]}}]}}"#
    )
}

fn audio_question(q: &str) -> String {
    format!(
        r#"{{"model":"sim","max_tokens":2,"messages":[{{"role":"user","content":[{{"type":"input_audio","input_audio":{{"data":"UklGRiQAAABXQVZF","format":"wav"}}}},{{"type":"text","text":"{q}"}}]}}]}}"#
    )
}

fn images_go_only_to_capable_backends(io: &str) {
    let (_engines, gw) = fleet(
        io,
        &[
            ("text0", r#""text""#),
            ("vision", r#""text", "image""#),
            ("text1", r#""text""#),
        ],
        "[routing]\npolicy = \"round_robin\"",
    );
    let addr = gw.local_addr();
    for q in 0..6 {
        let r = Client::connect(addr).post(
            "/v1/chat/completions",
            &image_question("https://example.com/cat.png", &format!("q{q}")),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-router-backend"), Some("vision"));
    }
    // Text still spreads over the whole fleet.
    let seen: HashSet<String> = (0..6)
        .map(|i| {
            let r = Client::connect(addr).post(
                "/v1/chat/completions",
                &chat_body(&format!("hi {i}"), false),
                &[],
            );
            assert_eq!(r.status, 200);
            r.header("x-router-backend").unwrap().to_string()
        })
        .collect();
    assert_eq!(seen.len(), 3, "{seen:?}");
    // Audio: no backend takes it.
    let r = Client::connect(addr).post("/v1/chat/completions", &audio_question("what"), &[]);
    assert_eq!(r.status, 415, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["code"], "unsupported_media");
    assert_eq!(e["type"], "invalid_request_error");
    assert_eq!(e["param"], "messages");
    assert!(e["message"].as_str().unwrap().contains("audio"), "{e}");
    let m = Client::connect(addr).get("/metrics").text();
    assert_eq!(
        metric(
            &m,
            "radixgate_requests_total{backend=\"none\",status=\"415\",reason=\"unsupported_media\",model=\"\"}"
        ),
        Some(1.0),
        "{m}"
    );
}
both_drivers!(images_go_only_to_capable_backends);

/// The same image (by URL) in a follow-up meets the engine that encoded it; another
/// image is another prefix.
fn follow_ups_about_an_image_meet_its_engine(io: &str) {
    let (_engines, gw) = fleet(
        io,
        &[
            ("v0", r#""text", "image""#),
            ("v1", r#""text", "image""#),
            ("v2", r#""text", "image", "audio""#),
        ],
        "[routing]\npolicy = \"prefix_aware\"",
    );
    let addr = gw.local_addr();
    let url = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk";
    let first = Client::connect(addr).post("/v1/chat/completions", &image_question(url, "a"), &[]);
    assert_eq!(first.status, 200);
    let home = first.header("x-router-backend").unwrap().to_string();
    // A follow-up may land on another shard (a new connection each): it must hold the
    // first request's insert by then.
    common::wait_replicated(addr);
    for q in ["b", "c", "d"] {
        let r = Client::connect(addr).post("/v1/chat/completions", &image_question(url, q), &[]);
        assert_eq!(
            r.header("x-router-backend"),
            Some(home.as_str()),
            "{:?} {:?}",
            r.header("x-router-reason"),
            r.header("x-router-matched-blocks")
        );
        assert_eq!(r.header("x-router-reason"), Some("longest-prefix"));
    }
    let r = Client::connect(addr).post("/v1/chat/completions", &audio_question("x"), &[]);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-router-backend"),
        Some("v2"),
        "{:?}",
        r.header("x-router-reason")
    );
}
both_drivers!(follow_ups_about_an_image_meet_its_engine);

fn capabilities_through_the_admin_api(io: &str) {
    const TOKEN: &str = "workload-admin-token-0123456789";
    let token_file = temp_file(&format!("workload-admin-token-{io}"), &format!("{TOKEN}\n"));
    let (_engines, gw) = fleet(
        io,
        &[("text0", r#""text""#)],
        &format!(
            "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"",
            token_file.display()
        ),
    );
    let (addr, admin) = (gw.local_addr(), gw.admin_addr().unwrap());
    let body = image_question("https://example.com/dog.png", "q");
    assert_eq!(
        Client::connect(addr)
            .post("/v1/chat/completions", &body, &[])
            .status,
        415
    );
    let vision = start_engine(io, EngineConfig::instant("sim"));
    let post = |json: String| {
        Client::connect(admin).post(
            "/admin/backends",
            &json,
            &[("Authorization", &format!("Bearer {TOKEN}"))],
        )
    };
    let bad = post(format!(
        r#"{{"id":"v","url":"{}","models":["sim"],"capabilities":["text","video"]}}"#,
        vision.url()
    ));
    assert_eq!(bad.status, 400, "{}", bad.text());
    assert!(
        bad.text()
            .contains("backend.capabilities: unknown capability `video`"),
        "{}",
        bad.text()
    );
    let added = post(format!(
        r#"{{"id":"v","url":"{}","models":["sim"],"capabilities":["text","image"]}}"#,
        vision.url()
    ));
    assert_eq!(added.status, 201, "{}", added.text());
    assert_eq!(
        added.json()["capabilities"],
        serde_json::json!(["text", "image"])
    );
    let r = Client::connect(addr).post("/v1/chat/completions", &body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-router-backend"), Some("v"));
    let _ = std::fs::remove_file(token_file);
}
both_drivers!(capabilities_through_the_admin_api);

fn chunk(n: usize) -> String {
    (0..30).map(|i| format!("chunk{n}-fact{i} ")).collect()
}

fn rag_body(chunks: &[usize], query: &str) -> String {
    let chunks: Vec<String> = chunks
        .iter()
        .map(|&n| format!("\"{}\"", chunk(n)))
        .collect();
    format!(
        r#"{{"model":"sim","max_tokens":2,"rag":{{"system":"Answer from the context.","chunks":[{}],"query":"{query}"}}}}"#,
        chunks.join(",")
    )
}

fn overlap(r: &Response) -> (u32, u32) {
    let n = |h| r.header(h).unwrap().parse::<u32>().unwrap();
    (n("x-router-chunk-overlap"), n("x-router-chunks"))
}

/// The same chunks in any order (and repeated) make one prefix; a request sharing
/// most of them but not its leading chunk meets the same engine by chunk affinity; a
/// disjoint one goes by the policy.
fn rag_chunk_sets_meet_on_one_engine(io: &str) {
    let (_engines, gw) = instant_fleet(io, 3, 1, "[routing]\npolicy = \"prefix_aware\"");
    let addr = gw.local_addr();
    let first = Client::connect(addr).post(
        "/v1/chat/completions",
        &rag_body(&[1, 2, 3, 4, 5], "a"),
        &[],
    );
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(overlap(&first), (0, 5));
    let home = first.header("x-router-backend").unwrap().to_string();

    // The same chunks in another order, repeated: the same prefix.
    let again = Client::connect(addr).post(
        "/v1/chat/completions",
        &rag_body(&[5, 3, 1, 4, 2, 3], "b"),
        &[],
    );
    assert_eq!(again.header("x-router-backend"), Some(home.as_str()));
    assert_eq!(again.header("x-router-reason"), Some("longest-prefix"));
    assert_eq!(overlap(&again), (5, 5));
    // The engine saw the same context: everything but the query was cached.
    let cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 400, "cached {cached}");

    // Four of those chunks and a new one that sorts first: no cached prefix to
    // follow, so chunk affinity decides.
    let first_id = [2, 3, 4, 5]
        .iter()
        .map(|&n| chunk_id(&chunk(n)))
        .min()
        .unwrap();
    let new = (100..).find(|&n| chunk_id(&chunk(n)) < first_id).unwrap();
    let most = Client::connect(addr).post(
        "/v1/chat/completions",
        &rag_body(&[2, 3, 4, 5, new], "c"),
        &[],
    );
    assert_eq!(most.header("x-router-backend"), Some(home.as_str()));
    assert_eq!(most.header("x-router-reason"), Some("chunk-affinity"));
    assert_eq!(overlap(&most), (4, 5));

    let other = Client::connect(addr).post("/v1/chat/completions", &rag_body(&[20, 21], "d"), &[]);
    assert_eq!(overlap(&other), (0, 2));
    assert_ne!(other.header("x-router-reason"), Some("chunk-affinity"));

    // Plain chat requests carry no chunk headers.
    let plain = Client::connect(addr).post("/v1/chat/completions", &chat_body("hi", false), &[]);
    assert_eq!(plain.status, 200);
    assert!(plain.header("x-router-chunks").is_none());
    let m = Client::connect(addr).get("/metrics").text();
    assert_eq!(
        metric(&m, &format!("radixgate_requests_total{{backend=\"{home}\",status=\"200\",reason=\"chunk-affinity\",model=\"sim\"}}")),
        Some(1.0),
        "{m}"
    );
}
both_drivers!(rag_chunk_sets_meet_on_one_engine);

/// What goes upstream is a plain OpenAI body; bad RAG fields are 400s naming their
/// param, before anything is sent; the field's name is configurable.
fn rag_bodies_are_normalised_and_checked(io: &str) {
    let reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}".to_vec();
    let upstream = ScriptedUpstream::start(Script::Reply(vec![reply]));
    let gw = start_gateway(
        io,
        1,
        "[routing]\npolicy = \"round_robin\"\nrag_field = \"retrieval\"",
        &[("up", upstream.url(), "sim")],
    );
    let addr = gw.local_addr();
    let body = r#"{"model":"sim","retrieval":{"chunks":["beta","alpha","beta"],"query":"why?"},"max_tokens":1}"#;
    let r = Client::connect(addr).post("/v1/chat/completions", body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(overlap(&r), (0, 2));
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    let sent: serde_json::Value = serde_json::from_slice(&seen[0].body).unwrap();
    assert!(sent.get("retrieval").is_none(), "{sent}");
    assert_eq!(sent["max_tokens"], 1);
    // One system message with the distinct chunks in canonical (id) order.
    let canonical = canonical_chunks(["alpha", "beta"]);
    assert_eq!(
        sent["messages"],
        serde_json::json!([
            {"role": "system", "content": render_context(None, &canonical)},
            {"role": "user", "content": "why?"},
        ])
    );
    assert_eq!(canonical_chunks(["beta", "alpha", "beta"]), canonical);
    for (bad, param) in [
        (
            r#"{"model":"sim","retrieval":{"chunks":["a"]}}"#,
            "retrieval.query",
        ),
        (
            r#"{"model":"sim","retrieval":{"chunks":[1],"query":"q"}}"#,
            "retrieval.chunks[0]",
        ),
        (
            r#"{"model":"sim","retrieval":{"chunks":[],"query":"q"},"messages":[]}"#,
            "retrieval",
        ),
    ] {
        let r = Client::connect(addr).post("/v1/chat/completions", bad, &[]);
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(r.json()["error"]["param"], param, "{bad}");
    }
    // Under another name the field is just an unknown member: no messages, 400.
    let r = Client::connect(addr).post(
        "/v1/chat/completions",
        r#"{"model":"sim","rag":{"chunks":[],"query":"q"}}"#,
        &[],
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "messages");
    assert_eq!(upstream.seen().len(), 1);
}
both_drivers!(rag_bodies_are_normalised_and_checked);

// === workflows ===

fn post_workflow(addr: std::net::SocketAddr, body: &str) -> Response {
    Client::connect(addr).post("/v1/workflows", body, &[])
}

fn node_of<'a>(result: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    result["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == id)
        .unwrap_or_else(|| panic!("no node {id} in {result}"))
}

/// Map-reduce summarisation: a split node, three map nodes that share a long
/// instruction prefix, a reduce node that joins their outputs.
fn map_reduce_body(stream: bool) -> String {
    let instructions: String = (0..200).map(|i| format!("rule{i} ")).collect();
    let map = |i: usize| {
        format!(
            r#"{{"id":"map{i}","model":"sim","parents":["split"],"params":{{"max_tokens":3}},"messages":[{{"role":"system","content":"Summarise one part. {instructions}"}},{{"role":"user","content":"Part {i} of: {{{{split}}}}"}}]}}"#
        )
    };
    format!(
        r#"{{"stream":{stream},"nodes":[{{"id":"split","model":"sim","params":{{"max_tokens":4}},"messages":[{{"role":"user","content":"Split the report"}}]}},{},{},{},{{"id":"reduce","model":"sim","parents":["map0","map1","map2"],"params":{{"max_tokens":2}},"messages":[{{"role":"user","content":"Join: {{{{map0}}}} | {{{{map1}}}} | {{{{map2}}}}"}}]}}]}}"#,
        map(0),
        map(1),
        map(2)
    )
}

fn workflows_run_map_reduce(io: &str) {
    let (_engines, gw) = instant_fleet(io, 3, 1, "[routing]\npolicy = \"prefix_aware\"");
    let r = post_workflow(gw.local_addr(), &map_reduce_body(false));
    assert_eq!(r.status, 200, "{}", r.text());
    let result = r.json();
    assert_eq!(result["object"], "workflow");
    assert_eq!(result["status"], "succeeded", "{result}");
    let split = node_of(&result, "split");
    let reduce = node_of(&result, "reduce");
    let maps: Vec<_> = (0..3)
        .map(|i| node_of(&result, &format!("map{i}")))
        .collect();
    let f = |n: &serde_json::Value, k: &str| n[k].as_f64().unwrap();
    for n in maps.iter().chain([&split, &reduce]) {
        assert_eq!(n["status"], "succeeded", "{n}");
        assert!(!n["output"].as_str().unwrap().is_empty(), "{n}");
        assert!(n["usage"]["prompt_tokens"].as_u64().unwrap() > 0, "{n}");
    }
    // Parents before children; the maps ran side by side.
    let first_map_done = maps
        .iter()
        .map(|m| f(m, "finished_ms"))
        .fold(f64::MAX, f64::min);
    for m in &maps {
        assert!(f(m, "started_ms") >= f(split, "finished_ms"));
        assert!(f(m, "started_ms") <= first_map_done);
        assert!(f(reduce, "started_ms") >= f(m, "finished_ms"));
    }
    // Siblings sharing their instructions met on one engine, cache-aware.
    assert_eq!(maps[1]["backend"], maps[0]["backend"], "{result}");
    assert_eq!(maps[2]["backend"], maps[0]["backend"], "{result}");
    assert_eq!(maps[1]["reason"], "session-affinity", "{result}");
    assert_eq!(maps[2]["reason"], "session-affinity", "{result}");
    assert!(maps[2]["matched_blocks"].as_u64().unwrap() > 3, "{result}");
    assert!(result["makespan_ms"].as_f64().unwrap() >= f(reduce, "finished_ms"));
    // Each node is a request routed on its own: five routing decisions.
    let m = Client::connect(gw.local_addr()).get("/metrics").text();
    assert_eq!(
        metric(
            &m,
            "radixgate_routing_decision_seconds_count{shard=\"all\"}"
        ),
        Some(5.0)
    );
}
both_drivers!(workflows_run_map_reduce);

fn workflow_stream_reports_nodes_as_they_finish(io: &str) {
    let (_engines, gw) = instant_fleet(io, 2, 1, "[routing]\npolicy = \"prefix_aware\"");
    let r = post_workflow(gw.local_addr(), &map_reduce_body(true));
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let text = r.text();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let parsed: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let nodes: Vec<&str> = parsed
        .iter()
        .filter(|e| e["object"] == "workflow.node")
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(nodes.len(), 5, "{text}");
    assert_eq!(nodes[0], "split");
    assert_eq!(nodes[4], "reduce");
    let last = parsed.last().unwrap();
    assert_eq!(last["object"], "workflow");
    assert_eq!(last["status"], "succeeded");
}
both_drivers!(workflow_stream_reports_nodes_as_they_finish);

/// A node that fails fails its descendants and nothing else.
fn a_failed_node_fails_only_its_descendants(io: &str) {
    let (_engines, gw) = instant_fleet(io, 2, 1, "");
    let body = r#"{"nodes":[
        {"id":"bad","model":"no-such-model","prompt":"x"},
        {"id":"child","model":"sim","parents":["bad"],"prompt":"after {{bad}}"},
        {"id":"grandchild","model":"sim","parents":["child"],"prompt":"y"},
        {"id":"fine","model":"sim","prompt":"z","params":{"max_tokens":2}}]}"#;
    let r = post_workflow(gw.local_addr(), body);
    assert_eq!(r.status, 200, "{}", r.text());
    let result = r.json();
    assert_eq!(result["status"], "partial");
    let bad = node_of(&result, "bad");
    assert_eq!(bad["status"], "failed");
    assert_eq!(bad["upstream_status"], 404);
    assert!(
        bad["error"].as_str().unwrap().contains("no-such-model"),
        "{bad}"
    );
    for id in ["child", "grandchild"] {
        let n = node_of(&result, id);
        assert_eq!(n["status"], "failed");
        assert_eq!(n["error"], "not run: its ancestor `bad` failed");
        assert!(n["backend"].is_null());
    }
    assert_eq!(node_of(&result, "fine")["status"], "succeeded");
}
both_drivers!(a_failed_node_fails_only_its_descendants);

/// Parent outputs reach the child JSON-escaped; malformed workflows are 400s and
/// nothing is sent upstream.
fn workflow_references_and_refusals(io: &str) {
    let content = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"OUT \"q\"\nline"}}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{content}",
        content.len()
    );
    let upstream = ScriptedUpstream::start(Script::Reply(vec![reply.into_bytes()]));
    let gw = start_gateway(
        io,
        1,
        "[workflows]\nmax_nodes = 4\nmax_fan_out = 2",
        &[("up", upstream.url(), "sim")],
    );
    let addr = gw.local_addr();
    let refusals = [
        (
            r#"{"nodes":[{"id":"a","model":"sim","prompt":"x"},{"id":"a","model":"sim","prompt":"y"}]}"#,
            "nodes[1]",
            "used twice",
        ),
        (
            r#"{"nodes":[{"id":"a","model":"sim","prompt":"x","parents":["ghost"]}]}"#,
            "nodes[0]",
            "`ghost`",
        ),
        (
            r#"{"nodes":[{"id":"a","model":"sim","prompt":"x","parents":["b"]},{"id":"b","model":"sim","prompt":"y","parents":["a"]}]}"#,
            "nodes",
            "cycle",
        ),
        (
            r#"{"nodes":[{"id":"a","model":"sim","prompt":"x"},{"id":"b","model":"sim","prompt":"{{a}}"}]}"#,
            "nodes[1]",
            "not one of the node's parents",
        ),
        (
            r#"{"nodes":[{"id":"a","model":"sim","prompt":"1"},{"id":"b","model":"sim","prompt":"2"},{"id":"c","model":"sim","prompt":"3"},{"id":"d","model":"sim","prompt":"4"},{"id":"e","model":"sim","prompt":"5"}]}"#,
            "nodes",
            "at most 4",
        ),
        (
            r#"{"nodes":[{"id":"r","model":"sim","prompt":"1"},{"id":"b","model":"sim","prompt":"2","parents":["r"]},{"id":"c","model":"sim","prompt":"3","parents":["r"]},{"id":"d","model":"sim","prompt":"4","parents":["r"]}]}"#,
            "nodes[0]",
            "3 children",
        ),
        (
            r#"{"nodes":[{"id":"a","model":"sim"}]}"#,
            "nodes[0]",
            "`messages` or `prompt`",
        ),
        (r#"{"nodes":"#, "", "not valid JSON"),
    ];
    for (body, param, needle) in refusals {
        let r = post_workflow(addr, body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let e = &r.json()["error"];
        if !param.is_empty() {
            assert_eq!(e["param"], param, "{body}: {e}");
        }
        assert!(
            e["message"].as_str().unwrap().contains(needle),
            "{body}: {e}"
        );
    }
    assert!(
        upstream.seen().is_empty(),
        "a refused workflow sent something upstream"
    );
    let r = Client::connect(addr).get("/v1/workflows");
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("POST"));

    let body = r#"{"nodes":[{"id":"tool","model":"sim","messages":[{"role":"user","content":"call the tool"}]},{"id":"use","model":"sim","parents":["tool"],"messages":[{"role":"user","content":"The tool said: {{tool}}."}],"params":{"temperature":0}}]}"#;
    let r = post_workflow(addr, body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "succeeded", "{}", r.text());
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2);
    let child: serde_json::Value = serde_json::from_slice(&seen[1].body).unwrap();
    assert_eq!(
        child["messages"][0]["content"],
        "The tool said: OUT \"q\"\nline."
    );
    assert_eq!(child["temperature"], 0);
    assert_eq!(child["stream"], false);
    assert!(seen[1].head.contains("X-Request-Id: "), "{}", seen[1].head);
}
both_drivers!(workflow_references_and_refusals);

/// Workflows take API keys; under tenant prefix isolation each tenant's nodes carry
/// its `cache_salt`, as its chat requests do.
fn workflows_are_authenticated_and_isolated_per_tenant(io: &str) {
    let content = r#"{"choices":[{"index":0,"text":"done"}]}"#;
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{content}",
        content.len()
    );
    let upstream = ScriptedUpstream::start(Script::Reply(vec![reply.into_bytes()]));
    let toml = format!(
        "[auth]\nrequired = true\n[tenancy]\nprefix_isolation = \"tenant\"\n[[tenants]]\nname = \"acme\"\nkeys = [\"{}\"]\n[[tenants]]\nname = \"globex\"\nkeys = [\"{}\"]\n",
        radixgate::tenants::hash_key("sk-acme"),
        radixgate::tenants::hash_key("sk-globex"),
    );
    let gw = start_gateway(io, 1, &toml, &[("up", upstream.url(), "sim")]);
    let body = r#"{"nodes":[{"id":"a","model":"sim","prompt":"same prompt"}]}"#;
    let anonymous = post_workflow(gw.local_addr(), body);
    assert_eq!(anonymous.status, 401);
    assert!(upstream.seen().is_empty());
    for key in ["sk-acme", "sk-globex"] {
        let r = Client::connect(gw.local_addr()).post(
            "/v1/workflows",
            body,
            &[("Authorization", &format!("Bearer {key}"))],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["nodes"][0]["output"], "done");
    }
    let salts: Vec<String> = upstream
        .seen()
        .iter()
        .map(|s| {
            let v: serde_json::Value = serde_json::from_slice(&s.body).unwrap();
            assert_eq!(v["prompt"], "same prompt");
            v["cache_salt"].as_str().expect("cache_salt").to_string()
        })
        .collect();
    assert_eq!(salts.len(), 2);
    assert_ne!(salts[0], salts[1]);
}
both_drivers!(workflows_are_authenticated_and_isolated_per_tenant);

/// A workflow is charged to its tenant's quotas like its own requests: one request
/// per node, so a workflow larger than what is left of the bucket is a 429 with the
/// rate-limit headers before any node runs.
fn workflows_are_charged_to_tenant_quotas(io: &str) {
    let content = r#"{"choices":[{"index":0,"text":"done"}]}"#;
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{content}",
        content.len()
    );
    let upstream = ScriptedUpstream::start(Script::Reply(vec![reply.into_bytes()]));
    let toml = format!(
        "[auth]\nrequired = true\n[[tenants]]\nname = \"acme\"\nkeys = [\"{}\"]\nrequests_per_sec = 4\n",
        radixgate::tenants::hash_key("sk-acme"),
    );
    let gw = start_gateway(io, 1, &toml, &[("up", upstream.url(), "sim")]);
    let nodes = |n: usize| {
        let list: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"id":"n{i}","model":"sim","prompt":"p{i}"}}"#))
            .collect();
        format!(r#"{{"nodes":[{}]}}"#, list.join(","))
    };
    let auth = [("Authorization", "Bearer sk-acme")];
    // Three nodes fit in the bucket of four...
    let r = Client::connect(gw.local_addr()).post("/v1/workflows", &nodes(3), &auth);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(upstream.seen().len(), 3);
    // ...and the next three do not: refused whole, nothing sent upstream.
    let r = Client::connect(gw.local_addr()).post("/v1/workflows", &nodes(3), &auth);
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    assert!(r.header("retry-after").is_some());
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("4"));
    assert_eq!(upstream.seen().len(), 3);
}
both_drivers!(workflows_are_charged_to_tenant_quotas);

/// A client that leaves while its workflow's nodes run abandons the workflow: the
/// running nodes' upstream requests are dropped, so the engines stop within a
/// second; the node waiting on them never starts; the in-flight accounting is
/// released; the workflow counts as 499; and no breaker opens, although here a
/// single failure would open one.
fn a_departed_client_abandons_its_workflow(io: &str) {
    let engines: Vec<EngineHandle> = (0..2)
        .map(|_| {
            let mut cfg = EngineConfig::instant("sim");
            cfg.decode_per_token = Duration::from_millis(20);
            start_engine(io, cfg)
        })
        .collect();
    let backends: Vec<(&str, String, &str)> = vec![
        ("e0", engines[0].url(), "sim"),
        ("e1", engines[1].url(), "sim"),
    ];
    let gw = start_gateway(
        io,
        1,
        "[breaker]\nfailure_threshold = 1\nopen_ms = 60000",
        &backends,
    );
    let running = || -> f64 {
        engines
            .iter()
            .map(|e| {
                let m = Client::connect(e.addr()).get("/metrics").text();
                metric(&m, "vllm:num_requests_running").unwrap_or(-1.0)
            })
            .sum()
    };
    let served = || -> f64 {
        engines
            .iter()
            .map(|e| {
                let m = Client::connect(e.addr()).get("/metrics").text();
                metric(&m, "vllm:request_success_total").unwrap_or(0.0)
            })
            .sum()
    };
    let node = |id: &str, parents: &str| {
        format!(
            r#"{{"id":"{id}","model":"sim","parents":[{parents}],"params":{{"max_tokens":1000}},"messages":[{{"role":"user","content":"write a long essay about {id}"}}]}}"#
        )
    };
    let body = format!(
        r#"{{"nodes":[{},{},{}]}}"#,
        node("a", ""),
        node("b", ""),
        node("join", r#""a","b""#)
    );
    let mut c = Client::connect(gw.local_addr());
    c.send(&post_bytes("/v1/workflows", &body, &[]));
    assert!(
        eventually(Duration::from_secs(5), || running() == 2.0),
        "the two root nodes never both ran"
    );
    drop(c);
    assert!(
        eventually(Duration::from_secs(1), || running() == 0.0),
        "the engines still run {} requests 1 s after the client left",
        running()
    );
    assert_departure_released(
        gw.local_addr(),
        &["e0", "e1"],
        "radixgate_requests_total{backend=\"none\",status=\"499\",reason=\"workflow\"",
    );
    // Nothing was served: the roots were aborted and the join never started.
    assert_eq!(served(), 0.0);
    assert_eq!(running(), 0.0);
}
both_drivers!(a_departed_client_abandons_its_workflow);
