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

/// Every usage key ends in this; one search for it finds all three, and the bytes in
/// front of it tell which key it ends (if any).
const SUFFIX: &[u8] = b"_tokens\":";

/// The bytes in front of [`SUFFIX`] for each key, in the order of [`Usage`]'s fields.
const PREFIXES: [&[u8]; 3] = [b"\"prompt", b"\"completion", b"\"cached"];

/// Pieces up to this size are searched for the suffix's first byte, `_`, with one
/// `memchr` pass (rare in an engine's JSON: a few member names), larger ones with a
/// `memmem` searcher. On an engine's ~260-byte answer (callgrind, per response) three
/// `memmem` searchers, one per key, cost ~1,120 instructions, one for the suffix ~790,
/// this `memchr` pass ~680. On a long piece of text full of `_` (code) `memchr` would
/// stop at every one, so `memmem` takes those.
const MEMCHR_MAX: usize = 1024;

/// The searcher for [`SUFFIX`], built once per process (building one costs more than
/// a scan). A `Finder` is immutable and `Sync`; after the first use the `LazyLock` is
/// one atomic load, no lock.
static FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(SUFFIX));

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
    /// byte `n`, else only keys wholly in `hay` (one that starts in the bytes before is
    /// the tail scan's). A number that runs to the end of `hay` may be cut: skip it
    /// (the tail scan of the next piece finds it whole).
    fn scan(&mut self, hay: &[u8], starts_before: Option<usize>) {
        if hay.len() <= MEMCHR_MAX {
            for pos in memchr::memchr_iter(SUFFIX[0], hay) {
                if hay[pos..].starts_with(SUFFIX) {
                    self.key_at(hay, pos, starts_before);
                }
            }
        } else {
            for pos in FINDER.find_iter(hay) {
                self.key_at(hay, pos, starts_before);
            }
        }
    }

    /// Reads the value of the key whose [`SUFFIX`] is at `pos` in `hay`, if it is a
    /// usage key (that starts before `starts_before`) with a whole number.
    fn key_at(&mut self, hay: &[u8], pos: usize, starts_before: Option<usize>) {
        let before = &hay[..pos];
        let Some(k) = PREFIXES.iter().position(|p| before.ends_with(p)) else {
            return;
        };
        if starts_before.is_some_and(|n| pos - PREFIXES[k].len() >= n) {
            return;
        }
        let mut i = pos + SUFFIX.len();
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
            return;
        }
        let slot = match k {
            0 => &mut self.usage.prompt_tokens,
            1 => &mut self.usage.completion_tokens,
            _ => &mut self.usage.cached_tokens,
        };
        *slot = Some(value);
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

    /// Only the exact keys count: other `…_tokens` members, longer names ending in a
    /// key's name, escaped text inside a string, and non-numbers are not usage.
    #[test]
    fn ignores_lookalike_keys() {
        let body = br#"{"choices":[{"message":{"content":"say \"prompt_tokens\":77"}}],"usage":{"total_tokens":9,"num_prompt_tokens":8,"xcached_tokens":7,"completion_tokens":"5","prompt_tokens":1}}"#;
        for piece in [1usize, 2, 5, 11, body.len()] {
            let mut s = UsageScanner::default();
            for p in body.chunks(piece) {
                s.feed(p);
            }
            assert_eq!(
                s.usage,
                Usage {
                    prompt_tokens: Some(1),
                    completion_tokens: None,
                    cached_tokens: None
                },
                "piece {piece}"
            );
        }
    }

    /// A key's common suffix at the very start of the first piece, with nothing before
    /// it, is no key; one whose name came in the previous piece is.
    #[test]
    fn suffix_at_the_start_of_a_piece() {
        let mut s = UsageScanner::default();
        s.feed(b"_tokens\":5,");
        assert_eq!(s.usage, Usage::default());
        s.feed(b"{\"cached");
        s.feed(b"_tokens\":6,");
        assert_eq!(s.usage.cached_tokens, Some(6));
    }

    /// An SSE stream in chunked framing, usage in the last event with a chunk boundary
    /// inside its keys: decoded and scanned whatever the reads' boundaries.
    #[test]
    fn chunked_sse_usage_at_any_split() {
        use crate::http::chunked::ChunkedDecoder;
        let events: [&[u8]; 4] = [
            b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt",
            b"_tokens\":300,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cach",
            b"ed_tokens\":256}}}\n\ndata: [DONE]\n\n",
        ];
        let mut wire = Vec::new();
        for e in events {
            wire.extend_from_slice(format!("{:x}\r\n", e.len()).as_bytes());
            wire.extend_from_slice(e);
            wire.extend_from_slice(b"\r\n");
        }
        wire.extend_from_slice(b"0\r\n\r\n");
        for split in 1..wire.len() {
            let mut s = UsageScanner::default();
            let mut d = ChunkedDecoder::new();
            for read in [&wire[..split], &wire[split..]] {
                let used = d.feed(read, |p| s.feed(p)).unwrap();
                assert_eq!(used, read.len());
            }
            assert!(d.is_done());
            assert_eq!(
                s.usage,
                Usage {
                    prompt_tokens: Some(300),
                    completion_tokens: Some(2),
                    cached_tokens: Some(256)
                },
                "split {split}"
            );
        }
    }

    /// A piece longer than the `memchr` limit (the `memmem` path), the usage keys near
    /// its end and split from the next piece, among text full of `_`.
    #[test]
    fn long_pieces_with_many_underscores() {
        let mut body = br#"{"choices":[{"message":{"content":""#.to_vec();
        while body.len() < 3 * MEMCHR_MAX {
            body.extend_from_slice(b"snake_case_name = other_name_tokens_x; ");
        }
        body.extend_from_slice(br#""}}],"usage":{"prompt_tokens":4096,"completion_tokens":512,"prompt_tokens_details":{"cached_tokens":2048}}}"#);
        for split in (body.len() - 120)..body.len() {
            let mut s = UsageScanner::default();
            s.feed(&body[..split]);
            s.feed(&body[split..]);
            assert_eq!(
                s.usage,
                Usage {
                    prompt_tokens: Some(4096),
                    completion_tokens: Some(512),
                    cached_tokens: Some(2048)
                },
                "split {split}"
            );
        }
    }
}
