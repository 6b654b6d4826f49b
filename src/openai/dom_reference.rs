//! The DOM-based body parser this module used before the one-pass one (sonic-rs `Value`),
//! kept as the reference the one-pass parser must agree with (the helpers it
//! did not change, `feed_json`, `feed_part`, `feed_prompt` and
//! `optional_count`, are shared): same facts, same
//! errors (kind and param), same canonical prompt stream (block hashes).

use super::{feed_json, feed_part, feed_prompt, optional_count};
use super::{Endpoint, ErrorKind, GatewayError, ModelTable, RequestFacts};
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
