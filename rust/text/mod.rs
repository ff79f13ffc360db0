//! The text work of pyserve: tokenizing, incremental detokenizing, stop
//! strings and regexes, the chat helpers (message content, reasoning,
//! tool calls), and NGRAM speculation's trie of token stretches, corpora
//! and draft trees.

mod byte_level;
pub mod chat;
pub mod detokenizer;
pub mod ngram_corpus;
pub mod ngram_draft;
pub mod ngram_trie;
pub mod stop;
pub mod stop_regex;
pub mod tokenizer;
