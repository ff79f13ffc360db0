//! The kernels' entry points. Each takes numpy arrays (Python passes
//! `tensor.numpy()`, a zero-copy view of a CPU tensor) and checks on this
//! side of the boundary, before any kernel reads or writes, that they are
//! what the kernel will index: the dtype and number of dimensions (pyo3's
//! conversion: a TypeError otherwise), C-contiguous and aligned, every
//! size relation between them, and every KV slot inside its cache (a
//! ValueError otherwise). A caller cannot make a kernel read or write out
//! of bounds.
//!
//! Lifetimes and aliasing: each array is borrowed through rust-numpy's
//! borrow tracking (`try_readonly` / `try_readwrite`) for the whole call,
//! the GIL released included. A borrowed array keeps its base (the torch
//! tensor) alive, and the tracking refuses a call whose written arrays
//! overlap any other array of the call (a ValueError), so the slices the
//! kernels get are live and unaliased as Rust's references require. (As
//! for any numpy C extension, Python code must not resize a tensor's
//! storage from another thread while a kernel runs on it.)

use numpy::ndarray::Dimension;
use numpy::{
    Element, PyArray, PyArray1, PyArray2, PyArray3, PyArrayMethods, PyReadonlyArray, PyReadwriteArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::value_error;
use crate::kernels::block_gemm::{self, Q4_1Tiles};
use crate::kernels::decode_layer::{self, Dims, KvCache, Layer, NewTokens, Rows, Sequences};
use crate::kernels::extend_attention::{self, Extend};
use crate::kernels::q8_0::{self, Q8_0Tiles};
use crate::kernels::simd::BLOCK;
use crate::kernels::spin_pool::SpinPool;

/// `array`, C-contiguous and aligned, borrowed for reading.
fn read<'py, T: Element, D: Dimension>(
    name: &str,
    array: &Bound<'py, PyArray<T, D>>,
) -> PyResult<PyReadonlyArray<'py, T, D>> {
    check_layout(name, array)?;
    array.try_readonly().map_err(|e| value_error(format!("{name}: {e}")))
}

/// `array`, C-contiguous and aligned, borrowed for writing (no other
/// borrow of its memory may be alive).
fn write<'py, T: Element, D: Dimension>(
    name: &str,
    array: &Bound<'py, PyArray<T, D>>,
) -> PyResult<PyReadwriteArray<'py, T, D>> {
    check_layout(name, array)?;
    array.try_readwrite().map_err(|e| value_error(format!("{name}: {e}")))
}

fn check_layout<T: Element, D: Dimension>(name: &str, array: &Bound<'_, PyArray<T, D>>) -> PyResult<()> {
    if !array.is_c_contiguous() {
        return Err(value_error(format!("{name} is not C-contiguous")));
    }
    // A slice must be aligned; numpy arrays over torch storage always are,
    // a view at an odd byte offset of a byte buffer need not be.
    if array.data() as usize % std::mem::align_of::<T>() != 0 {
        return Err(value_error(format!("{name} is not aligned for its dtype")));
    }
    Ok(())
}

/// The elements of a borrowed array, in C order.
fn values<'a, T: Element, D: Dimension>(array: &'a PyReadonlyArray<'_, T, D>) -> PyResult<&'a [T]> {
    array.as_slice().map_err(value_error)
}

fn values_mut<'a, T: Element, D: Dimension>(array: &'a mut PyReadwriteArray<'_, T, D>) -> PyResult<&'a mut [T]> {
    array.as_slice_mut().map_err(value_error)
}

/// Refuses `what` unless `fits`.
fn require(fits: bool, what: impl FnOnce() -> String) -> PyResult<()> {
    if fits {
        Ok(())
    } else {
        Err(value_error(what()))
    }
}

/// [rows, k] with k whole blocks: the activations of a block product.
fn block_rows(name: &str, shape: &[usize]) -> PyResult<(usize, usize)> {
    require(shape[1] % BLOCK == 0, || format!("{name}'s rows hold a multiple of {BLOCK} values, not {}", shape[1]))?;
    Ok((shape[0], shape[1]))
}

