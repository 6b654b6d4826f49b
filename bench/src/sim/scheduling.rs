//! `radixgate-bench sim --scheduling`: the workload-aware placements — RAG chunk
//! affinity and cache-aware DAG node placement — against round-robin, in simulated
//! time, running the orchestrator's own code: the gateway's [`Router`] (policy, chunk
//! affinity, session binding of a map step's siblings) over a [`Replica`], and
//! [`canonical_chunks`], [`render_context`], [`PromptHasher`].
//!
//! Each backend is one FIFO server with an [`EngineCache`] (the truth hit rates are
//! measured on): a request's service time is its uncached prompt tokens × the prefill
//! cost plus a fixed decode time; `in_flight` is the requests routed to it and not
//! finished. The router keeps its own [`Replica`], as a shard does.
//!
//! - **rag**: queries arrive every `RAG_GAP_NS`, each drawing `k` distinct chunks of a
//!   corpus of `N` with Zipf(α) popularity, normalised exactly as the gateway does
//!   (system text, then the chunks de-duplicated in canonical order, then the query).
//! - **map-reduce**: workflows arrive every `DAG_GAP_NS`: a split node (shared
//!   instructions + the workflow's document), `MAPS` map nodes that start when it
//!   finishes (instructions + document + their part), and a reduce node over the maps'
//!   outputs once all are done.
//!
//! Reported per placement: the engines' prompt-token hit rate (a vLLM-style prefix
//! cache: only the leading run of identical blocks is reused; it also sets the service
//! times), the makespan (last completion), and mean latency per request (RAG) or per
//! workflow (DAG). For RAG also the chunk reuse an engine would see if it cached
//! chunks position-independently (CacheBlend-style): the share of chunks sent to a
//! backend that had prefilled them among its last [`CHUNK_CACHE`].

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt::Write as _;
use std::num::NonZeroUsize;

use radixgate_orchestrator::rag::{canonical_chunks, render_context};
use radixgate_orchestrator::{
    ChunkIndex, EngineCache, FleetState, IndexConfig, MediaNeeds, PolicyConfig, PolicyName,
    PrefixIndex, PromptHasher, Replica, Router, RouterConfig, RoutingFacts, SessionTable,
};

const BACKENDS: usize = 4;
const CACHE_BLOCKS: usize = 1024;
const BLOCK_BYTES: usize = 64;
const TOKENS_PER_BLOCK: u64 = 16;
const PREFILL_NS_PER_TOKEN: u64 = 20_000;
const DECODE_NS: u64 = 15_000_000;

const CHUNKS: usize = 200;
const CHUNK_BYTES: usize = 512;
const CHUNKS_PER_QUERY: usize = 5;
const QUERIES: usize = 800;
const RAG_GAP_NS: u64 = 6_000_000;
/// One shared chunk is worth this many requests in flight (`routing.rag_chunk_weight`).
const CHUNK_WEIGHT: u32 = 2;

const WORKFLOWS: usize = 60;
const MAPS: usize = 4;
const DOC_BYTES: usize = 4096;
const INSTRUCTION_BYTES: usize = 1024;
const OUTPUT_BYTES: usize = 400;
const DAG_GAP_NS: u64 = 25_000_000;

/// How a run places requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    RoundRobin,
    /// `prefix_aware` with the prefix index.
    CacheAware,
    /// `prefix_aware` plus chunk affinity for RAG requests (the gateway's default).
    ChunkAffinity,
}

impl Placement {
    fn label(self) -> &'static str {
        match self {
            Placement::RoundRobin => "round_robin",
            Placement::CacheAware => "prefix_aware (prefix index only)",
            Placement::ChunkAffinity => "prefix_aware + chunk affinity",
        }
    }
}

/// The fleet and the router's beliefs about it.
struct Fleet {
    placement: Placement,
    policy: PolicyName,
    router: Router,
    replica: Replica,
    fleet: FleetState,
    caches: Vec<EngineCache>,
    free_at: Vec<u64>,
    finishes: Vec<Vec<u64>>,
    /// Per backend: (first-token time, predicted uncached tokens) of its requests
    /// without a first token yet, the gateway's pending prefill.
    pending: Vec<Vec<(u64, u32)>>,
    prompt_tokens: u64,
    cached_tokens: u64,
    last_finish: u64,
    /// Per backend, the chunk ids it recently prefilled (id → last use), at most
    /// [`CHUNK_CACHE`]: what a position-independent chunk cache would hold.
    chunk_caches: Vec<std::collections::HashMap<u64, u64>>,
    chunks_sent: u64,
    chunks_reused: u64,
    tick: u64,
}

/// Chunks a backend's KV cache holds when it caches chunks position-independently:
/// its blocks' worth of chunk text.
const CHUNK_CACHE: usize = CACHE_BLOCKS * BLOCK_BYTES / CHUNK_BYTES;

