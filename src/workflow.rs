//! `POST /v1/workflows`: runs a DAG of LLM calls on the shard that received it.
//!
//! The body is `{"nodes": [{"id", "model", "messages" | "prompt", "parents",
//! "params"}], "stream": bool}`. It is parsed and validated whole first (the
//! orchestrator's [`dag::plan`]): a malformed node, a duplicate id, an unknown parent,
//! a `{{id}}` reference to a node that is not a parent, a cycle or a limit
//! (`[workflows]`) is a 400 before any node runs. Then every node whose parents all
//! succeeded starts at once, beside the others in the workflow's task ([`crate::proxy::call`]): routed
//! like a client request, so the prefix index puts it where the prefixes it shares
//! with its parents live, and siblings (same parents) share a session key that keeps
//! them on the engine the first was placed on unless it saturates ([`sibling_group`]). A node's `{{parent}}` references are replaced by the parents' outputs
//! (JSON-escaped) just before it starts. A failed node fails its descendants and
//! leaves the rest running.
//!
//! A client that leaves (its socket closed while nodes run, or a failed write of a
//! streamed event) abandons the workflow: the running nodes' upstream requests are
//! dropped at once, so the engines stop working on them, no further node starts,
//! and the workflow is logged as 499 `client_closed`. No breaker is told.
//!
//! The answer lists every node's output, placement, timing and cache figures; with
//! `"stream": true` it is an SSE stream with one `workflow.node` event per node as it
//! finishes (or is failed by a parent), then the whole result, then `[DONE]`.

use crate::access_log::{AccessRecord, InlineId};
use crate::error::{write_json_string, ErrorKind, GatewayError, CLIENT_CLOSED};
use crate::http::io::peer_closed;
use crate::http::request::RequestHead;
use crate::metrics::RequestKey;
use crate::openai::Endpoint;
use crate::otlp::SpanKind;
use crate::proxy::abandon::Abandon;
use crate::proxy::call::{call, Call, CallFailed, Called};
use crate::shard::Shard;
use crate::tls::Stream;
use crate::trace::{ChildSpan, TraceContext};
use monoio::io::AsyncWriteRentExt;
use monoio::time::Instant;
use radixgate_orchestrator::dag::{self, NodeSpec, NodeState, Plan};
use serde_json::json;
use sonic_rs::{JsonContainerTrait, JsonValueTrait, Value};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::Poll;

/// Request members a node's `params` may not set (the node and the gateway own them).
const RESERVED_PARAMS: [&str; 5] = ["model", "messages", "prompt", "stream", "stream_options"];

/// One parsed node, its prompt kept as JSON text with `{{id}}` references in it.
struct Node {
    id: String,
    model: String,
    parents: Vec<String>,
    /// `messages` (a JSON array) or `prompt` (a JSON string), as JSON text.
    template: String,
    endpoint: Endpoint,
    /// The members of `params`, as JSON text without the braces (may be empty).
    params: String,
}

/// What became of one node.
#[derive(Default)]
struct Outcome {
    state: Option<NodeState>,
    output: Option<String>,
    error: Option<String>,
    backend: Option<usize>,
    reason: Option<&'static str>,
    matched_blocks: u32,
    status: u16,
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    started_ms: Option<f64>,
    finished_ms: Option<f64>,
}

