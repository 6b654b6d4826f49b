//! The simulated engine's request handling: vLLM's endpoints, the batch and queue,
//! and the OpenAI response shapes (plain JSON and SSE) with `cached_tokens`. Like
//! vLLM, it aborts a request whose client disconnects (a failed write while
//! streaming; a watched socket while prefilling or generating a whole answer), so
//! `vllm:num_requests_running` drops when a gateway gives a request up.

use super::disagg::{self as kv, Handoffs, Leg};
use super::kv_publish::{Publisher, SimEvent};
use super::sampling::{self, Choice};
use super::{EngineConfig, Words, BYTES_PER_TOKEN};
use crate::error::{ErrorKind, GatewayError};
use crate::http::conn::{ClientConn, ReadOutcome, RequestLimits};
use crate::http::request::Method;
use crate::http::response::Utf8Vec;
use crate::open_conns::OpenConnections;
use crate::openai::{BodyParser, Endpoint, ModelTable, RequestFacts};
use crate::tls::Stream;
use monoio::io::AsyncWriteRentExt;
use monoio::net::{TcpListener, TcpStream};
use radixgate_orchestrator::{EngineCache, PromptHasher};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::rc::Rc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A stream's response head.
const STREAM_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n";

#[derive(Default)]
struct Counters {
    prompt_tokens: u64,
    cached_tokens: u64,
    generation_tokens: u64,
    requests_ok: u64,
    requests_failed: u64,
}

pub struct Engine {
    config: EngineConfig,
    models: ModelTable,
    cache: RefCell<EngineCache>,
    parser: RefCell<BodyParser>,
    hasher: RefCell<PromptHasher>,
    rng: RefCell<fastrand::Rng>,
    running: Cell<usize>,
    /// Blocks pinned by running requests (drives `kv_cache_usage_perc`).
    running_blocks: Cell<usize>,
    waiting: RefCell<VecDeque<flume::Sender<()>>>,
    counters: RefCell<Counters>,
    next_id: Cell<u64>,
    /// The constant answer in `fixed_response` mode.
    fixed_body: Vec<u8>,
    /// Open connections, closed for real when the engine stops.
    pub conns: Rc<OpenConnections>,
    /// Where it listens (named in the `kv_transfer_params` it hands out).
    addr: SocketAddr,
    /// Its engine id in `kv_transfer_params`.
    engine_id: String,
    /// Blocks and rooms held for decode engines (split pools).
    handoffs: RefCell<Handoffs>,
    /// Tokenizing as vLLM does (`config.tokenizer`).
    tokens: Option<RefCell<crate::token_mode::TokenHasher>>,
    /// The last parsed prompt's token ids (tokenizer mode).
    last_ids: RefCell<Vec<u32>>,
    /// What answers are made of (the tokenizer's words in tokenizer mode).
    words: std::sync::Arc<Words>,
    /// KV-cache events (`config.kv_events`).
    publisher: Option<Publisher>,
}

/// The engine's own key for a block of the gateway's chain: another hash of the
/// same tokens, so a subscriber can only match them through `token_ids`.
fn engine_key(h: u64) -> u64 {
    (h ^ 0x9e37_79b9_7f4a_7c15).rotate_left(23)
}

/// A batch slot; dropping it hands the slot to the next waiter, or frees it.
struct Slot<'e> {
    engine: &'e Engine,
    blocks: usize,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let e = self.engine;
        e.running_blocks.set(e.running_blocks.get() - self.blocks);
        let mut waiting = e.waiting.borrow_mut();
        while let Some(next) = waiting.pop_front() {
            if next.send(()).is_ok() {
                return; // slot passed on; `running` unchanged
            }
        }
        e.running.set(e.running.get() - 1);
    }
}

