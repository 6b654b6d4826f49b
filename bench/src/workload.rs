//! Request bodies for the load generator, deterministic from a seed.
//!
//! Request number `i` of a run always gets the same body for the same configuration,
//! whichever connection sends it, so runs are comparable across policies and builds.
//! Three shapes exercise what a cache-aware router cares about:
//!
//! - `fixed`: one chat body, padded to a byte size, sent over and over.
//! - `docs`: a handful of shared documents, each asked several different questions;
//!   the document sits in the system message, so every request about one document
//!   shares a long prefix with the others about it.
//! - `multiturn`: conversations that grow a turn per request; each request repeats
//!   the earlier turns (with canned assistant replies, not the engine's real ones, to
//!   stay deterministic), so turn `t+1` extends turn `t`'s prompt. A turn is only
//!   sent once the previous one has been answered ([`Workload::follows`]), as a user
//!   reads the reply before writing the next turn.

use crate::json;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Fixed,
    Docs,
    Multiturn,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Fixed => "fixed",
            Kind::Docs => "docs",
            Kind::Multiturn => "multiturn",
        }
    }
}

#[derive(Clone, Debug)]
pub struct WorkloadConfig {
    pub kind: Kind,
    pub model: String,
    pub max_tokens: u32,
    /// Ask for SSE (`"stream":true`, with usage in the last event).
    pub stream: bool,
    /// Add vLLM's `"ignore_eos":true` so that every answer has `max_tokens` tokens.
    pub ignore_eos: bool,
    pub seed: u64,
    /// `fixed`: total body size in bytes (never below the bare JSON skeleton).
    pub body_bytes: usize,
    /// `docs`: how many shared documents.
    pub docs: usize,
    /// `docs`: size of each document in bytes.
    pub doc_bytes: usize,
    /// `docs`: distinct questions per document.
    pub questions: usize,
    /// `multiturn`: conversations running side by side.
    pub conversations: usize,
    /// `multiturn`: turns before a conversation starts over with fresh content.
    pub turns: usize,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            kind: Kind::Fixed,
            model: "sim".to_string(),
            max_tokens: 16,
            stream: false,
            ignore_eos: false,
            seed: 1,
            body_bytes: 2048,
            docs: 8,
            doc_bytes: 4000,
            questions: 8,
            conversations: 16,
            turns: 8,
        }
    }
}

/// A built workload: immutable, shared by all connection threads.
pub struct Workload {
    cfg: WorkloadConfig,
    fixed: Vec<u8>,
    fixed_content: String,
    docs: Vec<String>,
}

// Domain tags keep the per-purpose random streams apart.
const TAG_FIXED: u64 = 1;
const TAG_DOC: u64 = 2;
const TAG_PICK: u64 = 3;
const TAG_QUESTION: u64 = 4;
const TAG_USER: u64 = 5;
const TAG_ASSISTANT: u64 = 6;

impl Workload {
    pub fn new(mut cfg: WorkloadConfig) -> Workload {
        cfg.docs = cfg.docs.max(1);
        cfg.questions = cfg.questions.max(1);
        cfg.conversations = cfg.conversations.max(1);
        cfg.turns = cfg.turns.max(1);
        let fixed_content = match cfg.kind {
            Kind::Fixed => fixed_content(&cfg),
            _ => String::new(),
        };
        let fixed = match cfg.kind {
            Kind::Fixed => chat_body(&cfg, &[("user", &fixed_content)]),
            _ => Vec::new(),
        };
        let docs = match cfg.kind {
            Kind::Docs => (0..cfg.docs)
                .map(|d| document(cfg.seed, d, cfg.doc_bytes))
                .collect(),
            _ => Vec::new(),
        };
        Workload {
            cfg,
            fixed,
            fixed_content,
            docs,
        }
    }

    pub fn config(&self) -> &WorkloadConfig {
        &self.cfg
    }