impl Fleet {
    fn new(placement: Placement, seed: u64) -> Self {
        let name = match placement {
            Placement::RoundRobin => PolicyName::RoundRobin,
            _ => PolicyName::PrefixAware,
        };
        let mut config = PolicyConfig::default();
        config.prefix.tokens_per_block = TOKENS_PER_BLOCK as f64;
        config.prefix.default_prefill_ns_per_token = PREFILL_NS_PER_TOKEN as u32;
        let mut index = PrefixIndex::new(IndexConfig {
            max_blocks: BACKENDS * CACHE_BLOCKS * 2,
        });
        for b in 0..BACKENDS {
            index.set_capacity(b, CACHE_BLOCKS);
        }
        let router = RouterConfig {
            policy: config,
            rag_chunk_weight: CHUNK_WEIGHT,
            ..RouterConfig::default()
        };
        Self {
            placement,
            policy: name,
            router: Router::new(router, seed),
            replica: Replica::new(
                index,
                SessionTable::new(u64::MAX, usize::MAX),
                ChunkIndex::new(1 << 16),
            ),
            fleet: FleetState::healthy(BACKENDS),
            caches: (0..BACKENDS)
                .map(|_| EngineCache::new(CACHE_BLOCKS))
                .collect(),
            free_at: vec![0; BACKENDS],
            finishes: vec![Vec::new(); BACKENDS],
            pending: vec![Vec::new(); BACKENDS],
            prompt_tokens: 0,
            cached_tokens: 0,
            last_finish: 0,
            chunk_caches: vec![Default::default(); BACKENDS],
            chunks_sent: 0,
            chunks_reused: 0,
            tick: 0,
        }
    }

    /// Routes and runs one request arriving at `t`; returns its finish time and
    /// backend. `group`: its session (a workflow's sibling group), as the gateway
    /// hashes it.
    fn submit(
        &mut self,
        t: u64,
        blocks: &[u64],
        chunks: &[u64],
        group: Option<u64>,
    ) -> (u64, usize) {
        for (b, state) in self.fleet.states.iter_mut().enumerate() {
            self.finishes[b].retain(|&f| f > t);
            self.pending[b].retain(|&(first, _)| first > t);
            state.in_flight = self.finishes[b].len() as u32;
            state.pending_prefill_tokens = self.pending[b].iter().map(|&(_, n)| n).sum();
        }
        let now_ms = t / 1_000_000;
        let routed_chunks = if self.placement == Placement::ChunkAffinity {
            chunks
        } else {
            &[]
        };
        let facts = RoutingFacts {
            model: 0,
            adapter: None,
            policy: self.policy,
            blocks,
            affinity_key: blocks.first().copied(),
            media: &MediaNeeds::TEXT_ONLY,
            session: group,
            chunks: routed_chunks,
            excluded: &[],
        };
        let mut decision = self
            .router
            .decide(&self.replica, &self.fleet, &facts, now_ms)
            .expect("a fleet");
        for op in decision.ops.take() {
            self.replica.apply(&op);
        }
        let backend = decision.pick.backend;
        let predicted_uncached = decision.uncached_tokens;
        let held = &mut self.chunk_caches[backend];
        for id in chunks {
            self.tick += 1;
            self.chunks_sent += 1;
            if held.insert(*id, self.tick).is_some() {
                self.chunks_reused += 1;
            } else if held.len() > CHUNK_CACHE {
                let oldest = held.iter().min_by_key(|(_, t)| **t).map(|(id, _)| *id);
                if let Some(oldest) = oldest {
                    held.remove(&oldest);
                }
            }
        }
        let cache = &mut self.caches[backend];
        let hit = cache.matched(blocks) as u64;
        cache.touch(blocks);
        let tokens = blocks.len() as u64 * TOKENS_PER_BLOCK;
        self.prompt_tokens += tokens;
        self.cached_tokens += hit * TOKENS_PER_BLOCK;
        let prefill = (tokens - hit * TOKENS_PER_BLOCK) * PREFILL_NS_PER_TOKEN;
        let start = t.max(self.free_at[backend]);
        let finish = start + prefill + DECODE_NS;
        self.free_at[backend] = finish;
        self.finishes[backend].push(finish);
        self.pending[backend].push((start + prefill, predicted_uncached));
        self.last_finish = self.last_finish.max(finish);
        (finish, backend)
    }

    fn hit_rate(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }

    /// The share of chunks sent to an engine that had prefilled them recently: the
    /// hit rate of an engine that reuses chunks' KV wherever they sit in the prompt.
    fn chunk_reuse(&self) -> f64 {
        self.chunks_reused as f64 / self.chunks_sent.max(1) as f64
    }
}

