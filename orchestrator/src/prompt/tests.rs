use super::*;

fn hasher(block: usize, seed: u64) -> PromptHasher {
    let mut h = PromptHasher::new(NonZeroUsize::new(block).unwrap());
    h.reset(seed);
    h
}

fn blocks_of(block: usize, seed: u64, bytes: &[u8]) -> Vec<u64> {
    let mut h = hasher(block, seed);
    h.feed(bytes);
    h.blocks().to_vec()
}

/// With one-byte blocks, two streams are equal exactly when their block lists are.
fn canon(f: impl FnOnce(&mut PromptHasher)) -> Vec<u64> {
    let mut h = hasher(1, 0);
    f(&mut h);
    h.blocks().to_vec()
}

fn reference(block: usize, seed: u64, bytes: &[u8]) -> Vec<u64> {
    let mut prev = seed;
    bytes
        .chunks_exact(block)
        .map(|b| {
            prev = block_hash(b, prev);
            prev
        })
        .collect()
}

/// Both of `block_hash`'s paths (the 64-byte one and the general one) are rapidhash
/// v3 as the crate's plain entry point computes it, at every length.
#[test]
fn block_hash_is_rapidhash_v3_at_every_length() {
    let bytes = sample(300);
    for len in 0..=bytes.len() {
        for chain in [0, 1, u64::MAX, 0x0123_4567_89ab_cdef] {
            let expected = rapidhash::v3::rapidhash_v3_seeded(&bytes[..len], &chained(chain));
            assert_eq!(block_hash(&bytes[..len], chain), expected, "length {len}");
        }
    }
}

fn sample(len: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(7);
    (0..len).map(|_| rng.u8(..)).collect()
}

#[test]
fn matches_reference_chain() {
    let bytes = sample(1000);
    for block in [1, 3, 16, 64, 999, 1000, 1001] {
        assert_eq!(blocks_of(block, 42, &bytes), reference(block, 42, &bytes));
    }
}

#[test]
fn shared_prefix_shares_leading_blocks() {
    let a = sample(200);
    let mut b = a[..100].to_vec();
    b.extend_from_slice(b"something else entirely, long enough to fill blocks");
    let (ha, hb) = (blocks_of(16, 1, &a), blocks_of(16, 1, &b));
    // 100 shared bytes cover six 16-byte blocks.
    assert_eq!(ha[..6], hb[..6]);
    assert_ne!(ha[6], hb[6]);
}

#[test]
fn divergence_in_block_k_changes_blocks_k_onwards_only() {
    let base = sample(160);
    let h0 = blocks_of(16, 9, &base);
    assert_eq!(h0.len(), 10);
    for k in 0..10 {
        let mut changed = base.clone();
        changed[k * 16 + 5] ^= 0xFF;
        let h1 = blocks_of(16, 9, &changed);
        assert_eq!(h0[..k], h1[..k], "k = {k}");
        for i in k..10 {
            assert_ne!(h0[i], h1[i], "k = {k}, i = {i}");
        }
    }
}

#[test]
fn chained_same_content_at_different_positions_differs() {
    let h = blocks_of(8, 3, &[b'a'; 64]);
    let mut sorted = h.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), h.len());
    assert_eq!(h[0], block_hash(b"aaaaaaaa", 3));
    assert_ne!(h[1], h[0]);
}

#[test]
fn feeding_in_pieces_equals_feeding_at_once() {
    let bytes = sample(300);
    for block in [1, 7, 16, 64] {
        let whole = blocks_of(block, 5, &bytes);
        for split in 0..=bytes.len() {
            let mut h = hasher(block, 5);
            h.feed(&bytes[..split]);
            h.feed(&bytes[split..]);
            assert_eq!(h.blocks(), whole, "block {block}, split {split}");
        }
        let mut rng = fastrand::Rng::with_seed(block as u64);
        for _ in 0..50 {
            let mut h = hasher(block, 5);
            let mut rest = &bytes[..];
            while !rest.is_empty() {
                let n = rng.usize(0..=rest.len().min(40));
                h.feed(&rest[..n]);
                rest = &rest[n..];
            }
            assert_eq!(h.blocks(), whole);
            assert_eq!(h.bytes_fed(), bytes.len() as u64);
        }
    }
}

#[test]
fn seed_changes_every_hash() {
    let bytes = sample(256);
    let a = blocks_of(32, model_seed("llama-3-8b"), &bytes);
    let b = blocks_of(32, model_seed("qwen2.5-7b"), &bytes);
    assert_eq!(a.len(), 8);
    assert!(a.iter().zip(&b).all(|(x, y)| x != y));
}

