//! radixgate's fuzz targets, as plain functions of the input bytes so that the
//! libFuzzer binaries (`fuzz_targets/`, nightly), the stable runner
//! (`src/bin/prefix_index_stable.rs`) and the tests here all drive the same code.
//!
//! `prefix_index` decodes the bytes into a sequence of index operations over a small
//! tree of prompts (so chains share prefixes and diverge often) and runs the
//! differential check from `orchestrator/src/index/model.rs`, which this crate
//! includes by path: after every operation the index must agree with the brute-force
//! model on every match, on held and total counts and on the canonical node count,
//! stay within its budgets, and pass its own invariant check. The same ops then run
//! again with hashes folded into a tiny alphabet (one hash at several depths, which
//! real chains rule out), where only the index's own invariants are checked.
//!
//! `http_request` ([`http`]), `json_body` ([`json`]) and `prompt_hash` ([`prompt`])
//! drive the gateway's request head and chunked-body path, its JSON body parser, and
//! the orchestrator's prompt rendering and hashing.
//!
//! On stable, [`stable`] runs any target on seeded random inputs or replays saved ones
//! ([`replay`]); the committed corpora are replayed by this crate's tests and by the
//! root workspace's `tests/fuzz_corpus.rs`, which includes the check modules and
//! [`replay`] by path, so `cargo test --workspace` (CI) catches a regression on any
//! saved input without nightly or libFuzzer.

use radixgate_orchestrator::{IndexConfig, PrefixIndex, PrefixMatch};

mod http;
mod json;
mod prompt;
pub mod replay;
pub mod stable;

pub use http::http_request;
pub use json::json_body;
pub use prompt::prompt_hash;

/// The reference model and differential check; it uses `super::{IndexConfig,
/// PrefixIndex, PrefixMatch}`, imported above.
#[path = "../../orchestrator/src/index/model.rs"]
pub mod model;

use model::{chain_of, Op};

/// Longest operation sequence one input decodes to (keeps each run fast).
const MAX_OPS: usize = 64;

/// Runs the prefix-index differential check on `data`; panics on disagreement.
pub fn prefix_index(data: &[u8]) {
    let (max_blocks, ops) = decode(data);
    model::check_against_model(max_blocks, &ops);
    model::check_with_colliding_hashes(max_blocks, &ops);
}

/// Bytes to `(max_blocks, ops)`. Every input decodes (missing bytes read as 0):
/// byte 0 picks the global bound, bytes 1..4 declare backends 0..3, then each op
/// takes a tag byte and its operands.
pub fn decode(data: &[u8]) -> (usize, Vec<Op>) {
    let mut bytes = data.iter().copied();
    let mut next = || bytes.next();
    let max_blocks = match next().unwrap_or(0) {
        b @ 0..=199 => usize::from(b % 48),
        _ => usize::MAX,
    };
    let mut ops: Vec<Op> = (0..3)
        .map(|backend| Op::SetCapacity {
            backend,
            capacity: usize::from(next().unwrap_or(0) % 20),
        })
        .collect();
    while let Some(tag) = next() {
        if ops.len() >= MAX_OPS {
            break;
        }
        let mut arg = || next().unwrap_or(0);
        let backend = usize::from(arg() % 4);
        let op = match tag % 10 {
            0 => Op::SetCapacity {
                backend,
                capacity: usize::from(arg() % 20),
            },
            1..=6 => Op::Insert {
                backend,
                chain: chain_of(&path(arg(), arg(), arg())),
                now: u64::from(arg() % 16),
            },
            7 | 8 => Op::Remove {
                backend,
                chain: chain_of(&path(arg(), arg(), arg())),
                from: usize::from(arg() % 9),
            },
            _ => Op::RemoveBackend { backend },
        };
        ops.push(op);
    }
    (max_blocks, ops)
}

/// A path of up to 8 ternary branches.
fn path(len: u8, lo: u8, hi: u8) -> Vec<u8> {
    let mut digits = u16::from_le_bytes([lo, hi]);
    (0..len % 9)
        .map(|_| {
            let d = (digits % 3) as u8;
            digits /= 3;
            d
        })
        .collect()
}

/// `count` pseudo-random inputs from `seed` (splitmix64), 0 to 255 bytes each, for
/// exercising the targets without libFuzzer.
pub fn random_inputs(seed: u64, count: usize) -> impl Iterator<Item = Vec<u8>> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    (0..count).map(move |_| {
        let len = (next() % 256) as usize;
        (0..len).map(|_| next() as u8).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_inputs_agree_with_the_model() {
        for input in random_inputs(1, 300) {
            prefix_index(&input);
        }
    }

    #[test]
    fn random_inputs_pass_the_other_targets() {
        for input in random_inputs(2, 300) {
            http_request(&input);
            json_body(&input);
            prompt_hash(&input);
        }
        http_request(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
        json_body(br#"{"model":"m","messages":[{"role":"user","content":"hi there, a long enough prompt"}]}"#);
        json_body(br#"{"model":"sim","prompt":[1,2,3,99999999999999999999999]}"#);
    }

    /// The committed corpora (the root workspace's `tests/fuzz_corpus.rs` replays them
    /// in CI too).
    #[test]
    fn committed_corpora_pass() {
        let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
        for (name, check) in [
            ("http_request", http_request as fn(&[u8])),
            ("json_body", json_body),
            ("prompt_hash", prompt_hash),
        ] {
            assert!(replay::replay(&corpus.join(name), check) > 0, "{name}");
        }
    }

    #[test]
    fn short_and_empty_inputs_decode() {
        prefix_index(&[]);
        prefix_index(&[255]);
        assert_eq!(decode(&[0, 1, 2, 3]).1.len(), 3);
    }
}