/// The bytes of a Q4_1 weight [n, k] in block_gemm's tiles.
#[pyfunction]
fn q4_1_tiles_size(n: usize, k: usize) -> PyResult<usize> {
    require(k % BLOCK == 0, || format!("Q4_1 rows hold a multiple of {BLOCK} inputs"))?;
    Ok(Q4_1Tiles::size(n, k))
}

/// Packs a Q4_1 weight into block_gemm's tiles `out` (q4_1_tiles_size(n,
/// k) bytes): codes [n, k] (uint8 0..15, one a byte), scales and minimums
/// [n, k / 32] (float32).
#[pyfunction]
fn pack_q4_1(
    codes: &Bound<'_, PyArray2<u8>>,
    scales: &Bound<'_, PyArray2<f32>>,
    mins: &Bound<'_, PyArray2<f32>>,
    out: &Bound<'_, PyArray1<u8>>,
) -> PyResult<()> {
    let (codes, scales, mins, mut out) =
        (read("codes", codes)?, read("scales", scales)?, read("mins", mins)?, write("out", out)?);
    let (n, k) = block_rows("codes", codes.shape())?;
    let block_shape = [n, k / BLOCK];
    require(scales.shape() == block_shape && mins.shape() == block_shape, || {
        format!("a [{n}, {k}] Q4_1 weight has {block_shape:?} scales and minimums")
    })?;
    let size = Q4_1Tiles::size(n, k);
    require(out.len() == size, || format!("the tiles of a [{n}, {k}] weight are {size} bytes, not {}", out.len()))?;
    let codes = values(&codes)?;
    require(codes.iter().all(|&c| c < 16), || "Q4_1 codes are 0..15".into())?;
    block_gemm::pack(codes, values(&scales)?, values(&mins)?, n, k, values_mut(&mut out)?);
    Ok(())
}

/// The Q4_1 weight [n, k] whose tiles are `tiles`.
fn q4_1_tiles<'a>(tiles: &'a PyReadonlyArray<'_, u8, numpy::Ix1>, n: usize, k: usize) -> PyResult<Q4_1Tiles<'a>> {
    Q4_1Tiles::checked(values(tiles)?, n, k).map_err(value_error)
}

/// out [rows, n] = x [rows, k] @ w.T for the Q4_1 weight w [n, k] whose
/// tiles are `tiles` (float32, uint8); `threads` share the columns (the
/// caller's thread among them).
#[pyfunction]
fn matmul_q4_1(
    py: Python<'_>,
    x: &Bound<'_, PyArray2<f32>>,
    tiles: &Bound<'_, PyArray1<u8>>,
    out: &Bound<'_, PyArray2<f32>>,
    threads: usize,
) -> PyResult<()> {
    let (x, tiles, mut out) = (read("x", x)?, read("tiles", tiles)?, write("out", out)?);
    let (rows, k) = block_rows("x", x.shape())?;
    let n = out.shape()[1];
    require(out.shape()[0] == rows, || format!("out has {} rows, x {rows}", out.shape()[0]))?;
    let (weights, x, out) = (q4_1_tiles(&tiles, n, k)?, values(&x)?, values_mut(&mut out)?);
    py.allow_threads(|| block_gemm::matmul(SpinPool::global(), threads, x, &weights, out));
    Ok(())
}

/// The bytes of a Q8_0 weight [n, k] in q8_0's tiles.
#[pyfunction]
fn q8_0_tiles_size(n: usize, k: usize) -> PyResult<usize> {
    require(k % BLOCK == 0, || format!("Q8_0 rows hold a multiple of {BLOCK} inputs"))?;
    Ok(Q8_0Tiles::size(n, k))
}

