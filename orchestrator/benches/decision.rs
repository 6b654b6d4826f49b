//! One routing decision, as a shard makes it per request: render the chat prompt into
//! the canonical stream and hash it ([`PromptHasher`]), look the blocks up in the
//! prefix index ([`PrefixIndex::match_prefix`]), fill the candidates and pick
//! ([`RoutingPolicy::pick`]), and, in the `decide+insert` variant, record the pick
//! ([`PrefixIndex::insert`]).
//!
//! Prompts are a system message (384 bytes, shared with much of the index) plus a user
//! message, 1 KB to 128 KB of content in all. Indexes hold 10^4, 10^5 and 10^6 blocks
//! of filler documents spread over 8 backends, plus one document per prompt size that
//! shares the first half of that prompt's user message (held whole by backends 1 and
//! 5, its first quarter by backend 3), so every query is partly cached.
//!
//! After the criterion run the binary counts allocations per decision in steady state
//! (a counting global allocator; after a warm-up) for every case, plus a case the
//! criterion run leaves out: `insert-new-tail`, where each request ends in a new block
//! (a fresh question), so the insert must add a node. That case is timed with
//! `Instant` over a fixed run, because the index grows by one leaf per request and a
//! criterion run of unbounded length would measure a different index at its end.
//!
//! Run: `cargo bench -p radixgate-orchestrator --bench decision -- --warm-up-time 1
//! --measurement-time 2`. Without `--bench` (as `cargo test --benches` runs it) only the
//! smallest index is built and each case runs once.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;
use std::num::NonZeroUsize;
use std::time::Instant;

use criterion::{BenchmarkId, Criterion, Throughput};
use radixgate_orchestrator::{
    build_policy, model_seed, Candidate, IndexConfig, Pick, Policy, PolicyConfig, PolicyName,
    PrefixIndex, PrefixMatch, PromptHasher, RouteInput, RoutingPolicy,
};

// === counting allocator ===

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
    static BYTES: Cell<u64> = const { Cell::new(0) };
}

fn count(bytes: usize) {
    ALLOCS.with(|a| a.set(a.get() + 1));
    BYTES.with(|b| b.set(b.get() + bytes as u64));
}

// SAFETY: forwards every call unchanged to the system allocator; the counters are
// const-initialised thread-local `Cell`s, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// (allocations, bytes requested) so far on this thread.
fn allocated() -> (u64, u64) {
    (ALLOCS.with(Cell::get), BYTES.with(Cell::get))
}

// === workload ===

const BACKENDS: usize = 8;
/// Requests in flight per backend, as the shard would see them.
const IN_FLIGHT: [u32; BACKENDS] = [3, 4, 2, 5, 3, 2, 6, 4];
const SYSTEM_BYTES: usize = 384;
const SYSTEM_PROMPTS: usize = 4;
const PROMPT_KB: [usize; 4] = [1, 4, 32, 128];
const INDEX_BLOCKS: [(usize, &str); 3] = [(10_000, "1e4"), (100_000, "1e5"), (1_000_000, "1e6")];
const BLOCK_BYTES: usize = 64;
/// Where a query's 16-byte question id sits: inside its last complete block (the
/// canonical stream has 15 bytes of roles and separators, so a prompt whose content is
/// a multiple of 64 bytes ends in a 15-byte partial block).
const ID_FROM_END: usize = 40;

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
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "cache",
    "request",
    "model",
    "token",
    "prefix",
    "backend",
    "latency",
    "engine",
    "memory",
    "router",
    "document",
    "answer",
    "question",
    "section",
    "report",
    "policy",
    "network",
    "contract",
    "shipment",
    "invoice",
    "customer",
    "quarterly",
    "revenue",
    "growth",
    "analysis",
    "summary",
    "function",
    "variable",
    "return",
    "error",
    "value",
    "table",
    "column",
    "index",
    "migration",
    "deployment",
    "cluster",
    "throughput",
    "regression",
    "baseline",
    "measurement",
    "experiment",
    "hypothesis",
    "agreement",
    "liability",
    "obligation",
    "termination",
    "clause",
    "party",
    "schedule",
    "patient",
    "dosage",
    "symptom",
    "treatment",
    "diagnosis",
    "history",
    "chapter",
    "river",
    "mountain",
    "village",
    "winter",
    "harvest",
    "letter",
    "journey",
    "because",
    "however",
    "therefore",
    "although",
    "between",
    "without",
    "during",
    "against",
    "within",
    "through",
];

