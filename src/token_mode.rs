//! Token mode (`routing.hashing = "tokens"`): prefix blocks counted in the engine's
//! own tokens instead of canonical prompt bytes.
//!
//! Bytes mode, the default, hashes the canonical prompt stream in blocks of
//! `routing.block_bytes`; a block is "about `block_bytes / bytes_per_token` tokens".
//! Token mode makes that exact: the shard's [`PromptHasher`] records the same
//! canonical stream while [`BodyParser`](crate::openai::BodyParser) feeds it (one
//! rendering, see `radixgate_orchestrator::prompt`), then [`TokenHasher::hash`]
//! tokenizes it with the configured Hugging Face `tokenizer.json` and hashes the ids
//! in blocks of `routing.block_tokens` with the same chained block hash, seeded the same
//! way (model ^ tenant ^ `cache_salt`). Each canonical item (the tools, a message, a
//! completion prompt) is tokenized on its own and the ids are concatenated, as a chat
//! template's special tokens would split them; so an item's ids do not depend on
//! what precedes it, and a per-shard cache ([`ItemCache`]) keyed by the item's bytes
//! skips the tokenizer for items it has seen (a system prompt, a shared document,
//! a conversation's earlier turns). Those blocks replace the byte blocks for the
//! prefix index and the affinity key, and a matched block stands for exactly
//! `block_tokens` tokens in the est-TTFT estimate. A completion prompt given as token
//! ids is hashed as those ids, untokenized.
//!
//! The canonical form is not the engine's chat template (its separators are control
//! bytes, not template markup), so the gateway's block boundaries are in the engine's
//! units but not at the engine's exact positions; prefixes still match exactly when
//! prompts share their leading messages.
//!
//! Cost: the tokenizer is loaded once at config load and shared by every shard
//! (`Arc`; `Tokenizer` is `Send + Sync`), but encoding runs on the shard, inline:
//! tokenizers 0.22 needs about 0.8 ms per 2 KB of new prompt text (measured in
//! `benches/parse.rs` with Qwen3's tokenizer), some 45× the CPU of proxying the
//! request (see docs/routing.md, "Token mode"); items found in the cache cost a hash and a
//! copy. Use it where engine-sized block accounting is worth that;
//! bytes mode stays the fast path. Precise mode ([`TokenHasher::hash_precise`])
//! renders the engine's chat template instead and cuts the text at the tokenizer's
//! added tokens ([`added_split`]), so its spans use the same cache.

mod added_split;

use crate::chat_template::ChatTemplate;
use added_split::AddedTokenSplit;
use radixgate_orchestrator::PromptHasher;
use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::Arc;
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_64;

/// Token ids a shard's [`ItemCache`] keeps per generation (4 bytes each; two
/// generations: at most 2 MiB per shard).
pub const ITEM_CACHE_TOKENS: usize = 256 << 10;

/// Per-shard token-mode state: the shared tokenizer, the item cache and a hasher
/// over token ids.
pub struct TokenHasher {
    tokenizer: Arc<Tokenizer>,
    hasher: PromptHasher,
    cache: ItemCache,
    /// Precise mode: where the rendered prompt is cut into cacheable spans (`None`:
    /// tokenized whole; see [`added_split`]).
    added: Option<AddedTokenSplit>,
    /// The current prompt's ids (reused across requests).
    ids: Vec<u32>,
}

// === impl TokenHasher ===

impl TokenHasher {
    pub fn new(tokenizer: Arc<Tokenizer>, block_tokens: NonZeroUsize) -> Self {
        Self::with_cache(tokenizer, block_tokens, ITEM_CACHE_TOKENS)
    }

    /// With an item cache of `cache_tokens` ids per generation (0: no cache).
    pub fn with_cache(
        tokenizer: Arc<Tokenizer>,
        block_tokens: NonZeroUsize,
        cache_tokens: usize,
    ) -> Self {
        Self {
            added: AddedTokenSplit::of(&tokenizer),
            tokenizer,
            hasher: PromptHasher::for_tokens(block_tokens),
            cache: ItemCache::new(cache_tokens),
            ids: Vec::new(),
        }
    }

