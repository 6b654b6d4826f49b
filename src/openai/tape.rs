//! A validating one-pass JSON scanner for request bodies, built for the shard's hot
//! path: it checks the whole body against RFC 8259 (UTF-8, string escapes and
//! surrogate pairs, number grammar, nesting depth, nothing after the value) and
//! records every token on a flat tape, so [`super::BodyParser`] can then read the few
//! members routing needs without a tree of allocated values.
//!
//! Why not a general JSON crate here: sonic-rs's `Value` copies the body into a padded
//! buffer and allocates its tree on every request, and its lazy readers re-validate
//! what they skip (perf/RESULTS-notes.md). The tape lives in the shard's
//! [`super::BodyParser`] and is reused, so a parse allocates nothing once warm.
//! Strings without escapes are slices of the body; escaped ones are unescaped once,
//! during the scan, into the tape's arena. Numbers are kept as text and read (with the
//! standard library's correctly rounded parser) only when asked for. What the scanner
//! accepts and how it reads numbers match sonic-rs, which stays the reference in the
//! tests and the `json_body` fuzz target.

use std::fmt;

/// Deepest array/object nesting accepted in a body. Walking a value (`tools` is
/// rendered recursively) recurses, so the bound keeps hostile bodies off the stack.
pub const MAX_JSON_DEPTH: usize = 128;

/// Arena capacity kept between requests; a larger one (an unusually long escaped
/// body) is dropped when the next scan starts instead of pinning its memory to the
/// shard.
const ARENA_KEEP_BYTES: usize = 1 << 20;

/// Why a body is not JSON the gateway accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanError {
    /// Not valid JSON: what was wrong and the byte offset where it was found.
    Syntax { what: &'static str, at: usize },
    /// Valid so far, but nested deeper than [`MAX_JSON_DEPTH`].
    TooDeep,
    /// Valid JSON, but an object names `key` twice (compared after unescaping), at
    /// `path` (`messages[0].role`; see [`duplicate_path`]). Engines built on Python's
    /// `json` read the last occurrence and the gateway reads the first, so such a
    /// body would be routed, admitted and accounted as one request and served as
    /// another: it is refused.
    DuplicateKey { key: String, path: String },
}

impl fmt::Display for ScanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScanError::Syntax { what, at } => write!(f, "{what} at byte {at}"),
            ScanError::TooDeep => write!(f, "nests deeper than {MAX_JSON_DEPTH} levels"),
            ScanError::DuplicateKey { key, path } => {
                write!(f, "has the key `{key}` twice (at `{path}`)")
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Object,
    Array,
    /// A string: `start..end` in the body (between the quotes).
    Str,
    /// A string with escapes: `start..end` of its unescaped text in the arena.
    EscapedStr,
    Number,
    True,
    False,
    Null,
}

#[derive(Debug, Clone, Copy)]
struct Node {
    kind: Kind,
    start: u32,
    end: u32,
    /// Index of the node after this one's subtree (its next sibling, if any).
    next: u32,
}

/// The scanned tokens of one body, reused from request to request.
#[derive(Default)]
pub struct Tape {
    nodes: Vec<Node>,
    arena: String,
    open: Vec<u32>,
    /// The objects' node indices in body order (of their opening braces), for the
    /// duplicate-key check after the scan.
    objects: Vec<u32>,
    /// Scratch for that check: one object's key node indices.
    keys: Vec<u32>,
}

/// A number as sonic-rs reads it: a non-negative integer that fits is a `u64`, a
/// negative one that fits an `i64`; everything else (fractions, exponents, integers
/// out of range, `-0`) is a finite `f64`, with negative zero read as zero.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    U64(u64),
    I64(i64),
    F64(f64),
}

/// One value on a scanned tape.
#[derive(Clone, Copy)]
pub struct Json<'t> {
    body: &'t str,
    tape: &'t Tape,
    idx: usize,
}

