//! The body parser the gateway used before its own scanner ([`super::tape`]): a
//! sonic-rs `Value` tree read with keyed lookups. Kept, whole and independent of the
//! gateway's code, as the reference [`super::BodyParser`] must agree with in the
//! tests and the `json_body` fuzz target: same facts, same errors (kind and param;
//! the message too except for malformed JSON, whose detail is each parser's own),
//! same canonical prompt stream (block hashes). Duplicate keys are refused here by
//! walking the tree (sonic-rs keeps every occurrence), independently of the tape's
//! check: same rule, same `param`.

use super::{Endpoint, ErrorKind, GatewayError, ModelTable, RequestFacts};
use radixgate_orchestrator::media::media_id;
use radixgate_orchestrator::Capabilities;
use radixgate_orchestrator::{MediaNeeds, PromptHasher};
use sonic_rs::{JsonContainerTrait, JsonValueTrait, Value};

/// Per-shard parsing state. sonic-rs parses the original bytes (it does not rewrite
/// its input, so no scratch copy is needed); measured against simd-json in
/// `benches/parse.rs`: 1.2–2.5× faster for the whole step, 3 allocations per parse
/// instead of 9–10.
#[derive(Default)]
pub struct DomBodyParser;

impl DomBodyParser {
    pub fn parse(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
        models: &ModelTable,
        hasher: &mut PromptHasher,
        seed_mix: u64,
    ) -> Result<RequestFacts, GatewayError> {
        if super::nesting_exceeds(body, super::MAX_JSON_DEPTH) {
            return Err(GatewayError::new(
                ErrorKind::MalformedJson,
                "the request body is nested too deeply",
            ));
        }
        let value: Value = sonic_rs::from_slice(body).map_err(|e| {
            GatewayError::new(
                ErrorKind::MalformedJson,
                format!("the request body is not valid JSON: {e}"),
            )
        })?;
        if let Some(path) = first_duplicate(&value, String::new()) {
            return Err(GatewayError {
                kind: ErrorKind::MalformedJson,
                message: format!("the request body has a duplicate key at `{path}`"),
                param: Some(path),
            });
        }
        if !value.is_object() {
            return Err(GatewayError::new(
                ErrorKind::MalformedJson,
                "the request body must be a JSON object",
            ));
        }
        let model_name = match value.get("model") {
            None => return Err(GatewayError::invalid_param("model", "`model` is required")),
            Some(v) => v
                .as_str()
                .ok_or_else(|| GatewayError::invalid_param("model", "`model` must be a string"))?,
        };
        let model = models.get(model_name).ok_or_else(|| GatewayError {
            kind: ErrorKind::ModelNotFound,
            message: format!("The model `{model_name}` does not exist."),
            param: Some("model".into()),
        })?;
        let stream = match value.get("stream") {
            None => false,
            Some(v) if v.is_null() => false,
            Some(v) => v.as_bool().ok_or_else(|| {
                GatewayError::invalid_param("stream", "`stream` must be a boolean")
            })?,
        };
        let max_tokens = optional_count(value.get("max_tokens"), "max_tokens")?.or(optional_count(
            value.get("max_completion_tokens"),
            "max_completion_tokens",
        )?);
        if let Some(user) = value.get("user") {
            if !user.is_null() && user.as_str().is_none() {
                return Err(GatewayError::invalid_param(
                    "user",
                    "`user` must be a string",
                ));
            }
        }
        let include_usage = value
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        // vLLM keeps salted prompts apart in its cache; so does the index.
        let salt = match value.get("cache_salt") {
            None => None,
            Some(v) if v.is_null() => None,
            Some(v) => Some(v.as_str().ok_or_else(|| {
                GatewayError::invalid_param("cache_salt", "`cache_salt` must be a string")
            })?),
        };
        let salt_seed = salt.map_or(0, |s| xxhash_rust::xxh3::xxh3_64(s.as_bytes()));
        hasher.reset(models.seeds[model] ^ seed_mix ^ salt_seed);
        let media = match endpoint {
            Endpoint::ChatCompletions => feed_messages(&value, hasher)?,
            Endpoint::Completions => {
                feed_prompt(value.get("prompt"), hasher)?;
                MediaNeeds::TEXT_ONLY
            }
        };
        Ok(RequestFacts {
            adapter: None,
            model,
            stream,
            max_tokens,
            include_usage,
            has_cache_salt: salt.is_some(),
            affinity_key: hasher.affinity_key(),
            media,
        })
    }
}