impl Engine {
    pub fn new(config: EngineConfig, addr: SocketAddr, publisher: Option<Publisher>) -> Rc<Engine> {
        let block_bytes = NonZeroUsize::new(config.block_tokens.max(1) * BYTES_PER_TOKEN)
            .unwrap_or(NonZeroUsize::MIN);
        Rc::new(Engine {
            // Each adapter is a name of its own, so its prompts hash in their own
            // namespace (as vLLM's cache keys include the adapter).
            models: ModelTable::new(
                std::iter::once(&config.model)
                    .chain(&config.loras)
                    .cloned()
                    .collect(),
            ),
            cache: RefCell::new(EngineCache::new(config.cache_blocks)),
            parser: RefCell::new(BodyParser::default()),
            hasher: RefCell::new(PromptHasher::new(block_bytes)),
            rng: RefCell::new(fastrand::Rng::with_seed(config.seed)),
            running: Cell::new(0),
            running_blocks: Cell::new(0),
            waiting: RefCell::new(VecDeque::new()),
            counters: RefCell::new(Counters::default()),
            next_id: Cell::new(0),
            fixed_body: fixed_body(&config.model),
            conns: Rc::default(),
            addr,
            engine_id: format!("sim-{}-{}", config.seed, addr.port()),
            handoffs: RefCell::default(),
            tokens: config.tokenizer.as_ref().map(|t| {
                RefCell::new(crate::token_mode::TokenHasher::with_cache(
                    t.tokenizer.clone(),
                    NonZeroUsize::new(config.block_tokens.max(1)).unwrap_or(NonZeroUsize::MIN),
                    0,
                ))
            }),
            last_ids: RefCell::default(),
            words: config
                .tokenizer
                .as_ref()
                .map_or_else(Default::default, |t| t.words.clone()),
            publisher,
            config,
        })
    }

