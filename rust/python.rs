//! PyO3 bindings: thin wrappers that convert errors to Python exceptions and
//! release the GIL around tokenizer work.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tokenizers::Tokenizer as HfTokenizer;

use crate::detokenizer::DecodeState;
use crate::reasoning::ReasoningState;
use crate::stop::StopState;

fn value_error(e: impl ToString) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A Hugging Face `tokenizer.json`, loaded with the `tokenizers` crate.
#[pyclass(module = "pyserve._rust", frozen)]
struct Tokenizer {
    inner: Arc<HfTokenizer>,
}

impl Tokenizer {
    fn check_ids(&self, ids: &[u32]) -> PyResult<()> {
        let n = self.inner.get_vocab_size(true) as u32;
        match ids.iter().find(|&&id| id >= n) {
            Some(id) => Err(value_error(format!("token id {id} is outside the vocabulary (size {n})"))),
            None => Ok(()),
        }
    }
}

#[pymethods]
impl Tokenizer {
    #[staticmethod]
    fn from_file(path: &str) -> PyResult<Self> {
        let inner = HfTokenizer::from_file(path).map_err(|e| value_error(format!("{path}: {e}")))?;
        Ok(Tokenizer { inner: Arc::new(inner) })
    }

    /// Vocabulary size including added tokens (largest id + 1).
    #[getter]
    fn vocab_size(&self) -> usize {
        let added = self.inner.get_added_tokens_decoder();
        let max_added = added.keys().max().map(|&id| id as usize + 1).unwrap_or(0);
        self.inner.get_vocab_size(true).max(max_added)
    }

    #[pyo3(signature = (text, add_special_tokens = false))]
    fn encode(&self, py: Python<'_>, text: String, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let tok = self.inner.clone();
        py.allow_threads(move || tok.encode(text, add_special_tokens))
            .map(|e| e.get_ids().to_vec())
            .map_err(value_error)
    }

    #[pyo3(signature = (texts, add_special_tokens = false))]
    fn encode_batch(
        &self,
        py: Python<'_>,
        texts: Vec<String>,
        add_special_tokens: bool,
    ) -> PyResult<Vec<Vec<u32>>> {
        let tok = self.inner.clone();
        py.allow_threads(move || tok.encode_batch(texts, add_special_tokens))
            .map(|all| all.iter().map(|e| e.get_ids().to_vec()).collect())
            .map_err(value_error)
    }

    #[pyo3(signature = (ids, skip_special_tokens = true))]
    fn decode(&self, py: Python<'_>, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        self.check_ids(&ids)?;
        let tok = self.inner.clone();
        py.allow_threads(move || tok.decode(&ids, skip_special_tokens)).map_err(value_error)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Added tokens (content -> id), special or not.
    fn added_tokens(&self) -> std::collections::HashMap<String, u32> {
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (t.content, id))
            .collect()
    }

    /// Ids of the added tokens marked special, ascending.
    fn special_token_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }
}

/// Incremental detokenizer for one request (see detokenizer.rs).
#[pyclass(module = "pyserve._rust")]
struct DecodeStream {
    tokenizer: Arc<HfTokenizer>,
    state: DecodeState,
}

#[pymethods]
impl DecodeStream {
    #[new]
    #[pyo3(signature = (tokenizer, skip_special_tokens = true, prompt_tail = None))]
    fn new(tokenizer: &Tokenizer, skip_special_tokens: bool, prompt_tail: Option<Vec<u32>>) -> PyResult<Self> {
        let tail = prompt_tail.unwrap_or_default();
        tokenizer.check_ids(&tail)?;
        Ok(DecodeStream {
            tokenizer: tokenizer.inner.clone(),
            state: DecodeState::new(skip_special_tokens, &tail),
        })
    }

    fn step(&mut self, ids: Vec<u32>) -> PyResult<String> {
        let n = self.tokenizer.get_vocab_size(true) as u32;
        if let Some(id) = ids.iter().find(|&&id| id >= n) {
            return Err(value_error(format!("token id {id} is outside the vocabulary (size {n})")));
        }
        self.state.step(&self.tokenizer, &ids).map_err(value_error)
    }

    fn flush(&mut self) -> PyResult<String> {
        self.state.flush(&self.tokenizer).map_err(value_error)
    }
}

/// Stop strings over a stream of text deltas (see stop.rs).
#[pyclass(module = "pyserve._rust")]
struct StopMatcher {
    state: StopState,
}

#[pymethods]
impl StopMatcher {
    #[new]
    fn new(stops: Vec<String>) -> PyResult<Self> {
        Ok(StopMatcher { state: StopState::new(stops).map_err(value_error)? })
    }

    fn feed(&mut self, text: &str) -> (String, Option<usize>) {
        self.state.feed(text)
    }

    fn flush(&mut self) -> String {
        self.state.flush()
    }

    #[getter]
    fn matched(&self) -> Option<usize> {
        self.state.matched()
    }
}

/// Splits `<think>` reasoning from content in a text stream (see reasoning.rs).
#[pyclass(module = "pyserve._rust")]
struct ReasoningSplitter {
    state: ReasoningState,
}

#[pymethods]
impl ReasoningSplitter {
    #[new]
    #[pyo3(signature = (start = "<think>".to_string(), end = "</think>".to_string(), in_reasoning = false))]
    fn new(start: String, end: String, in_reasoning: bool) -> PyResult<Self> {
        Ok(ReasoningSplitter { state: ReasoningState::new(start, end, in_reasoning).map_err(value_error)? })
    }

    fn feed(&mut self, text: &str) -> (String, String) {
        self.state.feed(text)
    }

    fn flush(&mut self) -> (String, String) {
        self.state.flush()
    }
}

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Tokenizer>()?;
    m.add_class::<DecodeStream>()?;
    m.add_class::<StopMatcher>()?;
    m.add_class::<ReasoningSplitter>()?;
    Ok(())
}