/// Packs a Q8_0 weight into q8_0's tiles `out` (q8_0_tiles_size(n, k)
/// bytes): codes [n, k] (int8), scales [n, k / 32] (float32).
#[pyfunction]
fn pack_q8_0(
    codes: &Bound<'_, PyArray2<i8>>,
    scales: &Bound<'_, PyArray2<f32>>,
    out: &Bound<'_, PyArray1<u8>>,
) -> PyResult<()> {
    let (codes, scales, mut out) = (read("codes", codes)?, read("scales", scales)?, write("out", out)?);
    let (n, k) = block_rows("codes", codes.shape())?;
    require(scales.shape() == [n, k / BLOCK], || format!("a [{n}, {k}] Q8_0 weight has [{n}, {}] scales", k / BLOCK))?;
    let size = Q8_0Tiles::size(n, k);
    require(out.len() == size, || format!("the tiles of a [{n}, {k}] weight are {size} bytes, not {}", out.len()))?;
    q8_0::pack(values(&codes)?, values(&scales)?, n, k, values_mut(&mut out)?);
    Ok(())
}

/// The Q8_0 weight [n, k] whose tiles are `tiles`.
fn q8_0_tiles<'a>(tiles: &'a PyReadonlyArray<'_, u8, numpy::Ix1>, n: usize, k: usize) -> PyResult<Q8_0Tiles<'a>> {
    Q8_0Tiles::checked(values(tiles)?, n, k).map_err(value_error)
}

/// As matmul_q4_1 for the Q8_0 weight whose tiles are `tiles`.
#[pyfunction]
fn matmul_q8_0(
    py: Python<'_>,
    x: &Bound<'_, PyArray2<f32>>,
    tiles: &Bound<'_, PyArray1<u8>>,
    out: &Bound<'_, PyArray2<f32>>,
    threads: usize,
) -> PyResult<()> {
    let (x, tiles, mut out) = (read("x", x)?, read("tiles", tiles)?, write("out", out)?);
    let (rows, k) = block_rows("x", x.shape())?;
    let n = out.shape()[1];
    require(out.shape()[0] == rows, || format!("out has {} rows, x {rows}", out.shape()[0]))?;
    let (weights, x, out) = (q8_0_tiles(&tiles, n, k)?, values(&x)?, values_mut(&mut out)?);
    py.allow_threads(|| q8_0::matmul(SpinPool::global(), threads, x, &weights, out));
    Ok(())
}

/// out [n, k] (float32) = the Q4_1 weight whose tiles are `tiles`.
#[pyfunction]
fn dequantize_q4_1(py: Python<'_>, tiles: &Bound<'_, PyArray1<u8>>, out: &Bound<'_, PyArray2<f32>>) -> PyResult<()> {
    let (tiles, mut out) = (read("tiles", tiles)?, write("out", out)?);
    let (n, k) = block_rows("out", out.shape())?;
    let (weights, out) = (q4_1_tiles(&tiles, n, k)?, values_mut(&mut out)?);
    py.allow_threads(|| block_gemm::dequantize(&weights, out));
    Ok(())
}

/// out [n, k] (float32) = the Q8_0 weight whose tiles are `tiles`.
#[pyfunction]
fn dequantize_q8_0(
    py: Python<'_>,
    tiles: &Bound<'_, PyArray1<u8>>,
    out: &Bound<'_, PyArray2<f32>>,
    threads: usize,
) -> PyResult<()> {
    let (tiles, mut out) = (read("tiles", tiles)?, write("out", out)?);
    let (n, k) = block_rows("out", out.shape())?;
    let (weights, out) = (q8_0_tiles(&tiles, n, k)?, values_mut(&mut out)?);
    py.allow_threads(|| q8_0::dequantize(SpinPool::global(), threads, &weights, out));
    Ok(())
}

