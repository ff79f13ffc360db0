//! The text work of pyserve: tokenizing, incremental detokenizing, stop
//! strings and regexes, and the chat helpers (message content, reasoning,
//! tool calls).

mod byte_level;
pub mod chat;
pub mod detokenizer;
pub mod stop;
pub mod stop_regex;
pub mod tokenizer;
