"""Under --tp-size 2 each rank reads from the safetensors files only its
slice of every expert tensor (rows of gate and up, columns of down, the
same of the shared expert; gpt-oss's interleaved gate/up and its MXFP4
blocks and scales alike): a spy on the loader's file handles counts the
bytes each read returns and the tensors read whole. What the ranks hold
is the single rank's weights cut in two, and two ranks on gloo generate
what one does, in float32 and with quantized experts. A quantized
checkpoint's experts (GPTQ and AWQ int4, compressed-tensors W4A16, FP8 per
tensor or block) are read the same way, in their packed layouts: half of
every code, zero and scale tensor per rank."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors import safe_open

from pyserve.model import loader
from pyserve.model.cpu import blocks
from pyserve.model.layers.moe import MoEBlock
from pyserve.model.loader import load_model
from pyserve.model.parallel import TensorParallel
from tests.slow import slow, slow_test
from tests.test_gpt_oss import write_mxfp4_pair
from tests.test_quantized_formats import (
    awq_dequantized, awq_tensors, dense_copy, pack_columns, pack_rows, round_to_nearest, unpack_words, write_quantized,
)
from tests.test_tensor_parallel import _one_and_two_ranks, assert_same_generation
from tests.tiny_models import build_tiny_model

_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I32": 4, "I64": 8, "F8_E4M3": 1}


class ReadSpy:
    """safe_open's stand-in: every handle it opens counts, per tensor, the
    bytes its reads returned and whether it was read whole."""

    def __init__(self):
        self.bytes: Counter[str] = Counter()
        self.whole: set[str] = set()

    def open(self, *args, **kwargs):
        return _Handle(safe_open(*args, **kwargs), self)


class _Handle:
    def __init__(self, handle, spy: ReadSpy):
        self.handle, self.spy = handle, spy

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, key):
        tensor = self.handle.get_tensor(key)
        self.spy.whole.add(key)
        self.spy.bytes[key] += tensor.nbytes
        return tensor

    def get_slice(self, key):
        return _Slice(self.handle.get_slice(key), key, self.spy)


class _Slice:
    def __init__(self, view, key: str, spy: ReadSpy):
        self.view, self.key, self.spy = view, key, spy

    def get_shape(self):
        return self.view.get_shape()

    def __getitem__(self, index):
        tensor = self.view[index]
        self.spy.bytes[self.key] += tensor.nbytes
        return tensor


def tensor_bytes(model_dir) -> dict[str, int]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        sizes = {}
        for key in f.keys():
            view = f.get_slice(key)
            sizes[key] = _BYTES[view.get_dtype()] * int(torch.tensor(view.get_shape()).prod())
        return sizes


def rank_reads(monkeypatch, model_dir, rank: int, **kwargs) -> tuple[ReadSpy, torch.nn.Module]:
    spy = ReadSpy()
    monkeypatch.setattr(loader, "safe_open", spy.open)
    model, _ = load_model(model_dir, torch.float32, "cpu", tp=TensorParallel(rank, 2), **kwargs)
    monkeypatch.undo()
    return spy, model


def assert_each_rank_reads_half_of_each_expert(monkeypatch, model_dir, shared=()) -> list[torch.nn.Module]:
    """`shared`: suffixes of tensors every rank reads whole (a per-tensor
    scale, GPTQ's g_idx: one entry per input, kept to check its groups)."""
    sizes = tensor_bytes(model_dir)
    experts = [k for k in sizes if ".experts." in k or ".shared_expert." in k]
    assert experts
    ranks = []
    for rank in (0, 1):
        spy, model = rank_reads(monkeypatch, model_dir, rank)
        for key in experts:
            assert key not in spy.whole, key
            if key.endswith("down_proj_bias"):  # added once over the ranks, by rank 0
                assert spy.bytes[key] == (sizes[key] if rank == 0 else 0), key
            elif key.endswith(shared):
                assert spy.bytes[key] == sizes[key], key
            else:
                assert spy.bytes[key] == sizes[key] // 2, key
        ranks.append(model)
    return ranks


def assert_ranks_hold_halves_of_the_whole(model_dir, ranks) -> None:
    whole, _ = load_model(model_dir, torch.float32, "cpu")
    for i, layer in enumerate(whole.layers):
        if not isinstance(layer.mlp, MoEBlock):
            continue
        w13, w2, L = layer.mlp.w13, layer.mlp.w2, layer.mlp.w2.shape[-1] // 2
        I = w13.shape[1] // 2
        for r, model in enumerate(ranks):
            part = slice(r * L, (r + 1) * L)
            block = model.layers[i].mlp
            assert torch.equal(block.w13[:, :L], w13[:, part])
            assert torch.equal(block.w13[:, L:], w13[:, I + part.start:I + part.stop])
            assert torch.equal(block.w2, w2[..., part])


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "gpt_oss"])
def test_each_rank_reads_only_its_slice_of_float_experts(tmp_path, monkeypatch, arch):
    """Per-expert tensors (Mixtral, Qwen2-MoE with its shared expert) and
    stacked ones (gpt-oss: gate/up interleaved, biases)."""
    model_dir = build_tiny_model(tmp_path, arch)
    ranks = assert_each_rank_reads_half_of_each_expert(monkeypatch, model_dir)
    assert_ranks_hold_halves_of_the_whole(model_dir, ranks)


