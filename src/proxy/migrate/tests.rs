use super::*;

fn chat_event(content: &str, finish: Option<&str>) -> String {
    let mut c = Vec::new();
    crate::error::write_json_string(&mut c, content);
    let finish = finish.map_or("null".to_string(), |f| format!("\"{f}\""));
    format!(
        "data: {{\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"created\":11,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"logprobs\":null,\"finish_reason\":{finish}}}]}}\n\n",
        String::from_utf8(c).unwrap()
    )
}

#[test]
fn watches_the_text_across_pieces_and_unescapes_it() {
    let mut t = StreamText::new(Endpoint::ChatCompletions);
    let role = "data: {\"id\":\"chatcmpl-7\",\"created\":11,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n";
    let body = [
        role.to_string(),
        chat_event("the", None),
        chat_event(" \"quoted\"\n\\", None),
        chat_event(" caf\u{e9} \u{1f600}", None),
    ]
    .concat();
    // Escaped non-ASCII too, as some engines send it.
    let escaped = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" \\u00e9\\ud83d\\ude00\"},\"finish_reason\":null}]}\n\n";
    let body = body + escaped;
    for piece in body.as_bytes().chunks(7) {
        t.feed(piece);
    }
    assert_eq!(
        t.text(),
        "the \"quoted\"\n\\ caf\u{e9} \u{1f600} \u{e9}\u{1f600}"
    );
    assert_eq!(t.tokens(), 4, "the role chunk carries no token");
    assert!(t.can_continue());
    t.feed(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" x\"}");
    assert!(!t.can_continue(), "half an event reached the client");
    t.feed(b"}]}\n\n");
    assert!(t.can_continue());
    t.feed(chat_event(" end", Some("length")).as_bytes());
    assert!(!t.can_continue(), "a finish_reason ends the answer");
    assert_eq!(
        t.seen.first.as_deref(),
        Some(&role.as_bytes()[6..role.len() - 2])
    );
}

#[test]
fn done_or_a_second_choice_is_not_continued() {
    let mut t = StreamText::new(Endpoint::Completions);
    t.feed(b"data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":null}]}\n\n");
    assert_eq!((t.text(), t.tokens()), ("a", 1));
    assert!(t.can_continue());
    t.feed(b"data: {\"choices\":[{\"index\":10,\"text\":\"b\",\"finish_reason\":null}]}\n\n");
    assert!(!t.can_continue());
    let mut t = StreamText::new(Endpoint::Completions);
    t.feed(b"data: [DONE]\n\n");
    assert!(!t.can_continue());
}

#[test]
fn continuation_appends_the_text_and_reduces_the_limits() {
    let body = br#"{"model":"m","stream":true,"max_tokens":40,"messages":[{"role":"user","content":"hi"}]}"#;
    let c = continuation_body(body, Endpoint::ChatCompletions, "the of", 2).unwrap();
    let v: Value = serde_json::from_slice(&c).unwrap();
    assert_eq!(v["max_tokens"], 38);
    assert_eq!(v["messages"][1]["role"], "assistant");
    assert_eq!(v["messages"][1]["content"], "the of");
    assert_eq!(v["continue_final_message"], true);
    assert_eq!(v["add_generation_prompt"], false);
    assert_eq!(v["stream"], true);

    let body = br#"{"model":"m","max_completion_tokens":5,"prompt":["Once "],"echo":true}"#;
    let c = continuation_body(body, Endpoint::Completions, "upon", 1).unwrap();
    let v: Value = serde_json::from_slice(&c).unwrap();
    assert_eq!(v["prompt"][0], "Once upon");
    assert_eq!(v["max_completion_tokens"], 4);
    assert_eq!(v["echo"], false);

    assert!(continuation_body(body, Endpoint::Completions, "x", 5).is_err());
    let ids = br#"{"model":"m","prompt":[1,2,3]}"#;
    assert!(continuation_body(ids, Endpoint::Completions, "x", 1).is_err());
}

#[test]
fn splice_keeps_the_first_identity_drops_the_role_chunk_and_sums_usage() {
    let first = br#"{"id":"chatcmpl-7","created":11,"model":"m","choices":[]}"#;
    let splice = Splice::new(Some(first), 3);
    let mut out = Vec::new();
    splice.rewrite(b"data: {\"id\":\"chatcmpl-0\",\"created\":99,\"model\":\"m2\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n", &mut out);
    assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
    splice.rewrite(
        chat_event(" to", None)
            .replace("chatcmpl-7", "chatcmpl-0")
            .as_bytes(),
        &mut out,
    );
    let text = String::from_utf8(out.clone()).unwrap();
    assert!(
        text.starts_with("data: ") && text.ends_with("\n\n"),
        "{text}"
    );
    let v: Value = serde_json::from_str(text[6..].trim()).unwrap();
    assert_eq!(
        (&v["id"], &v["created"], &v["model"]),
        (&"chatcmpl-7".into(), &11.into(), &"m".into())
    );
    assert_eq!(v["choices"][0]["delta"]["content"], " to");
    out.clear();
    splice.rewrite(b"data: {\"id\":\"chatcmpl-0\",\"created\":99,\"model\":\"m2\",\"choices\":[],\"usage\":{\"prompt_tokens\":13,\"total_tokens\":20,\"completion_tokens\":7}}\n\n", &mut out);
    splice.rewrite(b"data: [DONE]\n\n", &mut out);
    let text = String::from_utf8(out).unwrap();
    let (usage, done) = text.split_once("\n\n").unwrap();
    let v: Value = serde_json::from_str(&usage[6..]).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], 10);
    assert_eq!(v["usage"]["completion_tokens"], 10);
    assert_eq!(v["usage"]["total_tokens"], 20);
    assert_eq!(done, "data: [DONE]\n\n");
}

/// A stream moved before its first token (`retry.first_token_timeout_ms`): the
/// request goes out as the client sent it, and the client, which has had no event,
/// gets the new engine's role chunk and identity untouched.
#[test]
fn nothing_streamed_yet_resends_the_request_and_passes_the_stream_through() {
    let body = br#"{"model":"m","stream":true,"max_tokens":40,"messages":[{"role":"user","content":"hi"}]}"#;
    let c = continuation_body(body, Endpoint::ChatCompletions, "", 0).unwrap();
    assert_eq!(c, body);
    let splice = Splice::new(None, 0);
    let role = b"data: {\"id\":\"chatcmpl-0\",\"created\":99,\"model\":\"m2\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n";
    let mut out = Vec::new();
    splice.rewrite(role, &mut out);
    let text = String::from_utf8(out).unwrap();
    let v: Value = serde_json::from_str(text[6..].trim()).unwrap();
    assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        (&v["id"], &v["created"]),
        (&"chatcmpl-0".into(), &99.into())
    );
}
