//! PyO3 bindings: thin wrappers over the plain Rust types that convert
//! arguments and errors (every error is a ValueError, nothing panics) and
//! release the GIL around the tokenizer work worth releasing it for.

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::block_gemm::{self, Q4_1Tiles};
use crate::block_quant::{self, Q8_0};
use crate::chat::content::{join_parts, Part};
use crate::chat::reasoning::ReasoningSplitter as Splitter;
use crate::chat::tool_calls::{deltas, CallEvent, Format, ToolCallParser as CallParser, Tools};
use crate::decode_layer;
use crate::detokenizer::DecodeStream as Stream;
use crate::extend_attention::{self, Extend};
use crate::spin_pool::SpinPool;
use crate::stop::StopMatcher as Matcher;
use crate::tokenizer::Tokenizer as Tok;

fn value_error(e: impl ToString) -> PyErr {
    PyValueError::new_err(e.to_string())
}

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
    #[pyo3(signature = (stops, regexes = None))]
    fn new(stops: Vec<String>, regexes: Option<Vec<String>>) -> PyResult<Self> {
        Ok(PyStopMatcher { matcher: Matcher::new(&stops, &regexes.unwrap_or_default()).map_err(value_error)? })
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

/// A borrowed view of `len` elements at a buffer address from Python.
///
/// SAFETY: the caller guarantees `address` is a live, aligned, contiguous
/// buffer of at least `len` elements of `T` for the whole call (the torch
/// tensors pyserve.model.quant checks and keeps alive).
unsafe fn view<'a, T>(address: usize, len: usize) -> &'a [T] {
    std::slice::from_raw_parts(address as *const T, len)
}

/// The Q4_1 weight [n, k] whose tiles (block_gemm's layout) are at
/// `address`. SAFETY: as for `view`.
unsafe fn q4_1_at<'a>(address: usize, n: usize, k: usize) -> Q4_1Tiles<'a> {
    Q4_1Tiles::new(view(address, Q4_1Tiles::size(n, k)), n, k)
}

/// The Q8_0 weight [n, k]: codes (i8, n * k) and scales (f32, n * k / 32).
/// SAFETY: as for `view`.
unsafe fn q8_0_at<'a>(codes: usize, scales: usize, n: usize, k: usize) -> Q8_0<'a> {
    Q8_0 { codes: view(codes, n * k), scales: view(scales, n * k / block_quant::BLOCK) }
}

/// The bytes of a Q4_1 weight [n, k] in block_gemm's tiles.
#[pyfunction]
fn q4_1_tiles_size(n: usize, k: usize) -> PyResult<usize> {
    if k % block_quant::BLOCK != 0 {
        return Err(PyValueError::new_err(format!("Q4_1 rows hold a multiple of {} inputs", block_quant::BLOCK)));
    }
    Ok(Q4_1Tiles::size(n, k))
}

/// Packs a Q4_1 weight [n, k] into block_gemm's tiles at `out`: codes
/// (u8 0..15, one a byte, n * k), scales and minimums (f32, n * k / 32).
/// Only pyserve.model.cpu.blocks calls this, after checking shapes, dtypes
/// and codes.
#[pyfunction]
fn pack_q4_1(codes: usize, scales: usize, mins: usize, n: usize, k: usize, out: usize) {
    let blocks = n * k / block_quant::BLOCK;
    // SAFETY: see `view`; `out` is written only by this call.
    unsafe {
        let out = std::slice::from_raw_parts_mut(out as *mut u8, Q4_1Tiles::size(n, k));
        block_gemm::pack(view(codes, n * k), view(scales, blocks), view(mins, blocks), n, k, out);
    }
}

/// out[rows, n] = x[rows, k] @ w.T for the Q4_1 weight w[n, k] whose tiles
/// are at `tiles`. The arguments are addresses of float32/uint8 buffers;
/// only pyserve.model.cpu.blocks calls this, after checking shapes and
/// dtypes. `threads` share the columns (the caller's thread among them).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn matmul_q4_1(py: Python<'_>, x: usize, rows: usize, k: usize, tiles: usize, n: usize, out: usize, threads: usize) {
    // SAFETY: see `view`; `out` is written only by this call.
    unsafe {
        let weights = q4_1_at(tiles, n, k);
        let (x, out) = (view::<f32>(x, rows * k), std::slice::from_raw_parts_mut(out as *mut f32, rows * n));
        py.allow_threads(|| block_gemm::matmul(SpinPool::global(), threads, x, &weights, out));
    }
}

