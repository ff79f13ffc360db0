"""Quantized checkpoints written by the tests in their tools' documented
layouts, and independent readers that dequantize them back.

References followed: AutoGPTQ's `QuantLinear.pack` (qweight [in*bits/32,
out] packed along inputs, qzeros [groups, out*bits/32] along outputs,
each zero stored minus one, g_idx for act-order); AutoAWQ's
`WQLinear_GEMM.from_linear` (qweight [in, out/8], qzeros [groups, out/8],
order_map [0, 2, 4, 6, 1, 3, 5, 7]); DeepSeek-V3's block FP8
(weight_scale_inv per [128, 128] block, here [32, 32] for tiny shapes).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _int32(values: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(values.numpy().astype(np.uint32).view(np.int32))


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> int32 [R * bits / 32, C]: code i of each word from row word * k + i."""
    k = 32 // bits
    words = torch.zeros(codes.shape[0] // k, codes.shape[1], dtype=torch.int64)
    for i in range(k):
        words |= codes[i::k].to(torch.int64) << (bits * i)
    return _int32(words)


def pack_columns(codes: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    k = 32 // bits
    order = order or tuple(range(k))
    words = torch.zeros(codes.shape[0], codes.shape[1] // k, dtype=torch.int64)
    for i in range(k):
        words |= codes[:, order[i]::k].to(torch.int64) << (bits * i)
    return _int32(words)


def unpack_words(words: torch.Tensor, bits: int, along: int, order=None) -> torch.Tensor:
    """The readers' side, through numpy's unsigned view: element by element shifts."""
    k = 32 // bits
    raw = words.numpy().view(np.uint32).astype(np.int64)
    parts = [(raw >> (bits * i)) & ((1 << bits) - 1) for i in range(k)]
    if order is not None:
        parts = [parts[order.index(c)] for c in range(k)]
    return torch.from_numpy(np.stack(parts, axis=along + 1).reshape(
        (-1, raw.shape[1]) if along == 0 else (raw.shape[0], -1)))


def round_to_nearest(w: torch.Tensor, bits: int, group: int, symmetric: bool, perm: torch.Tensor | None = None):
    """codes [out, in] (in w's column order), zeros and fp16-exact scales [out, groups]
    for groups of `group` consecutive columns of w[:, perm]."""
    out, cols = w.shape
    permuted = w if perm is None else w[:, perm]
    g = permuted.reshape(out, cols // group, group)
    maxq = 2 ** bits - 1
    if symmetric:
        scales = (g.abs().amax(-1) * 2 / maxq)
        zeros = torch.full_like(scales, (maxq + 1) / 2)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = (hi - lo) / maxq
    scales = scales.clamp(min=1e-6).half().float()
    if not symmetric:
        zeros = (-lo / scales).round().clamp(0, maxq)
    codes = (g / scales[..., None]).round().add(zeros[..., None]).clamp(0, maxq).reshape(out, cols)
    if perm is not None:
        unpermuted = torch.empty_like(codes)
        unpermuted[:, perm] = codes
        codes = unpermuted
    return codes.long(), zeros.long(), scales


def gptq_tensors(w, bits, group, symmetric, act_order, seed=0):
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed)) if act_order else None
    codes, zeros, scales = round_to_nearest(w, bits, group, symmetric, perm)
    g_idx = torch.arange(w.shape[1]) // group
    if perm is not None:
        g_idx[perm] = torch.arange(w.shape[1]) // group
    return {"qweight": pack_rows(codes.T, bits), "qzeros": pack_columns((zeros - 1).T, bits),
            "scales": scales.T.half(), "g_idx": g_idx.int()}


def gptq_dequantized(t, bits):
    codes = unpack_words(t["qweight"], bits, 0).T
    zeros = unpack_words(t["qzeros"], bits, 1).T + 1
    g = t["g_idx"].long()
    return (codes - zeros[:, g]).float() * t["scales"].T.float()[:, g]


def awq_tensors(w, group):
    codes, zeros, scales = round_to_nearest(w, 4, group, symmetric=False)
    return {"qweight": pack_columns(codes.T, 4, AWQ_ORDER), "qzeros": pack_columns(zeros.T, 4, AWQ_ORDER),
            "scales": scales.T.half()}


def awq_dequantized(t, group):
    codes = unpack_words(t["qweight"], 4, 1, AWQ_ORDER).T
    zeros = unpack_words(t["qzeros"], 4, 1, AWQ_ORDER).T.repeat_interleave(group, 1)
    return (codes - zeros).float() * t["scales"].T.float().repeat_interleave(group, 1)


def fp8_block_tensors(w, block=(32, 32)):
    out, cols = w.shape
    blocks = w.reshape(out // block[0], block[0], cols // block[1], block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-8)
    values = (blocks / scale[:, None, :, None]).reshape(out, cols).to(torch.float8_e4m3fn)
    return {"weight": values, "weight_scale_inv": scale}


def fp8_block_dequantized(t, block=(32, 32)):
    s = t["weight_scale_inv"].repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return t["weight"].float() * s


def fp8_tensor_tensors(w):
    scale = (w.abs().amax() / 448).reshape(())
    return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale, "input_scale": torch.tensor(0.02)}


def fp8_tensor_dequantized(t):
    return t["weight"].float() * t["weight_scale"]


def write_quantized(float_dir: Path, out_dir: Path, quantization_config: dict, tensors_of, dequantize,
                    skip=()) -> dict[str, torch.Tensor]:
    """Copy `float_dir` with its decoder layers' linear weights quantized by
    `tensors_of(weight)`; checks each against `dequantize` and returns the
    dequantized state dict (what transformers runs as the reference)."""
    shutil.copytree(float_dir, out_dir)
    state = load_file(float_dir / "model.safetensors")
    stored, reference = {}, {}
    for name, w in state.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and module.rpartition(".")[2] in LINEARS and not any(s in module for s in skip):
            packed = tensors_of(w)
            dense = dequantize(packed)
            # The file holds the quantized weight: close to w, not w itself.
            assert dense.shape == w.shape and not torch.equal(dense, w)
            assert (dense - w).abs().max() <= 0.2 * w.abs().max()
            stored.update({f"{module}.{k}": v for k, v in packed.items()})
            reference[name] = dense
        else:
            stored[name] = w
            reference[name] = w
    (out_dir / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in stored.items()}, out_dir / "model.safetensors")
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config))
    return reference