/// Plain English-looking ASCII text of exactly `len` bytes: words, sentences,
/// paragraphs.
fn text(rng: &mut fastrand::Rng, len: usize) -> String {
    let mut s = String::with_capacity(len + 32);
    let mut in_sentence = 0;
    while s.len() < len {
        let w = WORDS[rng.usize(..WORDS.len())];
        if in_sentence == 0 {
            let mut c = w.chars();
            if let Some(first) = c.next() {
                s.push(first.to_ascii_uppercase());
                s.push_str(c.as_str());
            }
        } else {
            s.push_str(w);
        }
        in_sentence += 1;
        if in_sentence > 6 && rng.u8(..8) == 0 {
            s.push_str(if rng.u8(..5) == 0 { ".\n\n" } else { ". " });
            in_sentence = 0;
        } else if rng.u8(..12) == 0 {
            s.push_str(", ");
        } else {
            s.push(' ');
        }
    }
    s.truncate(len);
    s
}

/// A request to route: `system` and `user` rendered as two chat messages, the bytes
/// `user[id]` being the question id the `insert-new-tail` case rewrites.
struct Query {
    kb: usize,
    system: String,
    user: String,
    id: std::ops::Range<usize>,
}

impl Query {
    fn bytes(&self) -> usize {
        self.system.len() + self.user.len()
    }
}

/// The fixed part of every index: the system prompts, the queries, and per query the
/// document that shares half of it.
struct Corpus {
    systems: Vec<String>,
    queries: Vec<Query>,
    /// Per query: the whole shared document's chain and its first quarter.
    targets: Vec<(Vec<u64>, Vec<u64>)>,
}

fn seed() -> u64 {
    model_seed("bench-model")
}

fn hasher() -> PromptHasher {
    PromptHasher::new(NonZeroUsize::new(BLOCK_BYTES).expect("non-zero"))
}

fn chain(h: &mut PromptHasher, system: &str, user: &str) -> Vec<u64> {
    h.reset(seed());
    h.feed_message("system", None, system);
    h.feed_message("user", None, user);
    h.blocks().to_vec()
}

impl Corpus {
    fn new() -> Self {
        let mut rng = fastrand::Rng::with_seed(7);
        let systems: Vec<String> = (0..SYSTEM_PROMPTS)
            .map(|_| text(&mut rng, SYSTEM_BYTES))
            .collect();
        let mut h = hasher();
        let mut queries = Vec::new();
        let mut targets = Vec::new();
        for kb in PROMPT_KB {
            let user_len = kb * 1024 - SYSTEM_BYTES;
            let shared = text(&mut rng, user_len / 2);
            let user = shared.clone() + &text(&mut rng, user_len - user_len / 2);
            let doc = shared.clone() + &text(&mut rng, 1024);
            let quarter = &shared[..shared.len() / 2];
            targets.push((
                chain(&mut h, &systems[0], &doc),
                chain(&mut h, &systems[0], quarter),
            ));
            let id = user_len - ID_FROM_END..user_len - ID_FROM_END + 16;
            queries.push(Query {
                kb,
                system: systems[0].clone(),
                user,
                id,
            });
        }
        Self {
            systems,
            queries,
            targets,
        }
    }

    /// An index of about `blocks` blocks: filler documents (1–16 KB after one of the
    /// system prompts, each on one or two random backends) up to the bound, then the
    /// queries' shared documents, newest.
    fn index(&self, blocks: usize) -> PrefixIndex {
        let mut index = PrefixIndex::new(IndexConfig { max_blocks: blocks });
        for b in 0..BACKENDS {
            index.set_capacity(b, blocks / 2);
        }
        let mut rng = fastrand::Rng::with_seed(blocks as u64);
        let mut h = hasher();
        let target_blocks: usize = self.targets.iter().map(|(t, _)| t.len()).sum();
        let mut now = 0;
        while index.total_blocks() + target_blocks < blocks {
            let system = &self.systems[rng.usize(..SYSTEM_PROMPTS)];
            let len = rng.usize(1024..16 * 1024);
            let doc = text(&mut rng, len);
            let c = chain(&mut h, system, &doc);
            now += 1;
            let first = rng.usize(..BACKENDS);
            index.insert(first, &c, now);
            if rng.bool() {
                index.insert((first + 1 + rng.usize(..BACKENDS - 1)) % BACKENDS, &c, now);
            }
        }
        for (whole, quarter) in &self.targets {
            now += 1;
            index.insert(1, whole, now);
            index.insert(5, whole, now);
            index.insert(3, quarter, now);
        }
        index
    }
}

// === the decision ===

/// A shard's per-request state, reused across requests as the gateway does.
struct Router {
    hasher: PromptHasher,
    matches: PrefixMatch,
    candidates: Vec<Candidate>,
    policy: Policy,
    rng: fastrand::Rng,
    now: u64,
}