/// extend_attention::attend over addresses: q and out [tokens, heads *
/// head_dim], a layer's k and v cache [cache_slots, kv_heads * head_dim]
/// (float32), the sequence's slots (int64, its new tokens' last); only
/// pyserve.model.cpu.extend_attention calls this, after checking them.
/// dims: (heads, kv_heads, head_dim, scale).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn attend_extend(
    py: Python<'_>,
    q: usize,
    tokens: usize,
    cache: (usize, usize, usize),
    slots: (usize, usize),
    dims: (usize, usize, usize, f32),
    out: usize,
    threads: usize,
) {
    let (heads, kv_heads, head_dim, scale) = dims;
    let (k, v, cache_slots) = cache;
    let kv_width = kv_heads * head_dim;
    // SAFETY: see `view`; `out` is written only by this call.
    unsafe {
        let e = Extend {
            q: view(q, tokens * heads * head_dim),
            k: view(k, cache_slots * kv_width),
            v: view(v, cache_slots * kv_width),
            slots: view(slots.0, slots.1),
            heads,
            kv_heads,
            head_dim,
            scale,
        };
        let out = std::slice::from_raw_parts_mut(out as *mut f32, tokens * heads * head_dim);
        py.allow_threads(|| extend_attention::attend(SpinPool::global(), threads, &e, out));
    }
}

/// decode_layer::decode_layer over addresses of float32 (int64 for slots)
/// buffers; only pyserve.model.cpu.native_layers calls this, with the
/// tensors of a decode or prefill step and of the layer, after checking them.
/// dims: (hidden, heads, kv_heads, head_dim, intermediate, eps, scale);
/// norms: (input, post-attention); qkv_bias 0 for none; step: (cos, sin,
/// new_slot); a decode step's `decode`: (slots, width, lens), or else a
/// prefill step's `extends`: (new tokens, slots, slot count) per sequence;
/// cache: (k, v, slots).
#[pyfunction]
#[pyo3(signature = (x, residual, rows, dims, norms, projections, qkv_bias, step, decode, extends, cache, threads))]
#[allow(clippy::too_many_arguments)]
fn decode_layer_q4_1(
    py: Python<'_>,
    x: usize,
    residual: usize,
    rows: usize,
    dims: (usize, usize, usize, usize, usize, f32, f32),
    norms: (usize, usize),
    projections: (usize, usize, usize, usize),
    qkv_bias: usize,
    step: (usize, usize, usize),
    decode: Option<(usize, usize, usize)>,
    extends: Vec<(usize, usize, usize)>,
    cache: (usize, usize, usize),
    threads: usize,
) {
    let (hidden, heads, kv_heads, head_dim, intermediate, eps, scale) = dims;
    let dims = decode_layer::Dims { hidden, heads, kv_heads, head_dim, intermediate, eps, scale };
    let (q_size, kv_size) = (heads * head_dim, kv_heads * head_dim);
    // SAFETY: see `view`.
    let q4_1 = |address: usize, n: usize, k: usize| unsafe { q4_1_at(address, n, k) };
    let (qkv, o, gate_up, down) = projections;
    let qkv_width = q_size + 2 * kv_size;
    let (cos, sin, new_slot) = step;
    let half = head_dim / 2;
    // SAFETY: see `view`; x, residual and the cache are written only by this call.
    unsafe {
        let layer = decode_layer::Layer {
            input_norm: view(norms.0, hidden),
            qkv: q4_1(qkv, qkv_width, hidden),
            qkv_bias: (qkv_bias != 0).then(|| view(qkv_bias, qkv_width)),
            o: q4_1(o, hidden, q_size),
            post_norm: view(norms.1, hidden),
            gate_up: q4_1(gate_up, 2 * intermediate, hidden),
            down: q4_1(down, hidden, intermediate),
        };
        let sequences = match decode {
            Some((slots, width, lens)) => {
                decode_layer::Sequences::Decode { slots: view(slots, rows * width), width, lens: view(lens, rows) }
            }
            None => decode_layer::Sequences::Extend(
                extends.iter().map(|&(count, slots, len)| (count, view(slots, len))).collect(),
            ),
        };
        let step = decode_layer::Rows {
            cos: view(cos, rows * half),
            sin: view(sin, rows * half),
            new_slot: view(new_slot, rows),
            sequences,
        };
        let cache = decode_layer::KvCache { k: cache.0 as *mut f32, v: cache.1 as *mut f32, slots: cache.2 };
        let x = std::slice::from_raw_parts_mut(x as *mut f32, rows * hidden);
        let residual = std::slice::from_raw_parts_mut(residual as *mut f32, rows * hidden);
        py.allow_threads(|| {
            decode_layer::decode_layer(SpinPool::global(), threads, &dims, &layer, &step, &cache, x, residual)
        });
    }
}

