//! Incremental decoder for HTTP/1.1 `Transfer-Encoding: chunked` bodies.
//!
//! Used in both directions: the shard decodes a client's chunked request body into
//! a contiguous buffer, and it tracks the chunk framing of an upstream response while
//! passing the raw bytes through untouched (so it knows where the body ends and can
//! show the payload to the usage observer). The decoder never buffers: it reports how
//! many input bytes it consumed and hands out payload slices as it finds them.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading hex digits of a chunk size.
    Size {
        value: u64,
        digits: u8,
    },
    /// Skipping a chunk extension up to CR.
    Extension {
        value: u64,
    },
    /// Expecting LF after the size line's CR.
    SizeLf {
        value: u64,
    },
    /// Inside chunk data, `remaining` bytes to go.
    Data {
        remaining: u64,
    },
    /// Expecting CR after chunk data.
    DataCr,
    /// Expecting LF after chunk data.
    DataLf,
    /// After the last chunk: at the start of a trailer line (or the final CRLF).
    TrailerLineStart,
    /// Inside a trailer line, skipping to CR.
    TrailerLine,
    /// Expecting LF after a trailer line's CR.
    TrailerLf {
        empty_line: bool,
    },
    Done,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkedError(&'static str);

impl fmt::Display for ChunkedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed chunked body: {}", self.0)
    }
}

impl std::error::Error for ChunkedError {}

/// Largest chunk size accepted (guards the u64 arithmetic; real limits are the
/// caller's body limits).
const MAX_CHUNK: u64 = 1 << 40;

#[derive(Debug, Clone)]
pub struct ChunkedDecoder {
    state: State,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkedDecoder {
    pub fn new() -> Self {
        Self {
            state: State::Size {
                value: 0,
                digits: 0,
            },
        }
    }

    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// True between chunks: the next byte would start a chunk-size line.
    pub fn at_chunk_boundary(&self) -> bool {
        matches!(self.state, State::Size { digits: 0, .. })
    }

    /// Feeds `input`; payload bytes are passed to `on_data`. Returns how many bytes of
    /// `input` belong to the chunked body (all of them unless the body ended inside
    /// `input`, in which case the rest belongs to whatever follows on the connection).
    pub fn feed(
        &mut self,
        input: &[u8],
        mut on_data: impl FnMut(&[u8]),
    ) -> Result<usize, ChunkedError> {
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            self.state = match self.state {
                State::Size { value, digits } => match b {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        let d = (b as char).to_digit(16).unwrap_or(0) as u64;
                        let value = value * 16 + d;
                        if value > MAX_CHUNK || digits >= 16 {
                            return Err(ChunkedError("chunk size too large"));
                        }
                        State::Size {
                            value,
                            digits: digits + 1,
                        }
                    }
                    b';' | b' ' | b'\t' if digits > 0 => State::Extension { value },
                    b'\r' if digits > 0 => State::SizeLf { value },
                    _ => return Err(ChunkedError("invalid chunk size")),
                },
                State::Extension { value } => match b {
                    b'\r' => State::SizeLf { value },
                    b'\n' => return Err(ChunkedError("bare LF in chunk extension")),
                    _ => State::Extension { value },
                },
                State::SizeLf { value } => {
                    if b != b'\n' {
                        return Err(ChunkedError("expected LF after chunk size"));
                    }
                    if value == 0 {
                        State::TrailerLineStart
                    } else {
                        State::Data { remaining: value }
                    }
                }
                State::Data { remaining } => {
                    let available = (input.len() - i) as u64;
                    let take = remaining.min(available) as usize;
                    on_data(&input[i..i + take]);
                    i += take;
                    let remaining = remaining - take as u64;
                    self.state = if remaining == 0 {
                        State::DataCr
                    } else {
                        State::Data { remaining }
                    };
                    continue;
                }
                State::DataCr => {
                    if b != b'\r' {
                        return Err(ChunkedError("expected CRLF after chunk data"));
                    }
                    State::DataLf
                }
                State::DataLf => {
                    if b != b'\n' {
                        return Err(ChunkedError("expected CRLF after chunk data"));
                    }
                    State::Size {
                        value: 0,
                        digits: 0,
                    }
                }
                State::TrailerLineStart => match b {
                    b'\r' => State::TrailerLf { empty_line: true },
                    _ => State::TrailerLine,
                },
                State::TrailerLine => match b {
                    b'\r' => State::TrailerLf { empty_line: false },
                    _ => State::TrailerLine,
                },
                State::TrailerLf { empty_line } => {
                    if b != b'\n' {
                        return Err(ChunkedError("expected LF in trailer"));
                    }
                    if empty_line {
                        self.state = State::Done;
                        return Ok(i + 1);
                    }
                    State::TrailerLineStart
                }
                State::Done => return Ok(i),
            };
            i += 1;
        }
        Ok(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_in_pieces(input: &[u8], piece: usize) -> (Vec<u8>, usize, bool) {
        let mut dec = ChunkedDecoder::new();
        let mut out = Vec::new();
        let mut consumed = 0;
        for part in input.chunks(piece) {
            let n = dec
                .feed(part, |d| out.extend_from_slice(d))
                .expect("valid body");
            consumed += n;
            if dec.is_done() {
                break;
            }
        }
        (out, consumed, dec.is_done())
    }

    #[test]
    fn decodes_any_split() {
        let body = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: a\r\n\r\nNEXT";
        for piece in 1..body.len() {
            let (out, consumed, done) = decode_in_pieces(body, piece);
            assert!(done, "piece {piece}");
            assert_eq!(out, b"hello, world");
            assert_eq!(&body[consumed..], b"NEXT", "piece {piece}");
        }
    }

    #[test]
    fn rejects_garbage() {
        for bad in [&b"zz\r\n"[..], b"5\r\nhelloXX", b"\r\n", b"5\nhello"] {
            let mut dec = ChunkedDecoder::new();
            assert!(dec.feed(bad, |_| {}).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rejects_oversized_chunk() {
        let mut dec = ChunkedDecoder::new();
        assert!(dec.feed(b"fffffffffffffffffff\r\n", |_| {}).is_err());
    }
}
