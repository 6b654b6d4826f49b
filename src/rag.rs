//! RAG requests at the edge: turns a chat body's structured retrieval field
//! (`routing.rag_field`, default `rag`: `{"system": str, "chunks": [str], "query": str}`)
//! into the plain OpenAI body that goes upstream, before the body parser hashes it.
//!
//! The chunks are de-duplicated and ordered by the orchestrator
//! ([`radixgate_orchestrator::rag`]) and become one system message after the system
//! text; the query becomes the user message. The request then routes like any chat
//! request, plus chunk affinity on the chunk ids returned here. The gateway calls
//! [`normalise`] only for a body whose one routing parse saw the member at the top
//! level (`BodyParser::parse_unless_member`); bodies without it pass through untouched
//! at no extra cost. [`normalise`] itself still checks for the quoted name first.

use crate::error::{ErrorKind, GatewayError};
use radixgate_orchestrator::rag::{canonical_chunks, render_context};
use sonic_rs::{JsonContainerTrait, JsonValueMutTrait, JsonValueTrait, Value};

/// A RAG request made plain.
#[derive(Debug)]
pub struct Normalised {
    /// The body to parse and send upstream.
    pub body: Vec<u8>,
    /// The distinct chunk ids, in canonical order.
    pub chunk_ids: Vec<u64>,
}

/// `Ok(None)`: `body` has no `field` member (send it as it is). Errors name the
/// offending `param` (`rag.chunks[2]`, ...). Malformed JSON is left to the body parser.
pub fn normalise(body: &[u8], field: &str) -> Result<Option<Normalised>, GatewayError> {
    if !mentions_member(body, field)
        || crate::openai::nesting_exceeds(body, crate::openai::MAX_JSON_DEPTH)
    {
        return Ok(None);
    }
    let Ok(mut value) = sonic_rs::from_slice::<Value>(body) else {
        return Ok(None);
    };
    let Some(object) = value.as_object_mut() else {
        return Ok(None);
    };
    let Some(rag) = object.remove(&field) else {
        return Ok(None);
    };
    let param = |key: &str| format!("{field}{key}");
    if object.get(&"messages").is_some() {
        return Err(GatewayError::invalid_param(
            field,
            format!("`{field}` replaces `messages`; send one or the other"),
        ));
    }
    if !rag.is_object() {
        return Err(GatewayError::invalid_param(
            field,
            format!("`{field}` must be an object with `chunks` and `query`"),
        ));
    }
    let system = match rag.get("system") {
        None => None,
        Some(v) if v.is_null() => None,
        Some(v) => Some(v.as_str().ok_or_else(|| {
            GatewayError::invalid_param(param(".system"), "`system` must be a string")
        })?),
    };
    let query = rag
        .get("query")
        .and_then(|q| q.as_str())
        .ok_or_else(|| GatewayError::invalid_param(param(".query"), "`query` must be a string"))?;
    let chunks = rag
        .get("chunks")
        .and_then(|c| c.as_array())
        .ok_or_else(|| {
            GatewayError::invalid_param(param(".chunks"), "`chunks` must be an array of strings")
        })?;
    let mut texts = Vec::with_capacity(chunks.len());
    for (i, c) in chunks.iter().enumerate() {
        texts.push(c.as_str().ok_or_else(|| {
            GatewayError::invalid_param(
                param(&format!(".chunks[{i}]")),
                "each chunk must be a string",
            )
        })?);
    }
    let canonical = canonical_chunks(texts);
    let context = render_context(system, &canonical);
    let mut messages = sonic_rs::Array::with_capacity(2);
    if !context.is_empty() {
        messages.push(message("system", &context));
    }
    messages.push(message("user", query));
    object.insert(&"messages", Value::from(messages));
    let body = sonic_rs::to_vec(&value).map_err(|e| {
        GatewayError::new(
            ErrorKind::MalformedJson,
            format!("the request body could not be rewritten: {e}"),
        )
    })?;
    Ok(Some(Normalised {
        body,
        chunk_ids: canonical.iter().map(|(id, _)| *id).collect(),
    }))
}