#[test]
fn affinity_key() {
    let mut h = hasher(16, 11);
    assert_eq!(h.affinity_key(), None);
    h.feed(b"");
    assert_eq!(h.affinity_key(), None);

    h.feed(b"short");
    assert_eq!(h.affinity_key(), Some(block_hash(b"short", 11)));
    let mut other = hasher(16, 12);
    other.feed(b"short");
    assert_ne!(other.affinity_key(), h.affinity_key());

    h.feed(b" but now long enough for a block");
    assert_eq!(h.affinity_key(), Some(h.blocks()[0]));
    let mut same_start = hasher(16, 11);
    same_start.feed(b"short but now long, with another tail");
    assert_eq!(same_start.affinity_key(), h.affinity_key());

    let mut chat = hasher(16, 11);
    chat.feed_message("user", None, "");
    assert!(chat.affinity_key().is_some());
}

#[test]
fn reset_starts_over_and_keeps_allocations() {
    let bytes = sample(100);
    let mut h = hasher(16, 1);
    h.feed(&bytes);
    h.feed_message("user", None, "x");
    let cap = h.blocks.capacity();
    h.reset(2);
    assert!(h.blocks().is_empty());
    assert_eq!(h.affinity_key(), None);
    assert_eq!(h.bytes_fed(), 0);
    assert_eq!(h.blocks.capacity(), cap);
    h.feed_message("user", None, "x");
    let mut fresh = hasher(16, 2);
    fresh.feed_message("user", None, "x");
    assert_eq!(h.affinity_key(), fresh.affinity_key());
}

#[test]
fn canonical_message_bytes() {
    assert_eq!(
        canon(|h| h.feed_message("user", None, "hello")),
        canon(|h| h.feed(b"user\x1F\x1Dhello")),
    );
    assert_eq!(
        canon(|h| {
            h.feed_message("system", None, "be brief");
            h.feed_message("user", Some("bob"), "hi");
            h.feed_content_part("there");
        }),
        canon(|h| h.feed(b"system\x1F\x1Dbe brief\x1Euser\x1Fbob\x1F\x1Dhi\x1Dthere")),
    );
    assert_eq!(
        canon(|h| h.feed_prompt("once upon")),
        canon(|h| h.feed(b"\x1Conce upon")),
    );
}

#[test]
fn different_splits_do_not_collide() {
    let pairs: [(Vec<u64>, Vec<u64>); 6] = [
        (
            canon(|h| h.feed_message("a", None, "bc")),
            canon(|h| h.feed_message("ab", None, "c")),
        ),
        (
            canon(|h| {
                h.feed_message("user", None, "ab");
                h.feed_content_part("c");
            }),
            canon(|h| {
                h.feed_message("user", None, "a");
                h.feed_content_part("bc");
            }),
        ),
        (
            canon(|h| h.feed_message("user", None, "abc")),
            canon(|h| {
                h.feed_message("user", None, "ab");
                h.feed_content_part("c");
            }),
        ),
        (
            canon(|h| h.feed_message("user", Some("x"), "y")),
            canon(|h| h.feed_message("user", None, "xy")),
        ),
        (
            canon(|h| {
                h.feed_message("user", None, "a");
                h.feed_message("user", None, "b");
            }),
            canon(|h| {
                h.feed_message("user", None, "a");
                h.feed_content_part("b");
            }),
        ),
        (
            canon(|h| h.feed_prompt("user")),
            canon(|h| h.feed_message("user", None, "")),
        ),
    ];
    for (i, (a, b)) in pairs.iter().enumerate() {
        assert_ne!(a, b, "pair {i}");
    }
}

#[test]
fn conversation_is_prefix_of_its_continuation() {
    let turn = |h: &mut PromptHasher| {
        h.feed_message("system", None, "you are terse");
        h.feed_message("user", None, "what is 2+2?");
    };
    let short = canon(turn);
    let long = canon(|h| {
        turn(h);
        h.feed_message("assistant", None, "4");
        h.feed_message("user", None, "and 3+3?");
    });
    assert!(long.len() > short.len());
    assert_eq!(long[..short.len()], short[..]);
}

#[test]
fn model_seed_depends_on_the_model() {
    assert_eq!(model_seed("m"), model_seed("m"));
    assert_ne!(model_seed("m"), model_seed("n"));
}

