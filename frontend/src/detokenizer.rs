//! Incremental detokenization of one request's output, vLLM style.
//!
//! Each push decodes a short window of tokens twice: from `prefix_offset` to `read_offset`
//! (text already released) and from `prefix_offset` to the end. The difference is the new
//! text. Decoding a window instead of single tokens keeps what a decoder does at token
//! boundaries (byte-level BPE merging bytes of one character, SentencePiece spaces)
//! correct; a window that ends in U+FFFD is an incomplete UTF-8 character, held back until
//! later tokens complete it.
//!
//! The window starts in the last few prompt tokens, so the first output token decodes in
//! context. For byte-level BPE the concatenation of every push and `finish` equals
//! `decode(output_ids)`, unless the prompt ends inside a UTF-8 character: then the
//! output's first bytes decode together with the prompt's last ones (as in vLLM), and a
//! U+FFFD that `decode(output_ids)` would show alone is not released again (the fuzz test
//! `fuzz_incremental_detokenizer` found this case).

use crate::tokenizer::Tokenizer;

/// How many prompt tokens before the read position the first window starts (vLLM's
/// INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
const INITIAL_OFFSET: usize = 5;

pub struct IncrementalDetokenizer {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// The tail of the prompt (for context), then every output token.
    tokens: Vec<u32>,
    /// Start of the decode window.
    prefix_offset: usize,
    /// End of the text already released.
    read_offset: usize,
    /// How many of `tokens` are prompt context.
    num_prompt_tokens: usize,
}

impl IncrementalDetokenizer {
    pub fn new(tokenizer: &Tokenizer, prompt_ids: &[u32], skip_special_tokens: bool) -> Self {
        // A couple of tokens more than the window needs, as vLLM keeps, so a character
        // split across the window's first tokens still decodes the same way.
        let context = &prompt_ids[prompt_ids.len().saturating_sub(INITIAL_OFFSET + 2)..];
        IncrementalDetokenizer {
            tokenizer: tokenizer.clone(),
            skip_special_tokens,
            tokens: context.to_vec(),
            prefix_offset: context.len().saturating_sub(INITIAL_OFFSET),
            read_offset: context.len(),
            num_prompt_tokens: context.len(),
        }
    }

    /// Adds one sampled token; returns the text it completes (often empty while a
    /// multi-byte character is still incomplete).
    pub fn push(&mut self, token_id: u32) -> String {
        self.tokens.push(token_id);
        let (prefix_text, new_text) = match self.decode_window() {
            Some(texts) => texts,
            None => return String::new(),
        };
        if new_text.len() <= prefix_text.len() || new_text.ends_with(char::REPLACEMENT_CHARACTER) {
            return String::new();
        }
        let delta = suffix_after(&prefix_text, &new_text);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        delta
    }