/// As matmul_q4_1 for Q8_0 weights: codes (i8, n * k) and scales (f32, n * k / 32).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn matmul_q8_0(
    py: Python<'_>,
    x: usize,
    rows: usize,
    k: usize,
    codes: usize,
    scales: usize,
    n: usize,
    out: usize,
    threads: usize,
) {
    // SAFETY: as in matmul_q4_1.
    unsafe {
        let weights = q8_0_at(codes, scales, n, k);
        let (x, out) = (view::<f32>(x, rows * k), std::slice::from_raw_parts_mut(out as *mut f32, rows * n));
        py.allow_threads(|| block_quant::matmul(SpinPool::global(), threads, x, k, &weights, out));
    }
}

/// out[n, k] (float32) = the Q4_1 weight given as in `matmul_q4_1`.
#[pyfunction]
fn dequantize_q4_1(py: Python<'_>, tiles: usize, n: usize, k: usize, out: usize) {
    // SAFETY: as in matmul_q4_1.
    unsafe {
        let weights = q4_1_at(tiles, n, k);
        let out = std::slice::from_raw_parts_mut(out as *mut f32, n * k);
        py.allow_threads(|| block_gemm::dequantize(&weights, out));
    }
}

/// out[n, k] (float32) = the Q8_0 weight given as in `matmul_q8_0`.
#[pyfunction]
fn dequantize_q8_0(py: Python<'_>, codes: usize, scales: usize, n: usize, k: usize, out: usize, threads: usize) {
    // SAFETY: as in matmul_q4_1.
    unsafe {
        let weights = q8_0_at(codes, scales, n, k);
        let out = std::slice::from_raw_parts_mut(out as *mut f32, n * k);
        py.allow_threads(|| block_quant::dequantize(SpinPool::global(), threads, &weights, k, out));
    }
}

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTokenizer>()?;
    m.add_class::<PyDecodeStream>()?;
    m.add_class::<PyStopMatcher>()?;
    m.add_class::<PyReasoningSplitter>()?;
    m.add_class::<PyToolCallParser>()?;
    m.add_function(wrap_pyfunction!(tool_call_prefix, m)?)?;
    m.add_function(wrap_pyfunction!(content_text, m)?)?;
    m.add_function(wrap_pyfunction!(q4_1_tiles_size, m)?)?;
    m.add_function(wrap_pyfunction!(pack_q4_1, m)?)?;
    m.add_function(wrap_pyfunction!(matmul_q4_1, m)?)?;
    m.add_function(wrap_pyfunction!(attend_extend, m)?)?;
    m.add_function(wrap_pyfunction!(matmul_q8_0, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_q4_1, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_q8_0, m)?)?;
    m.add_function(wrap_pyfunction!(decode_layer_q4_1, m)?)?;
    Ok(())
}
