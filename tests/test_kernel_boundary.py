"""The Rust kernels' entry points (pyserve._rust) refuse what they would
read or write out of bounds: wrong dtypes and dimensions (TypeError),
arrays that are not C-contiguous, sizes that do not fit together, KV slots
outside the cache, outputs that overlap an input (ValueError), before they
touch any memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyserve import _rust
from pyserve.model.cpu.blocks import Q4_1Linear, Q8_0Linear

N, K, ROWS = 16, 64, 3


@pytest.fixture(scope="module")
def q4_1() -> np.ndarray:
    """The tiles of a Q4_1 weight [N, K]."""
    return Q4_1Linear.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0))).tiles.numpy()


@pytest.fixture(scope="module")
def q8_0() -> np.ndarray:
    """The tiles of a Q8_0 weight [N, K]."""
    return Q8_0Linear.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(1))).tiles.numpy()


def rows(count: int = ROWS, width: int = K) -> np.ndarray:
    return np.random.default_rng(count).standard_normal((count, width), dtype=np.float32)


def test_q4_1_product_runs_on_arrays_that_fit(q4_1):
    out = np.zeros((ROWS, N), np.float32)
    _rust.matmul_q4_1(rows(), q4_1, out, 2)
    dense = np.zeros((N, K), np.float32)
    _rust.dequantize_q4_1(q4_1, dense)
    np.testing.assert_allclose(out, rows() @ dense.T, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("x, error, match", [
    (rows().astype(np.float64), TypeError, "argument 'x'"),
    (rows().reshape(-1), TypeError, "argument 'x'"),
    (np.asfortranarray(rows()), ValueError, "C-contiguous"),
    (rows(ROWS, 2 * K)[:, ::2], ValueError, "C-contiguous"),
    (rows(ROWS, K - 32), ValueError, "tiles of a"),
    (rows(ROWS, 40), ValueError, "multiple of 32"),
    (rows(ROWS + 1), ValueError, "rows"),
], ids=["float64", "1-d", "fortran-order", "strided", "other-k", "partial-block", "rows-unlike-out"])
def test_q4_1_product_refuses_activations_that_do_not_fit(q4_1, x, error, match):
    out = np.zeros((ROWS, N), np.float32)
    with pytest.raises(error, match=match):
        _rust.matmul_q4_1(x, q4_1, out, 2)
    assert not out.any(), "nothing written"


def test_q4_1_product_refuses_short_tiles_and_misshapen_outputs(q4_1):
    with pytest.raises(ValueError, match="tiles of a"):
        _rust.matmul_q4_1(rows(), q4_1[:-1], np.zeros((ROWS, N), np.float32), 1)
    with pytest.raises(ValueError, match="tiles of a"):
        _rust.matmul_q4_1(rows(), q4_1, np.zeros((ROWS, N + 8), np.float32), 1)  # more weight rows than packed
    with pytest.raises(TypeError):
        _rust.matmul_q4_1(rows(), q4_1.view(np.int8), np.zeros((ROWS, N), np.float32), 1)
    with pytest.raises(ValueError, match="tiles of a"):
        _rust.dequantize_q4_1(q4_1, np.zeros((N, K + 32), np.float32))


def test_an_output_that_overlaps_an_input_is_refused(q8_0):
    """The products borrow their inputs to read and the output to write:
    memory both read and written in one call is refused (rust-numpy's
    borrow tracking), not raced."""
    square = Q8_0Linear.quantize(torch.randn(K, K, generator=torch.Generator().manual_seed(2)))
    x = rows()
    with pytest.raises(ValueError, match="out"):
        _rust.matmul_q8_0(x, square.tiles.numpy(), x, 1)
    with pytest.raises(ValueError, match="out"):
        _rust.matmul_q4_1(x, square.tiles.numpy(), x, 1)  # not even read as Q4_1: the borrow comes first
    floats = np.zeros((N, K), np.float32)
    with pytest.raises(ValueError, match="out"):
        _rust.dequantize_q8_0(floats.view(np.uint8).reshape(-1)[: q8_0.size], floats, 1)


def test_q8_0_entry_points_check_tiles_activations_and_output(q8_0):
    out = np.zeros((ROWS, N), np.float32)
    _rust.matmul_q8_0(rows(), q8_0, out, 2)
    dense = np.zeros((N, K), np.float32)
    _rust.dequantize_q8_0(q8_0, dense, 2)
    np.testing.assert_allclose(out, rows() @ dense.T, rtol=0.05, atol=0.1)  # the activations' 8-bit rounding
    with pytest.raises(TypeError):
        _rust.matmul_q8_0(rows(), q8_0.view(np.int8), out, 2)
    with pytest.raises(ValueError, match="tiles of a"):
        _rust.matmul_q8_0(rows(), q8_0[:-1], out, 2)
    with pytest.raises(ValueError, match="tiles of a"):
        _rust.matmul_q8_0(rows(ROWS, K + 32), q8_0, out, 2)
    with pytest.raises(ValueError, match="rows"):
        _rust.matmul_q8_0(rows(ROWS + 1), q8_0, out, 2)
    with pytest.raises(ValueError, match="tiles of a"):
        _rust.dequantize_q8_0(q8_0, np.zeros((N + 8, K), np.float32), 2)  # more weight rows than packed
    with pytest.raises(ValueError, match="multiple of 32"):
        _rust.dequantize_q8_0(q8_0, np.zeros((N, K - 8), np.float32), 2)


def test_q8_0_packing_refuses_misshapen_scales_and_a_short_buffer():
    codes, scales = np.zeros((N, K), np.int8), np.ones((N, K // 32), np.float32)
    tiles = np.zeros(_rust.q8_0_tiles_size(N, K), np.uint8)
    _rust.pack_q8_0(codes, scales, tiles)
    with pytest.raises(ValueError, match="bytes"):
        _rust.pack_q8_0(codes, scales, tiles[:-1])
    with pytest.raises(ValueError, match="scales"):
        _rust.pack_q8_0(codes, scales[:, :1].copy(), tiles)
    with pytest.raises(ValueError, match="multiple of 32"):
        _rust.q8_0_tiles_size(N, 40)


def test_packing_refuses_codes_past_four_bits_and_a_short_buffer():
    codes, scales = np.zeros((N, K), np.uint8), np.ones((N, K // 32), np.float32)
    tiles = np.zeros(_rust.q4_1_tiles_size(N, K), np.uint8)
    _rust.pack_q4_1(codes, scales, scales.copy(), tiles)
    codes[3, 5] = 16
    with pytest.raises(ValueError, match="0..15"):
        _rust.pack_q4_1(codes, scales, scales.copy(), tiles)
    with pytest.raises(ValueError, match="bytes"):
        _rust.pack_q4_1(np.zeros((N, K), np.uint8), scales, scales.copy(), tiles[:-1])
    with pytest.raises(ValueError, match="scales and minimums"):
        _rust.pack_q4_1(np.zeros((N, K), np.uint8), np.ones((N, 1), np.float32), np.ones((N, 1), np.float32), tiles)


HEADS, KV_HEADS, HEAD_DIM, CACHE_SLOTS = 4, 2, 32, 20


def extend_arrays(tokens: int = 3, slots=None):
    """q and out [tokens, HEADS, HEAD_DIM], a layer's k and v caches, the slots."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((tokens, HEADS, HEAD_DIM), dtype=np.float32)
    k, v = (rng.standard_normal((CACHE_SLOTS, KV_HEADS, HEAD_DIM), dtype=np.float32) for _ in range(2))
    slots = np.arange(2, 9, dtype=np.int64) if slots is None else np.asarray(slots, np.int64)
    return q, k, v, slots, np.zeros_like(q)


