//! Prompt → chained block hashes: the keys of the prefix index and of hash routing.
//!
//! The gateway walks a request body once and streams its prompt into a
//! [`PromptHasher`] as a *canonical byte stream*, which is cut into blocks of exactly
//! `block_bytes` bytes regardless of message boundaries. Each complete block `i` gets
//! `h_i = block_hash(block_i, h_{i-1})` with `h_{-1} = seed` (see [`model_seed`] and
//! [`block_hash`]), so a block hash names the whole prefix up to and including that
//! block: two prompts that share a byte prefix share exactly the leading block hashes
//! it covers, and equal bytes at different positions hash differently.
//!
//! # Canonical form
//!
//! Chat message (`/v1/chat/completions`), given as `(role, name, parts)`:
//!
//! ```text
//! [0x1E if a message precedes it]  role  0x1F  [name 0x1F]  (0x1D part)*
//! ```
//!
//! - 0x1E (record separator) *separates* messages: it is written at the start of every
//!   message but the first, never after the last (it stands for the terminator of the
//!   message before). A conversation's stream is therefore a byte prefix of the
//!   stream of any continuation of it, which is what multi-turn prefix reuse needs,
//!   and no `finish` call is required.
//! - 0x1F (unit separator) ends the role, and the name when there is one.
//! - 0x1D (group separator) precedes every content part, so the first part comes in
//!   through [`PromptHasher::feed_message`] and each further one through
//!   [`PromptHasher::feed_content_part`]. A message with no content is fed with `""`
//!   and still gets its 0x1D.
//!
//! After `role 0x1F` the next byte is 0x1D for an unnamed message and a name byte
//! otherwise, and every field is closed by its own separator, so different splits of
//! the same characters (role `a` + content `bc` vs role `ab` + content `c`; parts
//! `ab|c` vs `a|bc`; a name vs none) give different streams. The separators are ASCII
//! control bytes that roles and names never hold; content that embeds them can forge a
//! boundary, which at worst changes a routing hint, never a response.
//!
//! Tool calls an assistant message made: `0x1A name 0x1F arguments` each, after its
//! content parts ([`PromptHasher::feed_tool_call`]). Tool definitions (`tools`) come
//! first, as one item: `0x1B` then the definitions as canonical JSON
//! ([`PromptHasher::feed_tools_start`], then [`PromptHasher::feed`]) — chat templates
//! render them ahead of the conversation, so requests sharing tools share that prefix.
//!
//! An image or audio content part enters as `0x1D 0x19 kind id` instead of its bytes
//! ([`PromptHasher::feed_media_part`]): a stable media id (the hash of its URL or
//! data), so the same attachment hashes alike in every request that sends it.
//!
//! A prompt shorter than one block has no complete block: [`PromptHasher::blocks`] is
//! empty, so it never matches the prefix index, and its affinity key is the seeded
//! hash of its partial bytes (hash routing still keeps identical short prompts
//! together).
//!
//! Completion prompt (`/v1/completions`): 0x1C (file separator) followed by the text.
//! It counts as an item like a message, so 0x1E also separates a prompt from whatever
//! item precedes or follows it, should a caller mix the two. A prompt given as token
//! ids is 0x1C followed by each id as 8 little-endian bytes
//! ([`PromptHasher::feed_token_id`]).
//!
//! # Token mode
//!
//! The gateway's token mode (`routing.hashing = "tokens"`) hashes token ids instead of
//! bytes, from this very canonical stream: with [`PromptHasher::set_recording`] on, the
//! hasher also keeps the bytes it was fed ([`PromptHasher::canonical`], by item:
//! [`PromptHasher::canonical_items`]) and the token ids of a token-id prompt
//! ([`PromptHasher::given_token_ids`]); the gateway tokenizes the former item by item
//! and feeds the ids to a second hasher built by [`PromptHasher::for_tokens`], through
//! [`PromptHasher::feed_token_ids`] (each id as 4 little-endian bytes, so a block is
//! exactly `block_tokens` ids), seeded with this hasher's
//! [`seed`](PromptHasher::seed). One rendering, two units of blocking.

use std::num::NonZeroUsize;

use rapidhash::v3::{rapidhash_v3_inline, RapidSecrets};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