/// The chat prompt's blocks, hashed as the gateway hashes a body's messages.
fn blocks_of(messages: &[(&str, &str)]) -> Vec<u64> {
    let mut h = PromptHasher::new(NonZeroUsize::new(BLOCK_BYTES).expect("non-zero"));
    h.reset(radixgate_orchestrator::model_seed("sim"));
    for (role, content) in messages {
        h.feed_message(role, None, content);
    }
    h.blocks().to_vec()
}

fn text(rng: &mut fastrand::Rng, tag: &str, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        let _ = write!(s, "{tag}-{} ", rng.u32(..100_000));
    }
    s
}

/// One RAG query: its messages' blocks and its chunk ids.
struct Query {
    blocks: Vec<u64>,
    chunk_ids: Vec<u64>,
}

fn rag_queries(seed: u64, alpha: f64) -> Vec<Query> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let corpus: Vec<String> = (0..CHUNKS)
        .map(|i| text(&mut rng, &format!("c{i}"), CHUNK_BYTES))
        .collect();
    let weights: Vec<f64> = (1..=CHUNKS).map(|r| 1.0 / (r as f64).powf(alpha)).collect();
    let total: f64 = weights.iter().sum();
    let draw = |rng: &mut fastrand::Rng| {
        let mut x = rng.f64() * total;
        for (i, w) in weights.iter().enumerate() {
            x -= w;
            if x <= 0.0 {
                return i;
            }
        }
        CHUNKS - 1
    };
    (0..QUERIES)
        .map(|q| {
            let mut picked: Vec<usize> = Vec::with_capacity(CHUNKS_PER_QUERY);
            while picked.len() < CHUNKS_PER_QUERY {
                let c = draw(&mut rng);
                if !picked.contains(&c) {
                    picked.push(c);
                }
            }
            let canonical = canonical_chunks(picked.iter().map(|&c| corpus[c].as_str()));
            let context = render_context(Some("Answer from the context."), &canonical);
            let query = format!("question {q}: {}", rng.u32(..1_000_000));
            Query {
                blocks: blocks_of(&[("system", &context), ("user", &query)]),
                chunk_ids: canonical.iter().map(|(id, _)| *id).collect(),
            }
        })
        .collect()
}

/// One RAG run: (hit rate, makespan ms, mean latency ms, chunk reuse).
fn rag_run(placement: Placement, queries: &[Query], seed: u64) -> (f64, f64, f64, f64) {
    let mut fleet = Fleet::new(placement, seed);
    let mut latency = 0u64;
    for (i, q) in queries.iter().enumerate() {
        let t = i as u64 * RAG_GAP_NS;
        let (finish, _) = fleet.submit(t, &q.blocks, &q.chunk_ids, None);
        latency += finish - t;
    }
    (
        fleet.hit_rate(),
        fleet.last_finish as f64 / 1e6,
        latency as f64 / queries.len() as f64 / 1e6,
        fleet.chunk_reuse(),
    )
}

/// One workflow's prompts, as blocks: the split, the maps, and the reduce (which
/// depends on the maps' outputs, drawn up front).
struct Workflow {
    split: Vec<u64>,
    maps: Vec<Vec<u64>>,
    reduce: Vec<u64>,
}

fn workflows(seed: u64) -> Vec<Workflow> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let instructions = text(&mut rng, "rule", INSTRUCTION_BYTES);
    let reduce_instructions = text(&mut rng, "join", INSTRUCTION_BYTES / 4);
    (0..WORKFLOWS)
        .map(|w| {
            let doc = text(&mut rng, &format!("d{w}"), DOC_BYTES);
            let system = format!("{instructions}\n{doc}");
            let split = blocks_of(&[("system", &system), ("user", "Split into parts.")]);
            let maps = (0..MAPS)
                .map(|m| {
                    blocks_of(&[
                        ("system", &system),
                        ("user", &format!("Summarise part {m}.")),
                    ])
                })
                .collect();
            let outputs: Vec<String> = (0..MAPS)
                .map(|m| text(&mut rng, &format!("o{w}.{m}"), OUTPUT_BYTES))
                .collect();
            let reduce = blocks_of(&[
                ("system", &reduce_instructions),
                ("user", &outputs.join("\n")),
            ]);
            Workflow {
                split,
                maps,
                reduce,
            }
        })
        .collect()
}

