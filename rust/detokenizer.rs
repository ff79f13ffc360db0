//! Incremental detokenization: turn a growing list of token ids into text
//! deltas that are always whole UTF-8 characters.
//!
//! Decoding ids one at a time is wrong for byte-level and byte-fallback
//! vocabularies (a character can span tokens) and for tokenizers whose
//! decoder strips a leading space. So each step decodes a short window
//! twice: the ids already emitted (`prefix_offset..read_offset`) and the same
//! ids plus the new ones. The new text is the difference, emitted only when
//! it does not end in an incomplete character (U+FFFD).

use tokenizers::Tokenizer;

const REPLACEMENT: char = '\u{FFFD}';

pub struct DecodeState {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl DecodeState {
    /// `context` ids precede the first new id: they are decoded for context
    /// only and never emitted.
    pub fn new(skip_special_tokens: bool, context: &[u32]) -> Self {
        DecodeState {
            ids: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            skip_special_tokens,
        }
    }

    fn decode(&self, tok: &Tokenizer, ids: &[u32]) -> Result<String, String> {
        tok.decode(ids, self.skip_special_tokens).map_err(|e| e.to_string())
    }

    /// Feed new ids; returns the text they complete (maybe empty).
    pub fn step(&mut self, tok: &Tokenizer, new_ids: &[u32]) -> Result<String, String> {
        self.ids.extend_from_slice(new_ids);
        let prefix = self.decode(tok, &self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.decode(tok, &self.ids[self.prefix_offset..])?;
        if full.len() <= prefix.len() || full.ends_with(REPLACEMENT) {
            return Ok(String::new());
        }
        let delta = match full.get(prefix.len()..) {
            Some(d) if full.starts_with(&prefix) => d.to_string(),
            // The window re-decoded differently (rare normalizer effects):
            // emit nothing now, the next step re-synchronises.
            _ => return Ok(String::new()),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Keep memory bounded: drop ids that no window will read again.
        self.ids.drain(..self.prefix_offset);
        self.read_offset -= self.prefix_offset;
        self.prefix_offset = 0;
        Ok(delta)
    }

    /// End of stream: whatever is still held back, incomplete bytes included.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, String> {
        let prefix = self.decode(tok, &self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.decode(tok, &self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or("").to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    /// A byte-level BPE with no merges: every byte is its own token, so
    /// multi-byte characters always span several tokens.
    fn byte_tokenizer() -> Tokenizer {
        let vocab: tokenizers::models::bpe::Vocab = ByteLevel::alphabet()
            .into_iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, vec![]).build().unwrap();
        let mut tok = Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        tok.with_decoder(Some(ByteLevel::default()));
        tok
    }

    #[test]
    fn stream_equals_full_decode_for_every_split() {
        let tok = byte_tokenizer();
        let text = "héllo 你好 🎉 ok";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        for split in 0..=ids.len() {
            let mut st = DecodeState::new(true, &[]);
            let mut out = st.step(&tok, &ids[..split]).unwrap();
            for id in &ids[split..] {
                let piece = st.step(&tok, &[*id]).unwrap();
                assert!(!piece.contains(REPLACEMENT), "split {split}: {piece:?}");
                out += &piece;
            }
            out += &st.flush(&tok).unwrap();
            assert_eq!(out, text);
        }
    }

    #[test]
    fn context_is_not_emitted() {
        let tok = byte_tokenizer();
        let ctx = tok.encode("ab", false).unwrap().get_ids().to_vec();
        let ids = tok.encode("cd", false).unwrap().get_ids().to_vec();
        let mut st = DecodeState::new(true, &ctx);
        let mut out = st.step(&tok, &ids).unwrap();
        out += &st.flush(&tok).unwrap();
        assert_eq!(out, "cd");
    }

    #[test]
    fn incomplete_tail_is_released_by_flush() {
        let tok = byte_tokenizer();
        let ids = tok.encode("a你", false).unwrap().get_ids().to_vec();
        let mut st = DecodeState::new(true, &[]);
        // "a" plus the first byte of a three-byte character.
        assert_eq!(st.step(&tok, &ids[..2]).unwrap(), "");
        assert_eq!(st.flush(&tok).unwrap(), "a\u{FFFD}");
    }
}