/// out [tokens, heads, head_dim] = the attention of a sequence's new
/// tokens `q` (alike) over a layer's `k_cache` and `v_cache` [cache slots,
/// kv_heads, head_dim] at `slots` (int64, the sequence's in order, its new
/// tokens' last), float32; see extend_attention.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn attend_extend(
    py: Python<'_>,
    q: &Bound<'_, PyArray3<f32>>,
    k_cache: &Bound<'_, PyArray3<f32>>,
    v_cache: &Bound<'_, PyArray3<f32>>,
    slots: &Bound<'_, PyArray1<i64>>,
    scale: f32,
    out: &Bound<'_, PyArray3<f32>>,
    threads: usize,
) -> PyResult<()> {
    let (q, k, v) = (read("q", q)?, read("k_cache", k_cache)?, read("v_cache", v_cache)?);
    let (slots, mut out) = (read("slots", slots)?, write("out", out)?);
    let (q_shape, k_shape, slot_count) = (q.shape().to_vec(), k.shape().to_vec(), slots.len());
    let misfit = |why: String| {
        value_error(format!("q {q_shape:?} does not fit the cache {k_shape:?} and {slot_count} slots: {why}"))
    };
    let ([_, heads, head_dim], [_, kv_heads, kv_dim]) =
        (q.dims().into_pattern().into(), k.dims().into_pattern().into());
    if k.shape() != v.shape() || kv_dim != head_dim || out.shape() != q.shape() {
        return Err(misfit(format!("v is {:?}, out {:?}", v.shape(), out.shape())));
    }
    let e = Extend {
        q: values(&q)?,
        k: values(&k)?,
        v: values(&v)?,
        slots: values(&slots)?,
        heads,
        kv_heads,
        head_dim,
        scale,
    };
    let out = values_mut(&mut out)?;
    py.allow_threads(|| extend_attention::attend(SpinPool::global(), threads, &e, out)).map_err(misfit)
}

/// A layer's weights as NativeDecode keeps them: the input and
/// post-attention norms (float32 [hidden]); the qkv, o, gate_up and down
/// projections' Q4_1 tiles (uint8); the q/k/v bias (float32) or None.
type LayerArrays<'py> = (
    Bound<'py, PyArray1<f32>>,
    Bound<'py, PyArray1<f32>>,
    Bound<'py, PyArray1<u8>>,
    Bound<'py, PyArray1<u8>>,
    Bound<'py, PyArray1<u8>>,
    Bound<'py, PyArray1<u8>>,
    Option<Bound<'py, PyArray1<f32>>>,
);

