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
    // The generated words cycle through sixteen, "with" among them.
    let stop = "with";
    let body =
        format!(r#"{{"model":"sim","prompt":"hi","max_tokens":50,"stop":["zzz","{stop}"]}}"#);
    let r = c.post("/v1/completions", &body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(!text.contains(stop), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let tokens = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=16).contains(&tokens), "{v}");
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

/// A GPT-2-style tokenizer (byte-level BPE, the kind `deploy/vllm/make_model.py`
/// trains) knowing `words` as whole space-prefixed tokens, or a word-level one
/// (whitespace split, decoded by joining with spaces), saved with a chat template in
/// a fresh directory; returns the `tokenizer.json` path.
fn tokenizer_dir(tag: &str, byte_level: bool, words: &[&str]) -> std::path::PathBuf {
    use std::collections::HashMap;
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::{Vocab, BPE};
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;
    use tokenizers::Tokenizer;

    let dir = std::env::temp_dir().join(format!("radixgate-simwords-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer = if byte_level {
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort();
        let mut vocab: Vec<String> = alphabet.iter().map(char::to_string).collect();
        let mut merges = Vec::new();
        for w in words {
            // "Ġ" + each letter in turn: Ġt, Ġth, Ġthe.
            let mut left = "Ġ".to_string();
            for ch in w.chars() {
                let merged = format!("{left}{ch}");
                if !vocab.contains(&merged) {
                    merges.push((left.clone(), ch.to_string()));
                    vocab.push(merged.clone());
                }
                left = merged;
            }
        }
        let vocab: Vocab = vocab
            .into_iter()
            .enumerate()
            .map(|(i, t)| (t, i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .unwrap();
        let mut t = Tokenizer::new(bpe);
        t.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        t.with_decoder(Some(ByteLevelDecoder::default()));
        t
    } else {
        let vocab: HashMap<String, u32> = ["[UNK]", "<|user|>"]
            .iter()
            .chain(words)
            .enumerate()
            .map(|(i, w)| (w.to_string(), i as u32))
            .collect();
        let model = WordLevel::builder()
            .vocab(vocab.into_iter().collect())
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let mut t = Tokenizer::new(model);
        t.with_pre_tokenizer(Some(Whitespace {}));
        t
    };
    let path = dir.join("tokenizer.json");
    tokenizer.save(&path, false).unwrap();
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    )
    .unwrap();
    path
}

/// Every choice's text, streamed (one chunk per token: each chunk must be one
/// token) or whole, and the answer's `completion_tokens`.
fn answer_texts(
    c: &mut Client,
    path: &str,
    body: &str,
    stream: bool,
    count: &dyn Fn(&str) -> usize,
) -> (Vec<String>, u64) {
    let r = c.post(path, body, &[]);
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    let field = |choice: &serde_json::Value| -> Option<String> {
        let v = &choice["text"];
        let v = if v.is_null() {
            &choice["delta"]["content"]
        } else {
            v
        };
        let v = if v.is_null() {
            &choice["message"]["content"]
        } else {
            v
        };
        v.as_str().map(str::to_string)
    };
    let mut texts: Vec<String> = Vec::new();
    let usage = if stream {
        let events = sse_events(&r);
        for e in &events {
            for choice in e["choices"].as_array().unwrap() {
                let i = choice["index"].as_u64().unwrap() as usize;
                let Some(piece) = field(choice).filter(|p| !p.is_empty()) else {
                    continue; // the chat role chunk
                };
                assert_eq!(count(&piece), 1, "one token per chunk: {piece:?}");
                if texts.len() <= i {
                    texts.resize(i + 1, String::new());
                }
                texts[i].push_str(&piece);
            }
        }
        events.last().unwrap()["usage"].clone()
    } else {
        let v = r.json();
        for choice in v["choices"].as_array().unwrap() {
            texts.push(field(choice).unwrap());
        }
        v["usage"].clone()
    };
    (texts, usage["completion_tokens"].as_u64().unwrap())
}

/// Given a tokenizer, the engine answers in words of its vocabulary: the text a
/// client re-tokenizes counts `completion_tokens` tokens, whole or streamed (one
/// token per chunk), on both endpoints, for a byte-level BPE and a word-level
/// tokenizer alike. Without one, the default words count one per whitespace-split
/// word.
#[test]
fn generated_text_retokenizes_to_completion_tokens() {
    let words = ["the", "cache", "prefix", "router", "engine", "shard", "w7"];
    for byte_level in [true, false] {
        let path = tokenizer_dir(&format!("bl{byte_level}"), byte_level, &words);
        let tokenizer = tokenizers::Tokenizer::from_file(&path).unwrap();
        let sim = radixgate::engine_sim::SimTokenizer::load(path.to_str().unwrap(), None)
            .expect("tokenizer loads");
        assert!(sim.words.len() >= words.len(), "{}", sim.words.len());
        let cfg = EngineConfig {
            tokenizer: Some(sim),
            ..EngineConfig::instant("sim")
        };
        let engine = start_engine("epoll", cfg);
        let count = |text: &str| tokenizer.encode_fast(text, false).unwrap().get_ids().len();
        let mut c = Client::connect(engine.addr());
        for stream in [false, true] {
            for max_tokens in [1, 5, 40] {
                for (path, input) in [
                    ("/v1/completions", r#""prompt":"the cache""#),
                    (
                        "/v1/chat/completions",
                        r#""messages":[{"role":"user","content":"the cache"}]"#,
                    ),
                ] {
                    let body = format!(
                        r#"{{"model":"sim",{input},"max_tokens":{max_tokens},"n":2,"stream":{stream},"stream_options":{{"include_usage":true}}}}"#
                    );
                    let (texts, completion) = answer_texts(&mut c, path, &body, stream, &count);
                    assert_eq!(texts.len(), 2, "{body}");
                    assert_eq!(completion, 2 * max_tokens, "{body}");
                    for t in &texts {
                        assert_eq!(count(t) as u64, max_tokens, "{body}: {t:?}");
                    }
                }
            }
        }
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    }

    // No tokenizer: common words, the first bare, one per whitespace-split word.
    let engine = start_engine("epoll", EngineConfig::instant("sim"));
    let mut c = Client::connect(engine.addr());
    let words = |t: &str| t.split_whitespace().count();
    for stream in [false, true] {
        let body = format!(
            r#"{{"model":"sim","prompt":"hi","max_tokens":20,"stream":{stream},"stream_options":{{"include_usage":true}}}}"#
        );
        let (texts, completion) = answer_texts(&mut c, "/v1/completions", &body, stream, &words);
        assert_eq!(completion, 20);
        assert_eq!(words(&texts[0]), 20, "{:?}", texts[0]);
        assert!(!texts[0].starts_with(' '), "{:?}", texts[0]);
    }
}

/// `stream_options.continuous_usage_stats` (which guidellm asks for): as in vLLM,
/// every chunk carries `usage` with the tokens generated so far; without it only the
/// last chunk does.
#[test]
fn continuous_usage_stats_in_every_chunk() {
    let engine = start_engine("epoll", EngineConfig::instant("sim"));
    let mut c = Client::connect(engine.addr());
    for continuous in [true, false] {
        let body = format!(
            r#"{{"model":"sim","messages":[{{"role":"user","content":"hi"}}],"max_tokens":3,"stream":true,"stream_options":{{"include_usage":true,"continuous_usage_stats":{continuous}}}}}"#
        );
        let r = c.post("/v1/chat/completions", &body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let events = sse_events(&r);
        assert_eq!(events.len(), 5, "role, 3 tokens, usage");
        let completion: Vec<Option<u64>> = events
            .iter()
            .map(|e| e["usage"]["completion_tokens"].as_u64())
            .collect();
        if continuous {
            assert_eq!(completion, [Some(0), Some(1), Some(2), Some(3), Some(3)]);
            let prompt = events[4]["usage"]["prompt_tokens"].clone();
            assert!(events.iter().all(|e| e["usage"]["prompt_tokens"] == prompt));
        } else {
            assert_eq!(completion, [None, None, None, None, Some(3)]);
        }
    }
}
