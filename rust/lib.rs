//! pyserve._rust: the text work of pyserve. Plain Rust types do the work
//! (detokenizer, stop, reasoning); `python.rs` wraps them for Python.

pub mod detokenizer;
pub mod reasoning;
pub mod stop;

#[cfg(feature = "python")]
mod python;