    pub async fn serve(self: Rc<Self>, listener: &TcpListener) {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                monoio::time::sleep(Duration::from_millis(5)).await;
                continue;
            };
            if self.chance(self.config.refuse_rate) {
                drop(stream);
                continue;
            }
            let _ = stream.set_nodelay(true);
            monoio::spawn(self.clone().connection(stream));
        }
    }

    fn chance(&self, rate: f64) -> bool {
        rate > 0.0 && self.rng.borrow_mut().f64() < rate
    }

    async fn connection(self: Rc<Self>, stream: TcpStream) {
        let limits = RequestLimits::lenient(64 << 20, Duration::from_secs(300));
        let mut conn = ClientConn::new(stream.into(), Vec::with_capacity(8192));
        let _registered = self.conns.register(conn.stream.tcp());
        loop {
            match conn.read_request(&limits).await {
                Ok(ReadOutcome::Request) => {}
                // Lenient limits never park: `Idle` does not come.
                Ok(ReadOutcome::Closed | ReadOutcome::Idle { .. }) => return,
                Err(e) => {
                    let _ = conn.stream.write_all(e.to_response(b"", false)).await;
                    return;
                }
            }
            let keep_alive = conn.head.keep_alive;
            let ok = match (conn.head.route_path(), conn.head.method()) {
                ("/v1/chat/completions" | "/v1/completions", Method::Post)
                    if self.config.fixed_response =>
                {
                    self.counters.borrow_mut().requests_ok += 1;
                    if !self.config.fixed_delay.is_zero() {
                        monoio::time::sleep(self.config.fixed_delay).await;
                    }
                    let body = self.fixed_body.clone();
                    reply(&mut conn.stream, 200, "application/json", body, keep_alive).await
                }
                ("/v1/chat/completions/render" | "/v1/completions/render", Method::Post) => {
                    let body = self.render(&conn.body);
                    reply(&mut conn.stream, 200, "application/json", body, keep_alive).await
                }
                ("/server_info" | "/get_server_info", Method::Get) => {
                    let body = format!(
                        "{{\"served_model_name\":\"{}\",\"max_running_requests\":{},\"page_size\":{}}}",
                        self.config.model, self.config.max_batch, self.config.block_tokens
                    );
                    reply(
                        &mut conn.stream,
                        200,
                        "application/json",
                        body.into_bytes(),
                        keep_alive,
                    )
                    .await
                }
                ("/model_info" | "/get_model_info", Method::Get) => {
                    reply(
                        &mut conn.stream,
                        200,
                        "application/json",
                        b"{\"is_generation\":true}".to_vec(),
                        keep_alive,
                    )
                    .await
                }
                ("/kv/pull" | "/kv/room", Method::Post) => self.hand_off(&mut conn).await,
                ("/v1/chat/completions", Method::Post) => {
                    self.generate(&mut conn, Endpoint::ChatCompletions).await
                }
                ("/v1/completions", Method::Post) => {
                    self.generate(&mut conn, Endpoint::Completions).await
                }
                ("/health", Method::Get) => {
                    reply(
                        &mut conn.stream,
                        200,
                        "application/json",
                        b"{}".to_vec(),
                        keep_alive,
                    )
                    .await
                }
                ("/v1/models", Method::Get) => {
                    let body = self.models_json();
                    reply(&mut conn.stream, 200, "application/json", body, keep_alive).await
                }
                ("/metrics", Method::Get) => {
                    reply(
                        &mut conn.stream,
                        200,
                        "text/plain; version=0.0.4",
                        self.metrics().into_bytes(),
                        keep_alive,
                    )
                    .await
                }
                _ => {
                    let e = GatewayError::new(ErrorKind::PathNotFound, "Not Found");
                    let (r, _) = conn.stream.write_all(e.to_response(b"", keep_alive)).await;
                    r.is_ok()
                }
            };
            if !ok || !keep_alive {
                return;
            }
        }
    }

    /// `GET /v1/models` as vLLM answers it: the model (`parent: null`), then each
    /// adapter with the model as its `parent` and a made-up path as its `root`.
    fn models_json(&self) -> Vec<u8> {
        let model = &self.config.model;
        let entry = |id: &str, root: &str, parent: Option<&str>| {
            serde_json::json!({
                "id": id, "object": "model", "created": 0, "owned_by": "vllm",
                "root": root, "parent": parent, "max_model_len": 4096,
            })
        };
        let mut data = vec![entry(model, model, None)];
        for lora in &self.config.loras {
            data.push(entry(lora, &format!("/loras/{lora}"), Some(model)));
        }
        serde_json::to_vec(&serde_json::json!({"object": "list", "data": data})).unwrap_or_default()
    }

    /// vLLM's render endpoints: the prompt as token ids. The simulated tokenizer is
    /// one id per `BYTES_PER_TOKEN` bytes of request body, so equal prefixes render to
    /// equal ids, which is all a cache-aware router needs from it.
    fn render(&self, body: &[u8]) -> Vec<u8> {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        let mut out = Vec::with_capacity(64 + body.len() * 2);
        let _ = write!(
            Utf8Vec(&mut out),
            "{{\"request_id\":\"render-{id}\",\"token_ids\":["
        );
        for (i, chunk) in body.chunks(BYTES_PER_TOKEN).enumerate() {
            let mut word = [0u8; 4];
            word[..chunk.len()].copy_from_slice(chunk);
            let token = u32::from_le_bytes(word) % 150_000;
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(Utf8Vec(&mut out), "{sep}{token}");
        }
        if body.is_empty() {
            out.push(b'0'); // vLLM never renders an empty prompt
        }
        out.extend_from_slice(b"]}");
        out
    }

    fn parse(
        &self,
        body: &[u8],
        endpoint: Endpoint,
    ) -> Result<(RequestFacts, Vec<u64>, u64), GatewayError> {
        let mut hasher = self.hasher.borrow_mut();
        let facts = self
            .parser
            .borrow_mut()
            .parse(endpoint, body, &self.models, &mut hasher, 0)?;
        if let (Some(tokens), Some(t)) = (&self.tokens, &self.config.tokenizer) {
            // As vLLM tokenizes: through the chat template (a precise-mode gateway
            // runs the same code, so its blocks are these blocks).
            let mut tokens = tokens.borrow_mut();
            tokens
                .hash_precise(&hasher, &t.template, body)
                .map_err(|e| GatewayError::new(ErrorKind::InvalidParam, e))?;
            let blocks = tokens.blocks().iter().map(|&h| engine_key(h)).collect();
            let mut ids = self.last_ids.borrow_mut();
            ids.clear();
            ids.extend_from_slice(tokens.ids());
            return Ok((facts, blocks, (ids.len() as u64).max(1)));
        }
        let prompt_tokens = hasher.bytes_fed().div_ceil(BYTES_PER_TOKEN as u64).max(1);
        Ok((facts, hasher.blocks().to_vec(), prompt_tokens))
    }

    /// KV events for one prompt: its blocks from `matched` on were stored (their
    /// tokens known in tokenizer mode), `evicted` were removed.
    fn publish_blocks(&self, blocks: &[u64], matched: usize, evicted: Vec<u64>) {
        let Some(p) = &self.publisher else {
            return;
        };
        let bt = self.config.block_tokens.max(1);
        let mut batch = Vec::new();
        if matched < blocks.len() {
            let ids = self.last_ids.borrow();
            let tokens = if self.tokens.is_some() {
                ids.get(matched * bt..blocks.len() * bt)
                    .map(<[u32]>::to_vec)
                    .unwrap_or_default()
            } else {
                Vec::new() // no tokenizer: the blocks' tokens are not known
            };
            batch.push(SimEvent::Stored {
                hashes: blocks[matched..].to_vec(),
                parent: matched.checked_sub(1).map(|i| blocks[i]),
                tokens,
                block_size: bt,
            });
        }
        if !evicted.is_empty() {
            batch.push(SimEvent::Removed { hashes: evicted });
        }
        p.publish(batch);
    }

    /// Serves one completion. Returns whether the connection is still usable.
    async fn generate(&self, conn: &mut ClientConn, endpoint: Endpoint) -> bool {
        let keep_alive = conn.head.keep_alive;
        let continued = match endpoint {
            Endpoint::ChatCompletions => super::continuation::read(&conn.body, &self.words),
            Endpoint::Completions => Ok(None),
        };
        let continued = match continued {
            Ok(c) => c.filter(|c| c.from.is_some()),
            Err(message) => {
                self.counters.borrow_mut().requests_failed += 1;
                return reply_error(conn, 400, &message, keep_alive).await;
            }
        };
        // A continued answer: the conversation before it is the prompt, plus the
        // tokens continued (as vLLM counts them).
        let parsed = match &continued {
            Some(c) => self.parse(&c.body, endpoint),
            None => self.parse(&conn.body, endpoint),
        };
        let mut continue_from = continued.and_then(|c| c.from);
        let (mut facts, mut blocks, mut first_prompt_tokens) = match parsed {
            Ok((facts, blocks, tokens)) => {
                let continued = continue_from.map_or(0, |(_, steps)| steps as u64);
                (facts, blocks, tokens + continued)
            }
            Err(e) => {
                let (r, _) = conn.stream.write_all(e.to_response(b"", keep_alive)).await;
                return r.is_ok();
            }
        };
        let mut sampling = match sampling::read(&conn.body, endpoint) {
            Ok(s) => s,
            Err(message) => {
                self.counters.borrow_mut().requests_failed += 1;
                return reply_error(conn, 400, &message, keep_alive).await;
            }
        };
        if let (Endpoint::Completions, [prompt]) = (endpoint, &sampling.prompts[..]) {
            let c = prompt
                .text
                .as_deref()
                .and_then(|p| super::continuation::completion(&conn.body, p, &self.words));
            if let Some(c) = c {
                if let (Ok((f, b, tokens)), Some((_, steps))) =
                    (self.parse(&c.body, endpoint), c.from)
                {
                    (facts, blocks, first_prompt_tokens) = (f, b, tokens + steps as u64);
                    continue_from = c.from;
                }
            }
        }
        // Token-id prompts count their ids; a batch counts every prompt (the cache
        // and the prefix match follow the first, as the gateway hashes it).
        let prompt_tokens: u64 = sampling
            .prompts
            .iter()
            .enumerate()
            .map(|(i, p)| match (p.ids, &p.text) {
                (Some(ids), _) => ids,
                (None, Some(text)) if i > 0 => {
                    (text.len() as u64).div_ceil(BYTES_PER_TOKEN as u64).max(1)
                }
                _ => first_prompt_tokens,
            })
            .sum();
        if self.chance(self.config.fail_rate) {
            self.counters.borrow_mut().requests_failed += 1;
            return reply_error(
                conn,
                503,
                "simulated engine failure (--fail-rate)",
                keep_alive,
            )
            .await;
        }
        let leg = match &self.config.disagg {
            Some(d) => kv::leg(d.role, d.protocol, &conn.body),
            None => Ok(Leg::Whole),
        };
        let mut transfer = None;
        let leg = match leg {
            Ok(Leg::Decode(pull)) => {
                let d = self
                    .config
                    .disagg
                    .as_ref()
                    .map(|d| d.hold)
                    .unwrap_or_default();
                match kv::pull(&pull, &conn.head.request_id, d).await {
                    Ok(tokens) => {
                        transfer = Some(tokens);
                        Leg::Decode(pull)
                    }
                    Err(e) => {
                        self.counters.borrow_mut().requests_failed += 1;
                        return reply_error(
                            conn,
                            400,
                            &format!("KV transfer failed: {e}"),
                            keep_alive,
                        )
                        .await;
                    }
                }
            }
            Ok(leg) => leg,
            Err(e) => {
                self.counters.borrow_mut().requests_failed += 1;
                return reply_error(conn, 400, &e, keep_alive).await;
            }
        };
        let Some(_slot) = self.admit(blocks.len()).await else {
            self.counters.borrow_mut().requests_failed += 1;
            return reply_error(conn, 503, "the engine's waiting queue is full", keep_alive).await;
        };

        // vLLM answers a stream's head before its prefill; by default the simulator
        // sends it with the first token (so a failure before then can still be a
        // status).
        let head_sent = facts.stream && self.config.stream_head_first && matches!(leg, Leg::Whole);
        if head_sent && conn.stream.write_all(STREAM_HEAD).await.0.is_err() {
            self.counters.borrow_mut().requests_failed += 1;
            return false;
        }

        // Prefill: only the blocks not already cached cost time.
        let matched = {
            let mut cache = self.cache.borrow_mut();
            let m = cache.matched(&blocks);
            let mut evicted = Vec::new();
            cache.touch_evicting(&blocks, &mut evicted);
            self.publish_blocks(&blocks, m, evicted);
            m
        };
        let first = sampling.prompts[0].ids.unwrap_or(first_prompt_tokens);
        let cached_tokens = if self.tokens.is_some() {
            // vLLM: whole blocks, and the last prompt token is always computed.
            let bt = self.config.block_tokens.max(1) as u64;
            (matched as u64).min(first.saturating_sub(1) / bt) * bt
        } else {
            ((matched * self.config.block_tokens) as u64).min(first.saturating_sub(1))
        };
        {
            let mut c = self.counters.borrow_mut();
            c.prompt_tokens += prompt_tokens;
            c.cached_tokens += cached_tokens;
        }
        let mut delay = match (transfer, &self.config.disagg) {
            // Handed-over KV: the transfer instead of the prefill.
            (Some(tokens), Some(d)) => d.transfer_time(tokens),
            _ => self.config.prefill_per_token * (prompt_tokens - cached_tokens) as u32,
        };
        if self.chance(self.config.spike_rate) {
            delay += self.config.spike;
        }
        if !delay.is_zero() && !work_or_abort(conn, monoio::time::sleep(delay)).await {
            self.counters.borrow_mut().requests_failed += 1;
            return false;
        }

        let prefill_leg = matches!(leg, Leg::VllmPrefill | Leg::SglangPrefill { .. });
        let max_tokens = if prefill_leg {
            1
        } else {
            facts.max_tokens.unwrap_or(self.config.default_max_tokens)
        };
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        sampling.continue_from = continue_from;
        let choices = sampling.choices(&self.words, id, max_tokens);
        let longest = choices.iter().map(|c| c.pieces.len()).max().unwrap_or(0) as u64;
        let usage = Usage {
            prompt: prompt_tokens,
            completion: choices.iter().map(|c| c.pieces.len() as u64).sum(),
            cached: cached_tokens,
        };
        let hold = self
            .config
            .disagg
            .as_ref()
            .map(|d| d.hold)
            .unwrap_or_default();
        let ok = if let Leg::VllmPrefill = leg {
            let ids = self.handoffs.borrow_mut().hold(
                prompt_tokens,
                self.config.block_tokens,
                &conn.head.request_id,
                hold,
            );
            let params = kv::transfer_params(&self.engine_id, &ids, self.addr);
            let mut body = full_body(endpoint, &self.config.model, id, &choices, &usage);
            body.pop(); // the closing brace
            let _ = write!(Utf8Vec(&mut body), ",\"kv_transfer_params\":{params}}}");
            reply(&mut conn.stream, 200, "application/json", body, keep_alive).await
        } else if facts.stream {
            let abort_at = self.chance(self.config.abort_rate).then_some(longest / 2);
            let streamed = Streamed {
                id,
                choices: &choices,
                usage: &usage,
                include_usage: facts.include_usage,
                continuous_usage: facts.include_usage && sampling.continuous_usage,
            };
            self.stream_tokens(conn, endpoint, &streamed, abort_at, head_sent)
                .await
        } else if work_or_abort(conn, self.decode_wait(longest)).await {
            let body = full_body(endpoint, &self.config.model, id, &choices, &usage);
            reply(&mut conn.stream, 200, "application/json", body, keep_alive).await
        } else {
            false
        };
        if let (Leg::SglangPrefill { room }, true) = (&leg, ok) {
            self.handoffs
                .borrow_mut()
                .publish(*room, prompt_tokens, hold);
        }
        let mut c = self.counters.borrow_mut();
        if ok {
            c.requests_ok += 1;
            c.generation_tokens += usage.completion;
        } else {
            c.requests_failed += 1;
        }
        ok
    }

    /// `/kv/pull` (vLLM: hand held blocks over) and `/kv/room` (SGLang: wait for a
    /// room's prefill), asked by decode engines.
    async fn hand_off(&self, conn: &mut ClientConn) -> bool {
        let keep_alive = conn.head.keep_alive;
        let v: serde_json::Value = serde_json::from_slice(&conn.body).unwrap_or_default();
        let result = if conn.head.route_path() == "/kv/pull" {
            let ids: Vec<u64> = v["block_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(|b| b.as_u64()).collect())
                .unwrap_or_default();
            if v["engine_id"].as_str() != Some(&self.engine_id) {
                Err("unknown engine id".to_string())
            } else {
                let rid = v["request_id"].as_str().unwrap_or_default();
                self.handoffs.borrow_mut().take(&ids, rid)
            }
        } else {
            let room = v["room"].as_u64().unwrap_or(u64::MAX);
            let joined = self.handoffs.borrow_mut().join(room);
            match joined {
                Ok(tokens) => Ok(tokens),
                Err(rx) => {
                    let wait = self
                        .config
                        .disagg
                        .as_ref()
                        .map(|d| d.hold)
                        .unwrap_or_default();
                    match monoio::time::timeout(wait, rx.recv_async()).await {
                        Ok(Ok(tokens)) => Ok(tokens),
                        _ => Err(format!("no prefill for room {room}")),
                    }
                }
            }
        };
        match result {
            Ok(tokens) => {
                let body = format!("{{\"tokens\":{tokens}}}").into_bytes();
                reply(&mut conn.stream, 200, "application/json", body, keep_alive).await
            }
            Err(e) => reply_error(conn, 404, &e, keep_alive).await,
        }
    }

    /// Waits for a batch slot; `None` when the waiting queue is full.
    async fn admit(&self, blocks: usize) -> Option<Slot<'_>> {
        if self.running.get() < self.config.max_batch {
            self.running.set(self.running.get() + 1);
        } else {
            if self.waiting.borrow().len() >= self.config.max_waiting {
                return None;
            }
            let (tx, rx) = flume::bounded(1);
            self.waiting.borrow_mut().push_back(tx);
            rx.recv_async().await.ok()?;
        }
        self.running_blocks.set(self.running_blocks.get() + blocks);
        Some(Slot {
            engine: self,
            blocks,
        })
    }

    async fn decode_wait(&self, tokens: u64) {
        let d = self.config.decode_per_token * tokens as u32;
        if !d.is_zero() {
            monoio::time::sleep(d).await;
        }
    }

    async fn stream_tokens(
        &self,
        conn: &mut ClientConn,
        endpoint: Endpoint,
        streamed: &Streamed<'_>,
        abort_at: Option<u64>,
        head_sent: bool,
    ) -> bool {
        if !head_sent && conn.stream.write_all(STREAM_HEAD).await.0.is_err() {
            return false;
        }
        let Streamed {
            id,
            choices,
            usage,
            include_usage,
            continuous_usage,
        } = *streamed;
        // vLLM's continuous_usage_stats: every chunk carries the usage so far (its
        // choice's tokens; the role chunk 0).
        let chunk_usage = |event: &mut Vec<u8>, completion: u64| {
            if continuous_usage {
                let u = Usage {
                    prompt: usage.prompt,
                    completion,
                    cached: usage.cached,
                };
                let _ = write!(Utf8Vec(event), ",\"usage\":{}", u.json());
            }
        };
        let model = &self.config.model;
        let created = unix_now();
        let (prefix, object) = match endpoint {
            Endpoint::ChatCompletions => ("chatcmpl", "chat.completion.chunk"),
            Endpoint::Completions => ("cmpl", "text_completion"),
        };
        let mut event = Vec::with_capacity(512);
        let start = |event: &mut Vec<u8>| {
            let _ = write!(
                Utf8Vec(event),
                "data: {{\"id\":\"{prefix}-{id}\",\"object\":\"{object}\",\"created\":{created},\"model\":\"{model}\",\"choices\":["
            );
        };
        if endpoint == Endpoint::ChatCompletions {
            start(&mut event);
            for (k, c) in choices.iter().enumerate() {
                let sep = if k == 0 { "" } else { "," };
                let _ = write!(
                    Utf8Vec(&mut event),
                    "{sep}{{\"index\":{},\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}",
                    c.index
                );
            }
            event.push(b']');
            chunk_usage(&mut event, 0);
            event.extend_from_slice(b"}\n\n");
            if !send_chunk(&mut conn.stream, &mut event).await {
                return false;
            }
        }
        let steps = choices.iter().map(|c| c.pieces.len()).max().unwrap_or(0);
        for i in 0..steps {
            if abort_at == Some(i as u64) {
                return false; // drop the connection mid-stream
            }
            if !self.config.decode_per_token.is_zero() {
                monoio::time::sleep(self.config.decode_per_token).await;
            }
            // One event per choice still generating, as vLLM sends them.
            for c in choices.iter().filter(|c| i < c.pieces.len()) {
                start(&mut event);
                let mut text = Vec::new();
                if i == 0 {
                    text.extend_from_slice(c.echo.as_deref().unwrap_or("").as_bytes());
                }
                text.extend_from_slice(c.pieces[i].as_bytes());
                let text = String::from_utf8_lossy(&text);
                let key = match endpoint {
                    Endpoint::ChatCompletions => "\"delta\":{\"content\":",
                    Endpoint::Completions => "\"text\":",
                };
                let _ = write!(Utf8Vec(&mut event), "{{\"index\":{},{key}", c.index);
                crate::error::write_json_string(&mut event, &text);
                if endpoint == Endpoint::ChatCompletions {
                    event.push(b'}');
                }
                let finish = if i + 1 == c.pieces.len() {
                    format!("\"{}\"", c.finish_reason())
                } else {
                    "null".to_string()
                };
                let _ = write!(
                    Utf8Vec(&mut event),
                    ",\"logprobs\":null,\"finish_reason\":{finish}}}]"
                );
                chunk_usage(&mut event, i as u64 + 1);
                event.extend_from_slice(b"}\n\n");
                if !send_chunk(&mut conn.stream, &mut event).await {
                    return false;
                }
            }
        }
        if include_usage {
            let _ = write!(
                Utf8Vec(&mut event),
                "data: {{\"id\":\"{prefix}-{id}\",\"object\":\"{object}\",\"created\":{created},\"model\":\"{model}\",\"choices\":[],\"usage\":{}}}\n\n",
                usage.json()
            );
            if !send_chunk(&mut conn.stream, &mut event).await {
                return false;
            }
        }
        event.extend_from_slice(b"data: [DONE]\n\n");
        if !send_chunk(&mut conn.stream, &mut event).await {
            return false;
        }
        let (r, _) = conn.stream.write_all(&b"0\r\n\r\n"[..]).await;
        r.is_ok()
    }

    fn metrics(&self) -> String {
        let c = self.counters.borrow();
        let cache = self.cache.borrow();
        let labels = format!("engine=\"0\",model_name=\"{}\"", self.config.model);
        let usage = if cache.capacity() == 0 {
            0.0
        } else {
            (self.running_blocks.get() as f64 / cache.capacity() as f64).min(1.0)
        };
        let mut out = String::with_capacity(2048);
        let gauges = [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                self.running.get() as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                self.waiting.borrow().len() as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                usage,
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}"
            );
        }
        let counters = [
            (
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                c.prompt_tokens,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                c.cached_tokens,
            ),
            (
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
                c.prompt_tokens,
            ),
            (
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
                c.generation_tokens,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{labels}}} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",num_gpu_blocks=\"{}\"}} 1.0",
            self.config.block_tokens,
            self.config.cache_blocks
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\nvllm:request_success_total{{{labels},finished_reason=\"length\"}} {}",
            c.requests_ok
        );
        out
    }
}

