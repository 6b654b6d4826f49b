//! `http_request`: a client request head and its chunked body, as the shard reads
//! them.
//!
//! The head parser must never panic, report a length within its input, and agree
//! with itself on a shorter prefix (incomplete, or the same error). Whatever
//! follows the head (or the whole input when it is no head) is decoded as a chunked
//! body twice — in one call, and in pieces of pseudo-random sizes carried over as
//! the shard does — and both must agree on payload, bytes consumed, end and errors.

use radixgate::http::chunked::ChunkedDecoder;
use radixgate::http::request::{parse_request_head, RequestHead};
use radixgate::http::BodyFraming;

pub fn http_request(data: &[u8]) {
    let mut head = RequestHead::default();
    let rest = match parse_request_head(data, &mut head) {
        Ok(Some(n)) => {
            assert!(n <= data.len());
            if let BodyFraming::Length(len) = head.framing() {
                assert!(len > 0);
            }
            // A prefix of a complete head is incomplete (or already invalid).
            if n > 1 {
                let mut again = RequestHead::default();
                if let Ok(Some(m)) = parse_request_head(&data[..n - 1], &mut again) {
                    panic!("a head of {n} bytes parsed complete at {m} on a shorter prefix");
                }
            }
            &data[n..]
        }
        Ok(None) => data,
        Err(e) => {
            assert!(matches!(e.status(), 400 | 431), "{e}");
            data
        }
    };
    chunked_agrees(rest, data.first().copied().unwrap_or(1));
}

#[derive(Debug, PartialEq, Eq)]
struct Decoded {
    payload: Vec<u8>,
    consumed: usize,
    done: bool,
    error: bool,
}

fn chunked_agrees(input: &[u8], seed: u8) {
    let whole = decode_whole(input);
    let pieces = decode_in_pieces(input, seed);
    assert_eq!(whole, pieces, "one call and pieces disagree");
    assert!(whole.payload.len() <= whole.consumed && whole.consumed <= input.len());
}

fn decode_whole(input: &[u8]) -> Decoded {
    let mut d = ChunkedDecoder::new();
    let mut payload = Vec::new();
    match d.feed(input, |p| payload.extend_from_slice(p)) {
        Ok(consumed) => Decoded {
            payload,
            consumed,
            done: d.is_done(),
            error: false,
        },
        Err(_) => Decoded {
            payload: Vec::new(),
            consumed: 0,
            done: false,
            error: true,
        },
    }
}

/// Feeds `input` in pieces of 1 to 16 bytes, as a connection would deliver it.
fn decode_in_pieces(input: &[u8], seed: u8) -> Decoded {
    let mut d = ChunkedDecoder::new();
    let mut payload = Vec::new();
    let mut consumed = 0;
    let mut at = 0;
    let mut state = u32::from(seed) | 1;
    while at < input.len() && !d.is_done() {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let end = (at + 1 + (state % 16) as usize).min(input.len());
        let piece = &input[at..end];
        match d.feed(piece, |p| payload.extend_from_slice(p)) {
            Ok(used) => {
                assert!(
                    used == piece.len() || d.is_done(),
                    "decoder left bytes of an unfinished body unconsumed"
                );
                consumed += used;
                at += used;
            }
            Err(_) => {
                return Decoded {
                    payload: Vec::new(),
                    consumed: 0,
                    done: false,
                    error: true,
                }
            }
        }
    }
    Decoded {
        payload,
        consumed,
        done: d.is_done(),
        error: false,
    }
}
