//! The simulated engine's generated text: a cycle of words, one token each, chosen
//! so that a client re-tokenizing the answer counts `completion_tokens` tokens.
//!
//! With a tokenizer (`--tokenizer`) the words are the tokenizer's own: token ids
//! that decode to one ASCII word (letters and digits, after at most one space),
//! taken in id order and kept only where the round trip holds, checked at start:
//! each id alone re-encodes to itself (the answer's first token), and the whole
//! cycle, wrapping once, re-encodes to its ids (every pair of neighbours an answer
//! can hold). A stream carries one token per chunk, each chunk the text that token
//! adds, as vLLM's incremental detokenizer sends it: the first token as it decodes
//! alone, each later one as it decodes after another (its space included).
//!
//! Without a tokenizer the words are common English function words, the first
//! bare and each later one after a space (`"the of and to"`): one token each in
//! the byte-level BPE and SentencePiece vocabularies clients usually count with.

use tokenizers::Tokenizer;

/// The default words (no tokenizer given).
const DEFAULT: [&str; 16] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "on", "at", "by",
    "this", "from",
];

/// At most this many words are taken from a tokenizer.
const MAX_WORDS: usize = 64;

/// The words an answer cycles through.
#[derive(Debug, Clone)]
pub struct Words {
    /// Each word's text as an answer's first token.
    lead: Vec<String>,
    /// Each word's text after another token (with its leading space).
    follow: Vec<String>,
    /// The token ids (empty without a tokenizer).
    ids: Vec<u32>,
}

impl Default for Words {
    fn default() -> Self {
        Self {
            lead: DEFAULT.iter().map(|w| w.to_string()).collect(),
            follow: DEFAULT.iter().map(|w| format!(" {w}")).collect(),
            ids: Vec::new(),
        }
    }
}

impl Words {
    /// The text of token `step` of an answer whose first word is `first`.
    pub fn piece(&self, first: usize, step: usize) -> &str {
        let k = (first + step) % self.lead.len();
        if step == 0 {
            &self.lead[k]
        } else {
            &self.follow[k]
        }
    }

    pub fn len(&self) -> usize {
        self.lead.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lead.is_empty()
    }

    /// Where `text` leaves an answer off, when it is one: `(first, steps)` such that
    /// `text` is the first `steps` tokens of the answer whose first word is `first`
    /// (so the answer goes on with token `steps`).
    pub fn continued(&self, text: &str) -> Option<(usize, usize)> {
        (0..self.len()).find_map(|first| {
            let mut rest = text.strip_prefix(self.piece(first, 0))?;
            let mut steps = 1;
            while !rest.is_empty() {
                rest = rest.strip_prefix(self.piece(first, steps))?;
                steps += 1;
            }
            Some((first, steps))
        })
    }

    /// The token ids of the words, in cycle order (empty without a tokenizer).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The words of `tokenizer`, verified to round-trip; an error when none does.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Self, String> {
        let mut words = Words {
            lead: Vec::new(),
            follow: Vec::new(),
            ids: Vec::new(),
        };
        let size = tokenizer.get_vocab_size(true) as u32;
        for id in 0..size {
            if words.ids.len() == MAX_WORDS {
                break;
            }
            if let Some((lead, follow)) = word_token(tokenizer, id) {
                words.lead.push(lead);
                words.follow.push(follow);
                words.ids.push(id);
            }
        }
        // Drop words from the end until the whole cycle round-trips.
        while !words.ids.is_empty() && !words.cycle_round_trips(tokenizer) {
            words.lead.pop();
            words.follow.pop();
            words.ids.pop();
        }
        if words.ids.is_empty() {
            return Err(
                "no token of this tokenizer decodes to a word that re-encodes to \
                 itself, so generated text could not re-tokenize to completion_tokens"
                    .into(),
            );
        }
        Ok(words)
    }

    /// Whether the cycle of all words, wrapping once to the first, re-encodes to
    /// its ids: every pair of neighbours an answer can hold is in it.
    fn cycle_round_trips(&self, tokenizer: &Tokenizer) -> bool {
        let n = self.len();
        let mut text = String::new();
        let mut ids = Vec::with_capacity(n + 1);
        for step in 0..=n {
            text.push_str(self.piece(0, step));
            ids.push(self.ids[step % n]);
        }
        encode(tokenizer, &text).as_deref() == Some(&ids[..])
    }
}

/// `(lead, follow)` when token `id` is one word: it decodes alone to `word` or
/// `" word"`, after itself to `" word"` more, and re-encodes alone to itself.
fn word_token(tokenizer: &Tokenizer, id: u32) -> Option<(String, String)> {
    let lead = tokenizer.decode(&[id], false).ok()?;
    let word = lead.strip_prefix(' ').unwrap_or(&lead);
    if word.is_empty() || !word.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return None;
    }
    let follow = format!(" {word}");
    let pair = tokenizer.decode(&[id, id], false).ok()?;
    if pair != format!("{lead}{follow}") {
        return None;
    }
    (encode(tokenizer, &lead).as_deref() == Some(&[id][..])).then_some((lead, follow))
}

fn encode(tokenizer: &Tokenizer, text: &str) -> Option<Vec<u32>> {
    let e = tokenizer.encode_fast(text, false).ok()?;
    Some(e.get_ids().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token_mode::tests::word_tokenizer as word_level;

    #[test]
    fn default_words_lead_bare_then_spaced() {
        let w = Words::default();
        let text: String = (0..4).map(|s| w.piece(0, s)).collect();
        assert_eq!(text, "the of and to");
        assert_eq!(w.piece(15, 1), " the");
    }

    #[test]
    fn an_answer_cut_anywhere_is_found_where_it_left_off() {
        let w = Words::default();
        let answer: Vec<&str> = (0..40).map(|s| w.piece(5, s)).collect();
        for cut in 1..40 {
            assert_eq!(w.continued(&answer[..cut].concat()), Some((5, cut)));
        }
        assert_eq!(w.continued("hello there"), None);
        assert_eq!(w.continued("the of and x"), None);
        assert_eq!(w.continued(""), None);
    }

    #[test]
    fn tokenizer_words_round_trip_and_skip_non_words() {
        let t = word_level(&["[UNK]", "<|x|>", "alpha", "b_c", "beta", "7", "gamma"]);
        let w = Words::from_tokenizer(&t).unwrap();
        assert_eq!(w.ids(), [2, 4, 5, 6]);
        for first in 0..w.len() {
            let text: String = (0..10).map(|s| w.piece(first, s)).collect();
            let ids = t.encode_fast(text.as_str(), false).unwrap();
            assert_eq!(ids.get_ids().len(), 10, "{text}");
        }
    }

    #[test]
    fn a_tokenizer_without_words_is_refused() {
        let t = word_level(&["[UNK]", "<s>", "a_b"]);
        assert!(Words::from_tokenizer(&t).is_err());
    }
}