impl Tape {
    /// Scans `body` onto the tape (replacing what it held) and returns its root value.
    pub fn scan<'t>(&'t mut self, body: &'t [u8]) -> Result<Json<'t>, ScanError> {
        self.nodes.clear();
        self.arena.clear();
        self.open.clear();
        self.objects.clear();
        if self.arena.capacity() > ARENA_KEEP_BYTES {
            self.arena = String::new();
        }
        let text = match simdutf8::basic::from_utf8(body) {
            Ok(text) => text,
            Err(_) => {
                let at = std::str::from_utf8(body).map_or_else(|e| e.valid_up_to(), |_| 0);
                return Err(syntax("invalid UTF-8", at));
            }
        };
        if u32::try_from(body.len()).is_err() {
            return Err(syntax("body too large to scan", 0));
        }
        Scanner {
            b: body,
            tape: self,
        }
        .run()?;
        self.refuse_duplicate_keys(text)?;
        Ok(Json {
            body: text,
            tape: self,
            idx: 0,
        })
    }
}

fn syntax(what: &'static str, at: usize) -> ScanError {
    ScanError::Syntax { what, at }
}

/// Objects with at most this many members are checked for duplicate keys pair by
/// pair (request objects have a handful); larger ones by sorting their keys, so a
/// hostile object with many keys costs `k log k`, not `k²`.
const PAIRWISE_KEYS: usize = 16;

/// Longest key text quoted in a duplicate-key error (a longer key is cut at a char
/// boundary and marked with `…`), so a hostile key does not balloon the answer.
pub const QUOTED_KEY_BYTES: usize = 64;

/// `key` as quoted in a duplicate-key error: at most [`QUOTED_KEY_BYTES`] bytes of it.
pub fn quoted_key(key: &str) -> String {
    if key.len() <= QUOTED_KEY_BYTES {
        return key.to_owned();
    }
    let mut cut = QUOTED_KEY_BYTES;
    while !key.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &key[..cut])
}

impl Tape {
    /// The text of a string node (a key), from the body or the arena.
    fn text<'s>(&'s self, body: &'s str, idx: u32) -> &'s str {
        let n = self.nodes[idx as usize];
        let range = n.start as usize..n.end as usize;
        match n.kind {
            Kind::EscapedStr => &self.arena[range],
            _ => &body[range],
        }
    }

    /// Every object of a scanned body, in body order: the first whose members name
    /// a key twice is refused, naming the key's second occurrence (the earliest
    /// second occurrence, if several keys repeat). Allocates nothing once warm (the
    /// scratch is reused); only a refusal builds its strings.
    fn refuse_duplicate_keys(&mut self, body: &str) -> Result<(), ScanError> {
        let mut keys = std::mem::take(&mut self.keys);
        let mut found = None;
        for &object in &self.objects {
            let end = self.nodes[object as usize].next;
            // Keys of different lengths differ (a node's range is its text's), so an
            // object whose key lengths all differ, mod 64, has no repeat: one pass
            // over its members, no scratch. Most request objects end here.
            let (mut lengths, mut clash) = (0u64, false);
            let mut idx = object + 1;
            while idx < end {
                let n = self.nodes[idx as usize];
                let bit = 1u64 << ((n.end - n.start) & 63);
                clash |= lengths & bit != 0;
                lengths |= bit;
                idx = self.nodes[idx as usize + 1].next;
            }
            if !clash {
                continue;
            }
            keys.clear();
            let mut idx = object + 1;
            while idx < end {
                keys.push(idx);
                idx = self.nodes[idx as usize + 1].next;
            }
            let repeated = if keys.len() <= PAIRWISE_KEYS {
                // A node's range is its text's (unescaped, for an escaped key), so
                // keys of different lengths, the usual case, differ without a look.
                let len = |k: u32| {
                    let n = self.nodes[k as usize];
                    n.end - n.start
                };
                (1..keys.len()).find_map(|j| {
                    let (kj, lj) = (keys[j], len(keys[j]));
                    keys[..j]
                        .iter()
                        .any(|&i| len(i) == lj && self.text(body, i) == self.text(body, kj))
                        .then_some(kj)
                })
            } else {
                // Sorted by text, then position: each later occurrence follows an
                // equal one, and the earliest of those is the answer.
                keys.sort_unstable_by(|&a, &b| {
                    self.text(body, a).cmp(self.text(body, b)).then(a.cmp(&b))
                });
                keys.windows(2)
                    .filter(|w| self.text(body, w[0]) == self.text(body, w[1]))
                    .map(|w| w[1])
                    .min()
            };
            if let Some(key) = repeated {
                found = Some((object, key));
                break;
            }
        }
        self.keys = keys;
        let Some((object, key)) = found else {
            return Ok(());
        };
        let key = self.text(body, key);
        let mut path = self.path_to(body, object);
        if !path.is_empty() {
            path.push('.');
        }
        let key = quoted_key(key);
        path.push_str(&key);
        Err(ScanError::DuplicateKey { key, path })
    }

