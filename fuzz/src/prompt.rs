//! `prompt_hash`: canonical prompt rendering and chained block hashing
//! (`radixgate_orchestrator::PromptHasher`) under arbitrary call sequences.
//!
//! The bytes decode into rendering calls (messages, content parts, tools, tool
//! calls, completion prompts, token ids) with a block size from 1 to 64. Checked:
//! no panic; exactly `bytes_fed / block_bytes` blocks; the recorded canonical stream
//! is `bytes_fed` long and, hashed in one piece or cut at arbitrary points, gives
//! the same chain; the affinity key is the first block (or the seeded tail);
//! a reset hasher reproduces the chain.

use radixgate_orchestrator::PromptHasher;
use std::num::NonZeroUsize;

pub fn prompt_hash(data: &[u8]) {
    let Some((&b0, rest)) = data.split_first() else {
        return;
    };
    let block = NonZeroUsize::new(usize::from(b0 % 64) + 1).unwrap();
    let seed = u64::from(b0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut h = PromptHasher::new(block);
    h.set_recording(true);
    h.reset(seed);
    render(&mut h, rest);
    let fed = h.bytes_fed() as usize;
    assert_eq!(h.blocks().len(), fed / block.get());
    assert_eq!(h.canonical().len(), fed);
    let items: usize = h.canonical_items().map(<[u8]>::len).sum();
    assert!(items <= fed);

    let mut whole = PromptHasher::new(block);
    whole.reset(seed);
    whole.feed(h.canonical());
    assert_eq!(whole.blocks(), h.blocks());
    assert_eq!(whole.affinity_key(), h.affinity_key());
    if let Some(first) = h.blocks().first() {
        assert_eq!(h.affinity_key(), Some(*first));
    }

    let mut cut = PromptHasher::new(block);
    cut.reset(seed);
    let canonical = h.canonical().to_vec();
    let mut at = 0;
    for &b in rest.iter().cycle().take(canonical.len()) {
        if at >= canonical.len() {
            break;
        }
        let end = (at + usize::from(b % 7)).min(canonical.len());
        cut.feed(&canonical[at..end]);
        at = end;
    }
    cut.feed(&canonical[at..]);
    assert_eq!(cut.blocks(), h.blocks(), "cut at other points");

    // Reuse after reset: same chain, no leftovers.
    let chain = h.blocks().to_vec();
    h.reset(seed);
    assert!(h.blocks().is_empty() && h.bytes_fed() == 0 && h.canonical().is_empty());
    render(&mut h, rest);
    assert_eq!(h.blocks(), &chain[..]);
}

/// Decodes `data` into rendering calls: a tag byte, a length byte, then that many
/// bytes of text (lossily UTF-8) or token ids.
fn render(h: &mut PromptHasher, data: &[u8]) {
    let mut i = 0;
    while i + 1 < data.len() {
        let (tag, len) = (data[i], usize::from(data[i + 1]));
        let start = (i + 2).min(data.len());
        let end = (start + len).min(data.len());
        let bytes = &data[start..end];
        let text = String::from_utf8_lossy(bytes);
        i = end;
        match tag % 8 {
            0 => h.feed_message("user", None, &text),
            1 => h.feed_message("assistant", Some(&text), ""),
            2 => h.feed_content_part(&text),
            3 => {
                h.feed_tools_start();
                h.feed(bytes);
            }
            4 => h.feed_tool_call(&text, "{}"),
            5 => h.feed_prompt(&text),
            6 => {
                h.feed_prompt("");
                for id in bytes.chunks(2) {
                    h.feed_token_id(u64::from(id[0]) << 8 | u64::from(*id.get(1).unwrap_or(&0)));
                }
            }
            _ => h.feed(bytes),
        }
    }
}
