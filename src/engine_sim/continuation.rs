//! vLLM's `continue_final_message` for chat: the last message, the assistant's,
//! is continued rather than answered (with `add_generation_prompt: false`, as vLLM
//! requires). The gateway uses it to continue a stream whose engine died; for
//! completions it extends the prompt, which a model simply goes on with.
//!
//! The simulated answer is a cycle of [`Words`], so a continued message that is an
//! answer's first `k` tokens goes on with tokens `k..` of that same answer: the
//! text a client reads is exactly what one uninterrupted engine would have sent.
//! The prompt is counted as vLLM counts it: the conversation before the message,
//! with its generation prompt, plus the `k` tokens continued; the cache sees the
//! conversation before the message. A completions prompt that ends in an answer's
//! first `k` tokens (two or more, after whitespace) goes on the same way.

use super::Words;
use serde_json::Value;

/// A continued final message: the request without it, and where the answer goes on.
pub struct Continued {
    /// The request body without the final message (what the engine parses).
    pub body: Vec<u8>,
    /// The answer's first word and the step it goes on from (the tokens continued),
    /// when the message is a simulated answer's start; `None`: an answer of its own.
    pub from: Option<(usize, usize)>,
}

/// Reads `continue_final_message`; `Ok(None)` when the request does not set it,
/// `Err` the message of vLLM's 400.
pub fn read(body: &[u8], words: &Words) -> Result<Option<Continued>, String> {
    if memchr::memmem::find(body, b"continue_final_message").is_none() {
        return Ok(None);
    }
    let mut v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let Some(obj) = v.as_object_mut() else {
        return Ok(None);
    };
    if obj.get("continue_final_message") != Some(&Value::Bool(true)) {
        return Ok(None);
    }
    if obj.get("add_generation_prompt") != Some(&Value::Bool(false)) {
        return Err(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.".into(),
        );
    }
    let messages = obj.get_mut("messages").and_then(Value::as_array_mut);
    let last = messages.and_then(|m| {
        let is_assistant = m.last()?.get("role")? == "assistant";
        is_assistant.then(|| m.pop()).flatten()
    });
    let Some(last) = last else {
        return Err(
            "continue_final_message requires the last message to be from the assistant".into(),
        );
    };
    let text = last.get("content").and_then(Value::as_str).unwrap_or("");
    let from = words.continued(text);
    obj.remove("continue_final_message");
    obj.remove("add_generation_prompt");
    let body = serde_json::to_vec(&v).map_err(|e| e.to_string())?;
    Ok(Some(Continued { body, from }))
}

/// A completions prompt that ends in an answer's first `k` tokens (at least two,
/// after whitespace): the request with the prompt before them, and where the answer
/// goes on (a prompt extended by the text generated so far, as the gateway
/// continues a completion).
pub fn completion(body: &[u8], prompt: &str, words: &Words) -> Option<Continued> {
    let (at, from) = prompt_run(prompt, words)?;
    let mut v: Value = serde_json::from_slice(body).ok()?;
    match v.get_mut("prompt")? {
        Value::String(p) => p.truncate(at),
        Value::Array(a) if a.len() == 1 => a[0] = Value::String(prompt[..at].into()),
        _ => return None,
    }
    let body = serde_json::to_vec(&v).ok()?;
    Some(Continued {
        body,
        from: Some(from),
    })
}

/// Where the run of an answer's tokens that ends `prompt` starts, and the answer's
/// first word and length.
fn prompt_run(prompt: &str, words: &Words) -> Option<(usize, (usize, usize))> {
    let bytes = prompt.as_bytes();
    (1..bytes.len())
        .filter(|&i| bytes[i - 1].is_ascii_whitespace() && prompt.is_char_boundary(i))
        .find_map(|i| {
            let from = words.continued(&prompt[i..]).filter(|&(_, k)| k >= 2)?;
            Some((i, from))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_ending_in_an_answer_goes_on_with_it() {
        let w = Words::default();
        let body = br#"{"model":"sim","prompt":"Once upon a time\nthe of and","max_tokens":3}"#;
        let c = completion(body, "Once upon a time\nthe of and", &w).unwrap();
        assert_eq!(c.from, Some((0, 3)));
        let v: Value = serde_json::from_slice(&c.body).unwrap();
        assert_eq!(v["prompt"], "Once upon a time\n");
        assert!(
            completion(body, "Once upon a time\nthe", &w).is_none(),
            "one word is no run"
        );
        assert!(
            completion(body, "what is in the", &w).is_none(),
            "words out of the answer's order"
        );
    }

    #[test]
    fn the_final_assistant_message_is_continued_where_it_left_off() {
        let w = Words::default();
        let body = br#"{"model":"sim","stream":true,"continue_final_message":true,"add_generation_prompt":false,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"in is that"}]}"#;
        let c = read(body, &w).unwrap().unwrap();
        assert_eq!(c.from, Some((4, 3)));
        let v: Value = serde_json::from_slice(&c.body).unwrap();
        assert_eq!(v["messages"].as_array().unwrap().len(), 1);
        assert!(v.get("continue_final_message").is_none());

        let plain =
            br#"{"model":"sim","messages":[{"role":"user","content":"continue_final_message"}]}"#;
        assert!(read(plain, &w).unwrap().is_none());
        let both =
            br#"{"continue_final_message":true,"messages":[{"role":"assistant","content":"x"}]}"#;
        assert!(read(both, &w).is_err());
        let user_last = br#"{"continue_final_message":true,"add_generation_prompt":false,"messages":[{"role":"user","content":"x"}]}"#;
        assert!(read(user_last, &w).is_err());
    }
}
