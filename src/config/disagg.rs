//! `[models.<name>.disagg]` and the backends' `role` / `bootstrap_port`: which models a
//! split prefill/decode pool serves, with which hand-off protocol, and the checks that
//! refuse impossible pools (wire structs and their validation).
//!
//! A model with a `disagg` table is *split*: its `prefill` backends compute prompts
//! and hand the KV to its `decode` backends (`proxy::disagg` runs the two legs,
//! `radixgate_orchestrator::disagg` picks the pair). `both` backends (the default role)
//! serve requests whole; for a split model they, and the decode backends, take the
//! requests the gateway serves locally (conditional disaggregation, fallback).

use super::{enum_value, BackendConfig};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// A backend's part in a split pool (`backends[].role`): routing's own type.
pub use radixgate_orchestrator::Role;

/// `models.<name>.disagg.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum SplitMode {
    Conditional,
    Always,
}

/// How the two legs of a split request are run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// vLLM (NIXL / Mooncake connectors): prefill first, its `kv_transfer_params`
    /// into the decode request.
    Vllm,
    /// SGLang: both legs at once, joined by `bootstrap_host/port/room`.
    Sglang,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Vllm => "vllm",
            Protocol::Sglang => "sglang",
        }
    }
}

#[derive(Debug, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct ModelWire {
    /// Serve this model with a split prefill/decode pool.
    #[serde(default)]
    disagg: Option<DisaggWire>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct DisaggWire {
    /// "vllm" (prefill, then decode with its `kv_transfer_params`) or "sglang" (both
    /// legs at once with a shared `bootstrap_room`).
    protocol: String,
    /// "conditional" (default): serve locally on a `both`/`decode` backend when the
    /// uncached part of the prompt is small or the prefill pool is the bottleneck.
    /// "always": split every request while a prefill backend is available.
    #[serde(default = "default_mode")]
    mode: String,
    /// conditional: split only when at least this many prompt tokens are uncached on
    /// the best prefill backend.
    #[serde(default = "default_min_uncached_tokens")]
    min_uncached_tokens: u64,
    /// conditional: the prefill pool is the bottleneck (serve locally) when even its
    /// least-loaded backend has at least this many requests in flight plus queued.
    #[serde(default = "default_prefill_saturation")]
    prefill_saturation: u32,
    /// Estimated KV-transfer cost per token moved to a decode backend, in
    /// microseconds (pair selection weighs it against decode load).
    #[serde(default = "default_transfer_us_per_token")]
    transfer_us_per_token: f64,
    /// Prefill backends tried per request (the first included) before giving up on
    /// the split.
    #[serde(default = "default_prefill_attempts")]
    prefill_attempts: u32,
    /// Fresh prefill+decode pairs tried when the decode leg fails before its first byte.
    #[serde(default = "default_decode_attempts")]
    decode_attempts: u32,
    /// When no prefill leg succeeds (or no prefill backend is available), serve the
    /// request locally on a `both`/`decode` backend instead of failing it.
    #[serde(default = "default_true")]
    local_fallback: bool,
    /// Longest a prefill leg may take, start to end.
    #[serde(default = "default_leg_timeout_ms")]
    prefill_timeout_ms: u64,
    /// Longest a decode leg may take to its first response byte (KV transfer included).
    #[serde(default = "default_leg_timeout_ms")]
    decode_first_byte_timeout_ms: u64,
}

fn default_mode() -> String {
    "conditional".into()
}
fn default_min_uncached_tokens() -> u64 {
    256
}
fn default_prefill_saturation() -> u32 {
    16
}
fn default_transfer_us_per_token() -> f64 {
    1.0
}
fn default_prefill_attempts() -> u32 {
    2
}
fn default_decode_attempts() -> u32 {
    2
}
fn default_true() -> bool {
    true
}
fn default_leg_timeout_ms() -> u64 {
    30_000
}

