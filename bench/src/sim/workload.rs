//! The simulator's workloads, deterministic from a seed: each is a list of sessions,
//! a session a list of turns (chat requests) issued strictly one after another.
//!
//! - `docs`: every request is its own one-turn session: a short shared system prompt
//!   plus one of `docs` documents in the system message, and a question that no other
//!   request asks in the user message. Documents are chosen uniformly or by Zipf(α)
//!   (document 0 the most popular).
//! - `multiturn`: `sessions` conversations of `turns` turns over one shared system
//!   prompt; a share of them (`code_share`) open with the same code context. After each
//!   turn the history grows by the user message, with probability `tool_prob` an
//!   assistant tool call and its tool result, and the assistant's reply; the next turn
//!   resends all of it. Assistant replies are canned text, so the history does not
//!   depend on what an engine would answer.
//!
//! `gen-trace` writes the same sessions as JSONL, so a trace replayed against the
//! gateway asks exactly what the simulator asked.

use std::sync::Arc;

use crate::chat::{ChatRequest, Message, ToolCall};
use crate::workload::{mix, text_of_len, words};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Distribution {
    Uniform,
    /// Document `k` (0-based) with probability ∝ `1 / (k + 1)^alpha`.
    Zipf(f64),
}

impl Distribution {
    pub fn label(&self) -> String {
        match self {
            Distribution::Uniform => "uniform".into(),
            Distribution::Zipf(a) => format!("zipf({a})"),
        }
    }
}

#[derive(Clone, Debug)]
pub struct DocsConfig {
    pub docs: usize,
    pub doc_bytes: usize,
    pub system_bytes: usize,
    pub question_bytes: usize,
    pub requests: usize,
    pub distribution: Distribution,
}

impl Default for DocsConfig {
    fn default() -> Self {
        DocsConfig {
            docs: 15,
            doc_bytes: 6144,
            system_bytes: 128,
            question_bytes: 48,
            requests: 3000,
            distribution: Distribution::Uniform,
        }
    }
}

#[derive(Clone, Debug)]
pub struct MultiturnConfig {
    pub sessions: usize,
    pub turns: usize,
    pub system_bytes: usize,
    pub code_bytes: usize,
    /// Share of sessions that open with the shared code context (rounded to whole
    /// sessions).
    pub code_share: f64,
    /// Probability that a turn's answer involves a tool call and its result.
    pub tool_prob: f64,
}

impl Default for MultiturnConfig {
    fn default() -> Self {
        MultiturnConfig {
            sessions: 12,
            turns: 6,
            system_bytes: 768,
            code_bytes: 1536,
            code_share: 0.4,
            tool_prob: 0.3,
        }
    }
}

#[derive(Clone, Debug)]
pub enum WorkloadSpec {
    Docs(DocsConfig),
    Multiturn(MultiturnConfig),
}

impl WorkloadSpec {
    pub fn name(&self) -> &'static str {
        match self {
            WorkloadSpec::Docs(_) => "docs",
            WorkloadSpec::Multiturn(_) => "multiturn",
        }
    }

    /// `uniform`/`zipf(α)` for docs; `sessions` for multiturn.
    pub fn distribution_label(&self) -> String {
        match self {
            WorkloadSpec::Docs(c) => c.distribution.label(),
            WorkloadSpec::Multiturn(_) => "sessions".into(),
        }
    }
}

/// One conversation: its turns go out in order, each after the previous completed.
#[derive(Clone, Debug)]
pub struct Session {
    pub name: String,
    pub turns: Vec<ChatRequest>,
    /// Whether the client would send `X-Session-ID` (multiturn) or not (docs).
    pub has_session_id: bool,
}

// Domain tags keep the per-purpose random streams apart.
const TAG_SYSTEM: u64 = 101;
const TAG_DOC: u64 = 102;
const TAG_PICK: u64 = 103;
const TAG_QUESTION: u64 = 104;
const TAG_CODE: u64 = 105;
const TAG_CODE_SESSIONS: u64 = 106;
const TAG_TURN: u64 = 107;