/// Handles one workflow request; `Err` only before anything was written.
pub async fn serve(
    shard: &Rc<Shard>,
    client: &mut Stream,
    head: &RequestHead,
    body: &[u8],
    request_id: &str,
) -> Result<bool, GatewayError> {
    let received = Instant::now();
    // Keys, quotas and limits as of this snapshot, for the whole workflow.
    let live = shard.fleet.borrow().live.clone();
    let tenant = crate::proxy::authenticate(shard, &live, head)?;
    // Under tenant prefix isolation a tenant's nodes hash and cache apart, as its
    // own requests do.
    let tenant_seed = tenant
        .filter(|_| shard.shared.config.tenant_prefix_isolation)
        .map(|t| live.tenants.get(t).seed);
    let (nodes, stream) = parse(body)?;
    let limits = live.config.workflows.limits;
    let specs: Vec<NodeSpec<'_>> = nodes
        .iter()
        .map(|n| NodeSpec {
            id: &n.id,
            parents: n.parents.iter().map(String::as_str).collect(),
            references: dag::references(&n.template).collect(),
        })
        .collect();
    let plan = dag::plan(&specs, limits).map_err(|e| {
        let param = e
            .node()
            .map_or("nodes".to_string(), |i| format!("nodes[{i}]"));
        GatewayError::invalid_param(param, e.to_string())
    })?;
    drop(specs);
    // The tenant's quotas, as for its own requests: every node is a request, and the
    // tokens are estimated up front (prompt bytes / 4 + the default completion per
    // node; parents' outputs are not known yet) and reconciled with the nodes'
    // reported usage at the end. The workflow holds one concurrency slot.
    let now = shard.shared.now_ms();
    let admission = match tenant.map(|t| &**live.tenants.get(t)) {
        None => None,
        Some(t) => {
            let tokens: u64 = nodes
                .iter()
                .map(|n| n.template.len() as u64 / 4 + crate::proxy::DEFAULT_COMPLETION_ESTIMATE)
                .sum();
            match t.admit_many(nodes.len() as u64, tokens, now) {
                Ok(a) => Some(a),
                Err(throttle) => {
                    let refused = crate::proxy::Refused {
                        head,
                        request_id,
                        tenant,
                        started: received,
                    };
                    return crate::proxy::answer_throttle(shard, client, &refused, t, throttle)
                        .await;
                }
            }
        }
    };
    let keep_alive = head.keep_alive;
    let mut sink = Sink {
        client,
        stream,
        open: true,
    };
    if stream {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\nX-Request-Id: ",
        );
        out.extend_from_slice(request_id.as_bytes());
        out.extend_from_slice(b"\r\n");
        if !keep_alive {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        sink.write(out).await;
    }
    let started = Instant::now();
    let Ran {
        outcomes,
        client_left,
    } = run(
        shard,
        &nodes,
        &plan,
        (request_id, TraceContext::of(head)),
        tenant_seed,
        started,
        &mut sink,
    )
    .await;
    let result = render_result(shard, &nodes, &outcomes, request_id, started);
    if let Some(bucket) = admission.as_ref().and_then(|a| a.tenant.tokens.as_ref()) {
        let used: u64 = outcomes
            .iter()
            .map(|o| o.prompt_tokens.unwrap_or(0) + o.completion_tokens.unwrap_or(0))
            .sum();
        let charged = admission.as_ref().map_or(0, |a| a.charged_tokens);
        bucket.adjust(charged as i64 - used as i64, shard.shared.now_ms());
    }
    // Each node counted itself under its backend; the workflow counts once here.
    let status = if client_left { CLIENT_CLOSED } else { 200 };
    shard
        .metrics
        .borrow_mut()
        .count_request(RequestKey::gateway(status, "workflow"));
    if client_left {
        finish(shard, head, request_id, tenant, &outcomes, received, status);
        return Ok(false);
    }
    if stream {
        let mut event = b"data: ".to_vec();
        event.extend_from_slice(result.to_string().as_bytes());
        event.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        sink.event(&event).await;
        sink.write(b"0\r\n\r\n".to_vec()).await;
        finish(shard, head, request_id, tenant, &outcomes, received, 200);
        return Ok(sink.open && keep_alive);
    }
    let body = result.to_string().into_bytes();
    let mut out = Vec::with_capacity(body.len() + 160);
    out.extend_from_slice(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: ");
    out.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
    out.extend_from_slice(b"\r\nX-Request-Id: ");
    out.extend_from_slice(request_id.as_bytes());
    out.extend_from_slice(b"\r\n");
    if !keep_alive {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    sink.write(out).await;
    finish(shard, head, request_id, tenant, &outcomes, received, 200);
    Ok(sink.open && keep_alive)
}

/// The client side: a plain response, or SSE events as chunks. Once a write fails
/// the rest is dropped (the nodes still finish, so engines are not left half-fed).
struct Sink<'c> {
    client: &'c mut Stream,
    stream: bool,
    open: bool,
}

impl Sink<'_> {
    async fn write(&mut self, bytes: Vec<u8>) {
        if self.open {
            let (r, _) = self.client.write_all(bytes).await;
            self.open = r.is_ok();
        }
    }

    /// One SSE event (already `data: ...\n\n`) as one chunk.
    async fn event(&mut self, event: &[u8]) {
        if !self.stream {
            return;
        }
        let mut out = Vec::with_capacity(event.len() + 16);
        out.extend_from_slice(format!("{:x}\r\n", event.len()).as_bytes());
        out.extend_from_slice(event);
        out.extend_from_slice(b"\r\n");
        self.write(out).await;
    }
}