impl Router {
    fn new(policy: PolicyName) -> Self {
        let config = PolicyConfig {
            backend_ids: (0..BACKENDS).map(|i| format!("engine-{i}")).collect(),
            ..PolicyConfig::default()
        };
        Self {
            hasher: hasher(),
            matches: PrefixMatch::default(),
            candidates: Vec::with_capacity(BACKENDS),
            policy: build_policy(policy, &config),
            rng: fastrand::Rng::with_seed(42),
            // Newer than anything the index was filled with.
            now: 1 << 32,
        }
    }

    /// Render + hash + match + fill candidates + pick. The user message is fed in three
    /// pieces around the question id, which yields the same canonical stream as one.
    #[inline]
    fn decide(&mut self, index: &PrefixIndex, q: &Query, question: &[u8]) -> Pick {
        let h = &mut self.hasher;
        h.reset(seed());
        h.feed_message("system", None, &q.system);
        h.feed_message("user", None, &q.user[..q.id.start]);
        h.feed(question);
        h.feed(&q.user.as_bytes()[q.id.end..]);
        index.match_prefix(h.blocks(), &mut self.matches);
        self.candidates.clear();
        for (backend, &in_flight) in IN_FLIGHT.iter().enumerate() {
            self.candidates.push(Candidate {
                backend,
                in_flight,
                matched_blocks: self.matches.matched.get(backend).copied().unwrap_or(0),
                ..Candidate::default()
            });
        }
        let input = RouteInput {
            candidates: &self.candidates,
            affinity_key: h.affinity_key(),
            prompt_blocks: h.blocks().len() as u32,
            ..RouteInput::default()
        };
        self.policy
            .pick(&input, &mut self.rng)
            .expect("there are candidates")
    }

    /// [`decide`](Self::decide), then record the pick in the index as the shard does.
    #[inline]
    fn decide_insert(&mut self, index: &mut PrefixIndex, q: &Query, question: &[u8]) -> Pick {
        let pick = self.decide(index, q, question);
        self.now += 1;
        index.insert(pick.backend, self.hasher.blocks(), self.now);
        pick
    }
}

// === cases ===

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// No index update: the index stays as filled (query partly cached).
    Decide,
    /// The same prompt again and again: after the first, the insert only touches an
    /// existing prefix.
    DecideInsert,
    /// Each request a new question id: the insert adds one new block (a new leaf).
    InsertNewTail,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Decide => "decide",
            Variant::DecideInsert => "decide+insert",
            Variant::InsertNewTail => "decide+insert-new-tail",
        }
    }
}

const POLICIES: [PolicyName; 2] = [PolicyName::PrefixAware, PolicyName::RoundRobin];

fn question_id(q: &Query) -> [u8; 16] {
    q.user.as_bytes()[q.id.clone()]
        .try_into()
        .expect("16 bytes")
}

fn fresh_id(n: u64) -> [u8; 16] {
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = b"0123456789abcdef"[(n >> (60 - 4 * i) & 0xf) as usize];
    }
    id
}

fn criterion_cases(c: &mut Criterion, corpus: &Corpus, index: &PrefixIndex, label: &str) {
    let mut group = c.benchmark_group(format!("index_{label}"));
    for q in &corpus.queries {
        group.throughput(Throughput::Bytes(q.bytes() as u64));
        let id = question_id(q);
        for policy in POLICIES {
            let mut router = Router::new(policy);
            group.bench_function(
                BenchmarkId::new(format!("{policy}/decide"), format!("{}KB", q.kb)),
                |b| b.iter(|| router.decide(black_box(index), black_box(q), &id)),
            );
            let mut index = index.clone();
            let mut router = Router::new(policy);
            group.bench_function(
                BenchmarkId::new(format!("{policy}/decide+insert"), format!("{}KB", q.kb)),
                |b| b.iter(|| router.decide_insert(black_box(&mut index), black_box(q), &id)),
            );
        }
    }
    group.finish();
}

struct AllocRow {
    label: &'static str,
    kb: usize,
    policy: PolicyName,
    variant: Variant,
    allocs: f64,
    bytes: f64,
    /// Mean ns per decision over the counted run (only reported for the new-tail case).
    ns: f64,
}

