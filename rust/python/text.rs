//! The text work's bindings: tokenizer, detokenizer, stop matcher and the
//! chat helpers, thin wrappers that convert arguments and errors (every
//! error is a ValueError, nothing panics) and release the GIL around the
//! tokenizer work worth releasing it for.

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use super::value_error;
use crate::text::chat::content::{join_parts, Part};
use crate::text::chat::harmony::HarmonyParser as Harmony;
use crate::text::chat::reasoning::ReasoningSplitter as Splitter;
use crate::text::chat::tool_calls::{deltas, CallEvent, Format, ToolCallParser as CallParser, Tools};
use crate::text::detokenizer::DecodeStream as Stream;
use crate::text::ngram_corpus::{draft_with_corpora, Corpus};
use crate::text::ngram_draft::DraftShape;
use crate::text::ngram_trie::{Cursor, NgramTrie as Trie, TrieShape, MAX_CAPACITY};
use crate::text::stop::StopMatcher as Matcher;
use crate::text::tokenizer::Tokenizer as Tok;

/// Python ints to token ids: a negative id is a ValueError like any other
/// id outside the vocabulary (PyO3 would raise OverflowError).
fn token_ids(ids: Vec<i64>) -> PyResult<Vec<u32>> {
    ids.into_iter()
        .map(|id| u32::try_from(id).map_err(|_| value_error(format!("token id {id} is outside the vocabulary"))))
        .collect()
}

/// A Hugging Face `tokenizer.json`, loaded with the `tokenizers` crate.
#[pyclass(name = "Tokenizer", module = "pyserve._rust", frozen)]
struct PyTokenizer {
    inner: Arc<Tok>,
}

#[pymethods]
impl PyTokenizer {
    #[staticmethod]
    fn from_file(py: Python<'_>, path: &str) -> PyResult<Self> {
        let inner = py.allow_threads(|| Tok::from_file(path)).map_err(value_error)?;
        Ok(PyTokenizer { inner: Arc::new(inner) })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    #[pyo3(signature = (text, add_special_tokens = false))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        py.allow_threads(|| self.inner.encode(text, add_special_tokens)).map_err(value_error)
    }

    #[pyo3(signature = (texts, add_special_tokens = false))]
    fn encode_batch(&self, py: Python<'_>, texts: Vec<String>, add_special_tokens: bool) -> PyResult<Vec<Vec<u32>>> {
        py.allow_threads(|| self.inner.encode_batch(&texts, add_special_tokens)).map_err(value_error)
    }

    fn encode_pairs(&self, py: Python<'_>, pairs: Vec<(String, String)>) -> PyResult<Vec<Vec<u32>>> {
        py.allow_threads(|| self.inner.encode_pairs(&pairs)).map_err(value_error)
    }

    #[pyo3(signature = (ids, skip_special_tokens = true))]
    fn decode(&self, py: Python<'_>, ids: Vec<i64>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = token_ids(ids)?;
        py.allow_threads(|| self.inner.decode(&ids, skip_special_tokens)).map_err(value_error)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn id_to_token(&self, id: i64) -> Option<String> {
        u32::try_from(id).ok().and_then(|id| self.inner.id_to_token(id))
    }

    fn added_tokens(&self) -> HashMap<String, u32> {
        self.inner.added_tokens()
    }

    fn special_token_ids(&self) -> Vec<u32> {
        self.inner.special_token_ids()
    }
}

/// Incremental detokenizer for one request (see detokenizer.rs). A step
/// decodes a few ids, so it keeps the GIL: releasing it would cost more.
#[pyclass(name = "DecodeStream", module = "pyserve._rust")]
struct PyDecodeStream {
    tokenizer: Arc<Tok>,
    stream: Stream,
}

#[pymethods]
impl PyDecodeStream {
    #[new]
    #[pyo3(signature = (tokenizer, skip_special_tokens = true, prompt_tail = None))]
    fn new(tokenizer: &PyTokenizer, skip_special_tokens: bool, prompt_tail: Option<Vec<i64>>) -> PyResult<Self> {
        let tail = token_ids(prompt_tail.unwrap_or_default())?;
        let stream = Stream::new(&tokenizer.inner, skip_special_tokens, &tail).map_err(value_error)?;
        Ok(PyDecodeStream { tokenizer: tokenizer.inner.clone(), stream })
    }

    fn step(&mut self, ids: Vec<i64>) -> PyResult<String> {
        let ids = token_ids(ids)?;
        self.stream.step(&self.tokenizer, &ids).map_err(value_error)
    }

    fn flush(&mut self) -> PyResult<String> {
        self.stream.flush(&self.tokenizer).map_err(value_error)
    }
}

/// Stop strings over a stream of text deltas (see stop.rs).
#[pyclass(name = "StopMatcher", module = "pyserve._rust")]
struct PyStopMatcher {
    matcher: Matcher,
}

#[pymethods]
impl PyStopMatcher {
    #[new]
    /// `keep_stops`: the matched stop's own text is released too.
    #[pyo3(signature = (stops, regexes = None, keep_stops = false))]
    fn new(stops: Vec<String>, regexes: Option<Vec<String>>, keep_stops: bool) -> PyResult<Self> {
        let matcher = Matcher::new(&stops, &regexes.unwrap_or_default()).map_err(value_error)?;
        Ok(PyStopMatcher { matcher: if keep_stops { matcher.keeping_stops() } else { matcher } })
    }