/// Whether `"field"` (quoted) occurs in `body`: the one check every chat body pays.
/// Prose that merely contains the word (`storage`, `paragraph`) does not count.
fn mentions_member(body: &[u8], field: &str) -> bool {
    memchr::memmem::find_iter(body, field.as_bytes())
        .any(|i| i > 0 && body[i - 1] == b'"' && body.get(i + field.len()) == Some(&b'"'))
}

fn message(role: &str, content: &str) -> Value {
    let mut m = sonic_rs::Object::with_capacity(2);
    m.insert(&"role", role);
    m.insert(&"content", content);
    Value::from(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(body: &str) -> (serde_json::Value, Vec<u64>) {
        let n = normalise(body.as_bytes(), "rag").unwrap().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&n.body).unwrap();
        assert!(v.get("rag").is_none());
        (v["messages"].clone(), n.chunk_ids)
    }

    #[test]
    fn chunk_order_and_duplicates_do_not_matter() {
        let (a, ids_a) = messages(
            r#"{"model":"m","rag":{"system":"S","chunks":["b","a","b"],"query":"q"},"max_tokens":3}"#,
        );
        let (b, ids_b) =
            messages(r#"{"model":"m","rag":{"system":"S","chunks":["a","b"],"query":"q"}}"#);
        assert_eq!(a, b);
        assert_eq!(ids_a, ids_b);
        assert_eq!(ids_a.len(), 2);
        assert_eq!(a[1], serde_json::json!({"role":"user","content":"q"}));
        assert!(a[0]["content"].as_str().unwrap().starts_with("S\n\n"));
        let (only_query, _) = messages(r#"{"model":"m","rag":{"chunks":[],"query":"q"}}"#);
        assert_eq!(only_query.as_array().unwrap().len(), 1);
    }

    #[test]
    fn only_the_quoted_name_costs_a_parse() {
        assert!(mentions_member(br#"{"rag":{}}"#, "rag"));
        assert!(!mentions_member(
            br#"{"messages":"storage paragraph rag"}"#,
            "rag"
        ));
        assert!(!mentions_member(br#"{"ragged":1}"#, "rag"));
        assert!(!mentions_member(b"rag\"", "rag"));
    }

    #[test]
    fn plain_bodies_pass_and_bad_fields_name_their_param() {
        for plain in [
            r#"{"model":"m","messages":[{"role":"user","content":"rag"}]}"#,
            r#"{"model":"m","messages":[]"#,
            r#"[1,"rag"]"#,
        ] {
            assert!(
                normalise(plain.as_bytes(), "rag").unwrap().is_none(),
                "{plain}"
            );
        }
        let param = |body: &str| {
            normalise(body.as_bytes(), "rag")
                .unwrap_err()
                .param
                .unwrap()
        };
        assert_eq!(param(r#"{"rag":3}"#), "rag");
        assert_eq!(
            param(r#"{"rag":{"chunks":[],"query":"q"},"messages":[]}"#),
            "rag"
        );
        assert_eq!(param(r#"{"rag":{"chunks":[]}}"#), "rag.query");
        assert_eq!(param(r#"{"rag":{"query":"q"}}"#), "rag.chunks");
        assert_eq!(
            param(r#"{"rag":{"chunks":["a",1],"query":"q"}}"#),
            "rag.chunks[1]"
        );
        assert_eq!(
            param(r#"{"rag":{"system":1,"chunks":[],"query":"q"}}"#),
            "rag.system"
        );
        let custom = normalise(br#"{"ctx":{"chunks":["a"],"query":"q"}}"#, "ctx").unwrap();
        assert_eq!(custom.unwrap().chunk_ids.len(), 1);
    }
}
