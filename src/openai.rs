//! Reads what routing needs from an OpenAI request body, and nothing more.
//!
//! The body is checked and scanned in one pass by the gateway's own JSON scanner
//! ([`tape`]) straight from the bytes that go upstream: no copy, no value tree, no
//! allocation once the shard's tape is warm. Only `model`, `stream`, `max_tokens`,
//! `user`, `stream_options`, `cache_salt` and the prompt (`tools` and `messages`, or
//! `prompt`) are read; the prompt is streamed into the orchestrator's
//! [`PromptHasher`] without building an intermediate string. Type errors name the
//! offending `param`, as OpenAI does. A body with a duplicate key in any object is
//! refused (400 `invalid_json`, `param` its path): the gateway would read the first
//! occurrence and the engine (Python's `json`) reads the last.

use crate::error::{ErrorKind, GatewayError};
use radixgate_orchestrator::media::media_id;
use radixgate_orchestrator::{model_seed, Capabilities, MediaNeeds, PromptHasher};
use std::collections::HashMap;
use tape::{Json, Number, Tape};

mod tape;
pub use tape::MAX_JSON_DEPTH;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
}

/// The facts routing and accounting need, copied out of the parsed body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestFacts {
    /// The model, or the base model of the LoRA adapter the request names.
    pub model: usize,
    /// The LoRA adapter the request names ([`crate::adapters::AdapterTable`]).
    pub adapter: Option<usize>,
    pub stream: bool,
    pub max_tokens: Option<u64>,
    /// `stream_options.include_usage`: the client wants a final usage event.
    pub include_usage: bool,
    /// The body carried vLLM's `cache_salt` (already mixed into the hash seed).
    pub has_cache_salt: bool,
    pub affinity_key: Option<u64>,
    /// The image and audio parts the prompt carries (routing needs capable backends).
    pub media: MediaNeeds,
}

/// Model name → dense index, shared read-only by all shards.
#[derive(Debug, Default, Clone)]
pub struct ModelTable {
    names: Vec<String>,
    /// foldhash rather than SipHash: one lookup per request, keys fixed by the config
    /// (SipHash cost ~150 instructions of the lookup's ~240).
    index: HashMap<String, usize, foldhash::fast::RandomState>,
    seeds: Vec<u64>,
}

impl ModelTable {
    pub fn new(names: Vec<String>) -> Self {
        let index = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i))
            .collect();
        let seeds = names.iter().map(|n| model_seed(n)).collect();
        Self {
            names,
            index,
            seeds,
        }
    }

    pub fn get(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    pub fn name(&self, idx: usize) -> &str {
        &self.names[idx]
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// What a request's `model` names: a model (its index), or a LoRA adapter of one,
/// and the seed of its prompt's hash chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelRef {
    pub model: usize,
    pub adapter: Option<usize>,
    pub seed: u64,
}

/// Looks a request's `model` up.
pub trait ModelNames {
    fn resolve(&self, name: &str) -> Option<ModelRef>;
}

impl ModelNames for ModelTable {
    fn resolve(&self, name: &str) -> Option<ModelRef> {
        let model = self.get(name)?;
        Some(ModelRef {
            model,
            adapter: None,
            seed: self.seeds[model],
        })
    }
}

/// Per-shard parsing state: the scanner's tape, reused from request to request (one
/// per shard, so parsing allocates nothing once warm). Each object is read in one
/// pass over its members instead of one linear `get` per field (the scan has
/// already refused duplicate keys, so which occurrence wins never matters). (sonic-rs, the parser before this one, cost about
/// twice as much per request: it copies the body into a padded buffer and builds an
/// allocated tree; benches/parse.rs measures both.)
#[derive(Default)]
pub struct BodyParser {
    tape: Tape,
}

/// Member values of one JSON object, picked out in one pass (keys are unique: the
/// scan refuses duplicates).
fn pick<'t, const N: usize>(value: Json<'t>, keys: [&str; N]) -> [Option<Json<'t>>; N] {
    let mut found = [None; N];
    for (k, v) in value.members() {
        if let Some(i) = keys.iter().position(|key| *key == k) {
            if found[i].is_none() {
                found[i] = Some(v);
            }
        }
    }
    found
}

impl BodyParser {
    pub fn parse(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
        models: &impl ModelNames,
        hasher: &mut PromptHasher,
        seed_mix: u64,
    ) -> Result<RequestFacts, GatewayError> {
        let parsed = self.parse_unless_member(endpoint, body, models, hasher, seed_mix, None)?;
        Ok(parsed.expect("no member to stop at"))
    }

