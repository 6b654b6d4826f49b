//! An incremental decoder for `Transfer-Encoding: chunked` response bodies, fed the
//! bytes as they arrive from the socket in pieces of any size. The HTTP client uses it
//! to find the end of streamed (SSE) responses and the first data byte for TTFT.

use crate::http::HttpError;

const MAX_CHUNK_LINE: usize = 4096;

/// An incremental `Transfer-Encoding: chunked` decoder: feed it the bytes as they
/// arrive, in pieces of any size.
#[derive(Default)]
pub struct ChunkedDecoder {
    state: ChunkState,
    line: Vec<u8>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum ChunkState {
    #[default]
    SizeLine,
    Data(u64),
    DataCr,
    DataLf,
    Trailer,
    Done,
}

impl ChunkedDecoder {
    /// Decodes from `input`, appending chunk data to `out`; returns how many bytes of
    /// `input` it used (all of them, unless the body ended inside `input`).
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<usize, HttpError> {
        let bad = |m: &str| HttpError::Protocol(format!("chunked body: {m}"));
        let mut i = 0;
        while i < input.len() {
            match self.state {
                ChunkState::SizeLine | ChunkState::Trailer => {
                    let rest = &input[i..];
                    match rest.iter().position(|&b| b == b'\n') {
                        None => {
                            self.line.extend_from_slice(rest);
                            i = input.len();
                        }
                        Some(k) => {
                            self.line.extend_from_slice(&rest[..k]);
                            i += k + 1;
                            self.end_line()?;
                        }
                    }
                    if self.line.len() > MAX_CHUNK_LINE {
                        return Err(bad("line too long"));
                    }
                }
                ChunkState::Data(left) => {
                    let take = (input.len() - i).min(usize::try_from(left).unwrap_or(usize::MAX));
                    out.extend_from_slice(&input[i..i + take]);
                    i += take;
                    let left = left - take as u64;
                    self.state = if left == 0 {
                        ChunkState::DataCr
                    } else {
                        ChunkState::Data(left)
                    };
                }
                ChunkState::DataCr => {
                    if input[i] != b'\r' {
                        return Err(bad("missing CRLF after chunk data"));
                    }
                    i += 1;
                    self.state = ChunkState::DataLf;
                }
                ChunkState::DataLf => {
                    if input[i] != b'\n' {
                        return Err(bad("missing CRLF after chunk data"));
                    }
                    i += 1;
                    self.state = ChunkState::SizeLine;
                }
                ChunkState::Done => break,
            }
        }
        Ok(i)
    }

    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    fn end_line(&mut self) -> Result<(), HttpError> {
        let bad = |m: &str| HttpError::Protocol(format!("chunked body: {m}"));
        let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
        match self.state {
            ChunkState::SizeLine => {
                let size = line.split(|&b| b == b';').next().unwrap_or(b"");
                let size = std::str::from_utf8(size)
                    .map_err(|_| bad("bad chunk size"))?
                    .trim();
                if size.is_empty()
                    || size.len() > 15
                    || !size.bytes().all(|b| b.is_ascii_hexdigit())
                {
                    return Err(bad("bad chunk size"));
                }
                let n = u64::from_str_radix(size, 16).map_err(|_| bad("bad chunk size"))?;
                self.state = if n == 0 {
                    ChunkState::Trailer
                } else {
                    ChunkState::Data(n)
                };
            }
            ChunkState::Trailer => {
                if line.is_empty() {
                    self.state = ChunkState::Done;
                }
            }
            _ => unreachable!("lines are only read in the size and trailer states"),
        }
        self.line.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNKED: &[u8] =
        b"5\r\nhello\r\n7;ext=1\r\n, world\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: 1\r\n\r\n";
    const DECODED: &[u8] = b"hello, worldabcdefghijklmnopqrstuvwxyz";

    fn decode_in_pieces(input: &[u8], cuts: &[usize]) -> (Vec<u8>, usize, bool) {
        let mut d = ChunkedDecoder::default();
        let mut out = Vec::new();
        let mut used = 0;
        let mut from = 0;
        for &to in cuts.iter().chain(std::iter::once(&input.len())) {
            used += d.feed(&input[from..to], &mut out).unwrap();
            from = to;
        }
        (out, used, d.is_done())
    }

    #[test]
    fn chunked_any_single_split() {
        for cut in 0..=CHUNKED.len() {
            let (out, used, done) = decode_in_pieces(CHUNKED, &[cut]);
            assert_eq!(out, DECODED, "split at {cut}");
            assert_eq!(used, CHUNKED.len());
            assert!(done);
        }
    }

    #[test]
    fn chunked_byte_by_byte_and_pairs_of_splits() {
        let every: Vec<usize> = (1..CHUNKED.len()).collect();
        assert_eq!(
            decode_in_pieces(CHUNKED, &every),
            (DECODED.to_vec(), CHUNKED.len(), true)
        );
        for a in 0..CHUNKED.len() {
            for b in a..CHUNKED.len() {
                assert_eq!(decode_in_pieces(CHUNKED, &[a, b]).0, DECODED);
            }
        }
    }

    #[test]
    fn chunked_stops_at_the_end_of_the_body() {
        let mut input = CHUNKED.to_vec();
        input.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        let mut d = ChunkedDecoder::default();
        let mut out = Vec::new();
        assert_eq!(d.feed(&input, &mut out).unwrap(), CHUNKED.len());
        assert!(d.is_done());
    }

    #[test]
    fn chunked_incomplete_is_not_done() {
        let (out, _, done) = decode_in_pieces(&CHUNKED[..CHUNKED.len() - 2], &[]);
        assert_eq!(out, DECODED);
        assert!(!done);
    }

    #[test]
    fn chunked_rejects_garbage() {
        for input in [
            &b"zz\r\n"[..],
            b"5\r\nhelloXX",
            b"\r\n",
            b"12345678901234567\r\n",
        ] {
            let mut d = ChunkedDecoder::default();
            assert!(
                d.feed(input, &mut Vec::new()).is_err(),
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }
}