pub fn build(spec: &WorkloadSpec, seed: u64, model: &str, max_tokens: u32) -> Vec<Session> {
    match spec {
        WorkloadSpec::Docs(c) => docs(c, seed, model, max_tokens),
        WorkloadSpec::Multiturn(c) => multiturn(c, seed, model, max_tokens),
    }
}

fn docs(c: &DocsConfig, seed: u64, model: &str, max_tokens: u32) -> Vec<Session> {
    let docs = c.docs.max(1);
    let mut rng = fastrand::Rng::with_seed(mix(&[seed, TAG_SYSTEM]));
    let system = text_of_len(
        &mut rng,
        "You answer questions about the document. ",
        c.system_bytes,
    );
    // One string per document with the system prompt in front: the system message.
    let contexts: Vec<Arc<str>> = (0..docs)
        .map(|d| {
            let mut rng = fastrand::Rng::with_seed(mix(&[seed, TAG_DOC, d as u64]));
            let doc = text_of_len(&mut rng, &format!("Document {d}. "), c.doc_bytes);
            format!("{system}{doc}").into()
        })
        .collect();
    let sampler = Sampler::new(docs, c.distribution);
    let mut pick = fastrand::Rng::with_seed(mix(&[seed, TAG_PICK]));
    (0..c.requests)
        .map(|i| {
            let d = sampler.sample(&mut pick);
            let mut rng = fastrand::Rng::with_seed(mix(&[seed, TAG_QUESTION, i as u64]));
            let question = text_of_len(&mut rng, &format!("Q{i}: what about "), c.question_bytes);
            Session {
                name: format!("docs-{i}"),
                turns: vec![ChatRequest {
                    model: model.to_string(),
                    messages: vec![
                        Message::text("system", contexts[d].clone()),
                        Message::text("user", question),
                    ],
                    max_tokens,
                }],
                has_session_id: false,
            }
        })
        .collect()
}

const TOOLS: [&str; 3] = ["read_file", "run_tests", "search_code"];

fn multiturn(c: &MultiturnConfig, seed: u64, model: &str, max_tokens: u32) -> Vec<Session> {
    let mut rng = fastrand::Rng::with_seed(mix(&[seed, TAG_SYSTEM]));
    let system: Arc<str> = text_of_len(
        &mut rng,
        "You are a careful coding assistant. ",
        c.system_bytes,
    )
    .into();
    let mut rng = fastrand::Rng::with_seed(mix(&[seed, TAG_CODE]));
    let code = text_of_len(&mut rng, "```rust\n// shared code context\n", c.code_bytes);
    // Exactly round(share × sessions) sessions open with the code, chosen by the seed.
    let with_code = ((c.code_share.clamp(0.0, 1.0) * c.sessions as f64).round()) as usize;
    let mut order: Vec<usize> = (0..c.sessions).collect();
    fastrand::Rng::with_seed(mix(&[seed, TAG_CODE_SESSIONS])).shuffle(&mut order);
    let mut has_code = vec![false; c.sessions];
    for &s in &order[..with_code] {
        has_code[s] = true;
    }

    (0..c.sessions)
        .map(|s| {
            let mut history = vec![Message::text("system", system.clone())];
            let mut turns = Vec::with_capacity(c.turns);
            for t in 0..c.turns {
                let mut rng = fastrand::Rng::with_seed(mix(&[seed, TAG_TURN, s as u64, t as u64]));
                let n = rng.usize(20..60);
                let mut user = format!("Turn {t} of session {s}: {}?", words(&mut rng, n));
                if t == 0 && has_code[s] {
                    user = format!("{code}\n```\n{user}");
                }
                history.push(Message::text("user", user));
                turns.push(ChatRequest {
                    model: model.to_string(),
                    messages: history.clone(),
                    max_tokens,
                });
                // What the assistant did with it, appended before the next user turn.
                if rng.f64() < c.tool_prob {
                    let id = format!("call_{s}_{t}");
                    let tool = TOOLS[rng.usize(..TOOLS.len())];
                    let n = rng.usize(2..6);
                    history.push(Message {
                        role: "assistant",
                        content: None,
                        tool_calls: vec![ToolCall {
                            id: id.clone(),
                            name: tool.to_string(),
                            arguments: format!("{{\"query\":\"{}\"}}", words(&mut rng, n)),
                        }],
                        tool_call_id: None,
                    });
                    let len = rng.usize(300..900);
                    history.push(Message {
                        tool_call_id: Some(id),
                        ..Message::text("tool", text_of_len(&mut rng, "result: ", len))
                    });
                }
                let n = rng.usize(40..120);
                history.push(Message::text("assistant", words(&mut rng, n)));
            }
            Session {
                name: format!("mt-{s}"),
                turns,
                has_session_id: true,
            }
        })
        .collect()
}

