//! Incremental detokenization: turn a growing list of token ids into text
//! deltas that are always whole UTF-8 characters.
//!
//! Decoding ids one at a time is wrong for byte-level and byte-fallback
//! vocabularies (a character can span tokens) and for decoders that strip a
//! leading space (Metaspace). So each step decodes a short window: the ids
//! emitted last time (left context, their text already sent) plus the
//! pending ones. The new text is what the window's text adds to the
//! context's text, emitted only once it does not end in an incomplete
//! character (U+FFFD). After each emission the window slides forward, so a
//! step costs the same at token 10 and at token 10,000.
//!
//! With `skip_special_tokens`, special ids never enter the window: decoding
//! skips them anyway, and a run of them must not become a left context that
//! decodes to "" (a Metaspace decoder would then strip the next word's
//! leading space, as at the start of a text).

use crate::text::tokenizer::Tokenizer;

const REPLACEMENT: char = '\u{FFFD}';
const REPLACEMENT_LEN: usize = REPLACEMENT.len_utf8();

/// How many ids may wait before the window moves on regardless: past this,
/// a text that still ends in U+FFFD holds invalid bytes (a model's garbage),
/// or the ids add no text. This bounds the window, and so the cost of a
/// step, whatever the model generates.
const MAX_PENDING: usize = 8;
/// A character is at most 4 bytes, so an incomplete one at the end of the
/// text comes from at most the last 3 ids, and decodes to at most 3 U+FFFD
/// (3 for byte fallback, which replaces each byte; 1 for byte-level).
const MAX_INCOMPLETE: usize = 3;

pub struct DecodeStream {
    /// The window: `ids[..read]` is left context, `ids[read..]` is pending.
    ids: Vec<u32>,
    read: usize,
    /// decode(ids[..read]), cached: it only changes when the window slides.
    context_text: String,
    /// Bytes at the end of `context_text` not sent yet: U+FFFD that may
    /// still turn out to be part of a character.
    unsent: usize,
    skip_special_tokens: bool,
}

impl DecodeStream {
    /// `context` ids precede the first new id: they are decoded for context
    /// only and never emitted.
    pub fn new(tok: &Tokenizer, skip_special_tokens: bool, context: &[u32]) -> Result<Self, String> {
        tok.check_ids(context)?;
        let ids = kept_ids(tok, context, skip_special_tokens);
        let context_text = tok.decode(&ids, skip_special_tokens)?;
        Ok(DecodeStream { read: ids.len(), ids, context_text, unsent: 0, skip_special_tokens })
    }

    /// Feed new ids; returns the text they complete (maybe empty).
    pub fn step(&mut self, tok: &Tokenizer, new_ids: &[u32]) -> Result<String, String> {
        tok.check_ids(new_ids)?;
        let new_ids = kept_ids(tok, new_ids, self.skip_special_tokens);
        if new_ids.is_empty() {
            return Ok(String::new());
        }
        self.ids.extend_from_slice(&new_ids);
        let text = tok.decode(&self.ids, self.skip_special_tokens)?;
        let overflow = self.ids.len() - self.read > MAX_PENDING;
        if text.ends_with(REPLACEMENT) {
            if !overflow {
                return Ok(String::new());
            }
            // Move on to the last of the final few ids where the text is
            // complete. Tokens can straddle characters, so there may be none:
            // then move on a few ids before the end, holding back the U+FFFD
            // the text ends with there, which may be a character cut short.
            let (mut end, mut text) = (self.ids.len(), text);
            while text.ends_with(REPLACEMENT) && end > self.ids.len() - MAX_INCOMPLETE {
                end -= 1;
                text = tok.decode(&self.ids[..end], self.skip_special_tokens)?;
            }
            return self.emit(tok, end, &text, trailing_replacements(&text));
        }
        let grew = text.len() > self.context_text.len() || !text.starts_with(&self.context_text);
        if !grew && !overflow {
            return Ok(String::new());
        }
        self.emit(tok, self.ids.len(), &text, 0)
    }

    /// End of stream: whatever is still held back, incomplete bytes included.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, String> {
        if self.read == self.ids.len() && self.unsent == 0 {
            return Ok(String::new());
        }
        let text = tok.decode(&self.ids, self.skip_special_tokens)?;
        self.emit(tok, self.ids.len(), &text, 0)
    }

    /// Emits `text`, the text of `ids[..end]`, from where the sent text ends
    /// to `hold` bytes before its end; then slides the window: `ids[read..end]`
    /// becomes the new context.
    fn emit(&mut self, tok: &Tokenizer, end: usize, text: &str, hold: usize) -> Result<String, String> {
        // Normally the context's text is a prefix of the window's. Where the
        // new ids changed it (they completed a character the context ended
        // in), the part that differs was never sent: send it now.
        let sent = self.context_text.len() - self.unsent;
        let start = common_prefix_len(&self.context_text, text).min(sent);
        let delta = text.get(start..text.len() - hold).unwrap_or_default().to_string();
        self.ids.drain(..self.read);
        self.read = end - self.read;
        self.context_text = tok.decode(&self.ids[..self.read], self.skip_special_tokens)?;
        self.unsent = hold.min(trailing_replacements(&self.context_text));
        Ok(delta)
    }
}

