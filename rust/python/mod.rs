//! PyO3 bindings of the crate's two parts: `text` and `kernels`, one
//! Python module, pyserve._rust.

mod kernels;
mod text;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn value_error(e: impl ToString) -> PyErr {
    PyValueError::new_err(e.to_string())
}

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    text::register(m)?;
    kernels::register(m)
}
