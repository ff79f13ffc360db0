//! pyserve._rust: the text work of pyserve (tokenizer, incremental
//! detokenizer, stop-string matcher, chat helpers).
use pyo3::prelude::*;

#[pymodule]
fn _rust(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