    /// Tokenizes the canonical prompt `canonical` recorded (it must have recording
    /// on) and hashes the ids, seeded like `canonical`'s own chain. If the tokenizer
    /// fails, the prompt gets no blocks (it is routed by load) and the error is
    /// returned for the caller to count; the request itself goes on.
    pub fn hash(&mut self, canonical: &PromptHasher) -> Result<(), tokenizers::Error> {
        if self.begin(canonical) {
            return Ok(());
        }
        for item in canonical.canonical_items() {
            self.cache.tokenize(&self.tokenizer, item, &mut self.ids)?;
        }
        self.hasher.feed_token_ids(&self.ids);
        Ok(())
    }

    /// Precise mode: the prompt as the engine tokenizes it. A chat request's
    /// `messages` (content parts joined by newlines, as vLLM joins text parts) and
    /// `tools` are rendered through the engine's chat template and tokenized without
    /// special tokens; a completion `prompt` string is tokenized with them; a prompt
    /// given as ids is hashed as those ids. Seeded like `canonical`'s own chain, so
    /// the blocks equal the ones [`crate::kv_events`] rebuilds from the engine's
    /// `BlockStored` events. On failure the prompt gets no blocks (routed by load)
    /// and the error is returned for the caller to count.
    pub fn hash_precise(
        &mut self,
        canonical: &PromptHasher,
        template: &ChatTemplate,
        body: &[u8],
    ) -> Result<(), String> {
        if self.begin(canonical) {
            return Ok(());
        }
        let mut v: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        if let Some(mut messages) = v.get_mut("messages").map(serde_json::Value::take) {
            join_text_parts(&mut messages);
            let text = template
                .render(&messages, v.get("tools").filter(|t| !t.is_null()))
                .map_err(|e| e.to_string())?;
            match &self.added {
                Some(split) => {
                    split.tokenize(&mut self.cache, &self.tokenizer, &text, &mut self.ids)
                }
                None => self
                    .cache
                    .tokenize(&self.tokenizer, text.as_bytes(), &mut self.ids),
            }
            .map_err(|e| e.to_string())?;
        } else if let Some(prompt) = v.get("prompt").and_then(|p| p.as_str()) {
            let encoding = self
                .tokenizer
                .encode_fast(prompt, true)
                .map_err(|e| e.to_string())?;
            self.ids.extend_from_slice(encoding.get_ids());
        }
        self.hasher.feed_token_ids(&self.ids);
        Ok(())
    }

    /// Starts a prompt seeded like `canonical`'s chain; a prompt given as token ids
    /// is hashed as those ids at once (returns true: nothing left to tokenize).
    fn begin(&mut self, canonical: &PromptHasher) -> bool {
        self.hasher.reset(canonical.seed());
        self.ids.clear();
        let given = canonical.given_token_ids();
        if given.is_empty() {
            return false;
        }
        self.ids.extend_from_slice(given);
        self.hasher.feed_token_ids(given);
        true
    }

    /// Chained hashes of the whole `block_tokens` blocks of the last prompt.
    pub fn blocks(&self) -> &[u64] {
        self.hasher.blocks()
    }

    /// The first block's hash, or for a prompt shorter than one block the seeded
    /// hash of its ids; `None` for an empty prompt.
    pub fn affinity_key(&self) -> Option<u64> {
        self.hasher.affinity_key()
    }

    /// The last prompt's token ids.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Tokens in the last prompt (its canonical form).
    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// Item-cache lookups that hit and that missed, since the start.
    pub fn cache_stats(&self) -> (u64, u64) {
        (self.cache.hits, self.cache.misses)
    }
}

/// Turns each message's array `content` (OpenAI content parts) into the string vLLM
/// gives a string-content chat template: its text parts joined by newlines.
fn join_text_parts(messages: &mut serde_json::Value) {
    let Some(list) = messages.as_array_mut() else {
        return;
    };
    for m in list {
        let Some(parts) = m.get("content").and_then(|c| c.as_array()) else {
            continue;
        };
        let text: Vec<&str> = parts
            .iter()
            .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
            .collect();
        m["content"] = serde_json::Value::String(text.join("\n"));
    }
}

