//! Watches a response body as it streams past, without buffering it, for the final
//! `usage` (prompt, completion and cached tokens).
//!
//! Works on plain JSON bodies and SSE streams alike: it looks for the usage keys in
//! each piece and keeps a short tail so a key split across two reads is still found.
//! The last value seen wins (usage comes once, at the end).

use memchr::memmem::Finder;
use std::sync::LazyLock;

const TAIL: usize = 48;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

#[derive(Debug)]
pub struct UsageScanner {
    tail: [u8; TAIL],
    tail_len: usize,
    pub usage: Usage,
}

impl Default for UsageScanner {
    fn default() -> Self {
        Self {
            tail: [0; TAIL],
            tail_len: 0,
            usage: Usage::default(),
        }
    }
}

const KEYS: [&[u8]; 3] = [
    b"\"prompt_tokens\":",
    b"\"completion_tokens\":",
    b"\"cached_tokens\":",
];

/// The three key searchers, built once per process: `memmem::find_iter` would build a
/// fresh searcher (prefilter, rare-byte ranking) for every key on every scan, which
/// cost more than the scan itself. A `Finder` is immutable and `Sync`; after the first
/// use the `LazyLock` is one atomic load, no lock.
static FINDERS: LazyLock<[Finder<'static>; 3]> = LazyLock::new(|| KEYS.map(Finder::new));

impl UsageScanner {
    pub fn feed(&mut self, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        // Keys that start in the tail and run into `data`.
        if self.tail_len > 0 {
            let mut joined = [0u8; TAIL * 2];
            let head = data.len().min(TAIL);
            joined[..self.tail_len].copy_from_slice(&self.tail[..self.tail_len]);
            joined[self.tail_len..self.tail_len + head].copy_from_slice(&data[..head]);
            let joined = &joined[..self.tail_len + head];
            self.scan(joined, Some(self.tail_len));
        }
        self.scan(data, None);
        // Keep the last TAIL bytes of everything seen.
        if data.len() >= TAIL {
            self.tail.copy_from_slice(&data[data.len() - TAIL..]);
            self.tail_len = TAIL;
        } else {
            let keep = (TAIL - data.len()).min(self.tail_len);
            self.tail
                .copy_within(self.tail_len - keep..self.tail_len, 0);
            self.tail[keep..keep + data.len()].copy_from_slice(data);
            self.tail_len = keep + data.len();
        }
    }

    /// Finds keys in `hay`; with `starts_before = Some(n)`, only keys starting before
    /// byte `n`. A number that runs to the end of `hay` may be cut: skip it (the tail
    /// scan of the next piece finds it whole).
    fn scan(&mut self, hay: &[u8], starts_before: Option<usize>) {
        for (k, finder) in FINDERS.iter().enumerate() {
            let key = finder.needle();
            for pos in finder.find_iter(hay) {
                if starts_before.is_some_and(|n| pos >= n) {
                    break;
                }
                let mut i = pos + key.len();
                while i < hay.len() && hay[i] == b' ' {
                    i += 1;
                }
                let start = i;
                let mut value: u64 = 0;
                while i < hay.len() && hay[i].is_ascii_digit() {
                    value = value
                        .saturating_mul(10)
                        .saturating_add((hay[i] - b'0') as u64);
                    i += 1;
                }
                if i == start || i == hay.len() {
                    continue;
                }
                let slot = match k {
                    0 => &mut self.usage.prompt_tokens,
                    1 => &mut self.usage.completion_tokens,
                    _ => &mut self.usage.cached_tokens,
                };
                *slot = Some(value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_usage_at_any_split() {
        let body = br#"data: {"choices":[]}

data: {"usage":{"prompt_tokens":1234,"completion_tokens":56,"total_tokens":1290,"prompt_tokens_details":{"cached_tokens":1024}}}

data: [DONE]

"#;
        for split in 1..body.len() {
            for piece in [1usize, 3, 7, 64] {
                let mut s = UsageScanner::default();
                s.feed(&body[..split]);
                for p in body[split..].chunks(piece) {
                    s.feed(p);
                }
                assert_eq!(
                    s.usage,
                    Usage {
                        prompt_tokens: Some(1234),
                        completion_tokens: Some(56),
                        cached_tokens: Some(1024)
                    },
                    "split {split} piece {piece}"
                );
            }
        }
    }
}