const MESSAGE_SEP: u8 = 0x1E;
const FIELD_END: u8 = 0x1F;
const PART_START: u8 = 0x1D;
const COMPLETION_START: u8 = 0x1C;
const TOOLS_START: u8 = 0x1B;
const TOOL_CALL_START: u8 = 0x1A;
const MEDIA_START: u8 = 0x19;

/// Bytes per token id in a token-mode block ([`PromptHasher::feed_token_ids`]).
pub const TOKEN_ID_BYTES: usize = 4;

/// The name of [`block_hash`]'s function, for whatever must tell apart gateways that
/// hash blocks differently (cluster mode's routing fingerprint).
pub const BLOCK_HASH: &str = "rapidhash-v3";

/// The secrets of [`block_hash`] (fixed: every replica of a fleet must agree on them).
const BLOCK_SECRETS: RapidSecrets = RapidSecrets::seed(0x7261_6469_7867_6174); // "radixgat"

/// One block's hash, seeded with the previous block's (`chain`): rapidhash v3 with
/// the chain as its seed. It is the request path's largest single cost (every 64
/// bytes of prompt), and rapidhash takes about 30–40 instructions for a 64-byte block
/// where xxh3 took about 70 (`perf/callgrind.sh`). The default 64-byte block (16
/// token ids in token mode) takes a path compiled for exactly that length; other
/// sizes take the general one, which gives the same hashes.
#[inline]
pub fn block_hash(block: &[u8], chain: u64) -> u64 {
    match <&[u8; 64]>::try_from(block) {
        Ok(block) => block_hash_64(block, chain),
        Err(_) => block_hash_any(block, chain),
    }
}

/// [`block_hash`] of a 64-byte block. Not inlined, and the only user of this
/// instantiation of rapidhash, so that the compiler inlines rapidhash's body here and
/// drops its branches on the length (measured: 40 against 80 instructions a block).
#[inline(never)]
fn block_hash_64(block: &[u8; 64], chain: u64) -> u64 {
    rapidhash_v3_inline::<true, false, false>(block, &chained(chain))
}

/// [`block_hash`] of a block of any other length. `COMPACT` only unrolls less (the
/// hashes are the same; a test checks it), and keeps this a separate instantiation
/// from [`block_hash_64`]'s.
#[inline(never)]
fn block_hash_any(block: &[u8], chain: u64) -> u64 {
    rapidhash_v3_inline::<true, true, false>(block, &chained(chain))
}

/// [`BLOCK_SECRETS`] seeded with the previous block's hash.
fn chained(chain: u64) -> RapidSecrets {
    RapidSecrets {
        seed: chain,
        ..BLOCK_SECRETS
    }
}

/// Seed of a prompt's hash chain: prompts for different models never share blocks.
pub fn model_seed(model: &str) -> u64 {
    xxh3_64(model.as_bytes())
}

/// Seed of the hash chain of a LoRA adapter's prompts: derived from its base model
/// and its own name, so an adapter's blocks never match the base model's blocks or
/// another adapter's (vLLM keeps each adapter's KV cache apart the same way).
pub fn adapter_seed(base: &str, adapter: &str) -> u64 {
    adapter_seed_from(model_seed(base), adapter)
}

/// [`adapter_seed`] from the base model's [`model_seed`].
pub fn adapter_seed_from(base_seed: u64, adapter: &str) -> u64 {
    xxh3_64_with_seed(adapter.as_bytes(), base_seed ^ 0x6c6f_7261) // "lora"
}

/// Streaming hasher for one prompt at a time; reuse it across requests with
/// [`reset`](Self::reset) so the request path does not allocate.
#[derive(Clone, Debug)]
pub struct PromptHasher {
    block_bytes: usize,
    seed: u64,
    /// Bytes of the block being filled; always shorter than `block_bytes`.
    pending: Vec<u8>,
    blocks: Vec<u64>,
    bytes_fed: u64,
    item_open: bool,
    /// Token mode: also keep the canonical stream and any given token ids.
    recording: bool,
    canonical: Vec<u8>,
    /// Offsets in `canonical` where each item (message, tools, prompt) begins, its
    /// leading 0x1E included.
    item_starts: Vec<usize>,
    given_ids: Vec<u32>,
}

