"""RMS norms: Llama's, the variants other families round or offset
differently, and the one over every attention head (Olmo 2's q/k norm),
which under tensor parallelism sums its statistics over the ranks.

Each follows its Hugging Face original's rounding so float16/bfloat16
models match too: Llama casts the normalized activations back before the
weight multiplies them; Olmo 2 and Gemma multiply in float32 and then
cast; Gemma's weight is stored as an offset from one, (1 + w).
"""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.config import NORM_STYLES, ModelConfig
from pyserve.model.parallel import TensorParallel


def fused_ops():
    # Imported on first use: Triton is a Linux-only dependency, unused on CPU.
    from pyserve.model import fused_ops

    return fused_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused_kernels: bool = True, *, scale_in_float32: bool = False,
                 unit_offset: bool = False):
        """`fused_kernels`: on CUDA, fused_ops.py's kernels (else the torch
        code; the kernels round as Llama does, so the variants keep the
        torch code). `scale_in_float32`: the weight multiplies before the
        cast back (Olmo 2, Gemma). `unit_offset`: the scale is 1 + weight (Gemma)."""
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32 or unit_offset
        self.unit_offset = unit_offset
        self.fused_kernels = fused_kernels and not self.scale_in_float32

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); given the residual stream, (norm(x + residual), x + residual)."""
        fused = self.fused_kernels and x.is_cuda
        if residual is None:
            return fused_ops().rms_norm(x, self.weight, self.eps) if fused else self._norm(x)
        if fused:
            return fused_ops().add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if not self.scale_in_float32:
            return self.weight * x.to(dtype)
        weight = self.weight.float()
        return (x * (1.0 + weight) if self.unit_offset else weight * x).to(dtype)


class AllHeadsRMSNorm(nn.Module):
    """RMSNorm over the concatenation of every head's q (or k) of a token,
    as Olmo 2 normalizes them. Each rank holds its heads' slice of the
    weight; the mean square spans all heads, so under tensor parallelism
    the ranks' sums of squares are all-reduced (a [tokens, 1] tensor per
    norm). `width`: all heads' width; `replicas`: how many ranks hold each
    of these heads (KV heads replicated over ranks are counted once)."""

    def __init__(self, shard_width: int, width: int, eps: float, tp: TensorParallel, replicas: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shard_width))
        self.eps = eps
        self.width = width
        self.tp = tp
        self.replicas = replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] of this rank's heads."""
        shape, dtype = x.shape, x.dtype
        x = x.reshape(shape[0], -1).float()
        if self.tp.size == 1:
            mean_square = x.pow(2).mean(-1, keepdim=True)
        else:
            sums = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True))
            mean_square = sums / (self.width * self.replicas)
        x = x * torch.rsqrt(mean_square + self.eps)
        return (self.weight * x).to(dtype).view(shape)


def rms_norm(config: ModelConfig, dim: int, fused_kernels: bool = True) -> RMSNorm:
    """An RMSNorm of `dim` in the config's norm style (config.NORM_STYLES)."""
    style = config.norm_style
    if style not in NORM_STYLES:
        raise ValueError(f"norm style {style!r}: expected one of {NORM_STYLES}")
    return RMSNorm(dim, config.rms_norm_eps, fused_kernels, scale_in_float32=style == "float32",
                   unit_offset=style == "gemma")