def test_each_rank_reads_only_its_slice_of_mxfp4_experts(tmp_path, monkeypatch):
    """gpt-oss's MXFP4 blocks and scales: a rank's rows of gate/up, its
    blocks of 32 inputs of down; dequantized, the float checkpoint's halves."""
    float_dir, mxfp4_dir = write_mxfp4_pair(tmp_path, build_tiny_model(tmp_path / "base", "gpt_oss"))
    ranks = assert_each_rank_reads_half_of_each_expert(monkeypatch, mxfp4_dir)
    assert any(k.endswith("_blocks") for k in tensor_bytes(mxfp4_dir))
    assert_ranks_hold_halves_of_the_whole(float_dir, ranks)


@slow_test
@pytest.mark.skipif(not blocks.available(), reason="8da4w's kernels need AVX2 (int4wo's per-group rows do not split evenly)")
def test_two_ranks_with_8da4w_experts_generate_what_one_does(tmp_path, default_model_dir):
    """Qwen3-MoE with its experts (and dense layers) in 8da4w on two gloo
    ranks: a rank's columns of down fall on whole blocks of 32, so its
    blocks are the single rank's; the same tokens, logprobs to float32's
    summation order."""
    model_dir = build_tiny_model(tmp_path, "qwen3_moe", tokenizer_dir=default_model_dir, moe_intermediate_size=64,
                                 decoder_sparse_step=2)
    one, two = _one_and_two_ranks(model_dir, torchao_config="8da4w")
    assert_same_generation(one, two, atol=1e-3)


@slow_test
def test_two_ranks_with_a_gptq_moe_in_auto_generate_what_one_does(tmp_path, default_model_dir):
    """A GPTQ-int4 Qwen3-MoE under auto (the 4-bit mode from the
    checkpoint's codes): each rank builds its experts from its rows of
    gate/up and its whole groups of down's inputs; the same tokens as one rank."""
    from tests.test_quantized_checkpoints import quantized_pair

    from pyserve.model.quant import resolve_quant

    quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, "gptq-int4-sym", "qwen3_moe",
                                          moe_intermediate_size=64, decoder_sparse_step=2)
    quant = resolve_quant("auto", quant_dir, torch.device("cpu"))
    whole = load_model(dense_dir, torch.float32, "cpu")[0].layers[1].mlp
    for rank in (0, 1):
        block = load_model(quant_dir, torch.float32, "cpu", quant, tp=TensorParallel(rank, 2))[0].layers[1].mlp
        part = slice(rank * 32, rank * 32 + 32)
        for e in range(len(block.w2)):  # the checkpoint's weights, exactly: its own codes
            gate_up = torch.cat([whole.w13[e, part], whole.w13[e, 64 + part.start:64 + part.stop]])
            assert torch.allclose(block.w13[e].dense_weight(), gate_up, rtol=0, atol=1e-6)
            assert torch.allclose(block.w2[e].dense_weight(), whole.w2[e][:, part], rtol=0, atol=1e-6)
    one, two = _one_and_two_ranks(quant_dir)
    assert_same_generation(one, two, atol=1e-3)


def _compressed_w4a16_tensors(w):
    """compressed-tensors' pack-quantized layout, asymmetric groups of 32:
    codes packed along the inputs, zero points along the outputs."""
    codes, zeros, scales = round_to_nearest(w, 4, 32, symmetric=False)
    return {"weight_packed": pack_columns(codes, 4), "weight_scale": scales.half(),
            "weight_zero_point": pack_rows(zeros, 4), "weight_shape": torch.tensor(w.shape)}


def _compressed_w4a16_dequantized(t):
    codes, zeros = unpack_words(t["weight_packed"], 4, 1), unpack_words(t["weight_zero_point"], 4, 0)
    return (codes - zeros.repeat_interleave(32, 1)).float() * t["weight_scale"].float().repeat_interleave(32, 1)


IN_GROUPS_OF_32 = {  # quantized_pair's formats have groups of 64 where they have groups
    "awq-int4-g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
                     lambda w: awq_tensors(w, 32), lambda t: awq_dequantized(t, 32)),
    "compressed-w4a16-g32": (
        {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}}},
        _compressed_w4a16_tensors, _compressed_w4a16_dequantized),
}