#[test]
fn tools_and_tool_calls_are_canonical() {
    assert_eq!(
        canon(|h| {
            h.feed_tools_start();
            h.feed(b"[{\"name\":\"f\"}]");
            h.feed_message("assistant", None, "");
            h.feed_tool_call("f", "{\"x\":1}");
        }),
        canon(|h| h.feed(b"\x1B[{\"name\":\"f\"}]\x1Eassistant\x1F\x1D\x1Af\x1F{\"x\":1}")),
    );
    // A call's name/arguments split cannot be forged by moving characters across.
    assert_ne!(
        canon(|h| {
            h.feed_message("assistant", None, "");
            h.feed_tool_call("ab", "c");
        }),
        canon(|h| {
            h.feed_message("assistant", None, "");
            h.feed_tool_call("a", "bc");
        }),
    );
}

fn token_blocks(block_tokens: usize, seed: u64, ids: &[u32]) -> Vec<u64> {
    let mut h = PromptHasher::for_tokens(NonZeroUsize::new(block_tokens).unwrap());
    h.reset(seed);
    h.feed_token_ids(ids);
    h.blocks().to_vec()
}

#[test]
fn token_blocks_count_whole_blocks_of_ids() {
    let ids: Vec<u32> = (0..203).map(|i| i * 7919 % 50_000).collect();
    for block_tokens in [1, 4, 16, 64, 128] {
        let blocks = token_blocks(block_tokens, 3, &ids);
        assert_eq!(
            blocks.len(),
            ids.len() / block_tokens,
            "block_tokens {block_tokens}"
        );
    }
    // Each block is its ids' little-endian u32 bytes, chained like byte blocks.
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    assert_eq!(token_blocks(16, 3, &ids), reference(64, 3, &bytes));
    // More than one stack buffer's worth, fed in odd pieces: the same chain.
    let mut h = PromptHasher::for_tokens(NonZeroUsize::new(16).unwrap());
    h.reset(3);
    for piece in ids.chunks(37) {
        h.feed_token_ids(piece);
    }
    assert_eq!(h.blocks(), &token_blocks(16, 3, &ids)[..]);
}

#[test]
fn token_blocks_share_a_shared_prefix() {
    let prefix: Vec<u32> = (0..100).collect();
    let a: Vec<u32> = prefix.iter().copied().chain(1..17).collect();
    let b: Vec<u32> = prefix.iter().copied().chain([9; 16]).collect();
    let (ba, bb) = (token_blocks(16, 5, &a), token_blocks(16, 5, &b));
    // 100 shared ids = 6 whole blocks of 16; block 6 (ids 96..112) differs.
    assert_eq!((ba.len(), bb.len()), (7, 7));
    assert_eq!(ba[..6], bb[..6]);
    assert_ne!(ba[6], bb[6]);
    assert_ne!(token_blocks(16, 6, &a)[0], ba[0], "seeded like byte blocks");
}

#[test]
fn recording_keeps_the_canonical_stream_and_given_ids() {
    let mut plain = hasher(8, 1);
    let mut rec = hasher(8, 1);
    rec.set_recording(true);
    for h in [&mut plain, &mut rec] {
        h.feed_message("system", None, "be brief");
        h.feed_message("user", Some("ann"), "hi");
    }
    assert_eq!(plain.blocks(), rec.blocks(), "recording changes no hash");
    assert!(plain.canonical().is_empty());
    assert_eq!(
        rec.canonical(),
        b"system\x1f\x1dbe brief\x1euser\x1fann\x1f\x1dhi"
    );
    let items: Vec<&[u8]> = rec.canonical_items().collect();
    assert_eq!(
        items,
        [
            &b"system\x1f\x1dbe brief"[..],
            &b"\x1euser\x1fann\x1f\x1dhi"[..]
        ]
    );
    assert_eq!(rec.seed(), 1);
    rec.reset(2);
    assert!(rec.canonical().is_empty());
    rec.feed_prompt("");
    for id in [5, 6, 7] {
        rec.feed_token_id(id);
    }
    assert_eq!(rec.given_token_ids(), &[5, 6, 7]);
    assert_eq!(rec.bytes_fed(), 1 + 3 * 8, "ids still hash as 8-byte words");
    rec.reset(3);
    rec.feed(b"raw");
    rec.feed_prompt("p");
    let items: Vec<&[u8]> = rec.canonical_items().collect();
    assert_eq!(items, [&b"raw"[..], &b"\x1cp"[..]]);
    rec.reset(3);
    rec.feed(b"only raw");
    assert_eq!(
        rec.canonical_items().collect::<Vec<_>>(),
        [&b"only raw"[..]]
    );
}

#[test]
fn an_adapters_chain_is_its_own() {
    let base = model_seed("m");
    let a = adapter_seed("m", "a");
    let b = adapter_seed("m", "b");
    assert!(a != base && b != base && a != b);
    // Same adapter name on another base model: another namespace.
    assert_ne!(a, adapter_seed("n", "a"));
    // An adapter is not the model of its own name.
    assert_ne!(a, model_seed("a"));
}
