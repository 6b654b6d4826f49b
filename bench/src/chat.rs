//! Chat requests as the simulator and the trace generator build them: a small model
//! of an OpenAI chat body (messages with optional tool calls), rendered two ways from
//! the same value so the two cannot drift apart:
//!
//! - [`ChatRequest::to_json`]: the body sent over the wire (`gen-trace`, `replay`);
//! - [`ChatRequest::feed`]: the canonical prompt stream the gateway derives from that
//!   body, fed to the orchestrator's [`PromptHasher`] call for call the way the
//!   gateway's request parser does (`src/openai.rs`, `feed_messages`): per message
//!   `feed_message(role, name, content or "")`, then `feed_tool_call(name, arguments)`
//!   per tool call, then `feed_content_part(tool_call_id)` for a tool result.
//!
//! Contents are `Arc<str>` so thousands of requests can share one document.

use std::sync::Arc;

use radixgate_orchestrator::{model_seed, PromptHasher};

use crate::json;

/// Tokens are counted as the gateway's simulated engine counts them: canonical prompt
/// bytes / 4, rounded up.
pub const BYTES_PER_TOKEN: u64 = 4;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The JSON-encoded arguments string, as OpenAI sends it.
    pub arguments: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: &'static str,
    /// `None` renders as `"content":null` (an assistant message that only calls tools).
    pub content: Option<Arc<str>>,
    pub tool_calls: Vec<ToolCall>,
    /// For `role: "tool"`: the call this message answers.
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn text(role: &'static str, content: impl Into<Arc<str>>) -> Message {
        Message {
            role,
            content: Some(content.into()),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    pub max_tokens: u32,
}

/// A prompt as the router and the engines see it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HashedPrompt {
    pub blocks: Vec<u64>,
    pub affinity_key: Option<u64>,
    /// Canonical prompt bytes.
    pub bytes: u64,
}

impl HashedPrompt {
    /// Prompt tokens the way the simulated engine reports them (at least 1).
    pub fn tokens(&self) -> u64 {
        self.bytes.div_ceil(BYTES_PER_TOKEN).max(1)
    }
}

// === impl ChatRequest ===

impl ChatRequest {
    /// Streams the canonical prompt into `hasher` exactly as the gateway's parser does
    /// for the JSON body [`Self::to_json`] renders (after `hasher.reset(model_seed)`).
    pub fn feed(&self, hasher: &mut PromptHasher) {
        hasher.reset(model_seed(&self.model));
        for m in &self.messages {
            hasher.feed_message(m.role, None, m.content.as_deref().unwrap_or(""));
            for call in &m.tool_calls {
                hasher.feed_tool_call(&call.name, &call.arguments);
            }
            if let Some(id) = &m.tool_call_id {
                hasher.feed_content_part(id);
            }
        }
    }

    pub fn hash(&self, hasher: &mut PromptHasher) -> HashedPrompt {
        self.feed(hasher);
        HashedPrompt {
            blocks: hasher.blocks().to_vec(),
            affinity_key: hasher.affinity_key(),
            bytes: hasher.bytes_fed(),
        }
    }