    /// [`Self::parse`], except that a body whose top-level object has the member
    /// `stop_at` is answered `Ok(None)` as soon as it is parsed, before anything is
    /// checked or hashed: the RAG detection (`routing.rag_field`) rides on this one
    /// parse instead of scanning every body for the name first.
    pub fn parse_unless_member(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
        models: &impl ModelNames,
        hasher: &mut PromptHasher,
        seed_mix: u64,
        stop_at: Option<&str>,
    ) -> Result<Option<RequestFacts>, GatewayError> {
        let value = self.tape.scan(body).map_err(|e| match e {
            tape::ScanError::TooDeep => {
                GatewayError::new(ErrorKind::MalformedJson, format!("the request body {e}"))
            }
            tape::ScanError::Syntax { .. } => GatewayError::new(
                ErrorKind::MalformedJson,
                format!("the request body is not valid JSON: {e}"),
            ),
            tape::ScanError::DuplicateKey { ref path, .. } => GatewayError {
                kind: ErrorKind::MalformedJson,
                message: format!("the request body {e}: a key may appear only once in an object"),
                param: Some(path.clone()),
            },
        })?;
        if !value.is_object() {
            return Err(GatewayError::new(
                ErrorKind::MalformedJson,
                "the request body must be a JSON object",
            ));
        }
        let [model, stream, max_tokens, max_completion_tokens, user, stream_options, cache_salt, tools, messages, prompt, stop] =
            pick(
                value,
                [
                    "model",
                    "stream",
                    "max_tokens",
                    "max_completion_tokens",
                    "user",
                    "stream_options",
                    "cache_salt",
                    "tools",
                    "messages",
                    "prompt",
                    stop_at.unwrap_or_default(),
                ],
            );
        if stop_at.is_some() && stop.is_some() {
            return Ok(None);
        }
        let model_name = match model {
            None => return Err(GatewayError::invalid_param("model", "`model` is required")),
            Some(v) => v
                .as_str()
                .ok_or_else(|| GatewayError::invalid_param("model", "`model` must be a string"))?,
        };
        let named = models.resolve(model_name).ok_or_else(|| GatewayError {
            kind: ErrorKind::ModelNotFound,
            message: format!("The model `{model_name}` does not exist."),
            param: Some("model".into()),
        })?;
        let stream = match stream {
            None => false,
            Some(v) if v.is_null() => false,
            Some(v) => v.as_bool().ok_or_else(|| {
                GatewayError::invalid_param("stream", "`stream` must be a boolean")
            })?,
        };
        let max_tokens = optional_count(max_tokens, "max_tokens")?.or(optional_count(
            max_completion_tokens,
            "max_completion_tokens",
        )?);
        if let Some(user) = user {
            if !user.is_null() && user.as_str().is_none() {
                return Err(GatewayError::invalid_param(
                    "user",
                    "`user` must be a string",
                ));
            }
        }
        let include_usage = stream_options
            .and_then(|o| o.get("include_usage"))
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        // vLLM keeps salted prompts apart in its cache; so does the index.
        let salt = match cache_salt {
            None => None,
            Some(v) if v.is_null() => None,
            Some(v) => Some(v.as_str().ok_or_else(|| {
                GatewayError::invalid_param("cache_salt", "`cache_salt` must be a string")
            })?),
        };
        let salt_seed = salt.map_or(0, |s| xxhash_rust::xxh3::xxh3_64(s.as_bytes()));
        hasher.reset(named.seed ^ seed_mix ^ salt_seed);
        let media = match endpoint {
            Endpoint::ChatCompletions => feed_messages(tools, messages, hasher)?,
            Endpoint::Completions => {
                feed_prompt(prompt, hasher)?;
                MediaNeeds::TEXT_ONLY
            }
        };
        Ok(Some(RequestFacts {
            model: named.model,
            adapter: named.adapter,
            stream,
            max_tokens,
            include_usage,
            has_cache_salt: salt.is_some(),
            affinity_key: hasher.affinity_key(),
            media,
        }))
    }
}