/// Canonical item bytes (by xxh3-64) → their token ids, bounded by a token count.
/// Two generations approximate LRU without bookkeeping per hit: new entries go into
/// `current`; a hit in `previous` moves up; when `current` is full it becomes
/// `previous` and the old `previous` is dropped. A 64-bit key collision would only
/// change a routing hint, never a response.
pub struct ItemCache {
    current: HashMap<u64, Box<[u32]>>,
    previous: HashMap<u64, Box<[u32]>>,
    current_tokens: usize,
    capacity_tokens: usize,
    hits: u64,
    misses: u64,
}

// === impl ItemCache ===

impl ItemCache {
    pub fn new(capacity_tokens: usize) -> Self {
        Self {
            current: HashMap::new(),
            previous: HashMap::new(),
            current_tokens: 0,
            capacity_tokens,
            hits: 0,
            misses: 0,
        }
    }

    /// Appends `item`'s token ids to `out`, from the cache or the tokenizer.
    fn tokenize(
        &mut self,
        tokenizer: &Tokenizer,
        item: &[u8],
        out: &mut Vec<u32>,
    ) -> Result<(), tokenizers::Error> {
        let key = xxh3_64(item);
        if let Some(ids) = self.current.get(&key) {
            self.hits += 1;
            out.extend_from_slice(ids);
            return Ok(());
        }
        if let Some(ids) = self.previous.remove(&key) {
            self.hits += 1;
            out.extend_from_slice(&ids);
            self.insert(key, ids);
            return Ok(());
        }
        self.misses += 1;
        // Items are cut at ASCII separators of a stream built from `&str` fields and
        // ASCII bytes, or at added tokens of a `&str`: always UTF-8 (lossy only
        // guards the impossible).
        let text = String::from_utf8_lossy(item);
        let encoding = tokenizer.encode_fast(&*text, false)?;
        let ids = encoding.get_ids();
        out.extend_from_slice(ids);
        if self.capacity_tokens > 0 && ids.len() <= self.capacity_tokens / 4 {
            self.insert(key, ids.into());
        }
        Ok(())
    }