    /// The body of request number `i`.
    pub fn body(&self, i: u64) -> Vec<u8> {
        match self.cfg.kind {
            Kind::Fixed => self.fixed.clone(),
            _ => {
                let messages = self.messages(i);
                let borrowed: Vec<(&str, &str)> =
                    messages.iter().map(|(r, m)| (*r, m.as_str())).collect();
                chat_body(&self.cfg, &borrowed)
            }
        }
    }

    /// The request that request `i` must wait for: the previous turn of its
    /// conversation (`multiturn`, from the second turn on), whose reply it quotes, so
    /// no user could send it before that reply arrived. `None` for the first turn and
    /// for the other shapes.
    pub fn follows(&self, i: u64) -> Option<u64> {
        match self.cfg.kind {
            Kind::Multiturn => {
                let (_, _, turn) = self.multiturn_pos(i);
                (turn > 0).then(|| i - self.cfg.conversations as u64)
            }
            Kind::Fixed | Kind::Docs => None,
        }
    }

    /// The chat messages (role, content) of request number `i`, as [`Self::body`]
    /// sends them.
    pub fn messages(&self, i: u64) -> Vec<(&'static str, String)> {
        match self.cfg.kind {
            Kind::Fixed => vec![("user", self.fixed_content.clone())],
            Kind::Docs => self.docs_messages(i),
            Kind::Multiturn => self.multiturn_messages(i),
        }
    }

    /// `docs`: which (document, question) request `i` asks.
    fn docs_pick(&self, i: u64) -> (usize, usize) {
        let mut rng = fastrand::Rng::with_seed(mix(&[self.cfg.seed, TAG_PICK, i]));
        (rng.usize(..self.cfg.docs), rng.usize(..self.cfg.questions))
    }

    fn docs_messages(&self, i: u64) -> Vec<(&'static str, String)> {
        let (d, q) = self.docs_pick(i);
        let mut rng =
            fastrand::Rng::with_seed(mix(&[self.cfg.seed, TAG_QUESTION, d as u64, q as u64]));
        let n = rng.usize(8..16);
        let question = format!(
            "Question {q}: what does the document say about {}?",
            words(&mut rng, n)
        );
        vec![("system", self.docs[d].clone()), ("user", question)]
    }

    /// `multiturn`: request `i` is turn `t` of conversation `c` in generation `g`
    /// (a conversation starts over with fresh content after `turns` turns).
    fn multiturn_pos(&self, i: u64) -> (u64, u64, u64) {
        let convs = self.cfg.conversations as u64;
        let turns = self.cfg.turns as u64;
        let c = i % convs;
        let round = i / convs;
        (c, round / turns, round % turns)
    }

