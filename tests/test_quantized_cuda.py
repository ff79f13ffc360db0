"""The GPU layers of quantized checkpoints against the dequantized float
weight: the Triton W4A16 kernel (in Triton's interpreter on CPU, compiled
on CUDA) over several group sizes, with and without zero points and with
an act-order g_idx; torch's tinygemm int4 kernel through the same module
(its CPU twin here, the CUDA op on a GPU); FP8's per-token activation
quantization and `torch._scaled_mm` (which torch also runs on CPU), its
dequantizing fallback, and the dispatch between them. Weights come from
the GPTQ / AWQ / FP8 layouts tests/test_quantized_formats.py writes and
checks against its own dequantizing reader."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # in case this file runs without conftest.py

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pyserve.model.quantized import awq, compressed, fp8, gptq, triton_w4a16  # noqa: E402
from pyserve.model.quantized.cuda import cuda_linear  # noqa: E402
from pyserve.model.quantized.gpu_layers import sliced, stacked, use_gpu_layers  # noqa: E402
from pyserve.model.quantized.fp8_linear import FP8_MAX, Fp8Linear, quantize_per_token  # noqa: E402
from pyserve.model.quantized.int4_linear import W4A16Linear, choose_backend  # noqa: E402
from pyserve.model.quantized.weights import IntWeight  # noqa: E402
from tests.test_quantized_formats import (  # noqa: E402
    awq_dequantized, awq_tensors, fp8_block_dequantized, fp8_block_tensors, fp8_tensor_dequantized,
    fp8_tensor_tensors, gptq_dequantized, gptq_tensors,
)

if not CUDA and not isinstance(triton_w4a16._w4a16_kernel, InterpretedFunction):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _weight(out=48, cols=128, seed=0) -> torch.Tensor:
    return torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def _x(rows, cols, dtype, seed=1) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _reference(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """The product in float32 of the inputs as the kernel sees them (x and W in x's dtype)."""
    return x.float() @ dense.to(x.dtype).float().to(x.device).T


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    err = (y.float() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), (err, ref.abs().max().item())


# The interpreter's tl.dot mis-reads bfloat16 operands (Triton 3.9), so bfloat16 runs on CUDA only.
TRITON_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("group,symmetric,act_order", [
    (16, False, False), (32, True, False), (64, False, False), (128, True, False), (32, False, True),
    (64, True, True),
], ids=["g16-zeros", "g32-sym", "g64-zeros", "row-sym", "g32-zeros-act-order", "g64-sym-act-order"])
def test_triton_w4a16_matches_the_dequantized_gptq_weight(group, symmetric, act_order, dtype):
    t = gptq_tensors(_weight(), 4, group, symmetric, act_order)
    weight = gptq.read(t, 4, group, zero_offset=1)
    layer = W4A16Linear(weight, dtype, DEVICE, "triton")
    assert (layer.zeros is None) == symmetric and (layer.perm is not None) == act_order
    for rows in (1, 5, 37):  # decode, a few rows, more than one row block
        x = _x(rows, 128, dtype, seed=rows)
        _close(layer(x), _reference(x, gptq_dequantized(t, 4)), dtype)


def test_triton_w4a16_awq_weight_with_a_bias_and_batch_dims():
    t = awq_tensors(_weight(64, 64), 32)
    bias = torch.randn(64)
    layer = W4A16Linear(awq.read(t, 32), torch.float16, DEVICE, "triton", bias=bias)
    x = _x(6, 64, torch.float16).view(2, 3, 64)
    ref = _reference(x.view(6, 64), awq_dequantized(t, 32)) + bias.half().float().to(DEVICE)
    y = layer(x)
    assert y.shape == (2, 3, 64) and y.dtype == torch.float16
    _close(y.view(6, 64), ref, torch.float16)


def test_pack_puts_eight_codes_per_word_along_the_inputs():
    codes = torch.randint(0, 16, (3, 16))
    words = triton_w4a16.pack(codes)
    assert words.shape == (2, 3)
    for k in range(16):
        assert torch.equal((words[k // 8] >> (4 * (k % 8))) & 0xF, codes[:, k].int())


@pytest.mark.parametrize("act_order", [False, True])
def test_tinygemm_backend_matches_the_dequantized_weight(act_order):
    """The aten kernel's layout (scales and float zeros per group, act-order reordering)."""
    t = gptq_tensors(_weight(64, 128), 4, 32, symmetric=False, act_order=act_order)
    layer = W4A16Linear(gptq.read(t, 4, 32, zero_offset=1), torch.bfloat16, DEVICE, "aten")
    x = _x(5, 128, torch.bfloat16)
    _close(layer(x), _reference(x, gptq_dequantized(t, 4)), torch.bfloat16)


def test_backend_choice():
    def weight(out=64, cols=256, group=128, bits=4):
        return IntWeight(torch.zeros(out, cols, dtype=torch.int32), torch.zeros(out, cols // group),
                         torch.ones(out, cols // group), group, bits)

    assert choose_backend(weight(), torch.bfloat16) == "aten"  # the library op where it covers the layer
    assert choose_backend(weight(), torch.float16) == "triton"  # tinygemm takes bfloat16 activations only
    assert choose_backend(weight(group=16), torch.bfloat16) == "triton"
    assert choose_backend(weight(out=60), torch.bfloat16) == "triton"
    assert choose_backend(weight(bits=8), torch.bfloat16) is None
    assert cuda_linear(weight(bits=8), torch.bfloat16, "cpu") is None  # served dense
    uneven = weight()
    uneven.g_idx = torch.tensor([0] * 100 + [1] * 156)  # act-order groups no reordering makes 128 wide
    assert choose_backend(uneven, torch.bfloat16) is None and cuda_linear(uneven, torch.bfloat16, "cpu") is None
    with pytest.raises(ValueError, match="aten int4 kernel does not cover"):
        W4A16Linear(weight(), torch.float16, "cpu", "aten")


def test_compressed_tensors_w4a16_through_the_triton_kernel():
    """compressed-tensors' signed codes (offset by 8) and its symmetric zeros."""
    codes = torch.randint(-8, 8, (32, 64))
    packed = (((codes + 8).view(32, 8, 8).int()) << (torch.arange(8) * 4).int()).sum(-1, dtype=torch.int32)
    scales = torch.rand(32, 2) * 0.1
    weight = compressed.read({"weight_packed": packed, "weight_scale": scales, "weight_shape": torch.tensor([32, 64])},
                             "pack-quantized", 4, 32, None)
    dense = codes.float() * scales.repeat_interleave(32, 1)
    layer = W4A16Linear(weight, torch.float16, DEVICE, "triton")
    assert layer.zeros is None
    x = _x(3, 64, torch.float16)
    _close(layer(x), _reference(x, dense), torch.float16)


def test_per_token_activation_quantization():
    x = torch.randn(6, 64) * torch.logspace(-3, 2, 6)[:, None]
    x[2] = 0
    q, scale = quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and torch.isfinite(scale).all()
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 3, 4, 5]], torch.full((5,), FP8_MAX))
    assert torch.equal(q.float()[2], torch.zeros(64))
    # e4m3 keeps 3 mantissa bits: each value within half a step, 2^-4 of its magnitude.
    back = q.float() * scale
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -9).all()


@pytest.mark.parametrize("per_channel", [False, True])
def test_scaled_mm_layer_against_the_dequantized_weight(per_channel):
    """The FP8 GEMM path, which torch also runs on CPU: within the rounding
    of the activations to float8 (relative 2^-4 per value)."""
    w = _weight(64, 128)
    if per_channel:
        scale = (w.abs().amax(-1, keepdim=True) / 448)
        t = {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
        dense = t["weight"].float() * scale
    else:
        t = fp8_tensor_tensors(w)
        dense = fp8_tensor_dequantized(t)
    layer = Fp8Linear(fp8.read(t, None), torch.bfloat16, DEVICE, "scaled_mm")
    x = _x(5, 128, torch.bfloat16)
    y = layer(x).float()
    ref = _reference(x, dense)
    assert y.dtype == torch.float32 and ((y - ref).abs().max() <= 0.03 * ref.abs().max())
    x_rounded = (lambda q, s: q.float() * s)(*quantize_per_token(x))
    assert torch.allclose(y, x_rounded @ dense.to(DEVICE).T, rtol=1e-2, atol=1e-3)


def test_fp8_fallback_dequantizes_block_scales():
    t = fp8_block_tensors(_weight(64, 128))
    layer = Fp8Linear(fp8.read(t, (32, 32)), torch.float32, "cpu")
    assert layer.backend == "dense"
    with pytest.raises(ValueError, match="not blocks"):
        Fp8Linear(fp8.read(t, (32, 32)), torch.float32, "cpu", "scaled_mm")
    x = _x(4, 128, torch.float32).cpu()
    _close(layer(x), _reference(x, fp8_block_dequantized(t)), torch.float32)


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("out,cols,block", [(64, 128, (32, 32)), (80, 96, (32, 32)), (48, 256, (16, 128))],
                         ids=["whole-blocks", "ragged-rows", "wide-blocks"])
def test_block_scaled_fp8_kernel_matches_the_dequantized_weight(out, cols, block, dtype):
    """The Triton kernel for block-wise scales (`weight_block_size`), blocks
    cut short at the last rows as DeepSeek's shapes allow."""
    g = torch.Generator().manual_seed(out)
    scale = torch.rand(-(-out // block[0]), -(-cols // block[1]), generator=g) * 0.01 + 0.001
    weight = fp8.read({"weight": torch.randn(out, cols, generator=g).mul(50).to(torch.float8_e4m3fn),
                       "weight_scale_inv": scale}, block)
    bias = torch.randn(out, generator=g)
    layer = Fp8Linear(weight, dtype, DEVICE, "triton_block", bias=bias)
    for rows in (1, 19):
        x = _x(rows, cols, dtype, seed=rows)
        _close(layer(x), _reference(x, weight.dense()) + bias.to(dtype).float().to(DEVICE), dtype)


def test_fp8_dispatch_without_an_fp8_gpu():
    layer = cuda_linear(fp8.read(fp8_tensor_tensors(_weight(64, 128)), None), torch.bfloat16, "cpu")
    assert isinstance(layer, Fp8Linear) and layer.backend == "dense"


@needs_cuda
def test_cuda_dispatch_runs_each_format_on_the_gpu():
    fp8_gpu = torch.cuda.get_device_capability() >= (8, 9)
    t = gptq_tensors(_weight(64, 256), 4, 128, symmetric=False, act_order=True)
    layer = cuda_linear(gptq.read(t, 4, 128, zero_offset=1), torch.bfloat16, "cuda")
    assert isinstance(layer, W4A16Linear) and layer.backend == "aten" and layer.packed.is_cuda
    x = _x(9, 256, torch.bfloat16)
    _close(layer(x), _reference(x, gptq_dequantized(t, 4)), torch.bfloat16)
    layer = cuda_linear(gptq.read(t, 4, 128, zero_offset=1), torch.float16, "cuda")
    assert layer.backend == "triton"
    _close(layer(x.half()), _reference(x.half(), gptq_dequantized(t, 4)), torch.float16)
    t = fp8_block_tensors(_weight(64, 256))
    layer = cuda_linear(fp8.read(t, (32, 32)), torch.bfloat16, "cuda")
    assert layer.backend == ("triton_block" if fp8_gpu else "dense")
    _close(layer(x), _reference(x, fp8_block_dequantized(t)), torch.bfloat16)
    t = fp8_tensor_tensors(_weight(64, 256))
    layer = cuda_linear(fp8.read(t, None), torch.bfloat16, "cuda")
    assert layer.backend == ("scaled_mm" if fp8_gpu else "dense")
    ref = _reference(x, fp8_tensor_dequantized(t))
    assert (layer(x).float() - ref).abs().max() <= 0.03 * ref.abs().max()


@pytest.mark.parametrize("act_order", [False, True])
def test_tensor_parallel_parts_and_fused_stacks_keep_the_weight(act_order):
    """Each rank's rows or inputs, and q/k/v stacked, dequantize to the
    same slices of the dense weights; act-order inputs cannot be split."""
    parts = [gptq.read(gptq_tensors(_weight(32, 128, seed), 4, 32, False, act_order, seed=3), 4, 32, 1)
             for seed in range(3)]
    if act_order:  # a fused projection's parts share their inputs' order
        parts = [IntWeight(p.codes, p.zeros, p.scales, 32, 4, parts[0].g_idx) for p in parts]
    half = range(16, 32)
    fused = stacked([(32 * i, sliced(p, 0, half)) for i, p in enumerate(parts)])
    assert torch.equal(fused.dense(), torch.cat([p.dense()[16:] for p in parts]))
    columns = sliced(parts[0], 1, range(64, 128))
    assert (columns is None) == act_order
    if not act_order:
        assert torch.equal(columns.dense(), parts[0].dense()[:, 64:])
        assert sliced(parts[0], 1, range(48, 128)) is None  # not on a group boundary


def test_fp8_parts_stack_with_their_own_scales():
    a, b = fp8_tensor_tensors(_weight(32, 64, 0)), fp8_tensor_tensors(_weight(16, 64, 1) * 3)
    fused = stacked([(32, sliced(fp8.read(b, None), 0, range(0, 16))), (0, fp8.read(a, None))])
    assert torch.equal(fused.dense(), torch.cat([fp8_tensor_dequantized(a), fp8_tensor_dequantized(b)]))
    blocks = fp8.read(fp8_block_tensors(_weight(64, 128)), (32, 32))
    assert torch.equal(sliced(blocks, 1, range(32, 96)).dense(), blocks.dense()[:, 32:96])
    assert sliced(blocks, 0, range(16, 48)) is None


def test_use_gpu_layers_replaces_the_linears_it_can_hold():
    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.proj = torch.nn.Linear(128, 64, bias=True, dtype=torch.bfloat16)
    model.down = torch.nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
    t = gptq_tensors(_weight(64, 128), 4, 32, symmetric=False, act_order=False)
    int8 = gptq.read(gptq_tensors(_weight(64, 64), 8, 32, True, False), 8, 32, 1)
    replaced = use_gpu_layers(model, {"attn.proj": gptq.read(t, 4, 32, 1), "down": int8}, torch.bfloat16, DEVICE)
    assert replaced == ["attn.proj"] and isinstance(model.attn.proj, W4A16Linear)
    assert isinstance(model.down, torch.nn.Linear)  # 8-bit codes: the dense weight stays
    x = _x(3, 128, torch.bfloat16)
    bias = model.attn.proj.bias.float()
    _close(model.attn.proj(x).float() - bias, _reference(x, gptq_dequantized(t, 4)), torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        use_gpu_layers(model, {"down": gptq.read(t, 4, 32, 1)}, torch.bfloat16, DEVICE)



@needs_cuda
@pytest.mark.parametrize("fmt", ["gptq-int4-sym", "fp8-tensor"])
def test_the_loader_puts_checkpoint_layers_on_their_gpu_kernels(tmp_path, default_model_dir, fmt):
    """A real checkpoint served on CUDA in bfloat16: its projections are the
    kernels' layers, and its greedy choices those of its dequantized copy.
    Teacher-forced (each next token chosen after the copy's own tokens), so
    one near-tie flipped by FP8's activation rounding costs one position,
    not the rest of the sequence (seen on an H100: free-running, 11 of 16)."""
    import asyncio

    from tests.test_engine import collect, started_engine
    from tests.test_quantized_checkpoints import quantized_pair

    quantized_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, fmt)
    prompt = [5, 9, 200, 31, 7]

    async def engine_on(model_dir):
        return await started_engine(model_dir, device="cuda", dtype="bfloat16", disable_cuda_graph=True)

    async def compare():
        dense = await engine_on(dense_dir)
        try:
            want = (await collect(dense, prompt, max_new_tokens=16, temperature=0, ignore_eos=True))[1]
        finally:
            await dense.shutdown()
        quantized = await engine_on(quantized_dir)
        try:
            model = quantized.runner.rank_model.model
            assert not isinstance(model.layers[0].self_attn.qkv_proj, torch.nn.Linear)
            assert any(isinstance(m, (W4A16Linear, Fp8Linear)) for m in model.modules())
            got = [(await collect(quantized, prompt + want[:i], max_new_tokens=1, temperature=0,
                                  ignore_eos=True))[1][0] for i in range(len(want))]
        finally:
            await quantized.shutdown()
        return got, want

    got, want = asyncio.run(compare())
    assert sum(a == b for a, b in zip(got, want)) >= 14, (got, want)