/// What [`run`] did: each node's outcome, and whether the client left meanwhile.
struct Ran {
    outcomes: Vec<Outcome>,
    client_left: bool,
}

/// A running node's call, polled in the workflow's own task.
type NodeCall<'a> = Pin<Box<dyn Future<Output = Result<Called, CallFailed>> + 'a>>;

/// Runs the plan: starts every ready node, waits for any to finish, fails the
/// descendants of a failed one, until nothing runs. Each node that runs has its own
/// span, a child of the workflow's request span in `cx`, which its upstream request
/// names as parent. While nodes run the client's socket is watched: if it closes
/// (or a streamed event cannot be written), the running nodes are abandoned and no
/// other node starts.
async fn run(
    shard: &Rc<Shard>,
    nodes: &[Node],
    plan: &Plan,
    (request_id, cx): (&str, TraceContext),
    tenant_seed: Option<u64>,
    started: Instant,
    sink: &mut Sink<'_>,
) -> Ran {
    let abandon = Abandon::default();
    let mut states = vec![NodeState::Waiting; nodes.len()];
    let mut outcomes: Vec<Outcome> = nodes.iter().map(|_| Outcome::default()).collect();
    let mut running: Vec<(usize, NodeCall<'_>)> = Vec::new();
    let mut spans: Vec<Option<ChildSpan>> = vec![None; nodes.len()];
    let max_bytes = (shard.fleet.borrow().live.config.workflows).max_node_response_bytes;
    loop {
        let ready: Vec<usize> = if abandon.is_abandoned() {
            Vec::new()
        } else {
            plan.ready(&states).collect()
        };
        for i in ready {
            states[i] = NodeState::Running;
            let body = node_body(&nodes[i], |id, out| {
                let parent = nodes.iter().position(|n| n.id == id);
                let text = parent
                    .and_then(|p| outcomes[p].output.as_deref())
                    .unwrap_or("");
                // JSON-escaped, without the quotes: the reference sits inside a string.
                let mut escaped = Vec::with_capacity(text.len() + 2);
                write_json_string(&mut escaped, text);
                out.push_str(std::str::from_utf8(&escaped[1..escaped.len() - 1]).unwrap_or(""));
            });
            outcomes[i].started_ms = Some(ms(started));
            let (shard, endpoint) = (shard.clone(), nodes[i].endpoint);
            let id = format!("{request_id}-{}", nodes[i].id);
            let group = sibling_group(request_id, &nodes[i]);
            spans[i] = crate::trace::start_child(&cx);
            let trace = (cx, crate::trace::id_of(spans[i]));
            let leave = abandon.watch();
            running.push((
                i,
                Box::pin(async move {
                    let what = Call {
                        endpoint,
                        body: &body,
                        request_id: &id,
                        max_bytes,
                        tenant_seed,
                        group,
                        trace,
                    };
                    call(&shard, what, leave).await
                }),
            ));
        }
        if running.is_empty() {
            break;
        }
        let watch_client = sink.open && !abandon.is_abandoned();
        let done = monoio::select! {
            done = first_done(&mut running) => Some(done),
            () = peer_closed(sink.client.tcp()), if watch_client => None,
        };
        let Some((slot, result)) = done else {
            // The client left: every running node ends at its next poll.
            sink.open = false;
            abandon.now();
            continue;
        };
        let (i, _) = running.swap_remove(slot);
        let o = &mut outcomes[i];
        o.finished_ms = Some(ms(started));
        let mut failure = "";
        let ok = match result {
            Ok(called) => {
                o.backend = Some(called.backend);
                o.reason = Some(called.reason.as_str());
                o.matched_blocks = called.matched_blocks;
                o.status = called.status;
                o.prompt_tokens = called.usage.prompt_tokens;
                o.cached_tokens = called.usage.cached_tokens;
                o.completion_tokens = called.usage.completion_tokens;
                match output_of(&called, nodes[i].endpoint) {
                    Ok(text) => {
                        o.output = Some(text);
                        true
                    }
                    Err(e) => {
                        o.error = Some(e);
                        false
                    }
                }
            }
            Err(CallFailed { error, backend }) => {
                o.backend = backend;
                o.status = error.status();
                failure = error.code();
                o.error = Some(error.message);
                false
            }
        };
        if let Some(mut span) = crate::trace::child(shard, SpanKind::Node, spans[i]) {
            span.backend = o.backend;
            span.status = o.status;
            span.reason = o.reason.unwrap_or(failure);
            span.id = Some(InlineId::new(&nodes[i].id));
            crate::trace::emit(shard, span);
        }
        states[i] = if ok {
            NodeState::Succeeded
        } else {
            NodeState::Failed
        };
        o.state = Some(states[i]);
        let mut finished = vec![i];
        if !ok {
            for d in plan.descendants(i) {
                if states[d] == NodeState::Waiting {
                    states[d] = NodeState::Failed;
                    outcomes[d].state = Some(NodeState::Failed);
                    outcomes[d].error =
                        Some(format!("not run: its ancestor `{}` failed", nodes[i].id));
                    finished.push(d);
                }
            }
        }
        for f in finished {
            let mut event = b"data: ".to_vec();
            let mut node = node_json(shard, &nodes[f], &outcomes[f]);
            node["object"] = json!("workflow.node");
            event.extend_from_slice(node.to_string().as_bytes());
            event.extend_from_slice(b"\n\n");
            sink.event(&event).await;
        }
        if !sink.open {
            abandon.now();
        }
    }
    let client_left = abandon.is_abandoned();
    if client_left {
        for (state, o) in states.iter().zip(&mut outcomes) {
            if *state == NodeState::Waiting {
                o.state = Some(NodeState::Failed);
                o.error = Some("not run: the client left".to_string());
            }
        }
    }
    Ran {
        outcomes,
        client_left,
    }
}

/// The workflow's access record and request span, once its answer is written (or
/// its client left: `status` 499): no one backend or model (each node's span names
/// its own), the nodes' token counts summed.
fn finish(
    shard: &Shard,
    head: &RequestHead,
    request_id: &str,
    tenant: Option<usize>,
    outcomes: &[Outcome],
    received: Instant,
    status: u16,
) {
    if shard.shared.access_log.is_none() && head.span_id == 0 {
        return;
    }
    let sum = |f: fn(&Outcome) -> Option<u64>| -> Option<u64> {
        outcomes.iter().filter_map(f).reduce(|a, b| a + b)
    };
    let record = AccessRecord {
        shard: shard.id,
        request_id: InlineId::new(request_id),
        trace_id: head.trace_id,
        tenant,
        model: None,
        policy: "",
        backend: None,
        reason: "workflow",
        matched_blocks: outcomes.iter().map(|o| o.matched_blocks).sum(),
        cached_tokens: sum(|o| o.cached_tokens),
        prompt_tokens: sum(|o| o.prompt_tokens),
        status,
        outcome: if status == CLIENT_CLOSED {
            "client_closed"
        } else {
            "completed"
        },
        ttft_us: None,
        total_us: received.elapsed().as_micros() as u64,
        retries: 0,
    };
    crate::trace::finish_request(shard, head, received.into_std(), &record);
    shard.log_access(record);
}

/// Siblings (nodes of one workflow with the same parents, a map step's fan-out) share
/// a session key, so they meet on the engine the first of them was placed on while it
/// has room, and the prefix they share (the step's instructions, the parents' output)
/// is computed once there. Launched together, each would otherwise see the first's
/// prefill still queued on that engine and, by estimated TTFT alone, spread out and
/// compute the shared prefix everywhere. Root nodes have no parents and no group.
fn sibling_group(request_id: &str, node: &Node) -> Option<u64> {
    if node.parents.is_empty() {
        return None;
    }
    let mut parents: Vec<&str> = node.parents.iter().map(String::as_str).collect();
    parents.sort_unstable();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(request_id.as_bytes());
    for p in parents {
        h.update(&[0]);
        h.update(p.as_bytes());
    }
    Some(h.digest())
}

/// Polls every running node; waits for whichever finishes first: its slot and
/// result.
async fn first_done(running: &mut [(usize, NodeCall<'_>)]) -> (usize, Result<Called, CallFailed>) {
    std::future::poll_fn(|cx| {
        for (slot, (_, call)) in running.iter_mut().enumerate() {
            if let Poll::Ready(r) = call.as_mut().poll(cx) {
                return Poll::Ready((slot, r));
            }
        }
        Poll::Pending
    })
    .await
}

/// Milliseconds since `since`, to the microsecond.
fn ms(since: Instant) -> f64 {
    since.elapsed().as_micros() as f64 / 1e3
}

/// The node's request body, its references rendered by `output`.
fn node_body(node: &Node, output: impl FnMut(&str, &mut String)) -> Vec<u8> {
    let mut rendered = String::with_capacity(node.template.len() + 256);
    dag::render(&node.template, &mut rendered, output);
    let mut body = Vec::with_capacity(rendered.len() + node.params.len() + 64);
    body.extend_from_slice(b"{\"model\":");
    write_json_string(&mut body, &node.model);
    body.extend_from_slice(match node.endpoint {
        Endpoint::ChatCompletions => b",\"messages\":",
        Endpoint::Completions => b",\"prompt\":",
    });
    body.extend_from_slice(rendered.as_bytes());
    body.extend_from_slice(b",\"stream\":false");
    if !node.params.is_empty() {
        body.push(b',');
        body.extend_from_slice(node.params.as_bytes());
    }
    body.push(b'}');
    body
}

/// The generated text of a node's response, or why there is none.
fn output_of(called: &Called, endpoint: Endpoint) -> Result<String, String> {
    if called.status != 200 {
        let detail = sonic_rs::from_slice::<Value>(&called.body)
            .ok()
            .and_then(|v| {
                v.get("error")
                    .and_then(|e| e.get("message"))
                    .and_then(|m| m.as_str().map(str::to_owned))
            })
            .unwrap_or_default();
        return Err(format!("the backend answered {}: {detail}", called.status));
    }
    let v: Value = sonic_rs::from_slice(&called.body)
        .map_err(|e| format!("the backend's response is not JSON: {e}"))?;
    let choice = v
        .get("choices")
        .and_then(|c| c.as_array())
        .and_then(|c| c.first());
    let text = match endpoint {
        Endpoint::ChatCompletions => choice
            .and_then(|c| c.get("message"))
            .and_then(|m| m.get("content"))
            .and_then(|t| t.as_str()),
        Endpoint::Completions => choice.and_then(|c| c.get("text")).and_then(|t| t.as_str()),
    };
    text.map(str::to_owned)
        .ok_or_else(|| "the backend's response has no generated text".to_string())
}

fn node_json(shard: &Shard, node: &Node, o: &Outcome) -> serde_json::Value {
    let backend = o.backend.map(|b| shard.backend_id(b));
    json!({
        "id": node.id,
        "status": match o.state {
            Some(NodeState::Succeeded) => "succeeded",
            Some(NodeState::Failed) => "failed",
            _ => "not_run",
        },
        "output": o.output,
        "error": o.error,
        "backend": backend,
        "reason": o.reason,
        "upstream_status": (o.status != 0).then_some(o.status),
        "matched_blocks": o.matched_blocks,
        "usage": {
            "prompt_tokens": o.prompt_tokens,
            "cached_tokens": o.cached_tokens,
            "completion_tokens": o.completion_tokens,
        },
        "started_ms": o.started_ms,
        "finished_ms": o.finished_ms,
    })
}

fn render_result(
    shard: &Shard,
    nodes: &[Node],
    outcomes: &[Outcome],
    request_id: &str,
    started: Instant,
) -> serde_json::Value {
    let failed = outcomes
        .iter()
        .filter(|o| o.state == Some(NodeState::Failed))
        .count();
    let status = match failed {
        0 => "succeeded",
        n if n == nodes.len() => "failed",
        _ => "partial",
    };
    let prompt: u64 = outcomes.iter().filter_map(|o| o.prompt_tokens).sum();
    let cached: u64 = outcomes.iter().filter_map(|o| o.cached_tokens).sum();
    json!({
        "id": format!("wf-{request_id}"),
        "object": "workflow",
        "status": status,
        "makespan_ms": ms(started),
        "usage": {"prompt_tokens": prompt, "cached_tokens": cached},
        "nodes": nodes
            .iter()
            .zip(outcomes)
            .map(|(n, o)| node_json(shard, n, o))
            .collect::<Vec<_>>(),
    })
}

/// Parses and checks the body's shape; the graph itself is checked by [`dag::plan`].
fn parse(body: &[u8]) -> Result<(Vec<Node>, bool), GatewayError> {
    if crate::openai::nesting_exceeds(body, crate::openai::MAX_JSON_DEPTH) {
        return Err(GatewayError::new(
            ErrorKind::MalformedJson,
            format!(
                "the request body nests deeper than {} levels",
                crate::openai::MAX_JSON_DEPTH
            ),
        ));
    }
    let value: Value = sonic_rs::from_slice(body).map_err(|e| {
        GatewayError::new(
            ErrorKind::MalformedJson,
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    if !value.is_object() {
        return Err(GatewayError::new(
            ErrorKind::MalformedJson,
            "the request body must be a JSON object",
        ));
    }
    let stream = match value.get("stream") {
        None => false,
        Some(v) if v.is_null() => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| GatewayError::invalid_param("stream", "`stream` must be a boolean"))?,
    };
    let list = value
        .get("nodes")
        .and_then(|n| n.as_array())
        .ok_or_else(|| GatewayError::invalid_param("nodes", "`nodes` must be an array"))?;
    let mut nodes = Vec::with_capacity(list.len());
    for (i, n) in list.iter().enumerate() {
        let bad = |key: &str, message: &str| {
            let param = if key.is_empty() {
                format!("nodes[{i}]")
            } else {
                format!("nodes[{i}].{key}")
            };
            GatewayError::invalid_param(param, message)
        };
        if !n.is_object() {
            return Err(bad("", "each node must be an object"));
        }
        let id = n
            .get("id")
            .and_then(|v| v.as_str())
            .filter(|id| dag::is_valid_id(id))
            .ok_or_else(|| {
                bad(
                    "id",
                    "`id` must be 1 to 64 letters, digits, `_`, `-` or `.`",
                )
            })?;
        let model = n
            .get("model")
            .and_then(|v| v.as_str())
            .ok_or_else(|| bad("model", "`model` must be a string"))?;
        let (template, endpoint) = match (n.get("messages"), n.get("prompt")) {
            (Some(m), None) if m.as_array().is_some_and(|a| !a.is_empty()) => {
                (m.to_string(), Endpoint::ChatCompletions)
            }
            (None, Some(p)) if p.as_str().is_some() => (p.to_string(), Endpoint::Completions),
            (Some(_), Some(_)) => {
                return Err(bad("", "give `messages` or `prompt`, not both"));
            }
            (Some(_), None) => {
                return Err(bad("messages", "`messages` must be a non-empty array"));
            }
            (None, Some(_)) => return Err(bad("prompt", "`prompt` must be a string")),
            (None, None) => return Err(bad("", "each node needs `messages` or `prompt`")),
        };
        let parents = match n.get("parents") {
            None => Vec::new(),
            Some(p) if p.is_null() => Vec::new(),
            Some(p) => {
                let list = p
                    .as_array()
                    .ok_or_else(|| bad("parents", "`parents` must be an array of node ids"))?;
                let mut parents = Vec::with_capacity(list.len());
                for v in list.iter() {
                    parents.push(
                        v.as_str()
                            .ok_or_else(|| {
                                bad("parents", "`parents` must be an array of node ids")
                            })?
                            .to_owned(),
                    );
                }
                parents
            }
        };
        let params = match n.get("params") {
            None => String::new(),
            Some(p) if p.is_null() => String::new(),
            Some(p) => {
                let object = p
                    .as_object()
                    .ok_or_else(|| bad("params", "`params` must be an object"))?;
                if let Some((k, _)) = object.iter().find(|(k, _)| RESERVED_PARAMS.contains(k)) {
                    return Err(bad(
                        "params",
                        &format!("`params` may not set `{k}` (the node sets it)"),
                    ));
                }
                let text = p.to_string();
                text[1..text.len() - 1].to_string()
            }
        };
        nodes.push(Node {
            id: id.to_owned(),
            model: model.to_owned(),
            parents,
            template,
            endpoint,
            params,
        });
    }
    Ok((nodes, stream))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_render_references_escaped_and_params_spliced() {
        let (nodes, stream) = parse(
            br#"{"stream":true,"nodes":[{"id":"a","model":"m","prompt":"x"},{"id":"b","model":"m","parents":["a"],"messages":[{"role":"user","content":"Sum up: {{a}}"}],"params":{"max_tokens":5}}]}"#,
        )
        .unwrap();
        assert!(stream);
        let body = node_body(&nodes[1], |id, out| {
            assert_eq!(id, "a");
            out.push_str("say \\\"hi\\\"");
        });
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["messages"][0]["content"], "Sum up: say \"hi\"");
        assert_eq!(v["max_tokens"], 5);
        assert_eq!(v["stream"], false);
        let prompt: serde_json::Value =
            serde_json::from_slice(&node_body(&nodes[0], |_, _| {})).unwrap();
        assert_eq!(prompt["prompt"], "x");
    }

    #[test]
    fn malformed_nodes_name_their_param() {
        let param = |b: &str| parse(b.as_bytes()).err().unwrap().param.unwrap();
        assert_eq!(param(r#"{"nodes":3}"#), "nodes");
        assert_eq!(
            param(r#"{"nodes":[{"id":"a b","model":"m","prompt":"x"}]}"#),
            "nodes[0].id"
        );
        assert_eq!(
            param(r#"{"nodes":[{"id":"a","prompt":"x"}]}"#),
            "nodes[0].model"
        );
        assert_eq!(
            param(r#"{"nodes":[{"id":"a","model":"m","prompt":"x","messages":[]}]}"#),
            "nodes[0]"
        );
        assert_eq!(
            param(r#"{"nodes":[{"id":"a","model":"m","prompt":"x","params":{"stream":true}}]}"#),
            "nodes[0].params"
        );
        assert_eq!(
            param(r#"{"nodes":[{"id":"a","model":"m","prompt":"x","parents":[1]}]}"#),
            "nodes[0].parents"
        );
        assert_eq!(param(r#"{"stream":1,"nodes":[]}"#), "stream");
    }
}