    fn feed(&mut self, text: &str) -> (String, Option<usize>) {
        self.matcher.feed(text)
    }

    fn flush(&mut self) -> (String, Option<usize>) {
        self.matcher.flush()
    }

    #[getter]
    fn matched(&self) -> Option<usize> {
        self.matcher.matched()
    }
}

/// NGRAM speculation's trie of every request's token stretches (see ngram_trie.rs).
#[pyclass(name = "NgramTrie", module = "pyserve._rust")]
struct PyNgramTrie {
    trie: Trie,
}

/// One request's place in an NgramTrie.
#[pyclass(name = "NgramCursor", module = "pyserve._rust")]
struct PyNgramCursor {
    cursor: Cursor,
}

#[pymethods]
impl PyNgramTrie {
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        branch_length: u32,
        capacity: usize,
        min_window: usize,
        max_window: usize,
        min_breadth: usize,
        max_breadth: usize,
        by_probability: bool,
    ) -> PyResult<Self> {
        let draft = DraftShape { min_window, max_window, min_breadth, max_breadth, by_probability };
        let shape = TrieShape { branch_length, capacity, draft };
        Ok(PyNgramTrie { trie: Trie::new(shape).map_err(value_error)? })
    }

    /// Most nodes a trie may be asked to keep.
    #[classattr]
    const MAX_CAPACITY: usize = MAX_CAPACITY;

    /// Add a request's tokens after those its cursor has in.
    fn extend(&mut self, mut cursor: PyRefMut<'_, PyNgramCursor>, tokens: Vec<i64>) -> PyResult<()> {
        self.trie.extend(&mut cursor.cursor, &token_ids(tokens)?);
        Ok(())
    }

    /// Up to `k` drafts after `ids`: their tokens and each one's parent
    /// (-1: the newest of `ids`), parents first; `reserved` of the nodes
    /// for the `corpora`' drafts (see ngram_corpus.rs).
    #[pyo3(signature = (ids, k, corpora = Vec::new(), reserved = 0))]
    fn draft(
        &self,
        ids: Vec<i64>,
        k: usize,
        corpora: Vec<PyRef<'_, PyNgramCorpus>>,
        reserved: usize,
    ) -> PyResult<(Vec<u32>, Vec<i32>)> {
        let corpora: Vec<&Corpus> = corpora.iter().map(|c| &c.corpus).collect();
        Ok(draft_with_corpora(&self.trie, &corpora, &token_ids(ids)?, k, reserved))
    }

    /// Drop every node.
    fn clear(&mut self) {
        self.trie.clear();
    }

    #[getter]
    fn size(&self) -> usize {
        self.trie.size()
    }
}

/// An operator's corpus for NGRAM draft trees (see ngram_corpus.rs).
#[pyclass(name = "NgramCorpus", module = "pyserve._rust", frozen)]
struct PyNgramCorpus {
    corpus: Corpus,
}

#[pymethods]
impl PyNgramCorpus {
    /// The corpus of `documents` (token ids), built without the GIL.
    #[new]
    fn new(py: Python<'_>, documents: Vec<Vec<i64>>) -> PyResult<Self> {
        let documents = documents.into_iter().map(token_ids).collect::<PyResult<Vec<_>>>()?;
        Ok(PyNgramCorpus { corpus: py.allow_threads(|| Corpus::build(&documents)) })
    }

    #[getter]
    fn tokens(&self) -> usize {
        self.corpus.tokens()
    }

    /// Bytes it holds.
    #[getter]
    fn nbytes(&self) -> usize {
        self.corpus.nbytes()
    }
}

#[pymethods]
impl PyNgramCursor {
    #[new]
    fn new() -> Self {
        PyNgramCursor { cursor: Cursor::default() }
    }

    /// The request's tokens in the trie.
    #[getter]
    fn indexed(&self) -> usize {
        self.cursor.indexed
    }
}

/// Splits `<think>` reasoning from content in a text stream (see chat/reasoning.rs).
#[pyclass(name = "ReasoningSplitter", module = "pyserve._rust")]
struct PyReasoningSplitter {
    splitter: Splitter,
}

#[pymethods]
impl PyReasoningSplitter {
    #[new]
    #[pyo3(signature = (start = "<think>", end = "</think>", in_reasoning = false))]
    fn new(start: &str, end: &str, in_reasoning: bool) -> PyResult<Self> {
        Ok(PyReasoningSplitter { splitter: Splitter::new(start, end, in_reasoning).map_err(value_error)? })
    }

    fn feed(&mut self, text: &str) -> (String, String) {
        self.splitter.feed(text)
    }