def test_extend_attention_runs_on_arrays_that_fit():
    q, k, v, slots, out = extend_arrays()
    _rust.attend_extend(q, k, v, slots, 0.2, out, 2)
    assert np.isfinite(out).all() and out.any()


@pytest.mark.parametrize("slots", [[2, 3, CACHE_SLOTS], [-1, 3, 4], [2, 3, 2**40]],
                         ids=["past-the-end", "negative", "far"])
def test_extend_attention_refuses_slots_outside_the_cache(slots):
    q, k, v, slots, out = extend_arrays(slots=slots)
    with pytest.raises(ValueError, match="slot past the cache"):
        _rust.attend_extend(q, k, v, slots, 0.2, out, 2)
    assert not out.any()


def test_extend_attention_refuses_shapes_that_do_not_fit():
    q, k, v, slots, out = extend_arrays()
    cases = [
        (q, k, v, slots[:2], out),  # more new tokens than slots
        (q[:, :3].copy(), k, v, slots, out[:, :3].copy()),  # 3 heads over 2 KV heads
        (q, k, v[:-1], slots, out),  # v unlike k
        (q, k, v, slots, out[:-1]),  # out unlike q
        (q[..., :16].copy(), k, v, slots, out[..., :16].copy()),  # heads unlike the cache's
    ]
    for args in cases:
        with pytest.raises(ValueError, match="does not fit"):
            _rust.attend_extend(*args[:4], 0.2, args[4], 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        _rust.attend_extend(q, k[::2], v[::2], slots, 0.2, out, 2)
    with pytest.raises(TypeError):
        _rust.attend_extend(q, k, v, slots.astype(np.int32), 0.2, out, 2)
    with pytest.raises(ValueError, match="out"):
        _rust.attend_extend(q, k, v, slots, 0.2, q, 2)  # out aliases q


HIDDEN, INTERMEDIATE = 64, 96
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


@pytest.fixture(scope="module")
def layer():
    """A decoder layer's arrays as NativeDecode keeps them: (input norm,
    post norm, qkv, o, gate_up, down tiles, qkv bias)."""
    g = torch.Generator().manual_seed(4)
    tiles = [Q4_1Linear.quantize(torch.randn(n, k, generator=g) * 0.1).tiles.numpy()
             for n, k in [(QKV, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTERMEDIATE, HIDDEN),
                          (HIDDEN, INTERMEDIATE)]]
    return (np.ones(HIDDEN, np.float32), np.ones(HIDDEN, np.float32), *tiles, np.zeros(QKV, np.float32))


DIMS = (HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, 1e-6, 0.2)


def decode_step(rows: int = 2, width: int = 4):
    """x, residual, step (cos, sin, new slots), decode (slots, lens) and a
    layer's (k, v) cache for `rows` decode rows."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((rows, HIDDEN), dtype=np.float32)
    step = (np.ones((rows, HEAD_DIM // 2), np.float32), np.zeros((rows, HEAD_DIM // 2), np.float32),
            np.arange(10, 10 + rows, dtype=np.int64))
    slots = np.arange(rows * width, dtype=np.int64).reshape(rows, width)
    slots[:, -1] = step[2]
    decode = (slots, np.full(rows, width, np.int64))
    cache = tuple(np.zeros((CACHE_SLOTS, KV_HEADS, HEAD_DIM), np.float32) for _ in range(2))
    return x, np.zeros_like(x), step, decode, cache


def test_decode_layer_runs_on_arrays_that_fit(layer):
    x, residual, step, decode, cache = decode_step()
    before = x.copy()
    _rust.decode_layer_q4_1(x, residual, DIMS, layer, step, decode, [], cache, 2)
    assert not np.array_equal(x, before) and np.isfinite(x).all()
    assert cache[0][10:12].any(), "the new tokens' k were written"
    # A prefill step of the same rows: one sequence of 2 new tokens.
    x, residual, step, _, cache = decode_step()
    extends = [(2, np.arange(5, 12, dtype=np.int64), False)]
    _rust.decode_layer_q4_1(x, residual, DIMS, layer, step, None, extends, cache, 2)
    assert np.isfinite(x).all()


def refused(layer, error=ValueError, match=None, *, x=None, residual=None, dims=DIMS, step=None, decode=None,
            extends=(), cache=None, layer_arrays=None):
    """Calls the layer with one argument swapped for a misfit; asserts the
    refusal and that neither x nor the cache was written."""
    fits_x, fits_residual, fits_step, fits_decode, fits_cache = decode_step()
    x = fits_x if x is None else x
    cache = fits_cache if cache is None else cache
    x_before, cache_before = x.copy(), [c.copy() for c in cache]
    decode = fits_decode if decode is None and not extends else decode
    with pytest.raises(error, match=match):
        _rust.decode_layer_q4_1(x, fits_residual if residual is None else residual, dims,
                                layer if layer_arrays is None else layer_arrays, fits_step if step is None else step,
                                decode, list(extends), cache, 2)
    assert np.array_equal(x, x_before) and all(np.array_equal(c, b) for c, b in zip(cache, cache_before))


def test_decode_layer_refuses_kv_slots_outside_the_cache(layer):
    _, _, (cos, sin, new_slots), (slots, lens), _ = decode_step()
    refused(layer, match="outside the cache", step=(cos, sin, np.array([10, CACHE_SLOTS], np.int64)))
    refused(layer, match="outside the cache", step=(cos, sin, np.array([-1, 11], np.int64)))
    far = slots.copy()
    far[1, 0] = 10**12
    refused(layer, match="outside the cache", decode=(far, lens))
    refused(layer, match="outside the cache", decode=None,
            extends=[(2, np.array([3, CACHE_SLOTS + 5], np.int64), False)])


def test_decode_layer_refuses_lengths_past_their_slots(layer):
    _, _, _, (slots, lens), _ = decode_step()
    refused(layer, match="1..=4 slots", decode=(slots, lens + 1))
    refused(layer, match="1..=4 slots", decode=(slots, lens * 0))
    refused(layer, match="one list", decode=(slots[:1], lens))
    refused(layer, match="new tokens are the rows", decode=None,
            extends=[(1, np.arange(4, dtype=np.int64), False)])
    refused(layer, match="new tokens", decode=None,
            extends=[(2, np.arange(1, dtype=np.int64), True), (0, slots[0], False)])


def test_decode_layer_refuses_weights_and_rows_that_do_not_fit(layer):
    norm, post, qkv, o, gate_up, down, bias = layer
    refused(layer, match="tiles of a", layer_arrays=(norm, post, o, o, gate_up, down, bias))
    refused(layer, match="tiles of a", layer_arrays=(norm, post, qkv, o, gate_up, down[:-1], bias))
    refused(layer, match="norms", layer_arrays=(norm[:-1], post, qkv, o, gate_up, down, bias))
    refused(layer, match="bias", layer_arrays=(norm, post, qkv, o, gate_up, down, bias[:-1]))
    refused(layer, TypeError, "argument 'layer'", layer_arrays=(norm, post, qkv, o, gate_up, down, bias.astype(np.float64)))
    refused(layer, match="x and the residual", x=np.zeros((3, HIDDEN), np.float32))
    refused(layer, match="cos and sin", step=(np.ones((2, 8), np.float32),) * 2 + (np.array([10, 11]),))
    refused(layer, match="KV heads", dims=(HIDDEN, 3, KV_HEADS, HEAD_DIM, INTERMEDIATE, 1e-6, 0.2))
    refused(layer, match="whole blocks", dims=(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 40, 1e-6, 0.2))


def test_decode_layer_refuses_caches_that_do_not_fit_or_alias(layer):
    k, v = decode_step()[4]
    refused(layer, match="caches", cache=(k, v[:-1]))
    refused(layer, match="caches", cache=(k[:, :1].copy(), v[:, :1].copy()))
    strided = np.zeros((CACHE_SLOTS, HEAD_DIM, KV_HEADS), np.float32).transpose(0, 2, 1)
    refused(layer, match="C-contiguous", cache=(strided, v))
    refused(layer, TypeError, "argument 'cache'", cache=(k.astype(np.float64), v))
    refused(layer, match="v_cache", cache=(k, k))  # k and v one buffer: both written
    x = decode_step()[0]
    refused(layer, match="residual", x=x, residual=x)