/// Whether `body` nests arrays/objects deeper than `max`, outside strings: the guard
/// before the sonic-rs parses off the hot path (RAG and workflow bodies), whose
/// parse, walk and drop recurse. One pass: string contents are skipped with memchr,
/// structure bytes are looked at one by one. Not a validator: sonic-rs rejects
/// malformed JSON next.
pub(crate) fn nesting_exceeds(body: &[u8], max: usize) -> bool {
    let mut depth = 0usize;
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'"' => {
                // Skip to the closing quote, past escapes.
                i += 1;
                loop {
                    match memchr::memchr2(b'"', b'\\', &body[i.min(body.len())..]) {
                        None => return false,
                        Some(off) if body[i + off] == b'\\' => i += off + 2,
                        Some(off) => {
                            i += off;
                            break;
                        }
                    }
                }
            }
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    false
}

fn optional_count(value: Option<Json>, key: &'static str) -> Result<Option<u64>, GatewayError> {
    match value {
        None => Ok(None),
        Some(v) if v.is_null() => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            GatewayError::invalid_param(key, format!("`{key}` must be a non-negative integer"))
        }),
    }
}

fn feed_messages(
    tools: Option<Json>,
    messages: Option<Json>,
    hasher: &mut PromptHasher,
) -> Result<MediaNeeds, GatewayError> {
    let mut media = MediaNeeds::TEXT_ONLY;
    if let Some(tools) = tools {
        if !tools.is_null() {
            if !tools.is_array() {
                return Err(GatewayError::invalid_param(
                    "tools",
                    "`tools` must be an array",
                ));
            }
            hasher.feed_tools_start();
            feed_json(tools, hasher);
        }
    }
    let messages = messages
        .ok_or_else(|| GatewayError::invalid_param("messages", "`messages` is required"))?;
    if !messages.is_array() {
        return Err(GatewayError::invalid_param(
            "messages",
            "`messages` must be an array",
        ));
    }
    if messages.items().next().is_none() {
        return Err(GatewayError::invalid_param(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    for (i, m) in messages.items().enumerate() {
        if !m.is_object() {
            return Err(GatewayError::invalid_param(
                format!("messages[{i}]"),
                "each message must be an object",
            ));
        }
        let [role, name, content, tool_calls, tool_call_id] =
            pick(m, ["role", "name", "content", "tool_calls", "tool_call_id"]);
        let role = role.and_then(|r| r.as_str()).ok_or_else(|| {
            GatewayError::invalid_param(
                format!("messages[{i}].role"),
                "each message needs a string `role`",
            )
        })?;
        let name = name.and_then(|n| n.as_str());
        match content {
            None => hasher.feed_message(role, name, ""),
            Some(c) if c.is_null() => hasher.feed_message(role, name, ""),
            Some(c) => {
                if let Some(text) = c.as_str() {
                    hasher.feed_message(role, name, text);
                } else if c.is_array() {
                    hasher.feed_message(role, name, "");
                    for (j, part) in c.items().enumerate() {
                        feed_part(part, hasher, &mut media).map_err(|message| {
                            GatewayError::invalid_param(
                                format!("messages[{i}].content[{j}]"),
                                message,
                            )
                        })?;
                    }
                } else {
                    return Err(GatewayError::invalid_param(
                        format!("messages[{i}].content"),
                        "`content` must be a string, an array of parts, or null",
                    ));
                }
            }
        }
        if let Some(calls) = tool_calls {
            for call in calls.items() {
                let function = call.get("function");
                let name = function
                    .and_then(|f| f.get("name"))
                    .and_then(|n| n.as_str());
                let args = function
                    .and_then(|f| f.get("arguments"))
                    .and_then(|a| a.as_str());
                hasher.feed_tool_call(name.unwrap_or(""), args.unwrap_or(""));
            }
        }
        if let Some(id) = tool_call_id.and_then(|c| c.as_str()) {
            hasher.feed_content_part(id);
        }
    }
    Ok(media)
}

/// Feeds a JSON value in a canonical compact form (keys in the order given, strings
/// unescaped) without building it as a string first.
fn feed_json(value: Json, hasher: &mut PromptHasher) {
    use std::io::Write as _;
    if let Some(text) = value.as_str() {
        hasher.feed(b"\"");
        hasher.feed(text.as_bytes());
        hasher.feed(b"\"");
    } else if value.is_array() {
        hasher.feed(b"[");
        for (i, item) in value.items().enumerate() {
            if i > 0 {
                hasher.feed(b",");
            }
            feed_json(item, hasher);
        }
        hasher.feed(b"]");
    } else if value.is_object() {
        hasher.feed(b"{");
        for (i, (k, v)) in value.members().enumerate() {
            if i > 0 {
                hasher.feed(b",");
            }
            hasher.feed(b"\"");
            hasher.feed(k.as_bytes());
            hasher.feed(b"\":");
            feed_json(v, hasher);
        }
        hasher.feed(b"}");
    } else {
        // A number, boolean or null, written without allocating.
        let mut buf = [0u8; 40];
        let mut cursor = std::io::Cursor::new(&mut buf[..]);
        let _ = if let Some(number) = value.as_number() {
            match number {
                Number::U64(u) => write!(cursor, "{u}"),
                Number::I64(i) => write!(cursor, "{i}"),
                Number::F64(f) => write!(cursor, "{f}"),
            }
        } else if let Some(b) = value.as_bool() {
            write!(cursor, "{b}")
        } else {
            write!(cursor, "null")
        };
        let n = cursor.position() as usize;
        hasher.feed(&buf[..n]);
    }
}

/// Feeds one content part: a text part's text, an image or audio part as its stable
/// media id (noted in `media`), any other part as its type. `Err`: why the part is
/// unusable.
fn feed_part(
    part: Json,
    hasher: &mut PromptHasher,
    media: &mut MediaNeeds,
) -> Result<(), &'static str> {
    const NO_TYPE: &str = "content parts must be objects with a `type`";
    let kind = part.get("type").ok_or(NO_TYPE)?.as_str().ok_or(NO_TYPE)?;
    let source = |outer: &str, inner: &str| {
        part.get(outer)
            .and_then(|o| o.get(inner))
            .and_then(|v| v.as_str())
    };
    let (modality, tag, source) = match kind {
        "text" => {
            let text = part.get("text").and_then(|t| t.as_str());
            hasher.feed_content_part(text.ok_or("a `text` part needs a string `text`")?);
            return Ok(());
        }
        "image_url" => (
            Capabilities::IMAGE,
            b'i',
            source("image_url", "url")
                .ok_or("an `image_url` part needs a string `image_url.url`")?,
        ),
        "input_audio" => (
            Capabilities::AUDIO,
            b'a',
            source("input_audio", "data")
                .ok_or("an `input_audio` part needs a string `input_audio.data`")?,
        ),
        "audio_url" => (
            Capabilities::AUDIO,
            b'a',
            source("audio_url", "url")
                .ok_or("an `audio_url` part needs a string `audio_url.url`")?,
        ),
        other => {
            hasher.feed_content_part(other);
            return Ok(());
        }
    };
    let block = hasher.feed_media_part(tag, media_id(source));
    media.note(modality, block);
    Ok(())
}

fn feed_prompt(prompt: Option<Json>, hasher: &mut PromptHasher) -> Result<(), GatewayError> {
    let prompt =
        prompt.ok_or_else(|| GatewayError::invalid_param("prompt", "`prompt` is required"))?;
    let bad = || {
        GatewayError::invalid_param(
            "prompt",
            "`prompt` must be a string, an array of strings, or an array of token ids",
        )
    };
    if let Some(text) = prompt.as_str() {
        hasher.feed_prompt(text);
        return Ok(());
    }
    if !prompt.is_array() {
        return Err(bad());
    }
    // Batched prompts and token-id prompts: hash the first prompt's content.
    match prompt.items().next().ok_or_else(bad)? {
        v if v.as_str().is_some() => {
            if !prompt.items().all(|i| i.as_str().is_some()) {
                return Err(bad());
            }
            hasher.feed_prompt(v.as_str().unwrap_or(""));
        }
        v if v.as_u64().is_some() => {
            hasher.feed_prompt("");
            for t in prompt.items() {
                hasher.feed_token_id(t.as_u64().ok_or_else(bad)?);
            }
        }
        v if v.is_array() => {
            hasher.feed_prompt("");
            for t in v.items() {
                hasher.feed_token_id(t.as_u64().ok_or_else(bad)?);
            }
        }
        _ => return Err(bad()),
    }
    Ok(())
}

/// The previous, sonic-rs based parser: the reference the tests and the `json_body`
/// fuzz target (also replayed in `tests/fuzz_corpus.rs`) hold [`BodyParser`] to.
/// Not in the product: built for tests and with the `dom-reference` feature only.
#[cfg(any(test, feature = "dom-reference"))]
#[doc(hidden)]
pub mod dom_reference;

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroUsize;

    fn parse(endpoint: Endpoint, body: &str) -> Result<RequestFacts, GatewayError> {
        let models = ModelTable::new(vec!["sim".into()]);
        let mut hasher = PromptHasher::new(NonZeroUsize::new(64).unwrap());
        BodyParser::default().parse(endpoint, body.as_bytes(), &models, &mut hasher, 0)
    }

    fn param_of(endpoint: Endpoint, body: &str) -> Option<String> {
        parse(endpoint, body).unwrap_err().param
    }

    #[test]
    fn stops_at_a_top_level_member_before_checking_anything() {
        let models = ModelTable::new(vec!["sim".into()]);
        let mut hasher = PromptHasher::new(NonZeroUsize::new(64).unwrap());
        let mut parse = |body: &str, stop_at| {
            let chat = Endpoint::ChatCompletions;
            BodyParser::default().parse_unless_member(
                chat,
                body.as_bytes(),
                &models,
                &mut hasher,
                0,
                stop_at,
            )
        };
        let rag = r#"{"model":"nope","rag":{"chunks":["a"],"query":"q"}}"#;
        assert!(parse(rag, Some("rag")).unwrap().is_none());
        // Without a member to stop at, the same body is checked as usual.
        assert_eq!(parse(rag, None).unwrap_err().kind, ErrorKind::ModelNotFound);
        // Only a top-level member counts, not the name in a value or a nested object.
        let nested = r#"{"model":"sim","messages":[{"role":"user","content":"\"rag\"","rag":1}]}"#;
        assert!(parse(nested, Some("rag")).unwrap().is_some());
        assert!(parse(
            r#"{"model":"sim","messages":[{"role":"user","content":"x"}],"ragged":1}"#,
            Some("rag")
        )
        .unwrap()
        .is_some());
        // Malformed JSON is still an error, member or not.
        assert!(parse(r#"{"rag":{}"#, Some("rag")).is_err());
    }

    #[test]
    fn nesting_scan() {
        assert!(!nesting_exceeds(br#"{"a":[[1]],"s":"[[[[\"[["}"#, 3));
        assert!(nesting_exceeds(br#"{"a":[[[1]]]}"#, 3));
        assert!(!nesting_exceeds(br#""unterminated \"#, 1));
        assert!(!nesting_exceeds(b"]]]]{", 1));
    }

    #[test]
    fn hostile_json_is_400_never_a_crash() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        for body in [
            format!(
                r#"{{"model":"sim","tools":{},"messages":[{{"role":"user","content":"x"}}]}}"#,
                deep(100_000)
            ),
            format!(
                r#"{{"model":"sim","messages":[{{"role":"user","content":"x","extra":{}}}]}}"#,
                deep(100_000)
            ),
            "[".repeat(1_000_000),
            format!(
                r#"{{"model":"sim","max_tokens":1{},"messages":[]}}"#,
                "0".repeat(400)
            ),
            r#"{"model":"sim","max_tokens":1e999,"messages":[{"role":"user","content":"x"}]}"#
                .into(),
            r#"{"model":"sim","max_tokens":-1,"messages":[{"role":"user","content":"x"}]}"#.into(),
            r#"{"model":"sim","prompt":[99999999999999999999999]}"#.into(),
        ] {
            for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
                let e = parse(endpoint, &body).unwrap_err();
                assert_eq!(e.status(), 400, "{e}");
            }
        }
        let models = ModelTable::new(vec!["sim".into()]);
        let mut hasher = PromptHasher::new(NonZeroUsize::new(64).unwrap());
        let bad_utf8 =
            b"{\"model\":\"sim\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}";
        let e = BodyParser::default()
            .parse(Endpoint::ChatCompletions, bad_utf8, &models, &mut hasher, 0)
            .unwrap_err();
        assert_eq!(e.code(), "invalid_json");
    }

    #[test]
    fn reads_facts() {
        let f = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"sim","stream":true,"max_tokens":7,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
        )
        .unwrap();
        assert_eq!(f.model, 0);
        assert!(f.stream);
        assert_eq!(f.max_tokens, Some(7));
        assert!(f.affinity_key.is_some());
        let c = parse(Endpoint::Completions, r#"{"model":"sim","prompt":[1,2,3]}"#).unwrap();
        assert!(!c.stream);
    }

    #[test]
    fn errors_name_the_param() {
        use Endpoint::*;
        assert_eq!(
            parse(ChatCompletions, "{nope").unwrap_err().kind,
            ErrorKind::MalformedJson
        );
        assert_eq!(
            parse(ChatCompletions, "[1]").unwrap_err().kind,
            ErrorKind::MalformedJson
        );
        assert_eq!(
            param_of(ChatCompletions, r#"{"messages":[]}"#).as_deref(),
            Some("model")
        );
        assert_eq!(
            param_of(ChatCompletions, r#"{"model":3}"#).as_deref(),
            Some("model")
        );
        assert_eq!(
            param_of(ChatCompletions, r#"{"model":"sim"}"#).as_deref(),
            Some("messages")
        );
        assert_eq!(
            param_of(
                ChatCompletions,
                r#"{"model":"sim","messages":[{"content":"x"}]}"#
            )
            .as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            param_of(
                ChatCompletions,
                r#"{"model":"sim","messages":[{"role":"user","content":5}]}"#
            )
            .as_deref(),
            Some("messages[0].content")
        );
        assert_eq!(
            param_of(
                ChatCompletions,
                r#"{"model":"sim","stream":"yes","messages":[{"role":"user","content":"x"}]}"#
            )
            .as_deref(),
            Some("stream")
        );
        assert_eq!(
            param_of(
                ChatCompletions,
                r#"{"model":"sim","max_tokens":-1,"messages":[{"role":"user","content":"x"}]}"#
            )
            .as_deref(),
            Some("max_tokens")
        );
        assert_eq!(
            param_of(Completions, r#"{"model":"sim","prompt":{}}"#).as_deref(),
            Some("prompt")
        );
        let e = parse(ChatCompletions, r#"{"model":"gpt-9","messages":[]}"#).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ModelNotFound);
        assert_eq!(e.status(), 404);
    }

    #[test]
    fn duplicate_keys_are_refused_naming_the_key() {
        use Endpoint::*;
        for (body, param) in [
            (
                r#"{"model":"sim","model":"other","messages":[{"role":"user","content":"x"}]}"#,
                "model",
            ),
            (
                r#"{"model":"sim","model":"other","messages":[{"role":"user","content":"x"}]}"#,
                "model",
            ),
            (
                r#"{"model":"sim","max_tokens":1,"max_tokens":3000,"messages":[{"role":"user","content":"x"}]}"#,
                "max_tokens",
            ),
            (
                r#"{"model":"sim","messages":[{"role":"user","content":"x","role":"system"}]}"#,
                "messages[0].role",
            ),
        ] {
            let e = parse(ChatCompletions, body).unwrap_err();
            assert_eq!((e.status(), e.code()), (400, "invalid_json"), "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            let key = param.rsplit('.').next().unwrap();
            assert!(e.message.contains(&format!("`{key}`")), "{}", e.message);
        }
        let e = parse(Completions, r#"{"model":"sim","prompt":"a","prompt":"b"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        // The same key in different objects is no duplicate.
        parse(
            ChatCompletions,
            r#"{"model":"sim","messages":[{"role":"user","content":"x"},{"role":"user","content":"y"}]}"#,
        )
        .unwrap();
    }

    fn blocks_of(body: &str) -> Vec<u64> {
        let models = ModelTable::new(vec!["sim".into()]);
        let mut hasher = PromptHasher::new(NonZeroUsize::new(8).unwrap());
        BodyParser::default()
            .parse(
                Endpoint::ChatCompletions,
                body.as_bytes(),
                &models,
                &mut hasher,
                0,
            )
            .unwrap();
        hasher.blocks().to_vec()
    }

    #[test]
    fn tools_and_tool_calls_shape_the_prefix() {
        let tools = r#""tools":[{"type":"function","function":{"name":"search","parameters":{"type":"object","n":1.5}}}]"#;
        let a = blocks_of(&format!(
            r#"{{"model":"sim",{tools},"messages":[{{"role":"user","content":"hi"}}]}}"#
        ));
        let b = blocks_of(r#"{"model":"sim","messages":[{"role":"user","content":"hi"}]}"#);
        assert_ne!(a.first(), b.first(), "tools come first in the stream");
        let call = |args: &str| {
            blocks_of(&format!(
                r#"{{"model":"sim","messages":[{{"role":"assistant","content":null,"tool_calls":[{{"id":"c1","type":"function","function":{{"name":"search","arguments":"{args}"}}}}]}},{{"role":"tool","tool_call_id":"c1","content":"result"}}]}}"#
            ))
        };
        assert_ne!(call("x"), call("y"));
        assert_eq!(call("x"), call("x"));
        let e = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"sim","tools":3,"messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools"));
    }

    #[test]
    fn same_prefix_same_affinity() {
        let long = "x".repeat(200);
        let a = parse(
            Endpoint::ChatCompletions,
            &format!(r#"{{"model":"sim","messages":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"a"}}]}}"#),
        )
        .unwrap();
        let b = parse(
            Endpoint::ChatCompletions,
            &format!(r#"{{"model":"sim","messages":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"b"}}]}}"#),
        )
        .unwrap();
        assert_eq!(a.affinity_key, b.affinity_key);
    }

    #[test]
    fn media_parts_are_noted_and_hashed_as_stable_ids() {
        let body = |url: &str, text: &str| {
            format!(
                r#"{{"model":"sim","messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{url}"}}}},{{"type":"text","text":"{text}"}}]}}]}}"#,
                "s".repeat(40)
            )
        };
        let f = parse(Endpoint::ChatCompletions, &body("https://x/cat.png", "a")).unwrap();
        assert_eq!(f.media.kinds, Capabilities::IMAGE);
        assert_eq!((f.media.images, f.media.audio), (1, 0));
        // 64-byte blocks: 55 bytes of system message and user header, then the
        // 19-byte media id, which ends in block 1.
        assert_eq!(f.media.first_block, 1);
        let text_only = parse(Endpoint::ChatCompletions, &chat("x")).unwrap();
        assert!(text_only.media.is_text_only());
        let cat = blocks_of(&body("https://x/cat.png", "what is this animal"));
        let same = blocks_of(&body("https://x/cat.png", "what is this animal"));
        let dog = blocks_of(&body("https://x/dog.png", "what is this animal"));
        assert_eq!(cat, same);
        assert_ne!(cat.last(), dog.last());
        let e = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"sim","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":1}}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"));
        assert!(e.message.contains("image_url.url"), "{e}");
    }

    fn chat(text: &str) -> String {
        format!(r#"{{"model":"sim","messages":[{{"role":"user","content":"{text}"}}]}}"#)
    }

    /// The lazy parser against the DOM parser it replaced, on bodies that exercise
    /// every field, escapes, duplicate keys, odd numbers and malformed JSON: the same
    /// facts and block hashes, or the same error (kind, param and message).
    #[test]
    fn agrees_with_the_dom_parser() {
        use Endpoint::*;
        let chat = [
            r#"{"model":"sim","messages":[{"role":"user","content":"hi"}]}"#,
            r#"  {"model":"sim","messages":[{"role":"user","content":"hi"}]}  \n"#,
            r#"{"model":"sim","stream":true,"stream_options":{"include_usage":true},"max_tokens":7,"user":"u","messages":[{"role":"system","content":"a\nb\"c\u00e9\ud83d\ude00"},{"role":"user","name":"n\t","content":"x"}]}"#,
            r#"{"model":"sim","model":"other","messages":[{"role":"user","role":"x","content":"a","content":"b"}]}"#,
            r#"{"mod\u0065l":"sim","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"sim","mod\u0065l":"other","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"sim","max_tokens":1,"max_tokens":3000,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":"a"},{"role":"user","content":[{"type":"text","text":"a","text":"b"}]}]}"#,
            r#"{"model":"sim","stream_options":{"include_usage":false,"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"sim","tools":[{"type":"function","function":{"name":"f","parameters":{"p":{"q":1},"p":2}}}],"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":"x","content":"y"}],"model":"sim"}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":"x"}],"x":{"a":1,"a":2},"x":3}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":"x","content":"y"}],"bad":tru}"#,
            r#"{"model":"sim","a":{"model":"x"},"b":[{"model":"y"}],"messages":[{"role":"user","content":"model"}]}"#,
            r#"[{"a":1,"a":2}]"#,
            r#"{"model":"sim","max_tokens":null,"max_completion_tokens":9,"stream":null,"user":null,"cache_salt":"s\n","messages":[{"role":"user","content":null}]}"#,
            r#"{"model":"sim","stream_options":[1],"messages":[{"role":"user"}]}"#,
            r#"{"model":"sim","stream_options":{"include_usage":"yes"},"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","max_tokens":1.0,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","max_tokens":1e3,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","max_tokens":18446744073709551616,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","user":5,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","cache_salt":1,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","tools":[{"type":"function","function":{"name":"f\u0041","parameters":{"n":1.5,"m":-3,"k":0,"e":1e2,"f":-0.0,"big":12345678901234567890,"neg":-9223372036854775808,"t":true,"f2":false,"z":null,"a":[],"o":{},"s":"q\"\\"}}}],"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","tools":null,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","tools":{},"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":[{"type":"text","text":"a\u0000"},{"type":"image_url","image_url":{"url":"data:x"}},{"type":"image_url","image_url":{"url":3}},{"type":"input_audio","input_audio":{}}]}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"UklG","format":"wav"}},{"type":"audio_url","audio_url":{"url":"https://a/b.mp3"}},{"type":"image_url","image_url":{"url":"https://a/c.png","detail":"low"}}]}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":[{"type":"audio_url","audio_url":{"url":7}}]}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":["x"]}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":[{"type":3}]}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":{}}]}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":"x"},3]}"#,
            r#"{"model":"sim","messages":[{"role":5,"content":"x"}]}"#,
            r#"{"model":"sim","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1","function":{"name":"f","arguments":"{\"a\":1}"}},{"function":{"name":3}},"junk",{"function":"nope"}]},{"role":"tool","tool_call_id":"1\n","content":"r"}]}"#,
            r#"{"model":"sim","messages":[{"role":"assistant","tool_calls":{"a":1},"tool_call_id":7}]}"#,
            r#"{"model":"sim","messages":[]}"#,
            r#"{"model":"sim","messages":{}}"#,
            r#"{"model":"sim"}"#,
            r#"{"model":"nope","messages":[]}"#,
            r#"{"model":null,"messages":[]}"#,
            r#"{}"#,
            r#" { } "#,
            r#"[1]"#,
            r#""str""#,
            r#"3"#,
            r#""#,
            r#"   "#,
            r#"{"model":"sim","messages":[{"role":"user","content":"x"}]}}"#,
            r#"{"model":"sim","messages":[{"role":"user","content":"x"}]} x"#,
            r#"{"model":"sim","messages":[{"role":"user","content":"x"}]"#,
            r#"{"model":"sim","messages":[{"role":"user","content":"x"}],}"#,
            r#"{"model":"sim","x":tru,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","x":[1,2,],"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","x":01,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","x":"\q","messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","x":"\ud800","messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"sim","x":"tab	in","messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model" "sim"}"#,
            r#"{model:"sim"}"#,
        ];
        let completions = [
            r#"{"model":"sim","prompt":"hello\nworld"}"#,
            r#"{"model":"sim","prompt":["a","b"]}"#,
            r#"{"model":"sim","prompt":["a",1]}"#,
            r#"{"model":"sim","prompt":[1,2,3]}"#,
            r#"{"model":"sim","prompt":[1,-2]}"#,
            r#"{"model":"sim","prompt":[[1,2],[3]]}"#,
            r#"{"model":"sim","prompt":[[1,"x"]]}"#,
            r#"{"model":"sim","prompt":[]}"#,
            r#"{"model":"sim","prompt":[null]}"#,
            r#"{"model":"sim","prompt":{}}"#,
            r#"{"model":"sim","prompt":1}"#,
            r#"{"model":"sim"}"#,
        ];
        let mut bodies: Vec<(Endpoint, Vec<u8>)> = chat
            .iter()
            .map(|b| (ChatCompletions, b.as_bytes().to_vec()))
            .chain(
                completions
                    .iter()
                    .map(|b| (Completions, b.as_bytes().to_vec())),
            )
            .collect();
        // Not UTF-8, inside a string and outside one.
        bodies.push((
            ChatCompletions,
            b"{\"model\":\"s\xffm\",\"messages\":[]}".to_vec(),
        ));
        bodies.push((ChatCompletions, b"{\"model\":\"sim\"}\xff".to_vec()));
        let models = ModelTable::new(vec!["sim".into()]);
        for (endpoint, body) in &bodies {
            let shown = String::from_utf8_lossy(body);
            let mut lazy_hasher = PromptHasher::new(NonZeroUsize::new(4).unwrap());
            let mut dom_hasher = PromptHasher::new(NonZeroUsize::new(4).unwrap());
            let lazy = BodyParser::default().parse(*endpoint, body, &models, &mut lazy_hasher, 7);
            let dom =
                dom_reference::DomBodyParser.parse(*endpoint, body, &models, &mut dom_hasher, 7);
            match (lazy, dom) {
                (Ok(a), Ok(b)) => {
                    assert_eq!(a, b, "{shown}");
                    assert_eq!(lazy_hasher.blocks(), dom_hasher.blocks(), "{shown}");
                }
                (Err(a), Err(b)) => {
                    assert_eq!(a.kind, b.kind, "{shown}");
                    assert_eq!(a.param, b.param, "{shown}");
                    if a.kind != ErrorKind::MalformedJson {
                        assert_eq!(a.message, b.message, "{shown}");
                    }
                }
                (a, b) => panic!("{shown}: lazy {a:?}, dom {b:?}"),
            }
        }
    }
}