struct Usage {
    prompt: u64,
    completion: u64,
    cached: u64,
}

impl Usage {
    fn json(&self) -> String {
        format!(
            "{{\"prompt_tokens\":{},\"total_tokens\":{},\"completion_tokens\":{},\"prompt_tokens_details\":{{\"cached_tokens\":{}}}}}",
            self.prompt,
            self.prompt + self.completion,
            self.completion,
            self.cached
        )
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What a streamed answer sends.
#[derive(Clone, Copy)]
struct Streamed<'a> {
    id: u64,
    choices: &'a [Choice<'a>],
    usage: &'a Usage,
    include_usage: bool,
    /// `usage` in every chunk too (`continuous_usage_stats`).
    continuous_usage: bool,
}

fn full_body(
    endpoint: Endpoint,
    model: &str,
    id: u64,
    choices: &[Choice],
    usage: &Usage,
) -> Vec<u8> {
    let created = unix_now();
    let (prefix, object) = match endpoint {
        Endpoint::ChatCompletions => ("chatcmpl", "chat.completion"),
        Endpoint::Completions => ("cmpl", "text_completion"),
    };
    let mut out = Vec::with_capacity(256);
    let _ = write!(
        Utf8Vec(&mut out),
        "{{\"id\":\"{prefix}-{id}\",\"object\":\"{object}\",\"created\":{created},\"model\":\"{model}\",\"choices\":["
    );
    for (k, c) in choices.iter().enumerate() {
        let mut text = c.echo.clone().unwrap_or_default();
        for p in &c.pieces {
            text.push_str(p);
        }
        let sep = if k == 0 { "" } else { "," };
        let _ = write!(Utf8Vec(&mut out), "{sep}{{\"index\":{},", c.index);
        match endpoint {
            Endpoint::ChatCompletions => {
                out.extend_from_slice(b"\"message\":{\"role\":\"assistant\",\"content\":");
                crate::error::write_json_string(&mut out, &text);
                out.push(b'}');
            }
            Endpoint::Completions => {
                out.extend_from_slice(b"\"text\":");
                crate::error::write_json_string(&mut out, &text);
            }
        }
        let _ = write!(
            Utf8Vec(&mut out),
            ",\"logprobs\":null,\"finish_reason\":\"{}\"}}",
            c.finish_reason()
        );
    }
    let _ = write!(Utf8Vec(&mut out), "],\"usage\":{}}}", usage.json());
    out
}