// === impl PromptHasher ===

impl PromptHasher {
    pub fn new(block_bytes: NonZeroUsize) -> Self {
        let block_bytes = block_bytes.get();
        Self {
            block_bytes,
            seed: 0,
            pending: Vec::with_capacity(block_bytes),
            blocks: Vec::new(),
            bytes_fed: 0,
            item_open: false,
            recording: false,
            canonical: Vec::new(),
            item_starts: Vec::new(),
            given_ids: Vec::new(),
        }
    }

    /// A hasher of token ids in blocks of `block_tokens` ids (token mode): feed it
    /// with [`feed_token_ids`](Self::feed_token_ids) only.
    pub fn for_tokens(block_tokens: NonZeroUsize) -> Self {
        Self::new(
            block_tokens.saturating_mul(
                NonZeroUsize::new(TOKEN_ID_BYTES).expect("TOKEN_ID_BYTES is not zero"),
            ),
        )
    }

    /// Starts a new prompt whose chain begins at `seed`; keeps allocations.
    pub fn reset(&mut self, seed: u64) {
        self.seed = seed;
        self.pending.clear();
        self.blocks.clear();
        self.bytes_fed = 0;
        self.item_open = false;
        self.canonical.clear();
        self.item_starts.clear();
        self.given_ids.clear();
    }

    /// Token mode: from now on also keep the canonical bytes fed (see the module docs).
    pub fn set_recording(&mut self, on: bool) {
        self.recording = on;
    }

    /// The canonical stream fed since the last reset, when recording (else empty).
    pub fn canonical(&self) -> &[u8] {
        &self.canonical
    }