/// A split model's settings (`[models.<name>.disagg]`).
#[derive(Debug, Clone, PartialEq)]
pub struct DisaggConfig {
    pub protocol: Protocol,
    pub policy: radixgate_orchestrator::DisaggPolicy,
    pub prefill_attempts: u32,
    pub decode_attempts: u32,
    pub local_fallback: bool,
    pub prefill_timeout: Duration,
    pub decode_first_byte_timeout: Duration,
}

/// Split models by name.
pub type SplitModels = BTreeMap<String, Arc<DisaggConfig>>;

pub(super) fn validate_models(
    wire: BTreeMap<String, ModelWire>,
    errors: &mut Vec<String>,
) -> SplitModels {
    let mut out = BTreeMap::new();
    for (name, m) in wire {
        let Some(d) = m.disagg else { continue };
        let at = format!("models.{name}.disagg");
        let protocol = enum_value(
            &format!("{at}.protocol"),
            &d.protocol,
            Protocol::Vllm,
            errors,
        );
        let mode = enum_value(
            &format!("{at}.mode"),
            &d.mode,
            SplitMode::Conditional,
            errors,
        );
        let always = mode == SplitMode::Always;
        super::check_non_negative(
            d.transfer_us_per_token,
            &format!("{at}.transfer_us_per_token"),
            errors,
        );
        for (key, v) in [
            ("prefill_attempts", d.prefill_attempts),
            ("decode_attempts", d.decode_attempts),
            ("prefill_saturation", d.prefill_saturation),
        ] {
            if v == 0 {
                errors.push(format!("{at}.{key}: must be at least 1"));
            }
        }
        for (key, v) in [
            ("prefill_timeout_ms", d.prefill_timeout_ms),
            (
                "decode_first_byte_timeout_ms",
                d.decode_first_byte_timeout_ms,
            ),
        ] {
            if v == 0 {
                errors.push(format!("{at}.{key}: must be greater than 0"));
            }
        }
        let policy = radixgate_orchestrator::DisaggPolicy {
            always,
            min_uncached_tokens: d.min_uncached_tokens,
            prefill_saturation: d.prefill_saturation,
            transfer_ns_per_token: d.transfer_us_per_token * 1e3,
            ..Default::default()
        };
        out.insert(
            name,
            Arc::new(DisaggConfig {
                protocol,
                policy,
                prefill_attempts: d.prefill_attempts.clamp(1, 8),
                decode_attempts: d.decode_attempts.clamp(1, 8),
                local_fallback: d.local_fallback,
                prefill_timeout: Duration::from_millis(d.prefill_timeout_ms),
                decode_first_byte_timeout: Duration::from_millis(d.decode_first_byte_timeout_ms),
            }),
        );
    }
    out
}

/// `backends[].role` and `bootstrap_port` on their own (the admin API adds backends
/// one at a time, so this part needs no other backend).
pub(super) fn validate_role(
    role: &str,
    bootstrap_port: Option<u16>,
    at: &str,
    errors: &mut Vec<String>,
) -> Role {
    let role = Role::parse(role).unwrap_or_else(|| {
        errors.push(format!(
            "{at}.role: unknown role `{role}`; expected both, prefill or decode"
        ));
        Role::Both
    });
    if bootstrap_port.is_some() && role != Role::Prefill {
        errors.push(format!(
            "{at}.bootstrap_port: only a `prefill` backend (SGLang) has a bootstrap server"
        ));
    }
    if bootstrap_port == Some(0) {
        errors.push(format!("{at}.bootstrap_port: must be a port number"));
    }
    role
}

/// A backend against the split models: a `prefill` or `decode` backend must serve
/// only split models, and an SGLang prefill backend needs its bootstrap port.
pub fn check_backend(b: &BackendConfig, split: &SplitModels, at: &str, errors: &mut Vec<String>) {
    for m in &b.models {
        match split.get(m) {
            None if b.role != Role::Both => errors.push(format!(
                "{at}.role: `{}` backend serves `{m}`, which has no [models.{m}.disagg] table",
                b.role.as_str()
            )),
            Some(d)
                if d.protocol == Protocol::Sglang
                    && b.role == Role::Prefill
                    && b.bootstrap_port.is_none() =>
            {
                errors.push(format!(
                    "{at}.bootstrap_port: required for a prefill backend of SGLang model `{m}`"
                ))
            }
            _ => {}
        }
    }
}