    /// Where node `target` (a value) sits: `messages[0].content[1]`, empty for the
    /// root. Keys are quoted with [`quoted_key`]. Only a refusal calls this.
    fn path_to(&self, body: &str, target: u32) -> String {
        let mut path = String::new();
        let mut at = 0u32;
        while at != target {
            let n = self.nodes[at as usize];
            let mut child = at + 1;
            let mut item = 0usize;
            loop {
                // Members are key then value; items are values.
                let value = if n.kind == Kind::Object {
                    child + 1
                } else {
                    child
                };
                if (value..self.nodes[value as usize].next).contains(&target) {
                    if n.kind == Kind::Object {
                        if !path.is_empty() {
                            path.push('.');
                        }
                        path.push_str(&quoted_key(self.text(body, child)));
                    } else {
                        path.push('[');
                        path.push_str(itoa::Buffer::new().format(item));
                        path.push(']');
                    }
                    at = value;
                    break;
                }
                child = self.nodes[value as usize].next;
                item += 1;
            }
        }
        path
    }
}

fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

struct Scanner<'a> {
    b: &'a [u8],
    tape: &'a mut Tape,
}

impl Scanner<'_> {
    fn ws(&self, mut i: usize) -> usize {
        while i < self.b.len() && is_ws(self.b[i]) {
            i += 1;
        }
        i
    }

    fn push(&mut self, kind: Kind, start: usize, end: usize) -> usize {
        let idx = self.tape.nodes.len();
        self.tape.nodes.push(Node {
            kind,
            start: start as u32,
            end: end as u32,
            next: idx as u32 + 1,
        });
        idx
    }

    /// The whole body: one value, then only whitespace.
    fn run(&mut self) -> Result<(), ScanError> {
        let mut i = self.ws(0);
        'value: loop {
            // A value starts at `i` (whitespace already skipped).
            match self.b.get(i) {
                Some(b'{') | Some(b'[') => {
                    let object = self.b[i] == b'{';
                    let idx = self.push(if object { Kind::Object } else { Kind::Array }, i, i);
                    self.tape.open.push(idx as u32);
                    if object {
                        self.tape.objects.push(idx as u32);
                    }
                    if self.tape.open.len() > MAX_JSON_DEPTH {
                        return Err(ScanError::TooDeep);
                    }
                    i = self.ws(i + 1);
                    let close = if object { b'}' } else { b']' };
                    if self.b.get(i) != Some(&close) {
                        if object {
                            i = self.key(i)?;
                        }
                        continue 'value;
                    }
                    // Empty: closed right away, handled below with the others.
                }
                Some(b'"') => i = self.string(i)?,
                Some(b't') => i = self.literal(i, b"true", Kind::True)?,
                Some(b'f') => i = self.literal(i, b"false", Kind::False)?,
                Some(b'n') => i = self.literal(i, b"null", Kind::Null)?,
                Some(b'-' | b'0'..=b'9') => i = self.number(i)?,
                Some(_) => return Err(syntax("expected a JSON value", i)),
                None => return Err(syntax("unexpected end of the body, expected a value", i)),
            }
            // After a value: a separator, the close of its container, or the end.
            loop {
                let Some(&top) = self.tape.open.last() else {
                    i = self.ws(i);
                    if i != self.b.len() {
                        return Err(syntax("unexpected characters after the JSON value", i));
                    }
                    return Ok(());
                };
                let object = self.tape.nodes[top as usize].kind == Kind::Object;
                i = self.ws(i);
                match self.b.get(i) {
                    Some(b',') => {
                        i = self.ws(i + 1);
                        if object {
                            i = self.key(i)?;
                        }
                        continue 'value;
                    }
                    Some(b'}') if object => {}
                    Some(b']') if !object => {}
                    Some(_) if object => return Err(syntax("expected ',' or '}'", i)),
                    Some(_) => return Err(syntax("expected ',' or ']'", i)),
                    None => return Err(syntax("unexpected end of the body", i)),
                }
                let next = self.tape.nodes.len() as u32;
                let node = &mut self.tape.nodes[top as usize];
                node.next = next;
                node.end = i as u32 + 1;
                self.tape.open.pop();
                i += 1;
            }
        }
    }

    /// A member's key and its colon; returns where the value starts.
    fn key(&mut self, i: usize) -> Result<usize, ScanError> {
        if self.b.get(i) != Some(&b'"') {
            return Err(syntax("expected a string key or '}'", i));
        }
        let after = self.string(i)?;
        let i = self.ws(after);
        if self.b.get(i) != Some(&b':') {
            return Err(syntax("expected ':' after a key", i));
        }
        Ok(self.ws(i + 1))
    }

    fn literal(&mut self, i: usize, word: &[u8], kind: Kind) -> Result<usize, ScanError> {
        if !self.b[i..].starts_with(word) {
            return Err(syntax("invalid literal (expected true, false or null)", i));
        }
        self.push(kind, i, i + word.len());
        Ok(i + word.len())
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`, finite as an f64.
    fn number(&mut self, start: usize) -> Result<usize, ScanError> {
        let b = self.b;
        let digits = |mut i: usize| {
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            i
        };
        let mut i = start + usize::from(b[start] == b'-');
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => i = digits(i + 1),
            _ => return Err(syntax("invalid number", i)),
        }
        let mut integer = true;
        if b.get(i) == Some(&b'.') {
            let after = digits(i + 1);
            if after == i + 1 {
                return Err(syntax("invalid number", after));
            }
            i = after;
            integer = false;
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(b.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            let after = digits(i);
            if after == i {
                return Err(syntax("invalid number", after));
            }
            i = after;
            integer = false;
        }
        // Integers that fit are exact; the rest must be finite as an f64.
        let long_integer = integer && i - start > 18;
        if (!integer || long_integer) && !read_f64(&b[start..i]).is_finite() {
            return Err(syntax("number out of range", start));
        }
        self.push(Kind::Number, start, i);
        Ok(i)
    }

    /// A string starting at its opening quote; returns the index after the closing one.
    fn string(&mut self, open: usize) -> Result<usize, ScanError> {
        let b = self.b;
        let start = open + 1;
        let mut i = start + special_byte(&b[start..]);
        if b.get(i) == Some(&b'"') {
            self.push(Kind::Str, start, i);
            return Ok(i + 1);
        }
        // Escapes (or an error): unescape into the arena.
        let arena_start = self.tape.arena.len();
        let mut from = start;
        loop {
            match b.get(i) {
                Some(b'"') => break,
                Some(b'\\') => {
                    self.tape.arena.push_str(as_str(&b[from..i]));
                    i = self.escape(i)?;
                    from = i;
                }
                Some(_) => return Err(syntax("control character in a string", i)),
                None => return Err(syntax("unterminated string", open)),
            }
            i += special_byte(&b[i..]);
        }
        self.tape.arena.push_str(as_str(&b[from..i]));
        // Unescaping never lengthens text, so arena offsets fit in u32 like the body's.
        let arena_end = self.tape.arena.len();
        self.push(Kind::EscapedStr, arena_start, arena_end);
        Ok(i + 1)
    }

    /// One escape at `i` (the backslash), appended to the arena; returns the index after it.
    fn escape(&mut self, i: usize) -> Result<usize, ScanError> {
        let b = self.b;
        let c = match b.get(i + 1) {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                let high = hex4(b, i + 2).ok_or(syntax("invalid \\u escape", i))?;
                let (code, len) = if (0xD800..0xDC00).contains(&high) {
                    let low = (b.get(i + 6) == Some(&b'\\') && b.get(i + 7) == Some(&b'u'))
                        .then(|| hex4(b, i + 8))
                        .flatten()
                        .filter(|low| (0xDC00..0xE000).contains(low))
                        .ok_or(syntax("invalid unicode code point", i))?;
                    (0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00), 12)
                } else {
                    (high, 6)
                };
                let c = char::from_u32(code).ok_or(syntax("invalid unicode code point", i))?;
                self.tape.arena.push(c);
                return Ok(i + len);
            }
            Some(_) => return Err(syntax("invalid escape", i)),
            None => return Err(syntax("unterminated string", i)),
        };
        self.tape.arena.push(c);
        Ok(i + 2)
    }
}

fn hex4(b: &[u8], i: usize) -> Option<u32> {
    let digits = b.get(i..i + 4)?;
    digits.iter().try_fold(0u32, |acc, &d| {
        let v = (d as char).to_digit(16)?;
        Some(acc << 4 | v)
    })
}

/// Text between special bytes of a string: the body was checked to be UTF-8 and the
/// cut points are ASCII, so this never fails.
fn as_str(bytes: &[u8]) -> &str {
    std::str::from_utf8(bytes).unwrap_or_default()
}

fn read_f64(text: &[u8]) -> f64 {
    as_str(text).parse::<f64>().unwrap_or(f64::NAN)
}

/// Offset of the first byte in `s` that ends a plain run of string text: a quote, a
/// backslash or a control character (below 0x20); `s.len()` if there is none. Most
/// of a prompt is such runs, so this is the scanner's inner loop: 32 bytes a step
/// with AVX2 where the CPU has it (detected at run time), else 16 with SSE2.
fn special_byte(s: &[u8]) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { simd::special_byte_avx2(s) };
        }
        simd::special_byte_sse2(s)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        special_byte_scalar(s, 0)
    }
}

fn special_byte_scalar(s: &[u8], from: usize) -> usize {
    s[from..]
        .iter()
        .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
        .map_or(s.len(), |p| from + p)
}

#[cfg(target_arch = "x86_64")]
mod simd {
    //! The vector loops of [`super::special_byte`]. A byte `v` is a control
    //! character exactly when `max(v, 0x1f) == 0x1f` (unsigned).
    use std::arch::x86_64::*;

    /// SSE2 is part of the x86_64 baseline, so this needs no detection.
    pub fn special_byte_sse2(s: &[u8]) -> usize {
        let mut i = 0;
        // SAFETY: SSE2 is always present on x86_64; each load reads the 16 bytes at
        // `i`, and the loop runs only while `i + 16 <= s.len()`.
        unsafe {
            let quote = _mm_set1_epi8(b'"' as i8);
            let backslash = _mm_set1_epi8(b'\\' as i8);
            let control_max = _mm_set1_epi8(0x1f);
            while i + 16 <= s.len() {
                let v = _mm_loadu_si128(s.as_ptr().add(i) as *const __m128i);
                let control = _mm_cmpeq_epi8(_mm_max_epu8(v, control_max), control_max);
                let hits = _mm_or_si128(
                    _mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)),
                    control,
                );
                let mask = _mm_movemask_epi8(hits) as u32;
                if mask != 0 {
                    return i + mask.trailing_zeros() as usize;
                }
                i += 16;
            }
        }
        super::special_byte_scalar(s, i)
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn special_byte_avx2(s: &[u8]) -> usize {
        let quote = _mm256_set1_epi8(b'"' as i8);
        let backslash = _mm256_set1_epi8(b'\\' as i8);
        let control_max = _mm256_set1_epi8(0x1f);
        // One bit per byte of the 32 at `at` that is special.
        let mask32 = |at: usize| {
            // SAFETY: callers keep `at + 32 <= s.len()`.
            let v = unsafe { _mm256_loadu_si256(s.as_ptr().add(at) as *const __m256i) };
            let control = _mm256_cmpeq_epi8(_mm256_max_epu8(v, control_max), control_max);
            let hits = _mm256_or_si256(
                _mm256_or_si256(_mm256_cmpeq_epi8(v, quote), _mm256_cmpeq_epi8(v, backslash)),
                control,
            );
            _mm256_movemask_epi8(hits) as u32 as u64
        };
        let mut i = 0;
        // 64 bytes a step: two loads, one test.
        while i + 64 <= s.len() {
            let mask = mask32(i) | mask32(i + 32) << 32;
            if mask != 0 {
                return i + mask.trailing_zeros() as usize;
            }
            i += 64;
        }
        if i + 32 <= s.len() {
            let mask = mask32(i);
            if mask != 0 {
                return i + mask.trailing_zeros() as usize;
            }
            i += 32;
        }
        i + special_byte_sse2(&s[i..])
    }
}

impl<'t> Json<'t> {
    fn node(&self) -> Node {
        self.tape.nodes[self.idx]
    }

    fn at(&self, idx: usize) -> Json<'t> {
        Json { idx, ..*self }
    }

    pub fn is_object(&self) -> bool {
        self.node().kind == Kind::Object
    }

    pub fn is_array(&self) -> bool {
        self.node().kind == Kind::Array
    }

    pub fn is_null(&self) -> bool {
        self.node().kind == Kind::Null
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self.node().kind {
            Kind::True => Some(true),
            Kind::False => Some(false),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&'t str> {
        let n = self.node();
        let range = n.start as usize..n.end as usize;
        match n.kind {
            Kind::Str => Some(&self.body[range]),
            Kind::EscapedStr => Some(&self.tape.arena[range]),
            _ => None,
        }
    }

    pub fn as_number(&self) -> Option<Number> {
        let n = self.node();
        if n.kind != Kind::Number {
            return None;
        }
        let text = &self.body[n.start as usize..n.end as usize];
        let integer = !text.contains(['.', 'e', 'E']);
        if integer {
            if let Some(digits) = text.strip_prefix('-') {
                if digits.bytes().any(|d| d != b'0') {
                    if let Ok(i) = text.parse::<i64>() {
                        return Some(Number::I64(i));
                    }
                }
            } else if let Ok(u) = text.parse::<u64>() {
                return Some(Number::U64(u));
            }
        }
        let f = text.parse::<f64>().unwrap_or(f64::NAN);
        Some(Number::F64(if f == 0.0 { 0.0 } else { f }))
    }

    pub fn as_u64(&self) -> Option<u64> {
        match self.as_number()? {
            Number::U64(u) => Some(u),
            _ => None,
        }
    }

    /// The members of an object in body order (duplicates included); empty if this
    /// is not an object.
    pub fn members(&self) -> impl Iterator<Item = (&'t str, Json<'t>)> + 't {
        let this = *self;
        let n = this.node();
        let (mut idx, end) = match n.kind {
            Kind::Object => (this.idx + 1, n.next as usize),
            _ => (0, 0),
        };
        std::iter::from_fn(move || {
            if idx >= end {
                return None;
            }
            let key = this.at(idx).as_str().unwrap_or_default();
            let value = this.at(idx + 1);
            idx = value.node().next as usize;
            Some((key, value))
        })
    }

    /// The items of an array in order; empty if this is not an array.
    pub fn items(&self) -> impl Iterator<Item = Json<'t>> + 't {
        let this = *self;
        let n = this.node();
        let (mut idx, end) = match n.kind {
            Kind::Array => (this.idx + 1, n.next as usize),
            _ => (0, 0),
        };
        std::iter::from_fn(move || {
            if idx >= end {
                return None;
            }
            let item = this.at(idx);
            idx = item.node().next as usize;
            Some(item)
        })
    }

    /// The first member named `key`, if this is an object that has one.
    pub fn get(&self, key: &str) -> Option<Json<'t>> {
        self.members().find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(body: &str) -> Result<(), ScanError> {
        Tape::default().scan(body.as_bytes()).map(|_| ())
    }

    #[test]
    fn reads_structure_strings_and_numbers() {
        let mut tape = Tape::default();
        let body =
            r#" {"a":[1,-2,3.5,{"b":null}],"s":"x\ny\u00e9\ud83d\ude00","t":true,"e":{},"f":[]} "#;
        let root = tape.scan(body.as_bytes()).unwrap();
        let keys: Vec<_> = root.members().map(|(k, _)| k).collect();
        assert_eq!(keys, ["a", "s", "t", "e", "f"]);
        let a: Vec<_> = root.get("a").unwrap().items().collect();
        assert_eq!(a.len(), 4);
        assert_eq!(a[0].as_number(), Some(Number::U64(1)));
        assert_eq!(a[1].as_number(), Some(Number::I64(-2)));
        assert_eq!(a[2].as_number(), Some(Number::F64(3.5)));
        assert!(a[3].get("b").unwrap().is_null());
        assert_eq!(root.get("s").unwrap().as_str(), Some("x\nyé😀"));
        assert_eq!(root.get("t").unwrap().as_bool(), Some(true));
        assert_eq!(root.get("e").unwrap().members().count(), 0);
        assert!(root.get("f").unwrap().is_array());
        assert_eq!(root.get("f").unwrap().items().count(), 0);
        assert!(root.get("nope").is_none());
    }

    #[test]
    fn numbers_read_as_sonic_rs_reads_them() {
        let mut tape = Tape::default();
        let cases = [
            ("0", Number::U64(0)),
            ("-0", Number::F64(0.0)),
            ("-0.0", Number::F64(0.0)),
            ("18446744073709551615", Number::U64(u64::MAX)),
            ("18446744073709551616", Number::F64(1.8446744073709552e19)),
            ("-9223372036854775808", Number::I64(i64::MIN)),
            ("-9223372036854775809", Number::F64(-9.223372036854776e18)),
            ("1e2", Number::F64(100.0)),
            ("1.5e-400", Number::F64(0.0)),
        ];
        for (text, want) in cases {
            let n = tape.scan(text.as_bytes()).unwrap().as_number();
            assert_eq!(n, Some(want), "{text}");
        }
        assert!(matches!(
            scan("1e999"),
            Err(ScanError::Syntax {
                what: "number out of range",
                ..
            })
        ));
        assert!(scan(&format!("1{}", "0".repeat(400))).is_err());
    }

    #[test]
    fn rejects_what_json_forbids() {
        for bad in [
            "",
            " ",
            "{",
            "}",
            "[1,]",
            r#"{"a":1,}"#,
            "01",
            "-",
            "1.",
            ".5",
            "1e",
            "+1",
            "tru",
            "nul",
            r#"{"a" 1}"#,
            r#"{a:1}"#,
            r#"{"a":1}}"#,
            "[1] x",
            r#""\q""#,
            r#""\ud800""#,
            r#""\udc00""#,
            r#""\ud800\u0041""#,
            r#""\u12""#,
            "\"tab\tin\"",
            "\"open",
            "[1 2]",
            r#"{"a":1 "b":2}"#,
            "[",
            "[{]",
            "{]",
        ] {
            assert!(scan(bad).is_err(), "{bad:?}");
        }
        assert!(Tape::default().scan(b"\"\xff\"").is_err());
        assert_eq!(
            scan(&"[".repeat(MAX_JSON_DEPTH + 1)),
            Err(ScanError::TooDeep)
        );
        let deepest = format!(
            "{}{}",
            "[".repeat(MAX_JSON_DEPTH),
            "]".repeat(MAX_JSON_DEPTH)
        );
        assert_eq!(scan(&deepest), Ok(()));
    }

    #[test]
    fn the_vector_scan_finds_every_special_byte() {
        for len in 0..80 {
            for at in 0..len {
                for special in [b'"', b'\\', 0x00, 0x1f] {
                    let mut s = vec![b'a'; len];
                    s[at] = special;
                    assert_eq!(special_byte(&s), at, "len {len} at {at}");
                    #[cfg(target_arch = "x86_64")]
                    assert_eq!(simd::special_byte_sse2(&s), at, "sse2: len {len} at {at}");
                }
            }
            assert_eq!(special_byte(&vec![0x20u8; len]), len);
            assert_eq!(special_byte(&vec![0xffu8; len]), len);
        }
    }

    fn duplicate(body: &str) -> Option<(String, String)> {
        match Tape::default().scan(body.as_bytes()) {
            Err(ScanError::DuplicateKey { key, path }) => Some((key, path)),
            Err(e) => panic!("{body}: {e}"),
            Ok(_) => None,
        }
    }

    #[test]
    fn refuses_duplicate_keys_anywhere() {
        let dup = |key: &str, path: &str| Some((key.to_string(), path.to_string()));
        assert_eq!(
            duplicate(r#"{"model":"a","model":"b"}"#),
            dup("model", "model")
        );
        assert_eq!(
            duplicate(r#"{"model":"a","model":"b"}"#),
            dup("model", "model")
        );
        assert_eq!(
            duplicate(r#"{"m":[{"role":"u","x":1},{"role":"u","c":2,"role":"s"}]}"#),
            dup("role", "m[1].role")
        );
        assert_eq!(
            duplicate(r#"[{},{"a":{"b":1,"b":2}}]"#),
            dup("b", "[1].a.b")
        );
        // Outer objects first, and in one object the earliest second occurrence.
        assert_eq!(
            duplicate(r#"{"o":{"i":1,"i":1},"b":1,"a":1,"b":2,"a":2}"#),
            dup("b", "b")
        );
        // The same key in different objects, or as a value, is fine.
        for fine in [
            r#"{"a":{"a":1},"b":[{"a":1},{"a":2}],"c":"a"}"#,
            r#"{"ab":1,"a":1,"a\\":1,"A":1}"#,
            r#"{}"#,
            r#"[]"#,
        ] {
            assert_eq!(duplicate(fine), None, "{fine}");
        }
        // Large objects take the sorted path; the answer is the same.
        let many: Vec<String> = (0..40).map(|i| format!(r#""k{i}":{i}"#)).collect();
        let body = format!(r#"{{{},"k7":0,"k3":0}}"#, many.join(","));
        assert_eq!(duplicate(&body), dup("k7", "k7"));
        assert_eq!(duplicate(&format!("{{{}}}", many.join(","))), None);
        // Hostile keys are quoted cut short.
        let long = "é".repeat(40);
        let (key, _) = duplicate(&format!(r#"{{"{long}":1,"{long}":2}}"#)).unwrap();
        assert!(key.len() <= QUOTED_KEY_BYTES + '…'.len_utf8(), "{key}");
        assert!(key.ends_with('…'));
        // Malformed JSON is reported as such, even after a duplicate.
        assert!(matches!(
            Tape::default().scan(br#"{"a":1,"a":2"#),
            Err(ScanError::Syntax { .. })
        ));
    }

    #[test]
    fn the_tape_is_reused() {
        let mut tape = Tape::default();
        let body = format!(
            r#"{{"s":"{}\n","m":[{{"role":"u","content":"c"}},{{"role":"a"}}]}}"#,
            "x".repeat(100)
        );
        tape.scan(body.as_bytes()).unwrap();
        let capacities = |t: &Tape| {
            (
                t.nodes.capacity(),
                t.arena.capacity(),
                t.objects.capacity(),
                t.keys.capacity(),
            )
        };
        let warm = capacities(&tape);
        for _ in 0..10 {
            tape.scan(body.as_bytes()).unwrap();
        }
        assert_eq!(capacities(&tape), warm);
    }
}
