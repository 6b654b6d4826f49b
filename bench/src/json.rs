//! Just enough JSON for the bench: escaping strings into request bodies and reports,
//! pulling integer usage fields (`"cached_tokens":N`) out of response bodies, and
//! splitting a trace line into its top-level fields ([`top_level_fields`]), each
//! value kept as raw text. The bench carries no JSON library on purpose; it never
//! builds a document tree.

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

/// The fields of a JSON object, in order, each value as its raw text (a nested
/// object stays exactly as written, ready to send). Keys are unescaped only for the
/// simple escapes; the structure is checked enough to find where values end.
pub fn top_level_fields(text: &str) -> Result<Vec<(String, &str)>, String> {
    let b = text.as_bytes();
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return Err("expected a JSON object".into());
    }
    i = skip_ws(b, i + 1);
    let mut fields = Vec::new();
    if b.get(i) == Some(&b'}') {
        return trailing(b, i + 1).map(|()| fields);
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return Err(format!("expected a key at byte {i}"));
        }
        let key_end = skip_value(b, i)?;
        let key = unescape(&text[i + 1..key_end - 1])?;
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return Err(format!("expected ':' at byte {i}"));
        }
        let start = skip_ws(b, i + 1);
        let end = skip_value(b, start)?;
        fields.push((key, &text[start..end]));
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return trailing(b, i + 1).map(|()| fields),
            _ => return Err(format!("expected ',' or '}}' at byte {i}")),
        }
    }
}

/// A JSON string's raw text (without its quotes) unescaped.
pub fn unescape(raw: &str) -> Result<String, String> {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('"') => out.push('"'),
            Some('\\') => out.push('\\'),
            Some('/') => out.push('/'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('t') => out.push('\t'),
            Some('b') => out.push('\u{8}'),
            Some('f') => out.push('\u{c}'),
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                let code = u32::from_str_radix(&hex, 16).map_err(|_| "bad \\u escape")?;
                out.push(char::from_u32(code).unwrap_or('\u{fffd}'));
            }
            _ => return Err("bad escape".into()),
        }
    }
    Ok(out)
}

fn trailing(b: &[u8], i: usize) -> Result<(), String> {
    if skip_ws(b, i) == b.len() {
        Ok(())
    } else {
        Err(format!("unexpected text after the object at byte {i}"))
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\r' | b'\n') {
        i += 1;
    }
    i
}

/// The end (exclusive) of the value starting at `i`.
fn skip_value(b: &[u8], i: usize) -> Result<usize, String> {
    match b.get(i) {
        Some(b'"') => {
            let mut j = i + 1;
            while j < b.len() {
                match b[j] {
                    b'\\' => j += 2,
                    b'"' => return Ok(j + 1),
                    _ => j += 1,
                }
            }
            Err("unterminated string".into())
        }
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = skip_value(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Ok(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            Err("unterminated object or array".into())
        }
        Some(_) => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n')
            {
                j += 1;
            }
            Ok(j)
        }
        None => Err("expected a value".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_top_level_fields() {
        let line =
            r#" {"session":"s\"1","turn":2, "at_ms" : 12.5,"body":{"a":[1,{"b":"}]"}],"c":null}} "#;
        let f = top_level_fields(line).unwrap();
        let keys: Vec<&str> = f.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["session", "turn", "at_ms", "body"]);
        assert_eq!(f[0].1, r#""s\"1""#);
        assert_eq!(unescape(&f[0].1[1..f[0].1.len() - 1]).unwrap(), "s\"1");
        assert_eq!((f[1].1, f[2].1), ("2", "12.5"));
        assert_eq!(f[3].1, r#"{"a":[1,{"b":"}]"}],"c":null}"#);
        assert!(top_level_fields("{}").unwrap().is_empty());
        assert!(top_level_fields(r#"{"a":1} x"#).is_err());
        assert!(top_level_fields(r#"{"a":"x}"#).is_err());
        assert!(top_level_fields("[1]").is_err());
        assert_eq!(unescape(r"\u00e9\n").unwrap(), "é\n");
    }

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
