//! pyserve._rust: the text work of pyserve. Plain Rust types do the work and
//! are tested without Python; `python.rs` wraps them for Python.

mod byte_level;
pub mod chat;
pub mod detokenizer;
pub mod stop;
pub mod stop_regex;
pub mod tokenizer;

#[cfg(feature = "python")]
mod python;
