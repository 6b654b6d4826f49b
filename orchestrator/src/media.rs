//! Multimodal requests: what a backend can take ([`Capabilities`]), what a request
//! needs ([`MediaNeeds`]) and what its media cost to prefill.
//!
//! The gateway's body parser notes every image or audio content part while it hashes
//! the prompt: each part enters the block chain as a stable media id (the xxh3 of its
//! URL or data, [`media_id`]), so a follow-up about the same image shares the
//! engine's cached prefix, and the block the first media id ends in is remembered.
//! Routing then keeps only backends whose capabilities cover the request's needs
//! ([`Capabilities::covers`]), and the `prefix_aware` cost model charges the media's
//! token cost ([`IMAGE_TOKENS`], [`AUDIO_TOKENS`] per part) to every candidate that does
//! not hold the prompt past that block ([`MediaNeeds::uncached_tokens`]): an engine that
//! encoded the image already skips the encoder and the media tokens' prefill.

use std::fmt;

use xxhash_rust::xxh3::xxh3_64;

/// Estimated prompt tokens one image adds (a 336 px tile in LLaVA-style encoders is
/// 576 tokens; larger images are tiled into more, so this is a floor).
pub const IMAGE_TOKENS: u32 = 576;

/// Estimated prompt tokens one audio clip adds (Whisper-style encoders give 1500
/// frames per 30 s, pooled 2:1 by the usual audio LLMs).
pub const AUDIO_TOKENS: u32 = 750;

/// The modalities a backend accepts, as a small bit set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Capabilities(u8);

/// One modality: its name in config and its bit.
const MODALITIES: [(&str, u8); 3] = [("text", 1), ("image", 2), ("audio", 4)];

// === impl Capabilities ===

impl Capabilities {
    pub const NONE: Capabilities = Capabilities(0);
    pub const TEXT: Capabilities = Capabilities(1);
    pub const IMAGE: Capabilities = Capabilities(2);
    pub const AUDIO: Capabilities = Capabilities(4);

    /// Parses config names (`text`, `image`, `audio`); `Err` names the unknown one.
    pub fn parse<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        let mut bits = 0;
        for name in names {
            let (_, bit) = MODALITIES.iter().find(|(n, _)| *n == name).ok_or_else(|| {
                format!("unknown capability `{name}`; expected text, image or audio")
            })?;
            bits |= bit;
        }
        Ok(Capabilities(bits))
    }

    pub fn union(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 | other.0)
    }

    /// Whether a backend with these capabilities can take a request needing `needs`.
    pub fn covers(self, needs: Capabilities) -> bool {
        self.0 & needs.0 == needs.0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The config names of the set, in a fixed order.
    pub fn names(self) -> impl Iterator<Item = &'static str> {
        MODALITIES
            .into_iter()
            .filter(move |(_, bit)| self.0 & bit != 0)
            .map(|(n, _)| n)
    }
}

impl Default for Capabilities {
    /// A backend that declares nothing is a text model.
    fn default() -> Self {
        Capabilities::TEXT
    }
}

impl fmt::Display for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, n) in self.names().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(n)?;
        }
        Ok(())
    }
}

/// The stable id a media part enters the block chain as: the xxh3 of its URL (for a
/// `data:` URL or inline audio, of the data itself), so the same attachment always
/// hashes alike however it is re-sent.
pub fn media_id(url_or_data: &str) -> u64 {
    xxh3_64(url_or_data.as_bytes())
}

/// What a request's media need: the modalities beyond text, how many parts of each,
/// and the prompt block the first media part fell in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MediaNeeds {
    /// Image and audio bits only; empty for a text-only request.
    pub kinds: Capabilities,
    pub images: u16,
    pub audio: u16,
    /// Index of the prompt block that ends the first media id.
    pub first_block: u32,
}

// === impl MediaNeeds ===

impl Default for MediaNeeds {
    fn default() -> Self {
        MediaNeeds::TEXT_ONLY
    }
}

impl MediaNeeds {
    pub const TEXT_ONLY: MediaNeeds = MediaNeeds {
        kinds: Capabilities::NONE,
        images: 0,
        audio: 0,
        first_block: 0,
    };

    /// Notes one media part of `kind` (image or audio) whose id ended in block
    /// `block` ([`crate::PromptHasher::feed_media_part`]).
    pub fn note(&mut self, kind: Capabilities, block: usize) {
        if self.kinds.is_empty() {
            self.first_block = u32::try_from(block).unwrap_or(u32::MAX);
        }
        self.kinds = self.kinds.union(kind);
        if kind == Capabilities::IMAGE {
            self.images = self.images.saturating_add(1);
        } else {
            self.audio = self.audio.saturating_add(1);
        }
    }

    pub fn is_text_only(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Estimated prompt tokens the media add.
    pub fn tokens(&self) -> u32 {
        u32::from(self.images) * IMAGE_TOKENS + u32::from(self.audio) * AUDIO_TOKENS
    }

    /// Media tokens a backend holding the prompt's first `matched_blocks` blocks must
    /// still prefill: none once its match reaches past the first media id's block.
    pub fn uncached_tokens(&self, matched_blocks: u32) -> u32 {
        if self.is_text_only() || matched_blocks > self.first_block {
            0
        } else {
            self.tokens()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_parse_cover_and_print() {
        let c = Capabilities::parse(["text", "image"]).unwrap();
        assert!(c.covers(Capabilities::IMAGE));
        assert!(c.covers(Capabilities::NONE));
        assert!(!c.covers(Capabilities::AUDIO));
        assert!(!c.covers(Capabilities::IMAGE.union(Capabilities::AUDIO)));
        assert_eq!(c.to_string(), "text, image");
        assert_eq!(Capabilities::default(), Capabilities::TEXT);
        let e = Capabilities::parse(["video"]).unwrap_err();
        assert!(e.contains("`video`"), "{e}");
    }

    #[test]
    fn media_cost_is_charged_until_the_match_covers_the_media() {
        let mut m = MediaNeeds::TEXT_ONLY;
        assert_eq!(m.uncached_tokens(0), 0);
        m.note(Capabilities::IMAGE, 3);
        m.note(Capabilities::AUDIO, 5);
        m.note(Capabilities::IMAGE, 9);
        assert_eq!((m.images, m.audio, m.first_block), (2, 1, 3));
        assert_eq!(m.tokens(), 2 * IMAGE_TOKENS + AUDIO_TOKENS);
        assert_eq!(m.uncached_tokens(3), m.tokens());
        assert_eq!(m.uncached_tokens(4), 0);
        assert_eq!(media_id("https://x/cat.png"), media_id("https://x/cat.png"));
        assert_ne!(media_id("https://x/cat.png"), media_id("https://x/dog.png"));
    }
}
