//! pyserve._rust: the two native parts of pyserve, in plain Rust types
//! tested without Python.
//!
//! - `text`: tokenizer, incremental detokenizer, stop strings and regexes,
//!   chat helpers (message content, reasoning, tool calls).
//! - `kernels`: the CPU kernels of the `8da4w` layout (Q4_1 and Q8_0 block
//!   products, attention over the paged KV cache, a whole decoder layer)
//!   and the thread pool they share.
//!
//! `python` (the `python` feature) wraps both for Python; the kernels'
//! entry points check the arrays they are given before touching them.

pub mod kernels;
pub mod text;

#[cfg(feature = "python")]
mod python;
