//! Precise mode's rendered prompt cut where the tokenizer itself cuts it: at its
//! added tokens (`<|im_start|>`, `<|im_end|>`, ...).
//!
//! A Hugging Face tokenizer first finds its added tokens in the text (leftmost-longest,
//! one Aho-Corasick pass), gives each its id, and tokenizes every span between them on
//! its own: normalizer, pre-tokenizer and model never see across an added token. So
//! tokenizing the spans one by one and putting the added tokens' ids between them
//! yields exactly the ids of the whole text, and each span can come from the shard's
//! [`ItemCache`]: a conversation's earlier messages are spans it has seen, so a new
//! turn costs the tokenizer only its new text instead of the whole conversation again.
//!
//! That equality needs the plain case, checked once when the hasher is built:
//! no added token strips whitespace around itself or must be a single word, none is
//! matched after normalization, special tokens are not encoded as text, and the
//! tokenizer neither truncates nor pads. A tokenizer outside it gets no splitter and
//! its rendered prompts are tokenized whole, as before.

use super::ItemCache;
use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::Tokenizer;

/// The tokenizer's added tokens, found as the tokenizer finds them.
pub struct AddedTokenSplit {
    matcher: AhoCorasick,
    /// Pattern index → the added token's id.
    ids: Vec<u32>,
}

impl AddedTokenSplit {
    /// The splitter for `tokenizer`, or `None` when tokenizing span by span might not
    /// give the ids of the whole (or it has no added tokens to cut at).
    pub fn of(tokenizer: &Tokenizer) -> Option<Self> {
        if tokenizer.get_truncation().is_some()
            || tokenizer.get_padding().is_some()
            || tokenizer.get_encode_special_tokens()
        {
            return None;
        }
        let mut tokens: Vec<(u32, String)> = Vec::new();
        for (id, t) in tokenizer.get_added_tokens_decoder() {
            if t.single_word || t.lstrip || t.rstrip || t.normalized {
                return None;
            }
            tokens.push((id, t.content));
        }
        if tokens.is_empty() {
            return None;
        }
        tokens.sort_unstable();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(_, content)| content))
            .ok()?;
        Some(Self {
            matcher,
            ids: tokens.into_iter().map(|(id, _)| id).collect(),
        })
    }

    /// Appends the ids of `text` (tokenized without special tokens added) to `out`:
    /// each added token's id, and each span between them through `cache`.
    pub fn tokenize(
        &self,
        cache: &mut ItemCache,
        tokenizer: &Tokenizer,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), tokenizers::Error> {
        let mut at = 0;
        for m in self.matcher.find_iter(text) {
            if at < m.start() {
                cache.tokenize(tokenizer, &text.as_bytes()[at..m.start()], out)?;
            }
            out.push(self.ids[m.pattern().as_usize()]);
            at = m.end();
        }
        if at < text.len() {
            cache.tokenize(tokenizer, &text.as_bytes()[at..], out)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::normalizers::unicode::NFC;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::AddedToken;

    const SPECIAL: [&str; 3] = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"];

    /// A byte-level BPE with an NFC normalizer (like Qwen's), trained here on text
    /// with ChatML markup, its three special tokens added as a chat model's are.
    fn chatml_tokenizer() -> Tokenizer {
        let mut t = Tokenizer::new(BPE::default());
        t.with_normalizer(Some(NFC));
        t.with_pre_tokenizer(Some(ByteLevel::default()));
        t.with_decoder(Some(ByteLevel::default()));
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(400)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        let corpus: Vec<String> = (0..40)
            .map(|i| {
                format!(
                    "<|im_start|>user\nthe cache of request {i} holds the prefix<|im_end|>\n\
                     <|im_start|>assistant\nan answer about engines and tokens {i}<|im_end|>\n"
                )
            })
            .collect();
        t.train(&mut trainer, corpus.iter()).unwrap();
        let special: Vec<AddedToken> = SPECIAL.iter().map(|s| AddedToken::from(*s, true)).collect();
        t.add_special_tokens(&special);
        t
    }

    fn whole(t: &Tokenizer, text: &str) -> Vec<u32> {
        t.encode_fast(text, false).unwrap().get_ids().to_vec()
    }

    fn split(s: &AddedTokenSplit, cache: &mut ItemCache, t: &Tokenizer, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        s.tokenize(cache, t, text, &mut ids).unwrap();
        ids
    }

    #[test]
    fn span_by_span_gives_the_ids_of_the_whole_text() {
        let t = chatml_tokenizer();
        let s = AddedTokenSplit::of(&t).expect("plain special tokens");
        let mut cache = ItemCache::new(1 << 16);
        let texts = [
            "<|im_start|>system\nYou answer.<|im_end|>\n<|im_start|>user\nthe cache<|im_end|>\n<|im_start|>assistant\n",
            // Added tokens back to back, at both ends, inside words, and near-misses.
            "<|im_start|><|im_end|>x<|im_start|>",
            "prefix<|im_end|>suffix <|endoftext|>",
            "<|im_sta rt|> <|im_end <|im_start|",
            // Text the normalizer changes (e + combining acute → é) beside a token.
            "caf\u{65}\u{301}<|im_end|>\u{301}tokens  \n\n  spaces",
            "",
            "no added token at all",
        ];
        for text in texts {
            // Twice: the second time every span comes from the cache.
            for _ in 0..2 {
                assert_eq!(split(&s, &mut cache, &t, text), whole(&t, text), "{text:?}");
            }
        }
        let (hits, misses) = (cache.hits, cache.misses);
        assert!(hits > 0 && misses > 0, "{hits} hits, {misses} misses");
    }

    #[test]
    fn a_growing_conversation_tokenizes_only_its_new_text() {
        let t = chatml_tokenizer();
        let s = AddedTokenSplit::of(&t).unwrap();
        let mut cache = ItemCache::new(1 << 16);
        let mut text = String::from("<|im_start|>system\nYou answer.<|im_end|>\n");
        for turn in 0..4 {
            text.push_str(&format!(
                "<|im_start|>user\nquestion {turn} about the engines<|im_end|>\n"
            ));
            let prompt = format!("{text}<|im_start|>assistant\n");
            let misses = cache.misses;
            assert_eq!(split(&s, &mut cache, &t, &prompt), whole(&t, &prompt));
            if turn > 0 {
                // The new question and the previous answer, nothing else.
                assert_eq!(cache.misses - misses, 2, "turn {turn}");
            }
            text.push_str(&format!("<|im_start|>assistant\nanswer {turn}<|im_end|>\n"));
        }
    }

    #[test]
    fn tokens_that_strip_whitespace_or_are_normalized_get_no_splitter() {
        let mut stripping = chatml_tokenizer();
        stripping.add_special_tokens(&[AddedToken::from("<mask>", true).lstrip(true)]);
        assert!(AddedTokenSplit::of(&stripping).is_none());

        let mut normalized = chatml_tokenizer();
        normalized.add_tokens(&[AddedToken::from("engines", false).normalized(true)]);
        assert!(AddedTokenSplit::of(&normalized).is_none());

        let mut as_text = chatml_tokenizer();
        as_text.set_encode_special_tokens(true);
        assert!(AddedTokenSplit::of(&as_text).is_none());

        let plain = Tokenizer::new(BPE::default());
        assert!(AddedTokenSplit::of(&plain).is_none(), "nothing to cut at");
    }
}