/// A split model needs at least one prefill and one decode backend at start.
pub(super) fn check_pools(
    split: &SplitModels,
    backends: &[BackendConfig],
    errors: &mut Vec<String>,
) {
    for name in split.keys() {
        let has = |role: Role| {
            backends
                .iter()
                .any(|b| b.role == role && b.models.contains(name))
        };
        for role in [Role::Prefill, Role::Decode] {
            if !has(role) {
                errors.push(format!(
                    "models.{name}.disagg: no backend with role = \"{}\" serves `{name}`",
                    role.as_str()
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, Protocol, Role};

    fn load(extra: &str, backends: &[(&str, &str)]) -> Result<Config, Vec<String>> {
        let mut toml = format!("[server]\nlisten = \"127.0.0.1:0\"\nshards = 1\n{extra}\n");
        for (i, (role, more)) in backends.iter().enumerate() {
            toml.push_str(&format!(
                "\n[[backends]]\nid = \"b{i}\"\nurl = \"http://127.0.0.1:{}\"\nmodels = [\"m\"]\nrole = \"{role}\"\n{more}\n",
                9000 + i
            ));
        }
        Config::from_toml(&toml).map_err(|e| e.0)
    }

    #[test]
    fn a_split_pool_loads() {
        let c = load(
            "[models.m.disagg]\nprotocol = \"sglang\"\nmode = \"always\"",
            &[
                ("prefill", "bootstrap_port = 8998"),
                ("decode", ""),
                ("both", ""),
            ],
        )
        .unwrap();
        let d = &c.split_models["m"];
        assert_eq!(d.protocol, Protocol::Sglang);
        assert!(d.policy.always);
        assert_eq!(c.backends[0].role, Role::Prefill);
        assert_eq!(c.backends[0].bootstrap_port, Some(8998));
        assert_eq!(c.backends[2].role, Role::Both);
    }

    #[test]
    fn impossible_pools_are_refused_with_key_paths() {
        let e = load("[models.m.disagg]\nprotocol = \"vllm\"", &[("decode", "")]).unwrap_err();
        assert_eq!(
            e,
            ["models.m.disagg: no backend with role = \"prefill\" serves `m`"]
        );
        let e = load(
            "[models.m.disagg]\nprotocol = \"vllm\"",
            &[("prefill", ""), ("both", "")],
        )
        .unwrap_err();
        assert_eq!(
            e,
            ["models.m.disagg: no backend with role = \"decode\" serves `m`"]
        );
        let e = load("", &[("prefill", ""), ("decode", "")]).unwrap_err();
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].starts_with("backends[0].role: `prefill` backend serves `m`, which has no"));
        let e = load(
            "[models.m.disagg]\nprotocol = \"sglang\"",
            &[("prefill", ""), ("decode", "")],
        )
        .unwrap_err();
        assert_eq!(
            e,
            ["backends[0].bootstrap_port: required for a prefill backend of SGLang model `m`"]
        );
        let e = load(
            "[models.m.disagg]\nprotocol = \"grpc\"\nmode = \"sometimes\"\nprefill_attempts = 0\nprefill_timeout_ms = 0",
            &[("prefill", ""), ("decode", "bootstrap_port = 1"), ("leader", "")],
        )
        .unwrap_err();
        for want in [
            "models.m.disagg.protocol: unknown variant `grpc`, expected `vllm` or `sglang`",
            "models.m.disagg.mode: unknown variant `sometimes`, expected `conditional` or `always`",
            "models.m.disagg.prefill_attempts: must be at least 1",
            "models.m.disagg.prefill_timeout_ms: must be greater than 0",
            "backends[1].bootstrap_port: only a `prefill` backend",
            "backends[2].role: unknown role `leader`",
        ] {
            assert!(e.iter().any(|l| l.starts_with(want)), "{want} not in {e:?}");
        }
        assert!(load(
            "[models.m]\ndisagg = { protocol = \"vllm\", colour = 1 }",
            &[("both", "")]
        )
        .is_err());
    }
}
