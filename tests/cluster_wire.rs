//! The cluster wire format (`radixgate::cluster::wire`): known encodings, each kind
//! of rejected message, and two properties: every batch survives encode then decode
//! unchanged, and no input of any bytes makes decoding panic.

use std::sync::Arc;

use proptest::prelude::*;
use radixgate::cluster::wire::{
    decode, decode_header, encode, BackendKey, Batch, Breaker, Encoder, Header, Op, WireError,
    HEADER_LEN, MAGIC, MAX_TENANT_LEN, VERSION,
};

const FP: u64 = 0xF1F2_F3F4_F5F6_F7F8;

fn header(seq: u64) -> Header {
    Header {
        fingerprint: FP,
        node: 7,
        epoch: 1_767_000_000_000,
        seq,
        sent_us: 0x0A0B,
    }
}

fn every_op() -> Vec<Op> {
    let b = BackendKey(0xAAAA_BBBB_CCCC_DDDD);
    vec![
        Op::Insert {
            backend: b,
            blocks: Arc::from(vec![1, 2, 3, u64::MAX]),
            now_ms: 1_767_000_000_123,
        },
        Op::Remove {
            backend: b,
            blocks: Arc::from(vec![1, 2, 3]),
            from: 1,
        },
        Op::Clear { backend: b },
        Op::HoldChunks {
            backend: b,
            chunks: Arc::from(vec![9, 8]),
            now_ms: 5,
        },
        Op::BindSession {
            session: 42,
            backend: b,
            now_ms: 6,
        },
        Op::Load {
            backend: b,
            in_flight: 17,
            pending_prefill_tokens: 40_000,
        },
        Op::Health {
            backend: b,
            healthy: false,
            breaker: Breaker::HalfOpen,
        },
        Op::Tenant {
            tenant: "team-ä".into(),
            requests: 3,
            tokens: 1 << 40,
        },
        Op::SnapshotRequest {
            nonce: u64::MAX - 1,
        },
    ]
}

#[test]
fn every_op_round_trips() {
    let ops = every_op();
    let bytes = encode(&header(3), &ops);
    let batch = decode(&bytes, FP).expect("decodes");
    assert_eq!(
        batch,
        Batch {
            header: header(3),
            ops
        }
    );
    assert_eq!(decode_header(&bytes, FP), Ok(header(3)));
}

#[test]
fn layout_is_as_documented() {
    let bytes = encode(&header(0x0102), &[]);
    assert_eq!(bytes.len(), HEADER_LEN);
    assert_eq!(&bytes[..4], b"RGCL");
    assert_eq!(bytes[4], VERSION);
    assert_eq!(bytes[5], 0);
    assert_eq!(&bytes[6..14], &FP.to_le_bytes());
    assert_eq!(&bytes[14..22], &7u64.to_le_bytes());
    assert_eq!(&bytes[30..38], &0x0102u64.to_le_bytes());
    assert_eq!(&bytes[38..46], &0x0A0Bu64.to_le_bytes());
    assert_eq!(&bytes[46..50], &0u32.to_le_bytes());
    // A four-block Insert: tag, key, now_ms (6-byte varint), count, 4 hashes.
    let insert = Op::Insert {
        backend: BackendKey(1),
        blocks: Arc::from(vec![1, 2, 3, 4]),
        now_ms: 1_767_000_000_123,
    };
    assert_eq!(encode(&header(0), &[insert]).len() - HEADER_LEN, 48);
}

#[test]
fn encoder_appends_to_a_buffer_and_counts_ops() {
    let mut buf = b"prefix".to_vec();
    let mut enc = Encoder::new(&mut buf, &header(1));
    assert!(enc.is_empty());
    for op in every_op() {
        enc.push(&op);
    }
    assert_eq!(enc.ops() as usize, every_op().len());
    let len = enc.finish();
    assert_eq!(len, buf.len() - 6);
    assert_eq!(decode(&buf[6..], FP).expect("decodes").ops, every_op());
}

