//! The prefix index's lookup is on the request path: once the caller's
//! [`PrefixMatch`] is sized, `match_prefix` must not touch the allocator. A counting
//! global allocator (per thread, so parallel tests do not interfere) checks it.

use radixgate_orchestrator::{IndexConfig, PrefixIndex, PrefixMatch};

mod support;

use support::{allocations_during, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A chain of `len` blocks whose first `shared` are common to every prompt with the
/// same `system` id.
fn chain(system: u64, prompt: u64, shared: usize, len: usize) -> Vec<u64> {
    (0..len as u64)
        .map(|i| {
            if (i as usize) < shared {
                system << 32 | i
            } else {
                (system << 48) ^ (prompt << 32) ^ i ^ 0xdead_0000
            }
        })
        .collect()
}

#[test]
fn warmed_up_match_does_not_allocate() {
    let mut index = PrefixIndex::new(IndexConfig {
        max_blocks: 1 << 20,
    });
    for b in 0..16 {
        index.set_capacity(b, 4096);
    }
    let mut queries = Vec::new();
    for i in 0..200u64 {
        let c = chain(i % 5, i, 32, 32 + (i as usize % 40));
        index.insert((i % 16) as usize, &c, i);
        queries.push(c);
    }
    queries.push(chain(1, 999, 32, 80));
    queries.push(Vec::new());
    let mut out = PrefixMatch::default();
    index.match_prefix(&queries[0], &mut out);
    let mut longest = 0;
    let n = allocations_during(|| {
        for _ in 0..20 {
            for q in &queries {
                index.match_prefix(q, &mut out);
                longest = longest.max(out.longest);
            }
        }
    });
    assert_eq!(n, 0);
    assert_eq!(out.matched.len(), 16);
    assert!(longest >= 32);
}