    /// Releases whatever is still held back (an incomplete character becomes U+FFFD, as
    /// `decode` would render it). Call once, when the request finishes.
    pub fn finish(&mut self) -> String {
        let (prefix_text, new_text) = match self.decode_window() {
            Some(texts) => texts,
            None => return String::new(),
        };
        let delta = if new_text.len() > prefix_text.len() {
            suffix_after(&prefix_text, &new_text)
        } else {
            String::new()
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        delta
    }

    /// The output token ids pushed so far.
    pub fn output_token_ids(&self) -> &[u32] {
        &self.tokens[self.num_prompt_tokens..]
    }

    /// Decodes [prefix_offset, read_offset) and [prefix_offset, end). None when the
    /// tokenizer fails, which holds the text back rather than guessing.
    fn decode_window(&self) -> Option<(String, String)> {
        let decode = |ids: &[u32]| {
            self.tokenizer
                .decode(ids, self.skip_special_tokens)
                .map_err(|e| tracing::warn!("incremental detokenization: {e}"))
                .ok()
        };
        let prefix_text = decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let new_text = decode(&self.tokens[self.prefix_offset..])?;
        Some((prefix_text, new_text))
    }
}

/// `new_text` past `prefix_text`. When the prefix is not literally a prefix (a decoder that
/// rewrites earlier text), fall back to vLLM's cut by character count.
fn suffix_after(prefix_text: &str, new_text: &str) -> String {
    match new_text.strip_prefix(prefix_text) {
        Some(rest) => rest.to_string(),
        None => new_text.chars().skip(prefix_text.chars().count()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::load;
    use proptest::prelude::*;

    const TEXTS: &[&str] = &[
        "Hello world",
        "  leading spaces and trailing  ",
        "Café crème brûlée, naïve façade — déjà vu",
        "你好，世界！这是一个测试。",
        "日本語のテキストと한국어 텍스트",
        "Emoji: 🦀🚀👩‍👩‍👧‍👦 🇫🇷 done",
        "mixed 🎉 ünïcödé 中文 text\nwith\ttabs and newlines\n\n",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝛑 ≈ 3.14159",
    ];

    /// Pushes `ids` one at a time and returns the concatenated text.
    fn stream(tok: &Tokenizer, prompt: &[u32], ids: &[u32], skip: bool) -> String {
        let mut detok = IncrementalDetokenizer::new(tok, prompt, skip);
        let mut out: String = ids.iter().map(|&id| detok.push(id)).collect();
        out.push_str(&detok.finish());
        assert_eq!(detok.output_token_ids(), ids);
        out
    }

    #[test]
    fn streaming_equals_decode_on_real_text() {
        for name in ["Qwen3-0.6B", "Llama-3.2-1B-Instruct"] {
            let tok = load(name);
            let prompt = tok.encode("Translate: ", true).unwrap();
            for text in TEXTS {
                let ids = tok.encode(text, false).unwrap();
                let full = tok.decode(&ids, true).unwrap();
                assert_eq!(full, *text, "{name}: tokenizer round trip");
                assert_eq!(stream(&tok, &prompt, &ids, true), full, "{name}");
                assert_eq!(stream(&tok, &[], &ids, true), full, "{name}, no prompt");
            }
        }
    }

    /// Every non-empty delta is whole characters: no U+FFFD from a split character leaks.
    #[test]
    fn split_characters_are_held_back_not_broken() {
        let tok = load("Qwen3-0.6B");
        let text = "🦀🚀👩‍👩‍👧‍👦 中文";
        let ids = tok.encode(text, false).unwrap();
        assert!(
            ids.len() > text.chars().count() / 2,
            "expect byte-split tokens"
        );
        let mut detok = IncrementalDetokenizer::new(&tok, &[], true);
        let mut deltas: Vec<String> = ids.iter().map(|&id| detok.push(id)).collect();
        deltas.push(detok.finish());
        assert!(deltas
            .iter()
            .all(|d| !d.contains(char::REPLACEMENT_CHARACTER)));
        assert!(
            deltas.iter().any(|d| d.is_empty()),
            "some token completed no character"
        );
        assert_eq!(deltas.concat(), text);
    }

    #[test]
    fn special_tokens_are_kept_or_skipped() {
        let tok = load("Qwen3-0.6B");
        let ids = tok.encode("Hi<|im_end|> there", false).unwrap();
        assert_eq!(stream(&tok, &[], &ids, false), "Hi<|im_end|> there");
        assert_eq!(stream(&tok, &[], &ids, true), "Hi there");
    }

    #[test]
    fn dangling_bytes_are_flushed_by_finish() {
        let tok = load("Qwen3-0.6B");
        // A rare character, so byte-level BPE spells it with several byte tokens.
        let ids = ["𓀀", "ꙮ", "𝔘", "🦀"]
            .iter()
            .map(|c| tok.encode(c, false).unwrap())
            .find(|ids| ids.len() > 1)
            .expect("some character spans several tokens");
        let head = &ids[..ids.len() - 1];
        let mut detok = IncrementalDetokenizer::new(&tok, &[], true);
        let pushed: String = head.iter().map(|&id| detok.push(id)).collect();
        assert_eq!(pushed, "");
        assert_eq!(detok.finish(), tok.decode(head, true).unwrap());
    }

    fn random_ids_property(name: &str, vocab: u32) {
        let tok = load(name);
        let prompt = tok.encode("Some prompt text.", true).unwrap();
        let config = ProptestConfig {
            cases: 200,
            ..ProptestConfig::default()
        };
        proptest!(config, |(ids in prop::collection::vec(0..vocab, 0..40), skip in any::<bool>())| {
            let full = tok.decode(&ids, skip).unwrap();
            prop_assert_eq!(&stream(&tok, &prompt, &ids, skip), &full);
            prop_assert_eq!(&stream(&tok, &[], &ids, skip), &full);
        });
    }

    #[test]
    fn random_ids_stream_equals_decode_qwen() {
        random_ids_property("Qwen3-0.6B", 151_700);
    }

    #[test]
    fn random_ids_stream_equals_decode_llama() {
        random_ids_property("Llama-3.2-1B-Instruct", 128_256);
    }

    /// Random ids drawn from the byte tokens only, where most sequences split characters.
    #[test]
    fn random_byte_tokens_stream_equals_decode() {
        let tok = load("Qwen3-0.6B");
        let byte_ids: Vec<u32> = (0..256).collect();
        let config = ProptestConfig {
            cases: 300,
            ..ProptestConfig::default()
        };
        proptest!(config, |(picks in prop::collection::vec(prop::sample::select(byte_ids.clone()), 0..30))| {
            let full = tok.decode(&picks, true).unwrap();
            prop_assert_eq!(&stream(&tok, &[], &picks, true), &full);
        });
    }
}
