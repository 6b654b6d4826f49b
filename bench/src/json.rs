//! Just enough JSON for the load generator: escaping strings into request bodies and
//! the JSON report, and pulling integer usage fields (`"cached_tokens":N`) out of
//! response bodies. The bench carries no JSON library on purpose; it never parses a
//! whole document.

/// Appends `s` to `out` as a quoted JSON string.
pub fn push_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The integer after the last occurrence of `"key"` (then optional whitespace, `:`,
/// optional whitespace) in `body` that is followed by a number at all; occurrences
/// followed by `null` or anything else are skipped. For an SSE stream this finds the
/// final usage event.
pub fn last_uint_field(body: &[u8], key: &str) -> Option<u64> {
    let needle = format!("\"{key}\"");
    let needle = needle.as_bytes();
    if body.len() < needle.len() {
        return None;
    }
    let mut end = body.len();
    while end >= needle.len() {
        let at = body[..end]
            .windows(needle.len())
            .rposition(|w| w == needle)?;
        if let Some(n) = uint_after_colon(&body[at + needle.len()..]) {
            return Some(n);
        }
        end = at + needle.len() - 1;
    }
    None
}

fn uint_after_colon(rest: &[u8]) -> Option<u64> {
    let rest = trim_ws(rest);
    let rest = trim_ws(rest.strip_prefix(b":")?);
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

fn trim_ws(b: &[u8]) -> &[u8] {
    let n = b
        .iter()
        .take_while(|c| matches!(c, b' ' | b'\t' | b'\r' | b'\n'))
        .count();
    &b[n..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_controls_and_quotes() {
        let mut s = String::new();
        push_str(&mut s, "a\"b\\c\nd\u{1}");
        assert_eq!(s, r#""a\"b\\c\nd\u0001""#);
    }

    #[test]
    fn finds_last_numeric_field() {
        let body = br#"data: {"usage":null}

data: {"usage":{"prompt_tokens": 12,"prompt_tokens_details":{"cached_tokens":null}}}

data: {"usage":{"prompt_tokens":30,"prompt_tokens_details":{"cached_tokens" : 8}}}

data: [DONE]
"#;
        assert_eq!(last_uint_field(body, "prompt_tokens"), Some(30));
        assert_eq!(last_uint_field(body, "cached_tokens"), Some(8));
        assert_eq!(last_uint_field(body, "completion_tokens"), None);
        assert_eq!(
            last_uint_field(br#"{"cached_tokens":null}"#, "cached_tokens"),
            None
        );
        assert_eq!(last_uint_field(b"", "cached_tokens"), None);
    }
}
