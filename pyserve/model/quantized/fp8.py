"""FP8 checkpoints (`quant_method: fp8`): float8_e4m3fn `weight` [out, in]
with either one `weight_scale` (per tensor) or, with `weight_block_size`
[b0, b1] (DeepSeek's and Qwen's block-wise FP8), `weight_scale_inv`
[ceil(out / b0), ceil(in / b1)], both multiplied in. `input_scale` (static
activation scales) is not needed: activations stay in float."""

from __future__ import annotations

import torch

from pyserve.model.quantized.weights import FloatWeight

MARKERS = ("weight_scale_inv", "weight_scale")
SUFFIXES = ("weight", "weight_scale_inv", "weight_scale", "input_scale")


def read(tensors: dict[str, torch.Tensor], block: tuple[int, int] | None) -> FloatWeight:
    if block is not None:
        return FloatWeight(tensors["weight"], tensors["weight_scale_inv"], block)
    return FloatWeight(tensors["weight"], tensors["weight_scale"])