def moe_in_groups_of_32(tmp_path, default_model_dir, fmt: str):
    """(A quantized Qwen3-MoE in groups of 32, so that a rank's half of
    down's 64 inputs is whole groups; its dequantized float copy)."""
    float_dir = build_tiny_model(tmp_path / "float", "qwen3_moe", tokenizer_dir=default_model_dir,
                                 moe_intermediate_size=64, decoder_sparse_step=2)
    reference = write_quantized(float_dir, tmp_path / fmt, *IN_GROUPS_OF_32[fmt])
    return tmp_path / fmt, dense_copy(float_dir, tmp_path / f"{fmt}-dense", reference)


# slow: AWQ's, compressed-tensors' and both FP8 layouts' experts (a part of
# each kind of dense layer is checked by default: test_quantized_tp_reads'
# part-read test and test_a_part_of_an_fp8_weight_is_the_whole_cut below).
@pytest.mark.parametrize("fmt, shared", [
    ("gptq-int4-sym", ("g_idx",)),
    pytest.param("awq-int4-g32", (), marks=slow),
    pytest.param("compressed-w4a16-g32", ("weight_shape",), marks=slow),
    pytest.param("fp8-block", (), marks=slow),
    pytest.param("fp8-tensor", ("weight_scale", "input_scale"), marks=slow),
])
def test_each_rank_reads_only_its_slice_of_quantized_experts(tmp_path, monkeypatch, default_model_dir, fmt, shared):
    """A quantized Qwen3-MoE's experts in their packed layouts: gate/up's
    output columns of qweight and scales, and the packed words of qzeros
    holding them; down's packed input rows and its groups' zeros and
    scales; FP8 values with the block rows or columns of scales covering
    them. Dequantized, the ranks hold the single rank's experts cut in two,
    and two gloo ranks generate what one does."""
    from tests.test_quantized_checkpoints import quantized_pair

    if fmt in IN_GROUPS_OF_32:
        quant_dir, dense_dir = moe_in_groups_of_32(tmp_path, default_model_dir, fmt)
    else:
        quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, fmt, "qwen3_moe", moe_intermediate_size=64,
                                      decoder_sparse_step=2)
    ranks = assert_each_rank_reads_half_of_each_expert(monkeypatch, quant_dir, shared)
    assert_ranks_hold_halves_of_the_whole(dense_dir, ranks)
    one, two = _one_and_two_ranks(quant_dir, torchao_config="none")
    assert_same_generation(one, two)


def test_act_order_experts_read_their_codes_by_part(tmp_path, monkeypatch, default_model_dir):
    """GPTQ act-order: down's groups are spread over every rank's inputs,
    so its scales and zeros (one row a group) are read whole, its codes
    by part; gate/up's rows by part. What each rank holds is the single
    rank's experts cut in two."""
    from tests.test_quantized_checkpoints import quantized_pair

    quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, "gptq-int4-act-order", "qwen3_moe",
                                  moe_intermediate_size=64, decoder_sparse_step=2)
    sizes = tensor_bytes(quant_dir)
    ranks = []
    for rank in (0, 1):
        spy, model = rank_reads(monkeypatch, quant_dir, rank)
        down = [k for k in sizes if ".experts." in k and ".down_proj." in k]
        gate = [k for k in sizes if ".experts." in k and ".gate_proj." in k and k.endswith(("qweight", "scales"))]
        assert down and gate
        assert all(spy.bytes[k] == sizes[k] // (2 if k.endswith("qweight") else 1) for k in down)
        assert all(spy.bytes[k] == sizes[k] // 2 for k in gate)
        ranks.append(model)
    assert_ranks_hold_halves_of_the_whole(dense_dir, ranks)


@pytest.mark.parametrize("scale_shape", [(), (64, 1), (64,)])
def test_a_part_of_an_fp8_weight_is_the_whole_cut(tmp_path, scale_shape):
    """FP8 scales per tensor (read whole) or per row (cut with the rows,
    whole for a part of the inputs): a part read is the dequantized whole's part."""
    from safetensors.torch import save_file

    from pyserve.model.quantized.modules import QuantizedModules
    from pyserve.model.quantized.scheme import detect

    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    scale = (torch.rand(scale_shape, generator=torch.Generator().manual_seed(1)) + 0.5) / 100
    values = (w / (scale if scale.dim() != 1 else scale[:, None])).to(torch.float8_e4m3fn)
    save_file({"m.weight": values, "m.weight_scale": scale}, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        modules = QuantizedModules(detect({"quantization_config": {"quant_method": "fp8"}}), [f])
        whole = modules.weight("m").dense()
        for dim, part in ((0, range(32, 64)), (1, range(0, 48))):
            weight, sliced = modules.weight_part("m", dim, part)
            assert sliced
            assert torch.equal(weight.dense(), whole.narrow(dim, part.start, len(part)))
