//! pyserve._rust: the text work of pyserve. Plain Rust types do the work and
//! are tested without Python; `python.rs` wraps them for Python.

pub mod block_gemm;
pub mod block_quant;
mod byte_level;
pub mod chat;
pub mod decode_layer;
pub mod detokenizer;
pub mod extend_attention;
pub mod spin_pool;
pub mod stop;
pub mod stop_regex;
pub mod tokenizer;

#[cfg(feature = "python")]
mod python;