#[test]
fn each_kind_of_bad_message_is_its_own_error() {
    let good = encode(&header(1), &every_op());

    let mut foreign = good.clone();
    foreign[0] = b'X';
    assert_eq!(decode(&foreign, FP), Err(WireError::Foreign));
    assert_eq!(decode(b"{\"json\":1}", FP), Err(WireError::Foreign));

    let mut version = good.clone();
    version[4] = 2;
    assert_eq!(decode(&version, FP), Err(WireError::Version { found: 2 }));
    // A newer version is reported as such even when its header is shorter.
    assert_eq!(
        decode(&[b'R', b'G', b'C', b'L', 9], FP),
        Err(WireError::Version { found: 9 })
    );

    assert_eq!(
        decode(&good, FP ^ 1),
        Err(WireError::Fingerprint {
            found: FP,
            expected: FP ^ 1
        })
    );

    for cut in 0..good.len() {
        assert_eq!(
            decode(&good[..cut], FP),
            Err(WireError::Truncated),
            "cut at {cut}"
        );
    }

    let mut trailing = good.clone();
    trailing.push(0);
    assert!(matches!(
        decode(&trailing, FP),
        Err(WireError::Malformed(_))
    ));

    let mut flags = good.clone();
    flags[5] = 1;
    assert!(matches!(decode(&flags, FP), Err(WireError::Malformed(_))));

    let mut tag = encode(
        &header(1),
        &[Op::Clear {
            backend: BackendKey(1),
        }],
    );
    tag[HEADER_LEN] = 200;
    assert!(matches!(decode(&tag, FP), Err(WireError::Malformed(_))));

    let mut breaker = encode(
        &header(1),
        &[Op::Health {
            backend: BackendKey(1),
            healthy: true,
            breaker: Breaker::Open,
        }],
    );
    *breaker.last_mut().expect("non-empty") = 3;
    assert!(matches!(decode(&breaker, FP), Err(WireError::Malformed(_))));

    // A Remove whose offset lies past its chain.
    let mut remove = encode(
        &header(1),
        &[Op::Remove {
            backend: BackendKey(1),
            blocks: Arc::from(vec![1]),
            from: 1,
        }],
    );
    remove[HEADER_LEN + 9] = 2;
    assert!(matches!(decode(&remove, FP), Err(WireError::Malformed(_))));

    let kinds: Vec<&str> = [
        WireError::Foreign,
        WireError::Version { found: 2 },
        WireError::Fingerprint {
            found: 1,
            expected: 2,
        },
        WireError::Truncated,
        WireError::Malformed("x"),
    ]
    .iter()
    .map(WireError::kind)
    .collect();
    assert_eq!(
        kinds,
        [
            "foreign",
            "version",
            "fingerprint",
            "truncated",
            "malformed"
        ]
    );
}

#[test]
fn huge_counts_are_refused_before_allocating() {
    let mut b = encode(&header(1), &[]);
    b[46..50].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(decode(&b, FP), Err(WireError::Truncated));
    // An Insert claiming 2^60 blocks.
    let mut b = encode(&header(1), &[]);
    b[46..50].copy_from_slice(&1u32.to_le_bytes());
    b.push(1);
    b.extend_from_slice(&1u64.to_le_bytes());
    b.push(0);
    b.extend_from_slice(&[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x10]);
    assert_eq!(decode(&b, FP), Err(WireError::Truncated));
    // A varint of eleven bytes.
    let mut b = encode(&header(1), &[]);
    b[46..50].copy_from_slice(&1u32.to_le_bytes());
    b.push(1);
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&[0xff; 11]);
    assert!(matches!(decode(&b, FP), Err(WireError::Malformed(_))));
}

#[test]
fn long_tenant_names_are_cut_at_a_char_boundary() {
    let name: String = "é".repeat(MAX_TENANT_LEN); // 2 bytes each
    let b = encode(
        &header(1),
        &[Op::Tenant {
            tenant: name.clone(),
            requests: 1,
            tokens: 2,
        }],
    );
    let ops = decode(&b, FP).expect("decodes").ops;
    let Op::Tenant { tenant, .. } = &ops[0] else {
        panic!("not a tenant op")
    };
    assert_eq!(tenant.len(), MAX_TENANT_LEN);
    assert!(name.starts_with(tenant.as_str()));
}