    /// The recorded canonical stream cut before each item (tools, message, prompt):
    /// every item but the first starts with its 0x1E separator. Bytes fed before the
    /// first item form an item of their own. Concatenated, they are [`Self::canonical`].
    pub fn canonical_items(&self) -> impl Iterator<Item = &[u8]> + '_ {
        let head = match self.item_starts.first() {
            Some(&0) => None,
            Some(&start) => Some(0..start),
            None => (!self.canonical.is_empty()).then_some(0..self.canonical.len()),
        };
        let ends = self
            .item_starts
            .iter()
            .skip(1)
            .copied()
            .chain(std::iter::once(self.canonical.len()));
        let items = self
            .item_starts
            .iter()
            .copied()
            .zip(ends)
            .map(|(a, b)| a..b);
        head.into_iter()
            .chain(items)
            .map(move |range| &self.canonical[range])
    }

    /// The ids of a token-id completion prompt fed since the last reset, when
    /// recording: the engine sees exactly these, so token mode hashes them as given.
    pub fn given_token_ids(&self) -> &[u32] {
        &self.given_ids
    }

    /// The seed the current chain began at.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Appends raw canonical bytes. Full blocks are hashed straight from `bytes`;
    /// only the tail of a block is copied.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        self.bytes_fed += bytes.len() as u64;
        if self.recording {
            self.canonical.extend_from_slice(bytes);
        }
        if !self.pending.is_empty() {
            let take = (self.block_bytes - self.pending.len()).min(bytes.len());
            self.pending.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.pending.len() < self.block_bytes {
                return;
            }
            let h = block_hash(&self.pending, self.chain());
            self.blocks.push(h);
            self.pending.clear();
        }
        // The chain stays in a register: reading it back from `blocks` after each push
        // put a store-to-load round trip on the serial path (~20% of hashing time).
        // `extend` over an exact-size iterator reserves once, not per block.
        let mut chain = self.chain();
        let full = bytes.chunks_exact(self.block_bytes);
        let tail = full.remainder();
        self.blocks.extend(full.map(|block| {
            chain = block_hash(block, chain);
            chain
        }));
        self.pending.extend_from_slice(tail);
    }

    /// Feeds one chat message with its first content part (see the module docs).
    pub fn feed_message(&mut self, role: &str, name: Option<&str>, content: &str) {
        self.begin_item();
        self.feed(role.as_bytes());
        self.feed(&[FIELD_END]);
        if let Some(name) = name {
            self.feed(name.as_bytes());
            self.feed(&[FIELD_END]);
        }
        self.feed_content_part(content);
    }

    /// Feeds a further content part of the message last begun with `feed_message`.
    pub fn feed_content_part(&mut self, text: &str) {
        self.feed(&[PART_START]);
        self.feed(text.as_bytes());
    }

    /// Feeds an image or audio content part as its stable media id
    /// ([`crate::media::media_id`]): `0x1D 0x19 kind id` with `kind` `i` (image) or `a`
    /// (audio) and the id as 16 lowercase hex digits (the stream stays UTF-8 for token
    /// mode). Returns the index of the block its last byte falls in: a backend that
    /// holds more leading blocks than that has seen the whole media id.
    pub fn feed_media_part(&mut self, kind: u8, id: u64) -> usize {
        let mut out = [0u8; 19];
        out[0] = PART_START;
        out[1] = MEDIA_START;
        out[2] = kind;
        const HEX: &[u8; 16] = b"0123456789abcdef";
        for (i, slot) in out[3..].iter_mut().enumerate() {
            *slot = HEX[((id >> (60 - 4 * i)) & 0xf) as usize];
        }
        self.feed(&out);
        ((self.bytes_fed - 1) / self.block_bytes as u64) as usize
    }

    /// Starts the tool-definitions item; feed the definitions next with [`Self::feed`].
    pub fn feed_tools_start(&mut self) {
        self.begin_item();
        self.feed(&[TOOLS_START]);
    }

    /// One tool call of the current (assistant) message.
    pub fn feed_tool_call(&mut self, name: &str, arguments: &str) {
        self.feed(&[TOOL_CALL_START]);
        self.feed(name.as_bytes());
        self.feed(&[FIELD_END]);
        self.feed(arguments.as_bytes());
    }

    /// Feeds a `/v1/completions` prompt.
    pub fn feed_prompt(&mut self, text: &str) {
        self.begin_item();
        self.feed(&[COMPLETION_START]);
        self.feed(text.as_bytes());
    }

    /// One id of a completion prompt given as token ids (after `feed_prompt("")`).
    pub fn feed_token_id(&mut self, id: u64) {
        self.feed(&id.to_le_bytes());
        if self.recording {
            self.given_ids.push(id as u32);
        }
    }

    /// Token mode: appends token ids, each as [`TOKEN_ID_BYTES`] little-endian bytes,
    /// so with [`for_tokens`](Self::for_tokens) a block holds exactly `block_tokens`
    /// ids. Converts through a stack buffer: no allocation.
    pub fn feed_token_ids(&mut self, ids: &[u32]) {
        let mut buf = [0u8; 64 * TOKEN_ID_BYTES];
        for chunk in ids.chunks(64) {
            for (dst, id) in buf.chunks_exact_mut(TOKEN_ID_BYTES).zip(chunk) {
                dst.copy_from_slice(&id.to_le_bytes());
            }
            self.feed(&buf[..chunk.len() * TOKEN_ID_BYTES]);
        }
    }

    /// Chained hashes of the complete blocks fed so far.
    pub fn blocks(&self) -> &[u64] {
        &self.blocks
    }

    /// Key for hash routing: the first block's hash, or for a prompt shorter than one
    /// block the seeded hash of its bytes; `None` when nothing was fed.
    pub fn affinity_key(&self) -> Option<u64> {
        match self.blocks.first() {
            Some(&h) => Some(h),
            None if self.pending.is_empty() => None,
            None => Some(block_hash(&self.pending, self.seed)),
        }
    }

    /// Bytes of the canonical stream fed since the last reset.
    pub fn bytes_fed(&self) -> u64 {
        self.bytes_fed
    }

    pub fn block_bytes(&self) -> NonZeroUsize {
        NonZeroUsize::new(self.block_bytes).expect("constructed from a NonZeroUsize")
    }

    fn begin_item(&mut self) {
        if self.recording {
            self.item_starts.push(self.canonical.len());
        }
        if self.item_open {
            self.feed(&[MESSAGE_SEP]);
        }
        self.item_open = true;
    }

    fn chain(&self) -> u64 {
        self.blocks.last().copied().unwrap_or(self.seed)
    }
}

#[cfg(test)]
mod tests;