/// Draws document indices by a cumulative table.
struct Sampler {
    cdf: Vec<f64>,
}

impl Sampler {
    fn new(n: usize, distribution: Distribution) -> Sampler {
        let alpha = match distribution {
            Distribution::Uniform => 0.0,
            Distribution::Zipf(a) => a,
        };
        let weights: Vec<f64> = (0..n).map(|k| ((k + 1) as f64).powf(-alpha)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Sampler { cdf }
    }

    fn sample(&self, rng: &mut fastrand::Rng) -> usize {
        let x = rng.f64();
        self.cdf
            .iter()
            .position(|&c| x < c)
            .unwrap_or(self.cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroUsize;

    use radixgate_orchestrator::PromptHasher;

    #[test]
    fn docs_prompts_have_the_specified_shape() {
        let c = DocsConfig::default();
        let sessions = build(&WorkloadSpec::Docs(c.clone()), 1, "sim", 16);
        assert_eq!(sessions.len(), 3000);
        let mut h = PromptHasher::new(NonZeroUsize::new(64).unwrap());
        let p = sessions[0].turns[0].hash(&mut h);
        // "system" 0x1F 0x1D (128 + 6144) 0x1E "user" 0x1F 0x1D question(48).
        assert_eq!(p.bytes, 8 + 6272 + 7 + 48);
        assert_eq!(p.blocks.len(), 98);
        let m = &sessions[0].turns[0].messages;
        assert_eq!(m[0].content.as_ref().unwrap().len(), 6272);
        assert_eq!(m[1].content.as_ref().unwrap().len(), 48);
    }

    #[test]
    fn zipf_prefers_the_first_document() {
        let s = Sampler::new(15, Distribution::Zipf(1.0));
        let mut rng = fastrand::Rng::with_seed(3);
        let mut counts = [0u32; 15];
        for _ in 0..30_000 {
            counts[s.sample(&mut rng)] += 1;
        }
        // p(0) = 1 / H_15 ≈ 0.301, p(1) ≈ 0.151.
        assert!((8_500..9_600).contains(&counts[0]), "{counts:?}");
        assert!(counts[0] > counts[1] && counts[1] > counts[14]);
        let u = Sampler::new(15, Distribution::Uniform);
        assert!((0..1000).all(|_| u.sample(&mut rng) < 15));
    }

    #[test]
    fn multiturn_turns_extend_each_other() {
        let c = MultiturnConfig::default();
        let sessions = build(&WorkloadSpec::Multiturn(c.clone()), 1, "sim", 16);
        assert_eq!(sessions.len(), 12);
        let mut h = PromptHasher::new(NonZeroUsize::new(64).unwrap());
        let mut code_sessions = 0;
        let mut tool_calls = 0;
        for s in &sessions {
            assert_eq!(s.turns.len(), 6);
            let blocks: Vec<Vec<u64>> = s.turns.iter().map(|t| t.hash(&mut h).blocks).collect();
            for w in blocks.windows(2) {
                assert!(w[1].starts_with(&w[0]) && w[1].len() > w[0].len());
            }
            let first_user = s.turns[0].messages[1].content.as_ref().unwrap();
            code_sessions += usize::from(first_user.starts_with("```rust"));
            tool_calls += s.turns[5]
                .messages
                .iter()
                .filter(|m| !m.tool_calls.is_empty())
                .count();
        }
        assert_eq!(code_sessions, 5);
        assert!(tool_calls > 0);
        // All sessions share the system prompt's blocks (768 bytes → 12 blocks).
        let a = sessions[0].turns[0].hash(&mut h).blocks;
        let b = sessions[1].turns[0].hash(&mut h).blocks;
        assert!(a[..12] == b[..12]);
    }
}