/// The path (`messages[0].role`) of the first duplicate key in `value`: objects in
/// body order (an object before the values inside it), and within one object the
/// first key already seen earlier in it. Keys in paths are cut to 64 bytes (at a
/// char boundary, marked `…`), as the gateway quotes them.
fn first_duplicate(value: &Value, path: String) -> Option<String> {
    let join = |key: &str| {
        let key = if key.len() > 64 {
            let mut cut = 64;
            while !key.is_char_boundary(cut) {
                cut -= 1;
            }
            format!("{}…", &key[..cut])
        } else {
            key.to_string()
        };
        if path.is_empty() {
            key
        } else {
            format!("{path}.{key}")
        }
    };
    if let Some(map) = value.as_object() {
        let mut seen = std::collections::HashSet::new();
        for (k, _) in map.iter() {
            if !seen.insert(k) {
                return Some(join(k));
            }
        }
        map.iter().find_map(|(k, v)| first_duplicate(v, join(k)))
    } else if let Some(items) = value.as_array() {
        items
            .iter()
            .enumerate()
            .find_map(|(i, v)| first_duplicate(v, format!("{path}[{i}]")))
    } else {
        None
    }
}

fn feed_messages(value: &Value, hasher: &mut PromptHasher) -> Result<MediaNeeds, GatewayError> {
    let mut media = MediaNeeds::TEXT_ONLY;
    if let Some(tools) = value.get("tools") {
        if !tools.is_null() {
            if tools.as_array().is_none() {
                return Err(GatewayError::invalid_param(
                    "tools",
                    "`tools` must be an array",
                ));
            }
            hasher.feed_tools_start();
            feed_json(tools, hasher);
        }
    }
    let messages = value
        .get("messages")
        .ok_or_else(|| GatewayError::invalid_param("messages", "`messages` is required"))?
        .as_array()
        .ok_or_else(|| GatewayError::invalid_param("messages", "`messages` must be an array"))?;
    if messages.is_empty() {
        return Err(GatewayError::invalid_param(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        if !m.is_object() {
            return Err(GatewayError::invalid_param(
                format!("messages[{i}]"),
                "each message must be an object",
            ));
        }
        let role = m.get("role").and_then(|r| r.as_str()).ok_or_else(|| {
            GatewayError::invalid_param(
                format!("messages[{i}].role"),
                "each message needs a string `role`",
            )
        })?;
        let name = m.get("name").and_then(|n| n.as_str());
        match m.get("content") {
            None => hasher.feed_message(role, name, ""),
            Some(c) if c.is_null() => hasher.feed_message(role, name, ""),
            Some(c) => {
                if let Some(text) = c.as_str() {
                    hasher.feed_message(role, name, text);
                } else if let Some(parts) = c.as_array() {
                    hasher.feed_message(role, name, "");
                    for (j, part) in parts.iter().enumerate() {
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
        if let Some(calls) = m.get("tool_calls").and_then(|c| c.as_array()) {
            for call in calls {
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
        if let Some(id) = m.get("tool_call_id").and_then(|c| c.as_str()) {
            hasher.feed_content_part(id);
        }
    }
    Ok(media)
}

fn optional_count(value: Option<&Value>, key: &'static str) -> Result<Option<u64>, GatewayError> {
    match value {
        None => Ok(None),
        Some(v) if v.is_null() => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            GatewayError::invalid_param(key, format!("`{key}` must be a non-negative integer"))
        }),
    }
}

/// Feeds a JSON value in a canonical compact form (keys in the order given, strings
/// unescaped) without building it as a string first.
fn feed_json(value: &Value, hasher: &mut PromptHasher) {
    use std::io::Write as _;
    if let Some(text) = value.as_str() {
        hasher.feed(b"\"");
        hasher.feed(text.as_bytes());
        hasher.feed(b"\"");
    } else if let Some(items) = value.as_array() {
        hasher.feed(b"[");
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                hasher.feed(b",");
            }
            feed_json(item, hasher);
        }
        hasher.feed(b"]");
    } else if let Some(map) = value.as_object() {
        hasher.feed(b"{");
        for (i, (k, v)) in map.iter().enumerate() {
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
        let _ = if let Some(u) = value.as_u64() {
            write!(cursor, "{u}")
        } else if let Some(i) = value.as_i64() {
            write!(cursor, "{i}")
        } else if let Some(f) = value.as_f64() {
            write!(cursor, "{f}")
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
    part: &Value,
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

fn feed_prompt(prompt: Option<&Value>, hasher: &mut PromptHasher) -> Result<(), GatewayError> {
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
    let items = prompt.as_array().ok_or_else(bad)?;
    if items.is_empty() {
        return Err(bad());
    }
    // Batched prompts and token-id prompts: hash the first prompt's content.
    match &items[0] {
        v if v.as_str().is_some() => {
            if !items.iter().all(|i| i.as_str().is_some()) {
                return Err(bad());
            }
            hasher.feed_prompt(v.as_str().unwrap_or(""));
        }
        v if v.as_u64().is_some() => {
            hasher.feed_prompt("");
            for t in items {
                hasher.feed_token_id(t.as_u64().ok_or_else(bad)?);
            }
        }
        v if v.as_array().is_some() => {
            hasher.feed_prompt("");
            for t in v.as_array().into_iter().flatten() {
                hasher.feed_token_id(t.as_u64().ok_or_else(bad)?);
            }
        }
        _ => return Err(bad()),
    }
    Ok(())
}
