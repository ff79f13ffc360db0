"""Which GPU layer serves a checkpoint's quantized linear weight: int4
groups through W4A16Linear (tinygemm or the Triton kernel), FP8 through
Fp8Linear (`torch._scaled_mm` or dequantized); None where neither holds
the weight (8-bit integer codes, int4 groups no kernel covers, act-order
groups of unequal sizes), which is then served dense in the model's dtype."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.quantized.fp8_linear import Fp8Linear
from pyserve.model.quantized.int4_linear import W4A16Linear, choose_backend
from pyserve.model.quantized.weights import FloatWeight, QuantizedWeight


def cuda_linear(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device | str,
                bias: torch.Tensor | None = None) -> nn.Module | None:
    if isinstance(weight, FloatWeight):
        return Fp8Linear(weight, dtype, device, bias=bias)
    if choose_backend(weight, dtype) is None:
        return None
    return W4A16Linear(weight, dtype, device, bias=bias)