/// The `fixed_response` answer: a small, valid chat completion (an OpenAI client
/// reading it from `/v1/completions` gets `choices` and `usage` as well).
fn fixed_body(model: &str) -> Vec<u8> {
    format!(
        "{{\"id\":\"chatcmpl-fixed\",\"object\":\"chat.completion\",\"created\":0,\"model\":\"{model}\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"ok\"}},\"logprobs\":null,\"finish_reason\":\"stop\"}}],\"usage\":{{\"prompt_tokens\":1,\"total_tokens\":2,\"completion_tokens\":1}}}}"
    )
    .into_bytes()
}

/// Writes `event` as one HTTP chunk and clears it.
/// Runs `work` (prefill or decode time) unless the client closes the connection
/// first, as vLLM aborts a request whose client disconnected: false then, and the
/// caller drops the request (its batch slot with it). A streamed request notices
/// instead when a write fails.
async fn work_or_abort(conn: &ClientConn, work: impl std::future::Future<Output = ()>) -> bool {
    monoio::select! {
        biased;
        _ = work => true,
        _ = crate::http::io::peer_closed(conn.stream.tcp()) => false,
    }
}

async fn send_chunk(stream: &mut Stream, event: &mut Vec<u8>) -> bool {
    let mut chunk = Vec::with_capacity(event.len() + 12);
    let _ = write!(Utf8Vec(&mut chunk), "{:x}\r\n", event.len());
    chunk.extend_from_slice(event);
    chunk.extend_from_slice(b"\r\n");
    event.clear();
    let (r, _) = stream.write_all(chunk).await;
    r.is_ok()
}

async fn reply(
    stream: &mut Stream,
    status: u16,
    content_type: &str,
    body: Vec<u8>,
    keep_alive: bool,
) -> bool {
    let mut out = Vec::with_capacity(128 + body.len());
    let _ = write!(
        Utf8Vec(&mut out),
        "HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n{}\r\n",
        crate::error::reason_phrase(status),
        body.len(),
        if keep_alive {
            ""
        } else {
            "connection: close\r\n"
        }
    );
    out.extend_from_slice(&body);
    let (r, _) = stream.write_all(out).await;
    r.is_ok()
}

async fn reply_error(conn: &mut ClientConn, status: u16, message: &str, keep_alive: bool) -> bool {
    let mut body = Vec::new();
    body.extend_from_slice(b"{\"error\":{\"message\":");
    crate::error::write_json_string(&mut body, message);
    let kind = match status {
        400 => "BadRequestError",
        404 => "NotFoundError",
        _ => "ServiceUnavailableError",
    };
    let _ = write!(
        Utf8Vec(&mut body),
        ",\"type\":\"{kind}\",\"param\":null,\"code\":{status}}}}}"
    );
    reply(
        &mut conn.stream,
        status,
        "application/json",
        body,
        keep_alive,
    )
    .await
}