/// decode_layer::decode_layer: one decoder layer over a decode or prefill
/// step's rows, in place on `x` and `residual` [rows, hidden] (float32).
/// dims: (hidden, heads, kv_heads, head_dim, intermediate, eps, scale);
/// step: (cos, sin [rows, head_dim / 2], the rows' new KV slots [rows]); a
/// decode step's `decode`: (slots [rows, width], lens [rows]), or else a
/// prefill step's `extends`: (new tokens, slots, as decode rows) per
/// sequence (slots int64; decode_layer::NewTokens); cache: the layer's
/// (k, v) [cache slots, kv_heads, head_dim].
#[pyfunction]
#[pyo3(signature = (x, residual, dims, layer, step, decode, extends, cache, threads))]
#[allow(clippy::too_many_arguments)]
fn decode_layer_q4_1<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyArray2<f32>>,
    residual: &Bound<'py, PyArray2<f32>>,
    dims: (usize, usize, usize, usize, usize, f32, f32),
    layer: LayerArrays<'py>,
    step: (Bound<'py, PyArray2<f32>>, Bound<'py, PyArray2<f32>>, Bound<'py, PyArray1<i64>>),
    decode: Option<(Bound<'py, PyArray2<i64>>, Bound<'py, PyArray1<i64>>)>,
    extends: Vec<(usize, Bound<'py, PyArray1<i64>>, bool)>,
    cache: (Bound<'py, PyArray3<f32>>, Bound<'py, PyArray3<f32>>),
    threads: usize,
) -> PyResult<()> {
    let (hidden, heads, kv_heads, head_dim, intermediate, eps, scale) = dims;
    let dims = Dims { hidden, heads, kv_heads, head_dim, intermediate, eps, scale };
    dims.check().map_err(value_error)?;
    let (q_size, kv_size) = (heads * head_dim, kv_heads * head_dim);
    let (mut x, mut residual) = (write("x", x)?, write("residual", residual)?);
    let (input_norm, post_norm, qkv, o, gate_up, down, qkv_bias) = layer;
    let norms = (read("input_norm", &input_norm)?, read("post_norm", &post_norm)?);
    let tiles = [read("qkv", &qkv)?, read("o", &o)?, read("gate_up", &gate_up)?, read("down", &down)?];
    let qkv_bias = qkv_bias.as_ref().map(|bias| read("qkv_bias", bias)).transpose()?;
    let (cos, sin, new_slot) = (read("cos", &step.0)?, read("sin", &step.1)?, read("new_slots", &step.2)?);
    let decode = match &decode {
        Some((slots, lens)) => Some((read("slots", slots)?, read("lens", lens)?)),
        None => None,
    };
    let extends = extends
        .iter()
        .map(|(count, slots, as_decode_rows)| Ok((*count, read("slots", slots)?, *as_decode_rows)))
        .collect::<PyResult<Vec<_>>>()?;
    let (mut k, mut v) = (write("k_cache", &cache.0)?, write("v_cache", &cache.1)?);
    require(k.shape()[1..] == [kv_heads, head_dim] && v.shape() == k.shape(), || {
        format!("the k {:?} and v {:?} caches are [slots, {kv_heads}, {head_dim}]", k.shape(), v.shape())
    })?;

    let layer = Layer {
        input_norm: values(&norms.0)?,
        qkv: q4_1_tiles(&tiles[0], q_size + 2 * kv_size, hidden)?,
        qkv_bias: qkv_bias.as_ref().map(values).transpose()?,
        o: q4_1_tiles(&tiles[1], hidden, q_size)?,
        post_norm: values(&norms.1)?,
        gate_up: q4_1_tiles(&tiles[2], 2 * intermediate, hidden)?,
        down: q4_1_tiles(&tiles[3], hidden, intermediate)?,
    };
    let sequences = match &decode {
        Some((slots, lens)) => {
            Sequences::Decode { slots: values(slots)?, width: slots.shape()[1], lens: values(lens)? }
        }
        None => Sequences::Extend(
            extends
                .iter()
                .map(|(count, slots, as_decode_rows)| {
                    Ok(NewTokens { count: *count, slots: values(slots)?, as_decode_rows: *as_decode_rows })
                })
                .collect::<PyResult<_>>()?,
        ),
    };
    let rows = Rows { cos: values(&cos)?, sin: values(&sin)?, new_slot: values(&new_slot)?, sequences };
    let cache = KvCache { k: values_mut(&mut k)?, v: values_mut(&mut v)? };
    let (x, residual) = (values_mut(&mut x)?, values_mut(&mut residual)?);
    // decode_layer checks every other relation (and each slot) before it writes.
    py.allow_threads(|| {
        decode_layer::decode_layer(SpinPool::global(), threads, &dims, &layer, &rows, cache, x, residual)
    })
    .map_err(value_error)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(q4_1_tiles_size, m)?)?;
    m.add_function(wrap_pyfunction!(pack_q4_1, m)?)?;
    m.add_function(wrap_pyfunction!(matmul_q4_1, m)?)?;
    m.add_function(wrap_pyfunction!(q8_0_tiles_size, m)?)?;
    m.add_function(wrap_pyfunction!(pack_q8_0, m)?)?;
    m.add_function(wrap_pyfunction!(matmul_q8_0, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_q4_1, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_q8_0, m)?)?;
    m.add_function(wrap_pyfunction!(attend_extend, m)?)?;
    m.add_function(wrap_pyfunction!(decode_layer_q4_1, m)?)?;
    Ok(())
}