/// One map-reduce run: (hit rate, makespan ms, mean workflow latency ms).
fn dag_run(placement: Placement, flows: &[Workflow], seed: u64) -> (f64, f64, f64) {
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Step {
        Split(usize),
        Maps(usize),
        Reduce(usize),
        Done(usize),
    }
    let mut fleet = Fleet::new(placement, seed);
    let mut events: BinaryHeap<Reverse<(u64, u64, Step)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |events: &mut BinaryHeap<Reverse<(u64, u64, Step)>>, t: u64, step: Step| {
        seq += 1;
        events.push(Reverse((t, seq, step)));
    };
    for w in 0..flows.len() {
        push(&mut events, w as u64 * DAG_GAP_NS, Step::Split(w));
    }
    let mut latency = 0u64;
    while let Some(Reverse((t, _, step))) = events.pop() {
        match step {
            Step::Split(w) => {
                let (done, _) = fleet.submit(t, &flows[w].split, &[], None);
                push(&mut events, done, Step::Maps(w));
            }
            Step::Maps(w) => {
                // Siblings share a session key, as in the gateway (`src/workflow.rs`):
                // the first one's backend is their home.
                let mut done = t;
                for m in &flows[w].maps {
                    let (finish, _) = fleet.submit(t, m, &[], Some(w as u64));
                    done = done.max(finish);
                }
                push(&mut events, done, Step::Reduce(w));
            }
            Step::Reduce(w) => {
                let (done, _) = fleet.submit(t, &flows[w].reduce, &[], None);
                push(&mut events, done, Step::Done(w));
            }
            Step::Done(w) => latency += t - w as u64 * DAG_GAP_NS,
        }
    }
    (
        fleet.hit_rate(),
        fleet.last_finish as f64 / 1e6,
        latency as f64 / flows.len() as f64 / 1e6,
    )
}

/// Both experiments as Markdown tables.
pub fn report(seed: u64) -> String {
    let mut out = String::new();
    for alpha in [0.6, 1.2] {
        let queries = rag_queries(seed, alpha);
        let _ = writeln!(
            out,
            "### RAG: {QUERIES} queries, {CHUNKS_PER_QUERY} of {CHUNKS} chunks ({CHUNK_BYTES} B) each, Zipf α = {alpha}, one every {} ms; {BACKENDS} backends × {CACHE_BLOCKS} blocks, seed {seed}\n",
            RAG_GAP_NS / 1_000_000
        );
        let _ = writeln!(
            out,
            "| placement | engine hit rate (prefix cache) | makespan ms | mean latency ms | chunk reuse (position-independent cache) |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|");
        for p in [
            Placement::RoundRobin,
            Placement::CacheAware,
            Placement::ChunkAffinity,
        ] {
            let (hit, makespan, mean, reuse) = rag_run(p, &queries, seed);
            let _ = writeln!(
                out,
                "| {} | {:.1}% | {makespan:.0} | {mean:.1} | {:.1}% |",
                p.label(),
                hit * 100.0,
                reuse * 100.0
            );
        }
        out.push('\n');
    }
    let flows = workflows(seed);
    let _ = writeln!(
        out,
        "### Map-reduce DAG: {WORKFLOWS} workflows (split → {MAPS} maps over a {DOC_BYTES} B document → reduce), one every {} ms; {BACKENDS} backends × {CACHE_BLOCKS} blocks, seed {seed}\n",
        DAG_GAP_NS / 1_000_000
    );
    let _ = writeln!(
        out,
        "| placement | engine hit rate | makespan ms | mean workflow latency ms |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|");
    for p in [Placement::RoundRobin, Placement::CacheAware] {
        let (hit, makespan, mean) = dag_run(p, &flows, seed);
        let _ = writeln!(
            out,
            "| {} | {:.1}% | {makespan:.0} | {mean:.1} |",
            p.label(),
            hit * 100.0
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_aware_placement_beats_round_robin() {
        let queries = rag_queries(1, 1.2);
        let (rr_hit, _, _, rr_reuse) = rag_run(Placement::RoundRobin, &queries, 1);
        let (_, _, _, prefix_reuse) = rag_run(Placement::CacheAware, &queries, 1);
        let (ca_hit, _, _, ca_reuse) = rag_run(Placement::ChunkAffinity, &queries, 1);
        assert!(ca_hit > rr_hit, "{ca_hit} vs {rr_hit}");
        // Chunk affinity is what raises position-independent chunk reuse.
        assert!(
            ca_reuse > prefix_reuse && ca_reuse > rr_reuse,
            "{ca_reuse} {prefix_reuse} {rr_reuse}"
        );
        let flows = workflows(1);
        let (rr_hit, rr_span, _) = dag_run(Placement::RoundRobin, &flows, 1);
        let (ca_hit, ca_span, _) = dag_run(Placement::CacheAware, &flows, 1);
        assert!(ca_hit > rr_hit, "{ca_hit} vs {rr_hit}");
        assert!(ca_span <= rr_span, "{ca_span} vs {rr_span}");
        // Deterministic by seed.
        assert_eq!(
            dag_run(Placement::CacheAware, &flows, 1),
            dag_run(Placement::CacheAware, &flows, 1)
        );
    }
}