def dense_copy(float_dir: Path, out_dir: Path, reference: dict[str, torch.Tensor]) -> Path:
    """`float_dir` with the dequantized weights: what transformers and pyserve's float path run."""
    shutil.copytree(float_dir, out_dir)
    save_file({k: v.contiguous() for k, v in reference.items()}, out_dir / "model.safetensors")
    return out_dir


# pyserve's readers (quantized/) against the writers above and their own readers.

from pyserve.model.quantized import awq, fp8, gptq  # noqa: E402
from pyserve.model.quantized.scheme import detect  # noqa: E402

_W = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reader_matches_the_written_layout(bits, symmetric, act_order):
    t = gptq_tensors(_W, bits, 32, symmetric, act_order)
    weight = gptq.read(t, bits, 32, zero_offset=1)
    assert torch.equal(weight.dense(), gptq_dequantized(t, bits))
    assert weight.contiguous_groups() != act_order
    groups = weight.int4_groups(32)
    if bits == 4 and not act_order:
        codes, scales, zeros = groups
        assert torch.equal((codes.float() - 8).view(64, 4, 32) * scales[..., None] + zeros[..., None],
                           weight.dense().view(64, 4, 32))
    else:
        assert groups is None


def test_awq_reader_matches_the_written_layout():
    t = awq_tensors(_W, 64)
    weight = awq.read(t, 64)
    assert torch.equal(weight.dense(), awq_dequantized(t, 64))
    codes, scales, zeros = weight.int4_groups(32)  # groups of 64 as blocks of 32, exactly
    rebuilt = (codes.float() - 8).view(64, 4, 32) * scales[..., None] + zeros[..., None]
    assert torch.allclose(rebuilt.view(64, 128), weight.dense(), rtol=0, atol=1e-6)


def test_fp8_readers_match_the_written_layouts():
    t = fp8_block_tensors(_W)
    assert torch.equal(fp8.read(t, (32, 32)).dense(), fp8_block_dequantized(t))
    t = fp8_tensor_tensors(_W)
    assert torch.equal(fp8.read(t, None).dense(), fp8_tensor_dequantized(t))


def test_detection_and_refusals():
    gptq_config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}}
    assert detect(gptq_config).name == "gptq int4 group 128"
    assert detect({}) is None and detect({}, "none") is None
    with pytest.raises(ValueError, match="--quantization none"):
        detect(gptq_config, "none")
    with pytest.raises(ValueError, match="says gptq"):
        detect(gptq_config, "awq")
    with pytest.raises(ValueError, match="no quantization_config"):
        detect({}, "fp8")
    for qc, named in [({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
                      ({"quant_method": "gptq", "bits": 3}, "gptq with 3 bits"),
                      ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
                      ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                        "config_groups": {"g": {"weights": {"type": "float", "num_bits": 4}}}}, "nvfp4")]:
        with pytest.raises(ValueError, match=named):
            detect({"quantization_config": qc})