    fn multiturn_messages(&self, i: u64) -> Vec<(&'static str, String)> {
        let (c, g, t) = self.multiturn_pos(i);
        let seed = self.cfg.seed;
        let turn_text = |tag: u64, k: u64, lo: usize, hi: usize| {
            let mut rng = fastrand::Rng::with_seed(mix(&[seed, tag, c, g, k]));
            let n = rng.usize(lo..hi);
            words(&mut rng, n)
        };
        let system = "You are a helpful assistant. Answer briefly.".to_string();
        let mut messages: Vec<(&'static str, String)> = vec![("system", system)];
        for k in 0..t {
            messages.push(("user", turn_text(TAG_USER, k, 30, 60)));
            messages.push(("assistant", turn_text(TAG_ASSISTANT, k, 20, 40)));
        }
        messages.push(("user", turn_text(TAG_USER, t, 30, 60)));
        messages
    }
}

/// The `fixed` workload's one message, padded so its body is `body_bytes` long.
fn fixed_content(cfg: &WorkloadConfig) -> String {
    let skeleton = chat_body(cfg, &[("user", "")]).len();
    let pad = cfg.body_bytes.saturating_sub(skeleton);
    let mut rng = fastrand::Rng::with_seed(mix(&[cfg.seed, TAG_FIXED]));
    text_of_len(&mut rng, "", pad)
}

fn document(seed: u64, d: usize, bytes: usize) -> String {
    let mut rng = fastrand::Rng::with_seed(mix(&[seed, TAG_DOC, d as u64]));
    text_of_len(&mut rng, &format!("Document {d}. "), bytes)
}

/// `{"model":..,"messages":[..],"max_tokens":..,"stream":..}`, messages first so that
/// bodies sharing leading messages share leading bytes.
fn chat_body(cfg: &WorkloadConfig, messages: &[(&str, &str)]) -> Vec<u8> {
    let mut s = String::with_capacity(128 + messages.iter().map(|m| m.1.len() + 32).sum::<usize>());
    s.push_str("{\"model\":");
    json::push_str(&mut s, &cfg.model);
    s.push_str(",\"messages\":[");
    for (k, (role, content)) in messages.iter().enumerate() {
        if k > 0 {
            s.push(',');
        }
        s.push_str("{\"role\":");
        json::push_str(&mut s, role);
        s.push_str(",\"content\":");
        json::push_str(&mut s, content);
        s.push('}');
    }
    s.push_str(&body_tail(cfg));
    s.into_bytes()
}

/// Everything after the last message.
fn body_tail(cfg: &WorkloadConfig) -> String {
    let ignore_eos = if cfg.ignore_eos {
        ",\"ignore_eos\":true"
    } else {
        ""
    };
    if cfg.stream {
        format!(
            "],\"max_tokens\":{}{ignore_eos},\"stream\":true,\"stream_options\":{{\"include_usage\":true}}}}",
            cfg.max_tokens
        )
    } else {
        format!(
            "],\"max_tokens\":{}{ignore_eos},\"stream\":false}}",
            cfg.max_tokens
        )
    }
}

const WORDS: &[&str] = &[
    "the", "of", "and", "cache", "prefix", "token", "block", "engine", "router", "gateway",
    "latency", "request", "model", "batch", "decode", "prefill", "memory", "queue", "shard",
    "core", "thread", "stream", "header", "policy", "tenant", "budget", "replica", "index",
    "radix", "tree", "hash", "chain", "backend", "pool", "health", "window", "signal", "river",
    "mountain", "harbor", "lantern", "garden", "copper", "violet", "meadow", "orbit", "pencil",
    "marble", "thunder", "ember", "quartz", "falcon", "willow", "canyon", "velvet", "anchor",
    "prism", "glacier", "saffron", "compass", "echo", "summit", "tide", "bramble",
];

/// `n` pseudo-random words separated by spaces.
pub(crate) fn words(rng: &mut fastrand::Rng, n: usize) -> String {
    let mut s = String::new();
    for k in 0..n {
        if k > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.usize(..WORDS.len())]);
    }
    s
}

/// `prefix` followed by pseudo-random words, cut to exactly `len` bytes (ASCII).
pub(crate) fn text_of_len(rng: &mut fastrand::Rng, prefix: &str, len: usize) -> String {
    let mut s = String::with_capacity(len + 16);
    s.push_str(prefix);
    while s.len() < len {
        s.push_str(WORDS[rng.usize(..WORDS.len())]);
        s.push(if rng.usize(..12) == 0 { '.' } else { ' ' });
    }
    s.truncate(len);
    s
}

/// splitmix64 over the parts: independent, well-spread seeds per purpose and index.
pub(crate) fn mix(parts: &[u64]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3u64;
    for &p in parts {
        h = splitmix64(h ^ p);
    }
    h
}

fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common_prefix(a: &[u8], b: &[u8]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    fn cfg(kind: Kind) -> WorkloadConfig {
        WorkloadConfig {
            kind,
            ..WorkloadConfig::default()
        }
    }

    #[test]
    fn same_seed_same_bodies_other_seed_other_bodies() {
        for kind in [Kind::Fixed, Kind::Docs, Kind::Multiturn] {
            let a = Workload::new(cfg(kind));
            let b = Workload::new(cfg(kind));
            let c = Workload::new(WorkloadConfig {
                seed: 2,
                ..cfg(kind)
            });
            for i in 0..50 {
                assert_eq!(a.body(i), b.body(i), "{kind:?} request {i}");
            }
            assert!(
                (0..50).any(|i| a.body(i) != c.body(i)),
                "{kind:?} ignores the seed"
            );
        }
    }

    #[test]
    fn fixed_body_has_the_requested_size() {
        for bytes in [2048, 4000, 10_000] {
            let w = Workload::new(WorkloadConfig {
                body_bytes: bytes,
                ..cfg(Kind::Fixed)
            });
            assert_eq!(w.body(0).len(), bytes);
            assert_eq!(w.body(0), w.body(7));
        }
        let tiny = Workload::new(WorkloadConfig {
            body_bytes: 1,
            ..cfg(Kind::Fixed)
        });
        assert!(tiny.body(0).starts_with(b"{\"model\":\"sim\""));
    }

    #[test]
    fn docs_requests_on_one_doc_share_the_doc() {
        let c = cfg(Kind::Docs);
        let w = Workload::new(c.clone());
        assert!(w.docs.iter().all(|d| d.len() == c.doc_bytes));
        let picks: Vec<(usize, usize)> = (0..100).map(|i| w.docs_pick(i)).collect();
        let bodies: Vec<Vec<u8>> = (0..100).map(|i| w.body(i)).collect();
        let mut same_doc = 0;
        let mut other_doc = 0;
        for i in 0..picks.len() {
            for j in (i + 1)..picks.len() {
                let (a, b) = (&bodies[i], &bodies[j]);
                let shared = common_prefix(a, b);
                if picks[i].0 == picks[j].0 {
                    assert!(shared >= c.doc_bytes, "same doc shares only {shared} bytes");
                    if picks[i].1 != picks[j].1 {
                        assert_ne!(a, b);
                        same_doc += 1;
                    }
                } else {
                    assert!(shared < 100, "different docs share {shared} bytes");
                    other_doc += 1;
                }
            }
        }
        assert!(same_doc > 0 && other_doc > 0);
    }

    #[test]
    fn multiturn_turns_extend_the_previous_prompt() {
        let c = WorkloadConfig {
            conversations: 4,
            turns: 3,
            ..cfg(Kind::Multiturn)
        };
        let w = Workload::new(c.clone());
        let tail = body_tail(&c).len();
        for conv in 0..4u64 {
            for t in 0..2u64 {
                let i = conv + 4 * t;
                let (earlier, later) = (w.body(i), w.body(i + 4));
                assert_eq!(w.multiturn_pos(i), (conv, 0, t));
                assert!(later.len() > earlier.len());
                assert!(later.starts_with(&earlier[..earlier.len() - tail]));
            }
        }
        // Different conversations diverge right after the shared system prompt, and a
        // conversation starts over after `turns` turns.
        let (a, b) = (w.body(0), w.body(1));
        assert!(common_prefix(&a, &b) < 150);
        assert_eq!(w.multiturn_pos(12), (0, 1, 0));
        assert_ne!(w.body(12), w.body(0));
    }

    #[test]
    fn a_turn_follows_its_conversations_previous_turn_only() {
        let w = Workload::new(WorkloadConfig {
            conversations: 4,
            turns: 3,
            ..cfg(Kind::Multiturn)
        });
        // Turn 0 of every conversation, and turn 0 of the next generation, follow nothing.
        for i in [0, 1, 2, 3, 12, 15] {
            assert_eq!(w.follows(i), None, "{i}");
        }
        assert_eq!(w.follows(4), Some(0));
        assert_eq!(w.follows(11), Some(7));
        assert_eq!(w.follows(16), Some(12));
        let docs = Workload::new(cfg(Kind::Docs));
        assert!((0..50).all(|i| docs.follows(i).is_none()));
    }
}