    fn insert(&mut self, key: u64, ids: Box<[u32]>) {
        self.current_tokens += ids.len();
        self.current.insert(key, ids);
        if self.current_tokens > self.capacity_tokens {
            self.previous = std::mem::take(&mut self.current);
            self.current_tokens = 0;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::openai::{BodyParser, Endpoint, ModelTable};
    use std::collections::HashMap;
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;

    /// A word-level tokenizer over `words` (anything else is `[UNK]`), split on
    /// whitespace and punctuation.
    pub(crate) fn word_tokenizer(words: &[&str]) -> Tokenizer {
        let mut vocab: HashMap<String, u32> = HashMap::new();
        vocab.insert("[UNK]".into(), 0);
        for w in words {
            let next = vocab.len() as u32;
            vocab.entry((*w).into()).or_insert(next);
        }
        let model = WordLevel::builder()
            .vocab(vocab.into_iter().collect())
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let mut t = Tokenizer::new(model);
        t.with_pre_tokenizer(Some(Whitespace {}));
        t
    }

    fn hash_body(t: &mut TokenHasher, endpoint: Endpoint, body: &str) -> Vec<u64> {
        let models = ModelTable::new(vec!["m".into()]);
        let mut canonical = PromptHasher::new(NonZeroUsize::new(64).unwrap());
        canonical.set_recording(true);
        BodyParser::default()
            .parse(endpoint, body.as_bytes(), &models, &mut canonical, 0)
            .unwrap();
        t.hash(&canonical).unwrap();
        t.blocks().to_vec()
    }

    fn chat(system: &str, user: &str) -> String {
        format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{user}"}}]}}"#
        )
    }

    #[test]
    fn shared_prefix_shares_token_blocks() {
        let tok = Arc::new(word_tokenizer(&["system", "user", "a", "b", "c", "d"]));
        let mut t = TokenHasher::new(tok, NonZeroUsize::new(4).unwrap());
        let doc = "a b c d ".repeat(10); // 40 tokens
        let one = hash_body(&mut t, Endpoint::ChatCompletions, &chat(&doc, "a a a a"));
        let tokens = t.tokens();
        let two = hash_body(&mut t, Endpoint::ChatCompletions, &chat(&doc, "b b b b"));
        assert_eq!(one.len(), tokens / 4, "whole blocks of 4 ids");
        // "system", separator, 40 doc tokens, separator... the doc's blocks agree.
        assert!(one.len() >= 10);
        assert_eq!(one[..10], two[..10]);
        assert_ne!(one.last(), two.last());
    }

    #[test]
    fn items_are_tokenized_apart_and_cached() {
        let words = ["system", "user", "a", "b", "c", "d"];
        let tok = Arc::new(word_tokenizer(&words));
        let block = NonZeroUsize::new(4).unwrap();
        let mut cached = TokenHasher::new(tok.clone(), block);
        let mut uncached = TokenHasher::with_cache(tok.clone(), block, 0);
        let doc = "a b c d ".repeat(10);
        for (i, user) in ["a a", "b b", "a a"].into_iter().enumerate() {
            let body = chat(&doc, user);
            let a = hash_body(&mut cached, Endpoint::ChatCompletions, &body);
            let b = hash_body(&mut uncached, Endpoint::ChatCompletions, &body);
            assert_eq!(a, b, "the cache changes no block");
            // The system message (item 1) hits from the second request on; the
            // user message "a a" hits on its second sight.
            let expected = [(0, 2), (1, 3), (3, 3)][i];
            assert_eq!(cached.cache_stats(), expected, "request {i}");
        }
        assert_eq!(uncached.cache_stats(), (0, 6));
        // Each item on its own: the ids are the items' ids concatenated.
        let system = tok
            .encode_fast(format!("system\x1f\x1d{doc}"), false)
            .unwrap();
        let user = tok.encode_fast("\x1euser\x1f\x1da a", false).unwrap();
        assert_eq!(
            cached.tokens(),
            system.get_ids().len() + user.get_ids().len()
        );
    }

    #[test]
    fn item_cache_stays_bounded() {
        let tok = word_tokenizer(&["w"]);
        let mut cache = ItemCache::new(40);
        let mut out = Vec::new();
        for i in 0..100 {
            let item = format!("w w w w w w w w w {i}");
            cache.tokenize(&tok, item.as_bytes(), &mut out).unwrap();
            assert!(cache.current_tokens <= 40);
            let held: usize = cache.previous.values().map(|v| v.len()).sum();
            assert!(held <= 40 + 10, "previous holds {held}");
        }
        assert_eq!(out.len(), 100 * 10);
        // Recent items are still there; the oldest are gone.
        let before = cache.hits;
        cache
            .tokenize(&tok, b"w w w w w w w w w 99", &mut out)
            .unwrap();
        cache
            .tokenize(&tok, b"w w w w w w w w w 0", &mut out)
            .unwrap();
        assert_eq!(cache.hits, before + 1);
    }

    #[test]
    fn token_id_prompts_are_hashed_as_given() {
        let tok = Arc::new(word_tokenizer(&[]));
        let mut t = TokenHasher::new(tok, NonZeroUsize::new(2).unwrap());
        let blocks = hash_body(
            &mut t,
            Endpoint::Completions,
            r#"{"model":"m","prompt":[7,8,9,10,11]}"#,
        );
        assert_eq!((t.tokens(), blocks.len()), (5, 2));
        let mut direct = PromptHasher::for_tokens(NonZeroUsize::new(2).unwrap());
        direct.reset(radixgate_orchestrator::model_seed("m"));
        direct.feed_token_ids(&[7, 8, 9, 10, 11]);
        assert_eq!(blocks, direct.blocks());
    }
}