/// The decision's parts on their own, for one index: render + hash, match, pick.
fn part_cases(c: &mut Criterion, corpus: &Corpus, index: &PrefixIndex, label: &str) {
    let mut group = c.benchmark_group(format!("parts_{label}"));
    let mut h = hasher();
    for q in &corpus.queries {
        group.throughput(Throughput::Bytes(q.bytes() as u64));
        group.bench_function(
            BenchmarkId::new("render+hash", format!("{}KB", q.kb)),
            |b| {
                b.iter(|| {
                    h.reset(seed());
                    h.feed_message("system", None, black_box(&q.system));
                    h.feed_message("user", None, black_box(&q.user));
                    h.blocks().len()
                })
            },
        );
        let blocks = chain(&mut h, &q.system, &q.user);
        let mut out = PrefixMatch::default();
        group.bench_function(BenchmarkId::new("match", format!("{}KB", q.kb)), |b| {
            b.iter(|| {
                index.match_prefix(black_box(&blocks), &mut out);
                out.longest
            })
        });
    }
    group.throughput(Throughput::Elements(1));
    for policy in POLICIES {
        let q = &corpus.queries[1];
        let mut router = Router::new(policy);
        router.decide(index, q, &question_id(q));
        let candidates = router.candidates.clone();
        let prompt_blocks = router.hasher.blocks().len() as u32;
        let affinity_key = router.hasher.affinity_key();
        group.bench_function(BenchmarkId::new("pick", policy), |b| {
            b.iter(|| {
                let input = RouteInput {
                    candidates: black_box(&candidates),
                    affinity_key,
                    prompt_blocks,
                    ..RouteInput::default()
                };
                router.policy.pick(&input, &mut router.rng)
            })
        });
    }
    group.finish();
}

/// Steady-state allocations per decision (after `warm` requests, over `runs`).
fn alloc_rows(
    corpus: &Corpus,
    index: &PrefixIndex,
    label: &'static str,
    quick: bool,
) -> Vec<AllocRow> {
    let (warm, runs) = if quick { (2, 4) } else { (200, 1000) };
    let mut rows = Vec::new();
    for q in &corpus.queries {
        let id = question_id(q);
        for policy in POLICIES {
            for variant in [
                Variant::Decide,
                Variant::DecideInsert,
                Variant::InsertNewTail,
            ] {
                let mut index = index.clone();
                let mut router = Router::new(policy);
                let mut n = 0u64;
                let mut step = |router: &mut Router, index: &mut PrefixIndex| {
                    n += 1;
                    match variant {
                        Variant::Decide => router.decide(index, q, &id),
                        Variant::DecideInsert => router.decide_insert(index, q, &id),
                        Variant::InsertNewTail => router.decide_insert(index, q, &fresh_id(n)),
                    }
                };
                for _ in 0..warm {
                    black_box(step(&mut router, &mut index));
                }
                let (a0, b0) = allocated();
                let t0 = Instant::now();
                for _ in 0..runs {
                    black_box(step(&mut router, &mut index));
                }
                let ns = t0.elapsed().as_nanos() as f64 / runs as f64;
                let (a1, b1) = allocated();
                rows.push(AllocRow {
                    label,
                    kb: q.kb,
                    policy,
                    variant,
                    allocs: (a1 - a0) as f64 / runs as f64,
                    bytes: (b1 - b0) as f64 / runs as f64,
                    ns,
                });
            }
        }
    }
    rows
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    let mut c = Criterion::default().configure_from_args();
    let corpus = Corpus::new();
    let mut rows = Vec::new();
    let mut shapes = Vec::new();
    for (blocks, label) in INDEX_BLOCKS {
        if !bench_mode && blocks > INDEX_BLOCKS[0].0 {
            break;
        }
        let t0 = Instant::now();
        let index = corpus.index(blocks);
        index.assert_invariants();
        shapes.push(format!(
            "index_{label}: {} blocks in {} nodes, built in {:.1} s",
            index.total_blocks(),
            index.node_count(),
            t0.elapsed().as_secs_f64()
        ));
        criterion_cases(&mut c, &corpus, &index, label);
        if blocks == INDEX_BLOCKS[2].0 || !bench_mode {
            part_cases(&mut c, &corpus, &index, label);
        }
        rows.extend(alloc_rows(&corpus, &index, label, !bench_mode));
    }
    c.final_summary();

    println!();
    for s in &shapes {
        println!("{s}");
    }
    let mut h = hasher();
    for (q, (whole, quarter)) in corpus.queries.iter().zip(&corpus.targets) {
        let blocks = chain(&mut h, &q.system, &q.user).len();
        println!(
            "{} KB prompt: {} bytes, {} blocks; cached: {} blocks on backends 1 and 5, {} on 3",
            q.kb,
            q.bytes(),
            blocks,
            whole
                .iter()
                .zip(h.blocks())
                .take_while(|(a, b)| a == b)
                .count(),
            quarter.len()
        );
    }
    println!();
    println!("Steady-state allocations per decision (after warm-up; counting allocator):");
    println!("| index | prompt | policy | variant | allocs/decision | bytes/decision | ns/decision (Instant) |");
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} KB | {} | {} | {:.2} | {:.0} | {:.0} |",
            r.label,
            r.kb,
            r.policy,
            r.variant.name(),
            r.allocs,
            r.bytes,
            r.ns
        );
    }
}
