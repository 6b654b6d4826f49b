//! Reading an engine's Prometheus `/metrics`: queue length, running requests, KV
//! usage and KV-cache size, under vLLM's or SGLang's names.
//!
//! The coordinator's probe thread scrapes each backend and feeds the result into
//! the fleet snapshot (for est-TTFT and saturation) and the index capacity.

/// What one scrape of an engine told us.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLoad {
    pub waiting: u32,
    pub running: u32,
    /// Fraction of the KV cache in use, 0–1.
    pub kv_usage: f32,
    /// KV-cache size in tokens, when the engine exposes it
    /// (`vllm:cache_config_info` `num_gpu_blocks` × `block_size`).
    pub cache_tokens: Option<u64>,
}

/// Parses Prometheus text; `None` when no known load metric is present.
pub fn parse(text: &str) -> Option<EngineLoad> {
    let mut load = EngineLoad::default();
    let mut found = false;
    let mut blocks = None;
    let mut block_size = None;
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (name, labels) = match line.find('{') {
            Some(i) => (&line[..i], &line[i..line.rfind('}').unwrap_or(line.len())]),
            None => (line.split(' ').next().unwrap_or(""), ""),
        };
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN);
        if !value.is_finite() {
            continue;
        }
        match name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                load.waiting = load.waiting.saturating_add(value as u32);
                found = true;
            }
            "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                load.running = load.running.saturating_add(value as u32);
                found = true;
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                load.kv_usage = load.kv_usage.max(value as f32);
                found = true;
            }
            "vllm:cache_config_info" => {
                blocks = label(labels, "num_gpu_blocks").and_then(|v| v.parse::<u64>().ok());
                block_size = label(labels, "block_size").and_then(|v| v.parse::<u64>().ok());
            }
            _ => {}
        }
    }
    if let (Some(b), Some(s)) = (blocks, block_size) {
        load.cache_tokens = Some(b * s);
    }
    found.then_some(load)
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let start = labels.find(&format!("{key}=\""))? + key.len() + 2;
    let len = labels[start..].find('"')?;
    Some(&labels[start..start + len])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_and_sglang() {
        let vllm = r#"# HELP x
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"} 1.0
"#;
        assert_eq!(
            parse(vllm),
            Some(EngineLoad {
                waiting: 7,
                running: 3,
                kv_usage: 0.25,
                cache_tokens: Some(32768)
            })
        );
        let sglang = "sglang:num_running_reqs{model_name=\"m\"} 2\nsglang:num_queue_reqs{model_name=\"m\"} 5\nsglang:token_usage{model_name=\"m\"} 0.5\n";
        assert_eq!(
            parse(sglang),
            Some(EngineLoad {
                waiting: 5,
                running: 2,
                kv_usage: 0.5,
                cache_tokens: None
            })
        );
        assert_eq!(parse("other_metric 1\n"), None);
    }
}
