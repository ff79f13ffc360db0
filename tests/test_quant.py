"""CPU weight-only quantization (--torchao-config): the layers compute what
their quantized weights say, the embedded model runs its own Q4_1 groups,
and a quantized model still answers as its float32 self does."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from pyserve.engine.engine import Engine
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.model.gguf import GGUFFile
from pyserve.model.loader import load_model
from pyserve.model.cpu import blocks
from pyserve.model.cpu.blocks import Q4_1Linear, Q8_0Linear
from pyserve.model.quant import (
    BLOCK_INT4, Int4Linear, Int8Linear, WeightQuant, pack_nibbles, parse_quant, resolve_quant, unpack_nibbles,
)
from pyserve.server_args import ServerArgs
from tests.test_model_vs_hf import CachedSequences
from tests.tiny_models import build_tiny_model

# bf16 activations and outputs: about 3 significant digits.
BF16_RTOL = 2e-2


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def test_parse_quant_names_and_refusals():
    assert parse_quant("int8wo") == WeightQuant(8)
    assert parse_quant("int4wo-64") == WeightQuant(4, 64)
    assert parse_quant("8da4w") == BLOCK_INT4 and BLOCK_INT4.name == "8da4w"
    assert parse_quant("none") is None and parse_quant("") is None
    assert parse_quant("auto") == "auto"
    for bad in ("int4wo-48", "int4wo", "fp8", "int8", "8da4w-64"):
        with pytest.raises(ValueError, match="--torchao-config"):
            parse_quant(bad)


def test_nibbles_round_trip():
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


@pytest.mark.parametrize("rows", [1, 5])
def test_int8_linear_is_its_dequantized_weight(rows):
    g = torch.Generator().manual_seed(0)
    weight, bias, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(rows, 64, generator=g)
    layer = Int8Linear.quantize(weight, bias)
    dequantized = layer.weight.float() * layer.scales.float()[:, None]
    assert relative_error(dequantized, weight) < 0.01  # 8 bits per row
    assert relative_error(layer(x), F.linear(x, dequantized, bias)) < BF16_RTOL
    assert layer(x).dtype == x.dtype


@pytest.mark.parametrize("group", [32, 64])
def test_int4_linear_is_its_dequantized_weight(group):
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(48, 128, generator=g), torch.randn(3, 128, generator=g)
    layer = Int4Linear.quantize(weight, group)
    # Rebuild the weight from the same codes/scales the kernel got.
    codes = ((weight.reshape(48, -1, group) - weight.reshape(48, -1, group).amin(-1, keepdim=True))
             / ((weight.reshape(48, -1, group).amax(-1) - weight.reshape(48, -1, group).amin(-1)) / 15)[..., None])
    codes = codes.round().clamp(0, 15)
    scales_zeros = layer.scales_and_zeros.float()  # [groups, out, 2]
    dequantized = ((codes - 8) * scales_zeros[..., 0].t()[..., None] + scales_zeros[..., 1].t()[..., None])
    dequantized = dequantized.reshape(48, 128)
    assert relative_error(dequantized, weight) < 0.1  # 4 bits: coarse, but close
    assert relative_error(layer(x), F.linear(x, dequantized)) < BF16_RTOL


def test_int4_linear_takes_its_dense_weight_for_many_rows():
    """A long prefill's rows go through the float32 dequantized weight and
    give what the int4 kernel gives a few rows at a time."""
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(64, 96, generator=g), torch.randn(64, generator=g)
    layer = Int4Linear.quantize(weight, 32, bias)
    x = torch.randn(Int4Linear.DENSE_FROM_ROWS + 3, 96, generator=g)
    by_kernel = torch.cat([layer(part) for part in x.split(7)])
    assert relative_error(layer(x), by_kernel) < BF16_RTOL
    assert torch.allclose(layer(x), F.linear(x, layer.dense_weight(), bias), atol=1e-5)
    assert relative_error(layer.dense_weight(), weight) < 0.1


def test_embedded_model_runs_its_own_q4_1_groups(default_model_dir):
    """The shipped int4 layer of the embedded model is the GGUF's d * q + m,
    not a re-quantization of the dense copy."""
    from pyserve.model.default_model import _gguf_path, _unpermute_rotary

    model, config = load_model(default_model_dir, torch.float32, "cpu", WeightQuant(4, 32))
    gguf = GGUFFile(_gguf_path())
    for kind, rows in (("attn_q", slice(0, 576)), ("ffn_down", slice(None))):
        expected = torch.from_numpy(gguf.tensor(f"blk.3.{kind}.weight").copy())
        if kind == "attn_q":
            expected = torch.from_numpy(_unpermute_rotary(expected.numpy(), config.num_attention_heads).copy())
        layer = model.layers[3].self_attn.qkv_proj if kind == "attn_q" else model.layers[3].mlp.down_proj
        assert isinstance(layer, Int4Linear)
        identity = torch.eye(expected.shape[1])
        # Column j of the weight is the output for unit input j: the int4
        # kernel (a few rows at a time) and the dense path (many rows).
        by_kernel = torch.cat([layer(part) for part in identity.split(Int4Linear.DENSE_FROM_ROWS - 1)])
        dense = layer(identity)
        assert identity.shape[0] >= Int4Linear.DENSE_FROM_ROWS
        assert relative_error(by_kernel.t()[rows], expected) < 0.005  # only bf16 rounding of scales and outputs
        assert relative_error(dense.t()[rows], expected) < 1e-6  # the GGUF's own arithmetic, in float32


def test_8da4w_embedded_model_runs_the_gguf_blocks(default_model_dir):
    """8da4w keeps the GGUF's Q4_1 blocks (d * q + m) and Q8_0 blocks for the
    vocabulary projection: the weights llama.cpp multiplies by."""
    from pyserve.model.default_model import _gguf_path

    model, _ = load_model(default_model_dir, torch.float32, "cpu", BLOCK_INT4)
    gguf = GGUFFile(_gguf_path())
    layer = model.layers[3].mlp.down_proj
    assert isinstance(layer, Q4_1Linear)
    expected = torch.from_numpy(gguf.tensor("blk.3.ffn_down.weight").copy())
    assert relative_error(layer.dense_weight(), expected) < 1e-6
    # A unit input quantizes exactly (127 times 1/127), so the kernel gives the weight's columns.
    identity = torch.eye(expected.shape[1])[:64]
    assert relative_error(layer(identity).t(), expected[:, :64]) < 1e-5
    head = model.lm_head
    assert isinstance(head, Q8_0Linear)
    embedding = torch.from_numpy(gguf.tensor("token_embd.weight").copy())
    # Re-quantized from the directory's bfloat16 embedding: the GGUF's blocks up to that rounding.
    assert relative_error(head.dense_weight(), embedding) < 1e-3


def test_auto_uses_shipped_weights_on_cpu_only(default_model_dir, tmp_path):
    tiny = build_tiny_model(tmp_path, "llama")
    # The shipped groups run through the block kernels where the CPU has AVX2.
    shipped = BLOCK_INT4 if blocks.available() else WeightQuant(4, 32)
    assert resolve_quant("auto", default_model_dir, torch.device("cpu")) == shipped
    assert resolve_quant("auto", tiny, torch.device("cpu")) is None  # ships no quantized weights
    assert resolve_quant("auto", default_model_dir, torch.device("cuda")) is None
    assert resolve_quant("none", default_model_dir, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quant("int8wo", tiny, torch.device("cuda"))


def greedy(model, config, prompts: list[list[int]], n: int) -> list[list[int]]:
    seqs = CachedSequences(model, config)
    outputs = [[t] for t in seqs.forward(dict(enumerate(prompts))).argmax(-1).tolist()]
    for _ in range(n - 1):
        for out, t in zip(outputs, seqs.forward({i: [o[-1]] for i, o in enumerate(outputs)}).argmax(-1).tolist()):
            out.append(t)
    return outputs


# Greedy answers to three plain prompts, as the quantized layers give them
# against float32's. Measured on this build: int8wo, int4wo-32 and 8da4w (on
# the torch layers or the native ones) give float32's answers token for token
# through 16 tokens. The first SAME_START of each answer must be float32's.
# Later, float32's own lead over its runner-up drops to 0.2 logits in places
# while quantization moves a lead by up to 0.5 (bench/quality.py follows long
# answers), and a flipped token changes the rest of its answer: of the
# 3 x 4 tokens after the start, LATER_AGREE must be float32's (one answer's
# last three may go).
PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Q: What is 2+2?\nA:"]
ANSWER_TOKENS, SAME_START, LATER_AGREE = 8, 4, 9


def assert_answers_start_as_float32(reference: list[list[int]], got: list[list[int]]) -> None:
    assert all(len(r) == len(g) == ANSWER_TOKENS for r, g in zip(reference, got)), (reference, got)
    assert [g[:SAME_START] for g in got] == [r[:SAME_START] for r in reference], (reference, got)
    later = sum(a == b for r, g in zip(reference, got) for a, b in zip(r[SAME_START:], g[SAME_START:]))
    assert later >= LATER_AGREE, (later, reference, got)


@pytest.mark.parametrize("mode", ["int8wo", "int4wo-32", "8da4w"])
def test_quantized_embedded_model_answers_like_float32(default_model_dir, mode):
    """Greedy answers to plain questions start as float32's (see
    assert_answers_start_as_float32 for how far)."""
    from pyserve._rust import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    prompts = [tok.encode(t) for t in PLAIN_PROMPTS]
    reference = greedy(*load_model(default_model_dir, torch.float32, "cpu"), prompts, ANSWER_TOKENS)
    quantized = greedy(*load_model(default_model_dir, torch.float32, "cpu", parse_quant(mode)), prompts, ANSWER_TOKENS)
    assert_answers_start_as_float32(reference, quantized)


@pytest.mark.parametrize("mode", ["int8wo", "int4wo-32", "8da4w"])
def test_engine_serves_a_safetensors_model_quantized_at_load(tmp_path, mode, default_model_dir):
    """A bf16/fp32 checkpoint quantized at load: the engine runs it to the end."""
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer_dir=default_model_dir)
    engine = Engine.from_args(ServerArgs(model_path=str(model_dir), max_total_tokens=512, torchao_config=mode,
                                         device="cpu"))  # CPU weight modes

    async def run():
        await engine.start()
        try:
            params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
            return [t async for out in engine.generate(GenerateRequest([5, 6, 7], params)) for t in out.token_ids]
        finally:
            await engine.shutdown()

    assert len(asyncio.run(run())) == 6
    head = engine.runner.rank_model.model.lm_head
    assert isinstance(head, Q8_0Linear if mode == "8da4w" else Int8Linear)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_8da4w_serves_layers_with_a_window_or_soft_cap(tmp_path, arch, default_model_dir):
    """A family whose layers attend with a sliding window (Mistral) or a
    soft-cap (Gemma 2) under 8da4w: a prompt longer than the window is
    served to the end, its extends attending through the torch backend."""
    model_dir = build_tiny_model(tmp_path, arch, tokenizer_dir=default_model_dir, sliding_window=8)
    engine = Engine.from_args(ServerArgs(model_path=str(model_dir), max_total_tokens=512, torchao_config="8da4w",
                                         device="cpu"))

    async def run():
        await engine.start()
        try:
            params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
            return [out async for out in engine.generate(GenerateRequest(list(range(5, 45)), params))]
        finally:
            await engine.shutdown()

    outputs = asyncio.run(run())
    assert outputs[-1].finish_reason == "length"
    assert sum(len(out.token_ids) for out in outputs) == 6
