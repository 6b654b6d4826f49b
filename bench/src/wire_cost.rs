//! `radixgate-bench wire`: what the cluster wire format costs per event, encoding and
//! decoding, on this machine (the gateway's own `src/cluster/wire.rs`, compiled here
//! as [`crate::cluster_wire`]).
//!
//! Two batches: 64 four-block Inserts (the common message), and a mixed batch of
//! every op kind. Each is encoded into a reused buffer and decoded (owned ops, the
//! hash lists as `Arc<[u64]>`) in a loop for `--millis`, `--rounds` times; the
//! median round is reported in nanoseconds per op.

use std::fmt::Write as _;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cluster_wire::{decode, BackendKey, Breaker, Encoder, Header, Op};

const FP: u64 = 0x5eed_f00d;

fn inserts(n: usize) -> Vec<Op> {
    let mut rng = fastrand::Rng::with_seed(1);
    (0..n)
        .map(|i| Op::Insert {
            backend: BackendKey(rng.u64(..) % 8),
            blocks: Arc::from((0..4).map(|_| rng.u64(..)).collect::<Vec<_>>()),
            now_ms: 1_767_000_000_000 + i as u64,
        })
        .collect()
}

fn mixed() -> Vec<Op> {
    let b = BackendKey(0x1234_5678_9abc_def0);
    let mut ops = inserts(8);
    ops.extend([
        Op::Remove {
            backend: b,
            blocks: Arc::from(vec![1, 2, 3, 4]),
            from: 2,
        },
        Op::Clear { backend: b },
        Op::HoldChunks {
            backend: b,
            chunks: Arc::from(vec![7, 8]),
            now_ms: 1_767_000_000_000,
        },
        Op::BindSession {
            session: 99,
            backend: b,
            now_ms: 1_767_000_000_000,
        },
        Op::Load {
            backend: b,
            in_flight: 12,
            pending_prefill_tokens: 30_000,
        },
        Op::Health {
            backend: b,
            healthy: true,
            breaker: Breaker::Closed,
        },
        Op::Tenant {
            tenant: "tenant-a".into(),
            requests: 1_000,
            tokens: 2_000_000,
        },
    ]);
    ops
}

struct Row {
    name: &'static str,
    ops: usize,
    bytes: usize,
    encode_ns: f64,
    decode_ns: f64,
}

fn measure(name: &'static str, ops: &[Op], millis: u64, rounds: usize) -> Row {
    let header = Header {
        fingerprint: FP,
        node: 1,
        epoch: 2,
        seq: 3,
        sent_us: 4,
    };
    let mut buf = Vec::with_capacity(4096);
    let encode_once = |buf: &mut Vec<u8>| {
        buf.clear();
        let mut e = Encoder::new(buf, &header);
        for op in ops {
            e.push(op);
        }
        e.finish()
    };
    let bytes = encode_once(&mut buf);
    let per_op = |f: &mut dyn FnMut()| {
        let mut v: Vec<f64> = (0..rounds)
            .map(|_| {
                let start = Instant::now();
                let mut n = 0u64;
                while start.elapsed() < Duration::from_millis(millis) {
                    for _ in 0..64 {
                        f();
                    }
                    n += 64;
                }
                start.elapsed().as_nanos() as f64 / (n as f64 * ops.len() as f64)
            })
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let mut enc_buf = Vec::with_capacity(4096);
    let encode_ns = per_op(&mut || {
        black_box(encode_once(&mut enc_buf));
    });
    let decode_ns = per_op(&mut || {
        let b = decode(black_box(&buf), FP).expect("valid batch");
        black_box(b.ops.len());
    });
    Row {
        name,
        ops: ops.len(),
        bytes,
        encode_ns,
        decode_ns,
    }
}

/// Markdown table of both batches.
pub fn run(millis: u64, rounds: usize) -> String {
    let rows = [
        measure("64 Inserts of 4 blocks", &inserts(64), millis, rounds),
        measure("mixed (every op kind)", &mixed(), millis, rounds),
    ];
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| batch | ops | bytes | bytes/op | encode ns/op | decode ns/op |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} |",
            r.name,
            r.ops,
            r.bytes,
            r.bytes as f64 / r.ops as f64,
            r.encode_ns,
            r.decode_ns
        );
    }
    s
}
