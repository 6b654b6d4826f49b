//! The request bodies of a split request's legs, rewritten from the client's.
//!
//! Only split requests pay for this (a parse and a re-serialisation per leg); whole
//! requests still go upstream byte for byte.

use crate::error::{ErrorKind, GatewayError};
use serde_json::{json, Map, Value};
use std::net::IpAddr;

fn object(body: &[u8]) -> Result<Map<String, Value>, GatewayError> {
    serde_json::from_slice(body)
        .map_err(|e| GatewayError::new(ErrorKind::MalformedJson, format!("invalid JSON body: {e}")))
}

fn bytes(v: Map<String, Value>) -> Vec<u8> {
    serde_json::to_vec(&Value::Object(v)).unwrap_or_default()
}

/// vLLM's prefill leg: one token, not streamed, asking for a remote decode.
pub fn vllm_prefill(body: &[u8]) -> Result<Vec<u8>, GatewayError> {
    let mut v = object(body)?;
    v.insert("stream".into(), Value::Bool(false));
    v.insert("max_tokens".into(), json!(1));
    if v.contains_key("max_completion_tokens") {
        v.insert("max_completion_tokens".into(), json!(1));
    }
    v.remove("stream_options");
    v.remove("min_tokens");
    v.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    Ok(bytes(v))
}

/// The `kv_transfer_params` a vLLM prefill answer carries.
pub fn transfer_params(answer: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(answer).ok()?;
    v.get("kv_transfer_params")
        .filter(|p| p.is_object())
        .cloned()
}

/// vLLM's decode leg: the client's request with the prefill's `kv_transfer_params`.
pub fn vllm_decode(body: &[u8], params: Value) -> Result<Vec<u8>, GatewayError> {
    let mut v = object(body)?;
    v.insert("kv_transfer_params".into(), params);
    Ok(bytes(v))
}

/// SGLang's two legs (the same body): the client's request with the prefill
/// server's bootstrap address and the request's room.
pub fn sglang(body: &[u8], host: IpAddr, port: u16, room: u64) -> Result<Vec<u8>, GatewayError> {
    let mut v = object(body)?;
    v.insert("bootstrap_host".into(), json!(host.to_string()));
    v.insert("bootstrap_port".into(), json!(port));
    v.insert("bootstrap_room".into(), json!(room));
    Ok(bytes(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_prefill_leg_is_one_token_unstreamed() {
        let body = br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"min_tokens":5,"max_tokens":50,"max_completion_tokens":50,"messages":[]}"#;
        let v: Value = serde_json::from_slice(&vllm_prefill(body).unwrap()).unwrap();
        assert_eq!(v["stream"], false);
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["max_completion_tokens"], 1);
        assert!(v.get("stream_options").is_none() && v.get("min_tokens").is_none());
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert!(v["kv_transfer_params"]["remote_block_ids"].is_null());
        let without: Value =
            serde_json::from_slice(&vllm_prefill(br#"{"model":"m"}"#).unwrap()).unwrap();
        assert!(without.get("max_completion_tokens").is_none());
    }

    #[test]
    fn decode_leg_carries_the_params_verbatim() {
        let answer =
            br#"{"id":"x","kv_transfer_params":{"remote_block_ids":[1,2],"remote_port":9}}"#;
        let p = transfer_params(answer).unwrap();
        let body = br#"{"model":"m","stream":true,"max_tokens":7}"#;
        let v: Value = serde_json::from_slice(&vllm_decode(body, p).unwrap()).unwrap();
        assert_eq!(v["kv_transfer_params"]["remote_block_ids"], json!([1, 2]));
        assert_eq!(v["stream"], true);
        assert_eq!(v["max_tokens"], 7);
        assert!(transfer_params(br#"{"id":"x"}"#).is_none());
        assert!(transfer_params(b"not json").is_none());
    }

    #[test]
    fn sglang_legs_carry_the_bootstrap_fields() {
        let b = sglang(br#"{"model":"m"}"#, "127.0.0.1".parse().unwrap(), 8998, 42).unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["bootstrap_host"], "127.0.0.1");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["bootstrap_room"], 42);
    }
}
