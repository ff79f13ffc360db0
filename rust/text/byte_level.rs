//! Fast decoding for byte-level BPE vocabularies (GPT-2, Llama 3, Qwen,
//! SmolLM...), the common case.
//!
//! Their decoder maps each character of each token back to one byte and
//! reads the bytes as UTF-8. The crate does that with a hash lookup per
//! character and an allocation per token, on every call; here each token's
//! bytes are worked out once, so decoding is a concatenation. This is most
//! of the cost of a DecodeStream step.

use std::collections::{HashMap, HashSet};

use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer as HfTokenizer;

pub struct ByteLevelDecoder {
    /// The bytes of token `id` are `bytes[offsets[id]..offsets[id + 1]]`
    /// (empty for an id with no token).
    bytes: Vec<u8>,
    offsets: Vec<u32>,
    special: Vec<bool>,
}

impl ByteLevelDecoder {
    /// Some when `tok` decodes with the plain byte-level decoder, and this
    /// decoder agrees with the crate on every token.
    pub fn for_tokenizer(tok: &HfTokenizer, vocab_size: usize) -> Option<Self> {
        if !matches!(tok.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let char_bytes: HashMap<char, u8> = byte_chars().into_iter().zip(0..=255u8).collect();
        let specials: HashSet<String> =
            tok.get_added_tokens_decoder().into_values().filter(|t| t.special).map(|t| t.content).collect();
        let mut decoder = ByteLevelDecoder { bytes: Vec::new(), offsets: vec![0], special: Vec::new() };
        for id in 0..vocab_size as u32 {
            let token = tok.id_to_token(id).unwrap_or_default();
            // Like the crate: a token with a character outside the byte
            // alphabet (an added token, say) stands for its own UTF-8.
            match token.chars().map(|c| char_bytes.get(&c).copied()).collect::<Option<Vec<u8>>>() {
                Some(bytes) => decoder.bytes.extend(bytes),
                None => decoder.bytes.extend_from_slice(token.as_bytes()),
            }
            decoder.offsets.push(u32::try_from(decoder.bytes.len()).ok()?);
            decoder.special.push(specials.contains(&token));
        }
        let agrees = (0..vocab_size as u32)
            .all(|id| tok.decode(&[id], false).is_ok_and(|text| text == decoder.decode(&[id], false)));
        agrees.then_some(decoder)
    }

    /// Ids must be below the vocabulary size.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let id = id as usize;
            if !(skip_special_tokens && self.special[id]) {
                bytes.extend_from_slice(&self.bytes[self.offsets[id] as usize..self.offsets[id + 1] as usize]);
            }
        }
        match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }
}

/// The character GPT-2's byte-level alphabet uses for each byte value:
/// printable bytes stand for themselves, the others are shifted to 256 and
/// up, in order.
fn byte_chars() -> Vec<char> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut shifted = 0u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                char::from(b)
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).expect("256..=323 are characters")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_the_crates() {
        let mut ours = byte_chars();
        let mut theirs: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet().into_iter().collect();
        ours.sort_unstable();
        theirs.sort_unstable();
        assert_eq!(ours, theirs);
        assert_eq!(byte_chars()[b' ' as usize], 'Ġ');
        assert_eq!(byte_chars()[b'\n' as usize], 'Ċ');
    }
}
