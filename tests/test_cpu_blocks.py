"""The 8da4w layers (pyserve/model/cpu/blocks.py over rust/kernels/block_gemm.rs and q8_0/):
each computes the product its blocks say, up to the rounding of its
activations to 8 bits per block of 32, eagerly and compiled."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pyserve.model.cpu.blocks import VOCAB_DENSE_FROM_ROWS, Q4_1Linear, Q8_0Linear
from pyserve.model.quant import BLOCK_INT4, Int4Linear, int4_groups, quantize_model


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def activation_rounding(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: each block of 32 rounded to 8 bits."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scales = blocks.abs().amax(dim=-1, keepdim=True) / 127
    return ((blocks / scales).round() * scales).reshape(x.shape)


@pytest.mark.parametrize("layer_class", [Q4_1Linear, Q8_0Linear])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 40, 130])
def test_kernel_is_the_product_of_its_blocks(layer_class, rows):
    """Every row count (the kernels take activation rows four at a time),
    a prefill's 130 too, against a float64 product of the dense weight and the rounded activations."""
    g = torch.Generator().manual_seed(rows)
    layer = layer_class.quantize(torch.randn(72, 96, generator=g) * 0.1)
    x = torch.randn(rows, 96, generator=g)
    expected = activation_rounding(x).double() @ layer.dense_weight().double().t()
    got = layer(x)
    assert got.shape == (rows, 72) and got.dtype == torch.float32
    assert relative_error(got.double(), expected) < 1e-5
    # And the rounding itself is small against the unrounded product.
    assert relative_error(got, x @ layer.dense_weight().t()) < 0.02


@pytest.mark.parametrize("layer_class", [Q4_1Linear, Q8_0Linear])
def test_a_row_gets_the_same_product_alone_and_in_any_batch(layer_class):
    """Greedy decoding must not depend on which requests share a step: the
    kernels tile rows by fours and weight rows by twos (Q8_0) or eights
    (Q4_1), and each tile must sum a row's blocks in the same order (a
    weight row count that fills neither, too)."""
    g = torch.Generator().manual_seed(7)
    for cols in (160, 576):  # Q4_1's minimums take one path below 8 blocks, another from 8 on
        layer = layer_class.quantize(torch.randn(73, cols, generator=g) * 0.1)
        x = torch.randn(11, cols, generator=g)
        batched = layer(x)
        for start, stop in [(0, 1), (3, 5), (2, 9), (0, 11)]:
            assert torch.equal(layer(x[start:stop]), batched[start:stop]), (cols, start, stop)


def test_long_vocabulary_inputs_take_the_dense_product():
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(64, generator=g)
    layer = Q8_0Linear.quantize(torch.randn(64, 64, generator=g), bias)
    x = torch.randn(2, VOCAB_DENSE_FROM_ROWS // 2, 64, generator=g)  # batch dims are flattened
    assert torch.allclose(layer(x), F.linear(x, layer.dense_weight(), bias), atol=1e-5)


def test_q4_1_blocks_are_int4_groups_of_32():
    """8da4w quantizes a dense layer as int4wo-32 does: the same weights."""
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    codes, scales, mins = int4_groups(weight, 32)
    assert torch.equal(Q4_1Linear.quantize(weight).dense_weight(), Q4_1Linear(codes, scales, mins, None).dense_weight())
    assert relative_error(Q4_1Linear.quantize(weight).dense_weight(), Int4Linear.quantize(weight, 32).dense_weight()) < 1e-6


def test_q8_0_requantizes_a_q8_0_weight_to_itself():
    """The embedded model's embedding is Q8_0: dequantized and quantized
    again, it keeps its codes and scales (each weight to a scale's rounding)."""
    g = torch.Generator().manual_seed(3)
    original = Q8_0Linear.quantize(torch.randn(16, 64, generator=g))
    again = Q8_0Linear.quantize(original.dense_weight())
    torch.testing.assert_close(again.dense_weight(), original.dense_weight(), rtol=1e-6, atol=0)


def test_refuses_inputs_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="multiples of 32"):
        Q4_1Linear.quantize(torch.randn(8, 40))


def test_q4_1_layer_refuses_codes_past_four_bits_and_misshapen_scales():
    scales = torch.ones(8, 2)
    with pytest.raises(ValueError, match="0..15"):
        Q4_1Linear(torch.full((8, 64), 16), scales, scales, None)
    with pytest.raises(ValueError, match="scales and minimums"):
        Q4_1Linear(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 3), scales, None)


def test_quantize_model_keeps_shapes_that_do_not_fit_dense():
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(40, 8, bias=False)
    model.up = torch.nn.Linear(64, 8, bias=True)
    model.embed_tokens = torch.nn.Embedding(16, 64)
    model.lm_head = None
    quantize_model(model, BLOCK_INT4)
    assert isinstance(model.proj, torch.nn.Linear) and isinstance(model.up, Q4_1Linear)
    assert isinstance(model.lm_head, Q8_0Linear) and model.up.bias is not None


def test_compiled_graph_calls_the_kernels():
    """Under torch.compile the products and the Q8_0 dequantizer of the dense
    path are opaque ops of the graph: same values, no graph break."""
    g = torch.Generator().manual_seed(4)
    layer, head = Q4_1Linear.quantize(torch.randn(64, 64, generator=g)), Q8_0Linear.quantize(torch.randn(96, 64, generator=g))

    def step(x):
        return head(torch.nn.functional.silu(layer(x)))

    # 3 rows, a prefill's 130, and from VOCAB_DENSE_FROM_ROWS the Q8_0 head's dense weight
    for rows in (3, 130, VOCAB_DENSE_FROM_ROWS):
        x = torch.randn(rows, 64, generator=g)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(step)(x)
        assert explained.graph_break_count == 0
        compiled = torch.compile(step, backend="eager")
        assert torch.allclose(compiled(x), step(x), atol=1e-5)


def test_layers_run_on_the_thread_count_they_are_built_with():
    """The kernels' threads come with the quantization (RankModel gives its
    CPU count through resolve_quant), not from a process-wide setting; the
    product does not depend on them."""
    model = torch.nn.Module()
    model.up = torch.nn.Linear(64, 16, bias=False)
    model.embed_tokens = torch.nn.Embedding(16, 64)
    model.lm_head = None
    quantize_model(model, dataclasses.replace(BLOCK_INT4, kernel_threads=3))
    assert model.up.threads == 3 and model.lm_head.threads == 3
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(72, 64, generator=g), torch.randn(5, 64, generator=g)
    for layer_class in (Q4_1Linear, Q8_0Linear):
        assert torch.equal(layer_class.quantize(weight, threads=1)(x), layer_class.quantize(weight, threads=3)(x))
