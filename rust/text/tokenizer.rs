//! A Hugging Face `tokenizer.json`, loaded with the `tokenizers` crate, plus
//! what the crate leaves to its callers: a vocabulary size that covers every
//! id (added tokens included), id validation, fast decoding of byte-level
//! vocabularies (byte_level.rs), and batch encoding that stays
//! safe after the process forks.

use std::collections::{HashMap, HashSet};
use std::sync::OnceLock;

use tokenizers::{EncodeInput, Tokenizer as HfTokenizer};

use crate::text::byte_level::ByteLevelDecoder;

pub struct Tokenizer {
    inner: HfTokenizer,
    vocab_size: usize,
    /// Decodes byte-level vocabularies without the crate (see byte_level.rs).
    byte_level: Option<ByteLevelDecoder>,
    /// Added tokens marked special: what `skip_special_tokens` leaves out.
    special: HashSet<u32>,
}

impl Tokenizer {
    pub fn from_file(path: &str) -> Result<Self, String> {
        HfTokenizer::from_file(path).map(Self::new).map_err(|e| format!("{path}: {e}"))
    }

    pub fn from_json(json: &str) -> Result<Self, String> {
        HfTokenizer::from_bytes(json).map(Self::new).map_err(|e| e.to_string())
    }

    fn new(inner: HfTokenizer) -> Self {
        // Ids need not be dense, so the size is the largest id + 1, not the
        // number of tokens.
        let vocab_size = inner.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1);
        let byte_level = ByteLevelDecoder::for_tokenizer(&inner, vocab_size);
        let special =
            inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect();
        Tokenizer { inner, vocab_size, byte_level, special }
    }

    /// Largest id + 1, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn check_ids(&self, ids: &[u32]) -> Result<(), String> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            Some(id) => Err(format!("token id {id} is outside the vocabulary (size {})", self.vocab_size)),
            None => Ok(()),
        }
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        // encode_fast skips the character offsets, which pyserve never reads.
        let encoding = self.inner.encode_fast(text, add_special_tokens).map_err(|e| e.to_string())?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn encode_batch(&self, texts: &[String], add_special_tokens: bool) -> Result<Vec<Vec<u32>>, String> {
        if !may_use_threads() {
            return texts.iter().map(|t| self.encode(t, add_special_tokens)).collect();
        }
        let inputs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let encodings = self.inner.encode_batch_fast(inputs, add_special_tokens).map_err(|e| e.to_string())?;
        Ok(encodings.iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// Each (first, second) pair encoded as one input, with the special
    /// tokens the tokenizer's post-processor puts around and between them
    /// (a cross-encoder's `[CLS] first [SEP] second [SEP]`).
    pub fn encode_pairs(&self, pairs: &[(String, String)]) -> Result<Vec<Vec<u32>>, String> {
        let inputs: Vec<EncodeInput> =
            pairs.iter().map(|(a, b)| EncodeInput::Dual(a.as_str().into(), b.as_str().into())).collect();
        let encodings = if may_use_threads() {
            self.inner.encode_batch_fast(inputs, true)
        } else {
            inputs.into_iter().map(|i| self.inner.encode_fast(i, true)).collect()
        };
        Ok(encodings.map_err(|e| e.to_string())?.iter().map(|e| e.get_ids().to_vec()).collect())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, String> {
        self.check_ids(ids)?;
        match &self.byte_level {
            Some(decoder) => Ok(decoder.decode(ids, skip_special_tokens)),
            None => self.inner.decode(ids, skip_special_tokens).map_err(|e| e.to_string()),
        }
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Added tokens (content -> id), special or not.
    pub fn added_tokens(&self) -> HashMap<String, u32> {
        self.inner.get_added_tokens_decoder().into_iter().map(|(id, t)| (t.content, id)).collect()
    }

    /// Ids of the added tokens marked special, ascending.
    pub fn special_token_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.special.iter().copied().collect();
        ids.sort_unstable();
        ids
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }
}

/// The crate encodes batches on rayon's thread pool. Its threads do not
/// survive fork(), so a forked child that used the parent's pool would hang:
/// only the process that first used the pool may use it.
fn may_use_threads() -> bool {
    static POOL_OWNER: OnceLock<u32> = OnceLock::new();
    *POOL_OWNER.get_or_init(std::process::id) == std::process::id()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A byte-level BPE with no merges, so every byte is its own token and
    /// multi-byte characters always span several tokens. Ids 0..256 are the
    /// bytes; 256 is a special added token, 257 an ordinary added token.
    pub(crate) fn byte_tokenizer() -> Tokenizer {
        let vocab: serde_json::Map<String, serde_json::Value> =
            tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
                .into_iter()
                .collect::<std::collections::BTreeSet<char>>()
                .into_iter()
                .enumerate()
                .map(|(id, c)| (c.to_string(), id.into()))
                .collect();
        let added = |id: u32, content: &str, special: bool| {
            serde_json::json!({"id": id, "content": content, "special": special, "single_word": false,
                               "lstrip": false, "rstrip": false, "normalized": false})
        };
        let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
                                            "trim_offsets": false, "use_regex": true});
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [added(256, "<|end|>", true), added(257, "<tool>", false)],
            "pre_tokenizer": byte_level,
            "decoder": byte_level,
            "model": {"type": "BPE", "vocab": vocab, "merges": []},
        });
        Tokenizer::from_json(&json.to_string()).unwrap()
    }

    #[test]
    fn round_trip_and_vocab_size() {
        let tok = byte_tokenizer();
        assert_eq!(tok.vocab_size(), 258);
        let text = "héllo 你好 🎉<|end|>";
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(*ids.last().unwrap(), 256);
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert_eq!(tok.decode(&ids, true).unwrap(), "héllo 你好 🎉");
    }

    #[test]
    fn byte_level_vocabularies_decode_without_the_crate() {
        let tok = byte_tokenizer();
        assert!(tok.byte_level.is_some());
        let ids = tok.encode("a\u{80}你<|end|>", false).unwrap();
        for skip in [false, true] {
            for end in 0..=ids.len() {
                assert_eq!(tok.decode(&ids[..end], skip).unwrap(), tok.inner.decode(&ids[..end], skip).unwrap());
            }
        }
    }

    #[test]
    fn batch_equals_single() {
        let tok = byte_tokenizer();
        let texts: Vec<String> = ["a b", "", "你好<tool>x"].iter().map(|s| s.to_string()).collect();
        let batch = tok.encode_batch(&texts, false).unwrap();
        for (text, ids) in texts.iter().zip(&batch) {
            assert_eq!(&tok.encode(text, false).unwrap(), ids);
        }
    }

    #[test]
    fn added_and_special_tokens() {
        let tok = byte_tokenizer();
        assert_eq!(tok.special_token_ids(), vec![256]);
        assert_eq!(tok.added_tokens().get("<tool>"), Some(&257));
        assert_eq!(tok.token_to_id("<|end|>"), Some(256));
        assert_eq!(tok.id_to_token(257).as_deref(), Some("<tool>"));
        assert_eq!(tok.id_to_token(5000), None);
    }

    #[test]
    fn bad_ids_and_files_are_errors() {
        let tok = byte_tokenizer();
        assert!(tok.decode(&[258], true).unwrap_err().contains("258"));
        assert!(Tokenizer::from_file("/nonexistent/tokenizer.json").is_err());
        assert!(Tokenizer::from_json("{").is_err());
    }
}