/// The ids that can add text: all, or all but the special ones when they are skipped.
fn kept_ids(tok: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> Vec<u32> {
    ids.iter().copied().filter(|&id| !(skip_special_tokens && tok.is_special(id))).collect()
}

/// Bytes of the U+FFFD run that ends `text`, at most `MAX_INCOMPLETE` of them.
fn trailing_replacements(text: &str) -> usize {
    text.chars().rev().take(MAX_INCOMPLETE).take_while(|&c| c == REPLACEMENT).count() * REPLACEMENT_LEN
}

/// Length in bytes of the longest common prefix, on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    if b.starts_with(a) {
        return a.len();
    }
    a.char_indices().zip(b.chars()).find(|((_, x), y)| x != y).map_or(a.len().min(b.len()), |((i, _), _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tokenizer::tests::byte_tokenizer;

    fn stream(tok: &Tokenizer, context: &[u32], chunks: &[&[u32]], skip: bool) -> Vec<String> {
        let mut st = DecodeStream::new(tok, skip, context).unwrap();
        let mut out: Vec<String> = chunks.iter().map(|c| st.step(tok, c).unwrap()).collect();
        out.push(st.flush(tok).unwrap());
        out
    }

    #[test]
    fn stream_equals_full_decode_for_every_split() {
        let tok = byte_tokenizer();
        let text = "héllo 你好 🎉 ok";
        let ids = tok.encode(text, false).unwrap();
        for split in 0..=ids.len() {
            let mut chunks = vec![&ids[..split]];
            chunks.extend(ids[split..].chunks(1));
            let pieces = stream(&tok, &[], &chunks, true);
            for piece in &pieces {
                assert!(!piece.contains(REPLACEMENT), "split {split}: {piece:?}");
            }
            assert_eq!(pieces.concat(), text);
        }
    }

    #[test]
    fn context_is_not_emitted() {
        let tok = byte_tokenizer();
        let ctx = tok.encode("ab", false).unwrap();
        let ids = tok.encode("cd", false).unwrap();
        assert_eq!(stream(&tok, &ctx, &[&ids], true).concat(), "cd");
    }

    #[test]
    fn context_ending_mid_character_is_completed() {
        let tok = byte_tokenizer();
        let ids = tok.encode("a你", false).unwrap();
        // The prompt ends with the first byte of 你; generation supplies the rest.
        let pieces = stream(&tok, &ids[..2], &[&ids[2..3], &ids[3..]], true);
        assert_eq!(pieces, vec!["", "你", ""]);
    }

    #[test]
    fn incomplete_tail_is_released_by_flush() {
        let tok = byte_tokenizer();
        let ids = tok.encode("a你", false).unwrap();
        // "a" plus the first byte of a three-byte character.
        assert_eq!(stream(&tok, &[], &[&ids[..2]], true), vec!["", "a\u{FFFD}"]);
    }

    #[test]
    fn skipped_special_tokens_keep_the_context() {
        let tok = byte_tokenizer();
        let hi = tok.encode("hi", false).unwrap();
        let there = tok.encode(" there", false).unwrap();
        let pieces = stream(&tok, &[], &[&hi, &[256], &[256], &there], true);
        assert_eq!(pieces.concat(), "hi there");
        let pieces = stream(&tok, &[], &[&hi, &[256], &there], false);
        assert_eq!(pieces.concat(), "hi<|end|> there");
    }

    #[test]
    fn window_stays_bounded() {
        let tok = byte_tokenizer();
        let mut st = DecodeStream::new(&tok, true, &[]).unwrap();
        // A lone continuation byte never completes; nor do skipped specials.
        let junk = tok.encode("\u{80}", false).unwrap()[1];
        for _ in 0..100 {
            st.step(&tok, &[junk]).unwrap();
            st.step(&tok, &[256]).unwrap();
            assert!(st.ids.len() <= 2 * (MAX_PENDING + 1));
        }
    }

    #[test]
    fn invalid_bytes_stream_like_full_decode() {
        let tok = byte_tokenizer();
        // Lone continuation bytes and cut-off characters, among valid text.
        let junk = tok.encode("\u{80}", false).unwrap()[1];
        let cut = tok.encode("你", false).unwrap()[0];
        let mut ids = vec![];
        for i in 0..40 {
            ids.push(if i % 7 == 3 { cut } else { junk });
            if i % 5 == 0 {
                ids.extend(tok.encode("ok", false).unwrap());
            }
        }
        let chunks: Vec<&[u32]> = ids.chunks(1).collect();
        assert_eq!(stream(&tok, &[], &chunks, true).concat(), tok.decode(&ids, true).unwrap());
    }

    #[test]
    fn bad_id_is_an_error_and_leaves_the_state_intact() {
        let tok = byte_tokenizer();
        let mut st = DecodeStream::new(&tok, true, &[]).unwrap();
        assert!(st.step(&tok, &[7, 100_000]).is_err());
        let ids = tok.encode("ok", false).unwrap();
        assert_eq!(st.step(&tok, &ids).unwrap(), "ok");
    }
}
