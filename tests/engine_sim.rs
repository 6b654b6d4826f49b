//! The simulated engine answers what the published routers ask of a worker (SGLang's
//! `/server_info` and `/model_info`, vLLM's `/v1/chat/completions/render`) and, in
//! `fixed_response` mode, answers completions with one constant body (`perf/`).

mod common;

use common::*;
use radixgate::engine_sim::EngineConfig;

fn answers_the_routers_probes(io: &str) {
    let engine = start_engine(io, EngineConfig::instant("sim"));
    let mut c = Client::connect(engine.addr());
    for path in ["/health", "/server_info", "/model_info"] {
        let r = c.get(path);
        assert_eq!(r.status, 200, "{path}");
        assert!(r.json().is_object(), "{path}: {}", r.text());
    }
    assert_eq!(c.get("/model_info").json()["is_generation"], true);

    // Render: one id per 4 body bytes, equal prefixes give equal ids.
    let short = chat_body("a shared system prompt", false);
    let long = chat_body("a shared system prompt, and then a question", false);
    let ids = |c: &mut Client, body: &str| -> Vec<u64> {
        let r = c.post("/v1/chat/completions/render", body, &[]);
        assert_eq!(r.status, 200);
        let v = r.json();
        assert!(v["request_id"].is_string());
        v["token_ids"]
            .as_array()
            .expect("token_ids")
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let a = ids(&mut c, &short);
    let b = ids(&mut c, &long);
    assert_eq!(a.len(), short.len().div_ceil(4));
    let common_prefix = short.find("prompt").unwrap() / 4;
    assert_eq!(a[..common_prefix], b[..common_prefix]);
}
both_drivers!(answers_the_routers_probes);

fn fixed_response_answers_with_one_constant_body(io: &str) {
    let cfg = EngineConfig {
        fixed_response: true,
        ..EngineConfig::new("sim") // slow settings: fixed mode must ignore them
    };
    let engine = start_engine(io, cfg);
    let mut c = Client::connect(engine.addr());
    let first = c.post("/v1/chat/completions", &chat_body("one", false), &[]);
    // Not even valid JSON is looked at.
    let second = c.post("/v1/chat/completions", "not json", &[]);
    let third = c.post("/v1/completions", r#"{"model":"sim","prompt":"x"}"#, &[]);
    for r in [&first, &second, &third] {
        assert_eq!(r.status, 200);
        assert_eq!(r.body, first.body);
    }
    let v = first.json();
    assert_eq!(v["choices"][0]["message"]["content"], "ok");
    assert_eq!(v["usage"]["total_tokens"], 2);
    // Stream requests get the same body: fixed mode never streams.
    let streamed = c.post("/v1/chat/completions", &chat_body("s", true), &[]);
    assert_eq!(streamed.body, first.body);
}
both_drivers!(fixed_response_answers_with_one_constant_body);

/// The `data:` events of a streamed answer, parsed (without `[DONE]`).
fn sse_events(r: &Response) -> Vec<serde_json::Value> {
    r.text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("event is JSON"))
        .collect()
}

/// Every chunk of a stream, the usage chunk included, carries one `id` (as vLLM's do).
#[test]
fn one_id_per_stream() {
    let engine = start_engine("epoll", EngineConfig::instant("sim"));
    let mut c = Client::connect(engine.addr());
    for (path, body, prefix) in [
        (
            "/v1/chat/completions",
            r#"{"model":"sim","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}"#,
            "chatcmpl-",
        ),
        (
            "/v1/completions",
            r#"{"model":"sim","prompt":"hi","max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}"#,
            "cmpl-",
        ),
    ] {
        let r = c.post(path, body, &[]);
        assert_eq!(r.status, 200, "{path}");
        let events = sse_events(&r);
        assert!(events.last().unwrap()["usage"].is_object(), "{path}");
        let id = events[0]["id"].as_str().unwrap().to_string();
        assert!(id.starts_with(prefix), "{path}: {id}");
        for e in &events {
            assert_eq!(e["id"], id.as_str(), "{path}: {e}");
        }
    }
}

/// A token-id prompt counts its ids; a batch of token-id arrays (which vLLM accepts)
/// counts every prompt and answers one choice per prompt.
#[test]
fn token_id_prompts_count_ids() {
    let engine = start_engine("epoll", EngineConfig::instant("sim"));
    let mut c = Client::connect(engine.addr());
    let r = c.post(
        "/v1/completions",
        r#"{"model":"sim","prompt":[1,2,3,4],"max_tokens":2}"#,
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["usage"]["prompt_tokens"], 4, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 1);

    let r = c.post(
        "/v1/completions",
        r#"{"model":"sim","prompt":[[1,2,3],[4,5,6,7,8]],"max_tokens":2}"#,
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["usage"]["prompt_tokens"], 8, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    let indices: Vec<u64> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [0, 1]);
}

/// `n`, `stop` and `echo` are honoured as vLLM honours them; `logprobs` is refused
/// with vLLM's 400 shape.
#[test]
fn n_stop_echo_and_logprobs() {
    let engine = start_engine("epoll", EngineConfig::instant("sim"));
    let mut c = Client::connect(engine.addr());

    // n: n choices, indexed 0..n, completion tokens summed; streamed too.
    for stream in [false, true] {
        let body = format!(
            r#"{{"model":"sim","messages":[{{"role":"user","content":"hi"}}],"max_tokens":3,"n":3,"stream":{stream},"stream_options":{{"include_usage":true}}}}"#
        );
        let r = c.post("/v1/chat/completions", &body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let (indices, usage) = if stream {
            let events = sse_events(&r);
            let mut seen: Vec<u64> = events
                .iter()
                .flat_map(|e| e["choices"].as_array().unwrap().clone())
                .filter(|c| c["finish_reason"].is_string())
                .map(|c| c["index"].as_u64().unwrap())
                .collect();
            seen.sort();
            (seen, events.last().unwrap()["usage"].clone())
        } else {
            let v = r.json();
            let seen = v["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["index"].as_u64().unwrap())
                .collect();
            (seen, v["usage"].clone())
        };
        assert_eq!(indices, [0, 1, 2], "stream={stream}");
        assert_eq!(usage["completion_tokens"], 9, "stream={stream}: {usage}");
    }

    // stop: the text ends before the stop string, finish_reason "stop", and only the
    // tokens generated up to it are counted.
    // The generated words cycle through twelve, "batch" among them.
    let stop = "batch";
    let body =
        format!(r#"{{"model":"sim","prompt":"hi","max_tokens":50,"stop":["zzz","{stop}"]}}"#);
    let r = c.post("/v1/completions", &body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(!text.contains(stop), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let tokens = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&tokens), "{v}");
    let stream_body = body.replace("\"max_tokens\"", "\"stream\":true,\"max_tokens\"");
    let r = c.post("/v1/completions", &stream_body, &[]);
    let events = sse_events(&r);
    let streamed: String = events
        .iter()
        .map(|e| e["choices"][0]["text"].as_str().unwrap_or(""))
        .collect();
    assert!(!streamed.contains(stop), "{streamed}");
    assert_eq!(
        events.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );

    // echo: the prompt comes back before the generated text.
    let r = c.post(
        "/v1/completions",
        r#"{"model":"sim","prompt":"say \"hi\"","max_tokens":2,"echo":true}"#,
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.starts_with("say \"hi\""), "{text}");
    assert!(text.len() > "say \"hi\"".len(), "{text}");

    // Refused as vLLM refuses: 400, BadRequestError, the parameter named.
    for (path, body, param) in [
        (
            "/v1/completions",
            r#"{"model":"sim","prompt":"hi","logprobs":2}"#,
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"sim","messages":[{"role":"user","content":"hi"}],"logprobs":true}"#,
            "logprobs",
        ),
        (
            "/v1/completions",
            r#"{"model":"sim","prompt":"hi","n":0}"#,
            "n",
        ),
    ] {
        let r = c.post(path, body, &[]);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let v = r.json();
        assert_eq!(v["error"]["type"], "BadRequestError", "{v}");
        assert_eq!(v["error"]["code"], 400, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().starts_with(param),
            "{v}"
        );
    }
}
