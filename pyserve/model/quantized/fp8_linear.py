"""An FP8 checkpoint layer (`quant_method: fp8`, compressed-tensors
float-quantized) on the GPU.

Where the GPU multiplies FP8 (compute capability 8.9 and up: Ada, Hopper)
and the weight has one scale per tensor or per output channel, the layer
keeps its float8 weight and runs `torch._scaled_mm` with row-wise scales:
the activations are quantized per token at each call (dynamic scaling, as
vLLM's FP8 does: each row's amax maps to float8_e4m3fn's 448), the weight
scale is one float per output, and the kernel applies both in its epilogue.

Block-wise scales (DeepSeek's and Qwen's `weight_block_size`), which
`_scaled_mm`'s row-wise recipe cannot take, run through a block-scaled
Triton GEMM on the same GPUs (triton_fp8_block.py: the FP8 weight and its
block scales kept, activations in the model's dtype). Elsewhere the weight
is dequantized at load to the model's dtype and multiplied densely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model.quantized.weights import FloatWeight

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BACKENDS = ("scaled_mm", "triton_block", "dense")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scales [M, 1]) with x ~ q * scale,
    each row's largest magnitude at FP8_MAX (a zero row gets a tiny scale, not a NaN)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def has_fp8_gemm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def output_scales(weight: FloatWeight) -> torch.Tensor | None:
    """The weight's scale as float32 [1, out], or None when it is per block."""
    if weight.block is not None:
        return None
    out = weight.values.shape[0]
    scale = weight.scale.float().reshape(-1)
    if scale.numel() not in (1, out):
        return None
    return scale.expand(out).reshape(1, out).contiguous()


def _block_fits(weight: FloatWeight) -> bool:
    from pyserve.model.quantized.triton_fp8_block import block_k

    return weight.block is not None and block_k(weight.block, weight.values.shape[1]) is not None


def choose_backend(weight: FloatWeight, device: torch.device) -> str:
    if not has_fp8_gemm(device):
        return "dense"
    out, cols = weight.values.shape
    if output_scales(weight) is not None and out % 16 == 0 and cols % 16 == 0:
        return "scaled_mm"
    return "triton_block" if _block_fits(weight) else "dense"


class Fp8Linear(nn.Module):
    """y = x @ W^T + bias, W an FP8 checkpoint's weight."""

    def __init__(self, weight: FloatWeight, dtype: torch.dtype, device: torch.device | str, backend: str = "auto",
                 bias: torch.Tensor | None = None):
        super().__init__()
        device = torch.device(device)
        backend = choose_backend(weight, device) if backend == "auto" else backend
        if backend not in BACKENDS:
            raise ValueError(f"fp8 backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        self.backend, self.dtype = backend, dtype
        self.out_features = weight.values.shape[0]
        self.register_buffer("bias", None if bias is None else bias.to(dtype).to(device))
        if backend == "scaled_mm":
            scales = output_scales(weight)
            if scales is None:
                raise ValueError("torch._scaled_mm takes per-tensor or per-channel weight scales, not blocks")
            self.register_buffer("values", weight.values.to(device))
            self.register_buffer("scales", scales.to(device))
        elif backend == "triton_block":
            if not _block_fits(weight):
                raise ValueError("the block-scaled FP8 kernel takes block-wise scales whose width and K share "
                                 "a multiple of 16")
            self.block = weight.block
            self.register_buffer("values", weight.values.to(device))
            self.register_buffer("scales", weight.scale.float().to(device))
        else:
            self.register_buffer("weight", weight.dense().to(dtype).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "dense":
            return F.linear(x.to(self.dtype), self.weight, self.bias).to(x.dtype)
        rows = x.reshape(-1, x.shape[-1])
        if self.backend == "triton_block":
            from pyserve.model.quantized.triton_fp8_block import fp8_block_matmul

            y = fp8_block_matmul(rows.to(self.dtype), self.values, self.scales, self.block)
        else:
            q, scale = quantize_per_token(rows)
            # Row-wise scaling produces bfloat16.
            y = torch._scaled_mm(q, self.values.t(), scale_a=scale, scale_b=self.scales, out_dtype=torch.bfloat16)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)