    fn flush(&mut self) -> (String, String) {
        self.splitter.flush()
    }

    #[getter]
    fn in_reasoning(&self) -> bool {
        self.splitter.in_reasoning()
    }
}

/// One OpenAI `delta.tool_calls` entry: (index, name in a call's first
/// delta or None, argument text to append).
type Deltas = Vec<(usize, Option<String>, String)>;

fn delta_tuples(events: Vec<CallEvent>) -> Deltas {
    deltas(events).into_iter().map(|d| (d.index, d.name, d.arguments)).collect()
}

/// Tool calls in a text stream, by format name (see chat/tool_calls/),
/// streamed as OpenAI deltas.
#[pyclass(name = "ToolCallParser", module = "pyserve._rust")]
struct PyToolCallParser {
    parser: CallParser,
}

#[pymethods]
impl PyToolCallParser {
    #[new]
    #[pyo3(signature = (format, tools = None))]
    fn new(format: &str, tools: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let format = Format::from_name(format).map_err(value_error)?;
        let tools = match tools {
            None => Tools::default(),
            Some(tools) => {
                let json = tools.py().import("json")?.call_method1("dumps", (tools,)).map_err(value_error)?;
                Tools::from_openai(&serde_json::from_str(json.extract()?).map_err(value_error)?)
            }
        };
        Ok(PyToolCallParser { parser: CallParser::with_tools(format, tools) })
    }

    fn feed_events(&mut self, text: &str) -> (String, Deltas) {
        let (text, events) = self.parser.feed(text);
        (text, delta_tuples(events))
    }

    fn flush_events(&mut self) -> (String, Deltas) {
        let (text, events) = self.parser.flush();
        (text, delta_tuples(events))
    }
}

/// gpt-oss's Harmony output in a text stream (see chat/harmony/): each
/// step's (reasoning, content, tool call deltas).
#[pyclass(name = "HarmonyParser", module = "pyserve._rust")]
struct PyHarmonyParser {
    parser: Harmony,
}

#[pymethods]
impl PyHarmonyParser {
    /// `functions`: the names calls may have (None: any); `read_calls`:
    /// False leaves calls as content.
    #[new]
    #[pyo3(signature = (functions = None, read_calls = true))]
    fn new(functions: Option<Vec<String>>, read_calls: bool) -> Self {
        PyHarmonyParser { parser: Harmony::new(functions, read_calls) }
    }

    fn feed(&mut self, text: &str) -> (String, String, Deltas) {
        let parsed = self.parser.feed(text);
        (parsed.reasoning, parsed.content, delta_tuples(parsed.calls))
    }

    fn flush(&mut self) -> (String, String, Deltas) {
        let parsed = self.parser.flush();
        (parsed.reasoning, parsed.content, delta_tuples(parsed.calls))
    }
}

/// The start of a tool call in `format`, to put after the prompt so that
/// the model goes on with a call (of function `name`, if given).
#[pyfunction]
#[pyo3(signature = (format, name = None))]
fn tool_call_prefix(format: &str, name: Option<&str>) -> PyResult<String> {
    Ok(Format::from_name(format).map_err(value_error)?.call_prefix(name))
}

/// OpenAI message content (None, a string, or a list of parts) as one
/// string (see chat/content.rs).
#[pyfunction]
fn content_text(content: &Bound<'_, PyAny>) -> PyResult<String> {
    if content.is_none() {
        return Ok(String::new());
    }
    if let Ok(text) = content.downcast::<PyString>() {
        return Ok(text.to_str()?.to_owned());
    }
    let malformed = || value_error("message content must be a string or a list of content parts");
    let items: Vec<Bound<'_, PyDict>> = content.extract().map_err(|_| malformed())?;
    let mut fields: Vec<(String, Option<String>)> = Vec::with_capacity(items.len());
    for item in &items {
        let field = |key: &str| -> PyResult<Option<String>> {
            match item.get_item(key)? {
                Some(v) if !v.is_none() => v.extract().map(Some).map_err(|_| malformed()),
                _ => Ok(None),
            }
        };
        fields.push((field("type")?.ok_or_else(malformed)?, field("text")?));
    }
    let parts: Vec<Part<'_>> = fields.iter().map(|(kind, text)| Part { kind, text: text.as_deref() }).collect();
    join_parts(&parts).map_err(value_error)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTokenizer>()?;
    m.add_class::<PyDecodeStream>()?;
    m.add_class::<PyStopMatcher>()?;
    m.add_class::<PyReasoningSplitter>()?;
    m.add_class::<PyToolCallParser>()?;
    m.add_class::<PyHarmonyParser>()?;
    m.add_class::<PyNgramTrie>()?;
    m.add_class::<PyNgramCursor>()?;
    m.add_class::<PyNgramCorpus>()?;
    m.add_function(wrap_pyfunction!(tool_call_prefix, m)?)?;
    m.add_function(wrap_pyfunction!(content_text, m)?)?;
    Ok(())
}
