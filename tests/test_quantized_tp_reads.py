"""Under --tp-size 2 each rank reads from the safetensors files only its
slice of every dense quantized layer (rows of q/k/v and gate/up, inputs
of o_proj and down_proj) in the checkpoint's packed layout, as it does for
MoE experts (tests/test_moe_tp_reads.py, whose spy on the loader's file
handles counts the bytes each read returns). Where the layout cannot cut
a rank's part (inputs not on whole groups) the layer is read whole, with
one log line; act-order GPTQ inputs, whose groups spread over every
rank's inputs, are read by part but for their small zeros and scales,
read whole. What each rank holds is the single rank's layers cut in
two, and two gloo ranks generate what one does."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from pyserve.model.loader import load_model
from pyserve.model.parallel import ModelShard, TensorParallel
from tests.test_moe_tp_reads import IN_GROUPS_OF_32, rank_reads, tensor_bytes
from tests.test_quantized_checkpoints import FORMATS, quantized_pair
from tests import test_quantized_formats
from tests.test_quantized_formats import (
    dense_copy, fp8_block_dequantized, fp8_block_tensors, write_quantized,
)
from tests.slow import slow, slow_test
from tests.test_tensor_parallel import _one_and_two_ranks, assert_same_generation
from tests.tiny_models import build_tiny_model

_DENSE = re.compile(r"layers\.\d+\.(self_attn|mlp)\.(\w+_proj)\.(\w+)$")
_WHOLE_LOG = "whole on every rank"


def _fp8_row_tensors(w):
    scale = (w.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-8)
    return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale}


_FP8_BLOCK_128 = dict(hidden_size=256, intermediate_size=512, head_dim=64)
_FORMATS = {
    **FORMATS,
    "fp8-row": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, _fp8_row_tensors,
                lambda t: t["weight"].float() * t["weight_scale"]),
    "fp8-block-128": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                      lambda w: fp8_block_tensors(w, (128, 128)), lambda t: fp8_block_dequantized(t, (128, 128))),
    **IN_GROUPS_OF_32,
}


def quantized_dir(tmp_path, default_model_dir, fmt: str, arch: str = "llama", **overrides):
    """(A quantized tiny model in `fmt`, its dequantized float copy)."""
    if fmt == "fp8-block-128":
        overrides = {**_FP8_BLOCK_128, **overrides}
    if fmt in FORMATS:
        return quantized_pair(tmp_path, default_model_dir, fmt, arch, **overrides)
    float_dir = build_tiny_model(tmp_path / "float", arch, tokenizer_dir=default_model_dir, **overrides)
    reference = write_quantized(float_dir, tmp_path / fmt, *_FORMATS[fmt])
    return tmp_path / fmt, dense_copy(float_dir, tmp_path / f"{fmt}-dense", reference)


def assert_reads(monkeypatch, caplog, model_dir, whole=(), shared=()) -> list[torch.nn.Module]:
    """Each rank reads half the bytes of every dense quantized tensor, but
    those of the projections `whole` (read whole, logged) and the tensors
    whose names end in `shared` (read whole by every rank: g_idx, a scale
    shared by a part's rows); its models."""
    sizes = tensor_bytes(model_dir)
    dense = {k: m for k in sizes if (m := _DENSE.search(k)) and m.group(3) != "bias"}
    assert any(m.group(3) != "weight" for m in dense.values())
    ranks = []
    for rank in (0, 1):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pyserve.model.quantized.modules"):
            spy, model = rank_reads(monkeypatch, model_dir, rank)
        for key, m in dense.items():
            if m.group(2) in whole:
                assert key in spy.whole, key
            elif key.endswith(shared):
                assert spy.bytes[key] == sizes[key], key
            else:
                assert key not in spy.whole and spy.bytes[key] == sizes[key] // 2, (key, spy.bytes[key], sizes[key])
        logged = [r.getMessage() for r in caplog.records if _WHOLE_LOG in r.getMessage()]
        assert len(logged) == (1 if whole else 0), logged
        ranks.append(model)
    return ranks


def assert_ranks_hold_the_whole_cut_in_two(model_dir, ranks) -> None:
    """The ranks' dequantized layers against the single rank's: rows of q,
    k, v (a KV head on several ranks alike), gate and up; inputs of o_proj
    and down_proj."""
    whole, config = load_model(model_dir, torch.float32, "cpu")
    hd, q_rows = config.head_dim, config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * hd
    for rank, model in enumerate(ranks):
        shard = ModelShard.of(config, TensorParallel(rank, 2))
        q = slice(shard.q_heads.start * hd, shard.q_heads.stop * hd)
        kv = slice(shard.kv_heads.start * hd, shard.kv_heads.stop * hd)
        inter = slice(shard.intermediate.start, shard.intermediate.stop)
        I = config.intermediate_size
        for mine, full in zip(model.layers, whole.layers):
            qkv = full.self_attn.qkv_proj.weight
            k, v = q_rows + kv.start, q_rows + kv_rows + kv.start
            width = kv.stop - kv.start
            assert torch.equal(mine.self_attn.qkv_proj.weight, torch.cat([qkv[q], qkv[k:k + width], qkv[v:v + width]]))
            assert torch.equal(mine.self_attn.o_proj.weight, full.self_attn.o_proj.weight[:, q])
            gate_up = full.mlp.gate_up_proj.weight
            assert torch.equal(mine.mlp.gate_up_proj.weight,
                               torch.cat([gate_up[inter], gate_up[I + inter.start:I + inter.stop]]))
            assert torch.equal(mine.mlp.down_proj.weight, full.mlp.down_proj.weight[:, inter])


_SIX_HEADS = {"num_attention_heads": 6, "hidden_size": 96}


@pytest.mark.parametrize("fmt, overrides, whole, shared", [
    ("gptq-int4-sym", {}, (), ("g_idx",)),
    # act-order: o_proj's and down_proj's inputs name groups spread over all of them: their codes cut,
    # their zeros and scales (one row a group) read whole
    ("gptq-int4-act-order", {}, (), ("g_idx",) + tuple(f"{proj}.{t}" for proj in ("o_proj", "down_proj")
                                                       for t in ("qzeros", "scales"))),
    # groups of 64: down_proj's 64 inputs a rank are one group, o_proj's 32 lie in its only group
    ("awq-int4-g64", {}, (), ("o_proj.qzeros", "o_proj.scales")),
    # 6 heads: o_proj's 48 inputs a rank do not end on its groups of 32
    ("awq-int4-g32", _SIX_HEADS, ("o_proj",), ()),
    # one scale per row: cut with the rows, whole for a part of the inputs
    ("fp8-row", {}, (), ("o_proj.weight_scale", "down_proj.weight_scale")),
    # blocks of 128: k/v's 64 rows a rank lie in their one block row of scales
    ("fp8-block-128", {}, (), ("k_proj.weight_scale_inv", "v_proj.weight_scale_inv")),
    ("compressed-w4a16-g32", {}, (), ("weight_shape",)),
])
def test_each_rank_reads_only_its_slice_of_dense_quantized_layers(tmp_path, monkeypatch, caplog, default_model_dir,
                                                                  fmt, overrides, whole, shared):
    quant_dir, _ = quantized_dir(tmp_path, default_model_dir, fmt, **overrides)
    ranks = assert_reads(monkeypatch, caplog, quant_dir, whole, shared)
    assert_ranks_hold_the_whole_cut_in_two(quant_dir, ranks)


# What the ranks hold is the whole cut in two (above), so generation adds
# the layers' use of their parts: act-order's part of the inputs in the
# default suite; the other formats, and a layer read whole (six heads), slow.
@pytest.mark.parametrize("fmt, overrides", [
    pytest.param("gptq-int4-sym", {}, marks=slow),
    ("gptq-int4-act-order", {}),
    pytest.param("awq-int4-g64", {}, marks=slow),
    pytest.param("awq-int4-g32", _SIX_HEADS, marks=slow),
    pytest.param("fp8-row", {}, marks=slow),
    pytest.param("fp8-block-128", {}, marks=slow),
    pytest.param("compressed-w4a16-g32", {}, marks=slow),
])
def test_two_ranks_generate_what_one_does_from_the_parts_they_read(tmp_path, default_model_dir, fmt, overrides):
    quant_dir, _ = quantized_dir(tmp_path, default_model_dir, fmt, **overrides)
    assert_same_generation(*_one_and_two_ranks(quant_dir, torchao_config="none"))


@pytest.mark.parametrize("arch, overrides", [
    pytest.param("phi3", {}, id="phi3-fused-qkv-gate-up"),
    # slow: replicated KV heads read whole (test_tensor_parallel's unquantized case runs by default)
    pytest.param("llama", {"num_key_value_heads": 1}, id="llama-replicated-kv", marks=slow),
])
def test_fused_checkpoint_layers_and_replicated_kv_heads(tmp_path, monkeypatch, caplog, default_model_dir, arch,
                                                         overrides):
    """Phi-3's qkv_proj and gate_up_proj: each slot's rows of the one
    tensor read apart; one KV head on two ranks: both read its rows."""
    monkeypatch.setattr(test_quantized_formats, "LINEARS",
                        test_quantized_formats.LINEARS + ("qkv_proj", "gate_up_proj"))
    quant_dir, _ = quantized_dir(tmp_path, default_model_dir, "gptq-int4-sym", arch, **overrides)
    monkeypatch.undo()
    sizes = tensor_bytes(quant_dir)
    if arch == "phi3":
        assert "model.layers.0.self_attn.qkv_proj.qweight" in sizes
        ranks = assert_reads(monkeypatch, caplog, quant_dir, shared=("g_idx",))
    else:
        ranks = assert_reads(monkeypatch, caplog, quant_dir, shared=("g_idx", "k_proj.qweight", "k_proj.qzeros",
                                                                      "k_proj.scales", "v_proj.qweight",
                                                                      "v_proj.qzeros", "v_proj.scales"))
    assert_ranks_hold_the_whole_cut_in_two(quant_dir, ranks)
    assert_same_generation(*_one_and_two_ranks(quant_dir, torchao_config="none"))


def _parts_of_two_ranks(tmp_path, default_model_dir, fmt):
    """(config, [(module, whole weight, dim, part, the part read, whether it was cut)])
    for every quantized layer of a `fmt` checkpoint and each of two ranks' parts."""
    import json

    from safetensors import safe_open

    from pyserve.model.families import family_of, read_config
    from pyserve.model.loader import _dense_split
    from pyserve.model.quantized.modules import QuantizedModules
    from pyserve.model.quantized.scheme import detect

    quant_dir, _ = quantized_dir(tmp_path, default_model_dir, fmt)
    config = read_config(quant_dir)
    names = family_of(config.architecture).checkpoint
    parts = []
    with safe_open(str(quant_dir / "model.safetensors"), "pt") as f:
        modules = QuantizedModules(detect(json.loads((quant_dir / "config.json").read_text())), [f])
        for module in modules.tensors:
            whole = modules.weight(module)
            for rank in (0, 1):
                shard = ModelShard.of(config, TensorParallel(rank, 2))
                for dim, part in _dense_split(modules, module, config, shard, names):
                    parts.append((module, whole, dim, part, *modules.weight_part(module, dim, part)))
    return config, parts


@pytest.mark.parametrize("fmt", ["gptq-int4-sym", "gptq-int4-act-order", "awq-int4-g64", "fp8-row", "fp8-block-128",
                                 "compressed-w4a16-g32"])
def test_a_part_read_is_what_the_gpu_slices_from_the_whole(tmp_path, default_model_dir, fmt):
    """What a rank hands the GPU kernels (gpu_layers): each part read is
    the whole layer's `sliced` part, codes, zeros, scales and groups
    alike, or (where `sliced` cannot cut the whole: inputs within the
    layer's one group) the same dense weight."""
    from pyserve.model.quantized.gpu_layers import sliced
    from pyserve.model.quantized.weights import IntWeight

    _, parts = _parts_of_two_ranks(tmp_path, default_model_dir, fmt)
    cut = 0
    for module, whole, dim, part, weight, read in parts:
        if not read:
            continue
        cut += 1
        assert torch.equal(weight.dense(), whole.dense().narrow(dim, part.start, len(part))), module
        want = sliced(whole, dim, part)
        if isinstance(want, IntWeight):
            assert weight.group_size == want.group_size
            for field in ("codes", "zeros", "scales"):
                assert torch.equal(getattr(weight, field), getattr(want, field)), (module, field)
    assert cut


@slow_test
def test_two_ranks_in_the_4bit_mode_hold_the_checkpoints_codes(tmp_path, default_model_dir):
    """AWQ groups of 64 under auto (the CPU's 4-bit mode from the
    checkpoint's codes): a rank's 32 inputs of o_proj lie in its one group,
    read as a group of 32; every layer is the single rank's cut in two,
    exactly (a layer requantized from its dense weight would not be)."""
    from pyserve.model.quant import resolve_quant

    quant_dir, _ = quantized_dir(tmp_path, default_model_dir, "awq-int4-g64")
    quant = resolve_quant("auto", quant_dir, torch.device("cpu"))
    whole = load_model(quant_dir, torch.float32, "cpu", quant)[0].layers
    for rank in (0, 1):
        layers = load_model(quant_dir, torch.float32, "cpu", quant, tp=TensorParallel(rank, 2))[0].layers
        for mine, full in zip(layers, whole):
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                held = mine.get_submodule(name)
                assert hasattr(held, "dense_weight"), (name, type(held))
                cols = held.dense_weight().shape[1]
                want = full.get_submodule(name).dense_weight()[:, rank * cols:(rank + 1) * cols]
                assert torch.allclose(held.dense_weight(), want, rtol=0, atol=1e-6), name
    one, two = _one_and_two_ranks(quant_dir)
    assert [ids for ids, _, _ in two] == [ids for ids, _, _ in one]


def test_an_act_order_part_holds_its_inputs_codes_and_the_groups_they_name(tmp_path, default_model_dir):
    """GPTQ act-order, two ranks: o_proj's and down_proj's parts of the
    inputs are the whole layer's codes of those inputs, with the zeros
    and scales of the groups their g_idx names (only those: no group
    the part does not use), dequantizing to the whole's columns."""
    config, parts = _parts_of_two_ranks(tmp_path, default_model_dir, "gptq-int4-act-order")
    inputs_cut = 0
    for module, whole, dim, part, weight, read in parts:
        assert not whole.contiguous_groups(), module
        if dim != 1:
            continue
        assert read, module
        inputs_cut += 1
        cols = slice(part.start, part.stop)
        groups = whole.g_idx[cols].long()
        assert torch.equal(weight.codes, whole.codes[:, cols])
        assert weight.scales.shape[1] == len(groups.unique())
        assert torch.equal(weight.scales[:, weight.g_idx.long()], whole.scales[:, groups])
        assert torch.equal(weight.zeros[:, weight.g_idx.long()], whole.zeros[:, groups])
        assert torch.equal(weight.dense(), whole.dense()[:, cols])
    assert inputs_cut == 2 * 2 * config.num_hidden_layers  # o_proj and down_proj, each rank


@slow_test  # act-order's parts generate on two ranks by default, unquantized (above)
def test_two_act_order_ranks_in_the_4bit_mode_generate_what_one_does(tmp_path, default_model_dir):
    """Under auto (the CPU's 4-bit mode) act-order groups are requantized
    from the dequantized weight; a rank's part of the inputs read alone
    gives the same tokens as one rank."""
    quant_dir, _ = quantized_dir(tmp_path, default_model_dir, "gptq-int4-act-order")
    one, two = _one_and_two_ranks(quant_dir)
    assert [ids for ids, _, _ in two] == [ids for ids, _, _ in one]