    /// The OpenAI chat body (non-streaming), messages first so bodies that share
    /// leading messages share leading bytes.
    pub fn to_json(&self) -> String {
        let mut s = String::with_capacity(
            96 + self
                .messages
                .iter()
                .map(|m| m.content.as_ref().map_or(0, |c| c.len()) + 48)
                .sum::<usize>(),
        );
        s.push_str("{\"model\":");
        json::push_str(&mut s, &self.model);
        s.push_str(",\"messages\":[");
        for (k, m) in self.messages.iter().enumerate() {
            if k > 0 {
                s.push(',');
            }
            s.push_str("{\"role\":");
            json::push_str(&mut s, m.role);
            s.push_str(",\"content\":");
            match &m.content {
                Some(c) => json::push_str(&mut s, c),
                None => s.push_str("null"),
            }
            if !m.tool_calls.is_empty() {
                s.push_str(",\"tool_calls\":[");
                for (j, call) in m.tool_calls.iter().enumerate() {
                    if j > 0 {
                        s.push(',');
                    }
                    s.push_str("{\"id\":");
                    json::push_str(&mut s, &call.id);
                    s.push_str(",\"type\":\"function\",\"function\":{\"name\":");
                    json::push_str(&mut s, &call.name);
                    s.push_str(",\"arguments\":");
                    json::push_str(&mut s, &call.arguments);
                    s.push_str("}}");
                }
                s.push(']');
            }
            if let Some(id) = &m.tool_call_id {
                s.push_str(",\"tool_call_id\":");
                json::push_str(&mut s, id);
            }
            s.push('}');
        }
        s.push_str("],\"max_tokens\":");
        s.push_str(&self.max_tokens.to_string());
        s.push_str(",\"stream\":false}");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroUsize;

    fn hasher() -> PromptHasher {
        PromptHasher::new(NonZeroUsize::new(64).unwrap())
    }

    fn request(messages: Vec<Message>) -> ChatRequest {
        ChatRequest {
            model: "sim".into(),
            messages,
            max_tokens: 16,
        }
    }

    #[test]
    fn renders_json_with_tool_calls() {
        let r = request(vec![
            Message::text("user", "hi \"there\""),
            Message {
                role: "assistant",
                content: None,
                tool_calls: vec![ToolCall {
                    id: "call_1".into(),
                    name: "read_file".into(),
                    arguments: "{\"path\":\"a.rs\"}".into(),
                }],
                tool_call_id: None,
            },
            Message {
                tool_call_id: Some("call_1".into()),
                ..Message::text("tool", "fn main() {}")
            },
        ]);
        assert_eq!(
            r.to_json(),
            r#"{"model":"sim","messages":[{"role":"user","content":"hi \"there\""},{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"a.rs\"}"}}]},{"role":"tool","content":"fn main() {}","tool_call_id":"call_1"}],"max_tokens":16,"stream":false}"#
        );
    }

    #[test]
    fn canonical_stream_matches_the_documented_form() {
        // role 0x1F 0x1D content; 0x1E between messages; 0x1A name 0x1F args per call;
        // 0x1D tool_call_id for tool results (orchestrator/src/prompt.rs).
        let r = request(vec![
            Message::text("system", "S"),
            Message {
                role: "assistant",
                content: None,
                tool_calls: vec![ToolCall {
                    id: "c".into(),
                    name: "f".into(),
                    arguments: "{}".into(),
                }],
                tool_call_id: None,
            },
            Message {
                tool_call_id: Some("c".into()),
                ..Message::text("tool", "R")
            },
        ]);
        let expected: &[u8] =
            b"system\x1f\x1dS\x1eassistant\x1f\x1d\x1af\x1f{}\x1etool\x1f\x1dR\x1dc";
        let mut h = hasher();
        let p = r.hash(&mut h);
        assert_eq!(p.bytes, expected.len() as u64);
        let mut direct = hasher();
        direct.reset(model_seed("sim"));
        direct.feed(expected);
        assert_eq!(p.affinity_key, direct.affinity_key());
        assert_eq!(p.tokens(), (expected.len() as u64).div_ceil(4));
    }

    #[test]
    fn continuations_extend_the_block_chain() {
        let doc: Arc<str> = "x".repeat(1000).into();
        let a = request(vec![Message::text("system", doc.clone())]);
        let mut b = a.clone();
        b.messages.push(Message::text("user", "y".repeat(200)));
        let mut h = hasher();
        let (pa, pb) = (a.hash(&mut h), b.hash(&mut h));
        assert_eq!(pa.blocks.len(), 1008 / 64);
        assert!(pb.blocks.starts_with(&pa.blocks));
        assert!(pb.blocks.len() > pa.blocks.len());
    }
}
