//! The request parameters the simulated engine reads beyond the gateway's facts, as
//! vLLM reads them: `n`, `stop`, `echo`, batched and token-id prompts,
//! `stream_options.continuous_usage_stats`; and those it
//! refuses with vLLM's 400 (`logprobs`, `prompt_logprobs`, chat `echo`). The
//! generated text comes from [`Words`], one word per token.

use super::words::Words;
use crate::openai::Endpoint;
use serde::Deserialize;
use serde_json::Value;

/// The most choices one request may ask for (`n` × batched prompts).
const MAX_CHOICES: usize = 128;

#[derive(Deserialize, Default)]
struct Raw {
    n: Option<Value>,
    echo: Option<Value>,
    logprobs: Option<Value>,
    prompt_logprobs: Option<Value>,
    stop: Option<Value>,
    prompt: Option<Value>,
    stream_options: Option<Value>,
}

/// One prompt of a (possibly batched) request.
pub struct Prompt {
    /// Its length when it came as token ids (otherwise the caller counts its text).
    pub ids: Option<u64>,
    /// Its text, when it came as a string.
    pub text: Option<String>,
}

pub struct Sampling {
    pub n: u64,
    pub stop: Vec<String>,
    pub echo: bool,
    /// The prompts of a completions batch (one entry for chat).
    pub prompts: Vec<Prompt>,
    /// `stream_options.continuous_usage_stats`: `usage` in every chunk (vLLM).
    pub continuous_usage: bool,
    /// A continued answer (`continue_final_message`): its first word and the step it
    /// goes on from.
    pub continue_from: Option<(usize, usize)>,
}

/// One answer: `n` per prompt, indexed prompt-major as vLLM does.
pub struct Choice<'w> {
    pub index: usize,
    /// The echoed prompt, put before the generated text.
    pub echo: Option<String>,
    /// The generated tokens' text (the last one cut where a stop string began).
    pub pieces: Vec<&'w str>,
    pub stopped: bool,
}

impl Choice<'_> {
    pub fn finish_reason(&self) -> &'static str {
        if self.stopped {
            "stop"
        } else {
            "length"
        }
    }
}

fn bad(message: String) -> Result<Sampling, String> {
    Err(message)
}

/// Reads the parameters; `Err` is the message of vLLM's 400.
pub fn read(body: &[u8], endpoint: Endpoint) -> Result<Sampling, String> {
    let raw: Raw = serde_json::from_slice(body).unwrap_or_default();
    let n = match &raw.n {
        None | Some(Value::Null) => 1,
        Some(v) => match v.as_u64() {
            Some(0) => return bad("n must be at least 1, got 0.".into()),
            Some(n) => n,
            None => return bad(format!("n must be a positive integer, got {v}.")),
        },
    };
    let unsupported =
        |p: &str| format!("{p} is not supported by the simulated engine (engine-sim)");
    let set = |v: &Option<Value>| !matches!(v, None | Some(Value::Null) | Some(Value::Bool(false)));
    if set(&raw.logprobs) {
        return bad(unsupported("logprobs"));
    }
    if set(&raw.prompt_logprobs) {
        return bad(unsupported("prompt_logprobs"));
    }
    let echo = set(&raw.echo);
    if echo && endpoint == Endpoint::ChatCompletions {
        return bad(unsupported("echo (on chat completions)"));
    }
    let stop = match &raw.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect(),
        Some(_) => return bad("stop must be a string or an array of strings".into()),
    };
    let stop = stop.into_iter().filter(|s| !s.is_empty()).collect();
    let ids = |a: &[Value]| a.iter().all(|t| t.as_u64().is_some());
    let prompts = match (&raw.prompt, endpoint) {
        (_, Endpoint::ChatCompletions) | (None, _) => vec![Prompt {
            ids: None,
            text: None,
        }],
        (Some(Value::String(s)), _) => vec![Prompt {
            ids: None,
            text: Some(s.clone()),
        }],
        (Some(Value::Array(a)), _) if !a.is_empty() && ids(a) => vec![Prompt {
            ids: Some(a.len() as u64),
            text: None,
        }],
        (Some(Value::Array(a)), _) => {
            let mut out = Vec::with_capacity(a.len());
            for p in a {
                out.push(match p {
                    Value::String(s) => Prompt {
                        ids: None,
                        text: Some(s.clone()),
                    },
                    Value::Array(t) if !t.is_empty() && ids(t) => Prompt {
                        ids: Some(t.len() as u64),
                        text: None,
                    },
                    _ => {
                        return bad(
                            "prompt must be a string, an array of strings, an array of token ids, or an array of token-id arrays"
                                .into(),
                        )
                    }
                });
            }
            out
        }
        // The gateway's parser has refused other shapes already.
        (Some(_), _) => vec![Prompt {
            ids: None,
            text: None,
        }],
    };
    if echo && prompts.iter().any(|p| p.text.is_none()) {
        return bad(unsupported("echo with token-id prompts"));
    }
    if prompts
        .len()
        .saturating_mul(n.min(usize::MAX as u64) as usize)
        > MAX_CHOICES
    {
        return bad(format!(
            "n × prompts must be at most {MAX_CHOICES} in the simulated engine"
        ));
    }
    let continuous_usage = raw
        .stream_options
        .as_ref()
        .and_then(|o| o.get("continuous_usage_stats"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Sampling {
        n,
        stop,
        echo,
        prompts,
        continuous_usage,
        continue_from: None,
    })
}

impl Sampling {
    /// The choices of request `id`: up to `max_tokens` tokens each, cut at the first
    /// stop string (which, as in vLLM, is left out of the text).
    pub fn choices<'w>(&self, words: &'w Words, id: u64, max_tokens: u64) -> Vec<Choice<'w>> {
        let mut out = Vec::new();
        for p in &self.prompts {
            for _ in 0..self.n {
                let index = out.len();
                let (first, from) = match self.continue_from {
                    Some(at) if index == 0 => at,
                    _ => ((id as usize).wrapping_add(index) % words.len(), 0),
                };
                let (pieces, stopped) = generate(words, (first, from), max_tokens, &self.stop);
                out.push(Choice {
                    index,
                    echo: if self.echo { p.text.clone() } else { None },
                    pieces,
                    stopped,
                });
            }
        }
        out
    }
}

/// Up to `max_tokens` tokens of the answer whose first word is `first`, from step
/// `from` on.
fn generate<'w>(
    words: &'w Words,
    (first, from): (usize, usize),
    max_tokens: u64,
    stop: &[String],
) -> (Vec<&'w str>, bool) {
    let mut pieces: Vec<&'w str> = Vec::with_capacity(max_tokens.min(4096) as usize);
    let longest = stop.iter().map(String::len).max().unwrap_or(0);
    let mut text = String::new();
    for i in 0..max_tokens as usize {
        let piece = words.piece(first, from + i);
        pieces.push(piece);
        if longest == 0 {
            continue;
        }
        // Only a match ending in the new piece is new (the text is ASCII).
        let from = text.len().saturating_sub(longest - 1);
        text.push_str(piece);
        let Some(cut) = stop
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|at| from + at))
            .min()
        else {
            continue;
        };
        let mut left = cut;
        for p in &mut pieces {
            let keep = p.len().min(left);
            *p = &p[..keep];
            left -= keep;
        }
        return (pieces, true);
    }
    (pieces, false)
}