#[test]
fn magic_is_the_documented_bytes() {
    assert_eq!(MAGIC, *b"RGCL");
}

fn arb_list() -> impl Strategy<Value = Arc<[u64]>> {
    prop::collection::vec(any::<u64>(), 0..12).prop_map(Arc::from)
}

fn arb_op() -> impl Strategy<Value = Op> {
    let key = any::<u64>().prop_map(BackendKey);
    let breaker = prop_oneof![
        Just(Breaker::Closed),
        Just(Breaker::Open),
        Just(Breaker::HalfOpen)
    ];
    prop_oneof![
        (key.clone(), arb_list(), any::<u64>()).prop_map(|(backend, blocks, now_ms)| Op::Insert {
            backend,
            blocks,
            now_ms
        }),
        (key.clone(), arb_list(), any::<u32>()).prop_map(|(backend, blocks, f)| {
            let from = f % (blocks.len() as u32 + 1);
            Op::Remove {
                backend,
                blocks,
                from,
            }
        }),
        key.clone().prop_map(|backend| Op::Clear { backend }),
        (key.clone(), arb_list(), any::<u64>()).prop_map(|(backend, chunks, now_ms)| {
            Op::HoldChunks {
                backend,
                chunks,
                now_ms,
            }
        }),
        (any::<u64>(), key.clone(), any::<u64>()).prop_map(|(session, backend, now_ms)| {
            Op::BindSession {
                session,
                backend,
                now_ms,
            }
        }),
        (key.clone(), any::<u32>(), any::<u64>()).prop_map(|(backend, in_flight, p)| Op::Load {
            backend,
            in_flight,
            pending_prefill_tokens: p
        }),
        (key, any::<bool>(), breaker).prop_map(|(backend, healthy, breaker)| Op::Health {
            backend,
            healthy,
            breaker
        }),
        ("\\PC{0,40}", any::<u64>(), any::<u64>()).prop_map(|(tenant, requests, tokens)| {
            Op::Tenant {
                tenant,
                requests,
                tokens,
            }
        }),
        any::<u64>().prop_map(|nonce| Op::SnapshotRequest { nonce }),
    ]
}

fn arb_header() -> impl Strategy<Value = Header> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(fingerprint, node, epoch, seq, sent_us)| Header {
            fingerprint,
            node,
            epoch,
            seq,
            sent_us,
        })
}

proptest! {
    #[test]
    fn any_batch_round_trips(h in arb_header(), ops in prop::collection::vec(arb_op(), 0..40)) {
        let bytes = encode(&h, &ops);
        let batch = decode(&bytes, h.fingerprint).expect("a batch we encoded decodes");
        prop_assert_eq!(batch, Batch { header: h, ops });
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512), fp in any::<u64>()) {
        let _ = decode(&bytes, fp);
        let _ = decode_header(&bytes, fp);
    }

    #[test]
    fn bytes_after_a_valid_header_never_panic(
        h in arb_header(),
        tail in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        // Past the magic and fingerprint checks, into the op decoder.
        let mut bytes = encode(&h, &[]);
        let n = (tail.len() as u32 / 4).to_le_bytes();
        bytes[HEADER_LEN - 4..].copy_from_slice(&n);
        bytes.extend_from_slice(&tail);
        let _ = decode(&bytes, h.fingerprint);
    }

    #[test]
    fn a_flipped_byte_in_a_valid_batch_never_panics(
        h in arb_header(),
        ops in prop::collection::vec(arb_op(), 1..10),
        at in any::<prop::sample::Index>(),
        x in 1u8..,
    ) {
        let mut bytes = encode(&h, &ops);
        let i = at.index(bytes.len());
        bytes[i] ^= x;
        let _ = decode(&bytes, h.fingerprint);
    }
}
