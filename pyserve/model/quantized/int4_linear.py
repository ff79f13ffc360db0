"""An int4 group-wise checkpoint layer (GPTQ, AWQ, compressed-tensors
W4A16) that keeps its 4-bit codes on the GPU and multiplies through one of
two kernels (docs/quantized-checkpoints.md says why each is used where):

- "aten": torch's own tinygemm kernel, `_weight_int4pack_mm` (CUDA; its
  `_for_cpu` twin on CPU), after `_convert_weight_to_int4pack`. It computes
  w = (q - 8) * s + zero with a float zero, which holds both symmetric and
  asymmetric checkpoints exactly as zero = (8 - z) * s. It takes bfloat16
  activations, groups of 32..256 and N a multiple of 8.
- "triton": triton_w4a16.py, for what tinygemm does not cover (float16 or
  float32 activations, groups of 16, odd N).

Act-order checkpoints (GPTQ `desc_act`, a `g_idx` that is not k // group)
are reordered once at load: the inputs are sorted by group, so that each
group is a contiguous run, and the activations are gathered in that order
at each call (x[:, perm] @ W[:, perm]^T = x @ W^T).
"""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.quantized.weights import IntWeight

BACKENDS = ("aten", "triton")
_ATEN_GROUPS = (32, 64, 128, 256)


def contiguous_groups(weight: IntWeight) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weight's codes with each group a contiguous run of inputs, and
    the input order that makes it so (None: already in order); None where
    the groups of a g_idx are not all `group_size` inputs."""
    if weight.contiguous_groups():
        return weight.codes, None
    g_idx = weight.g_idx.long()
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(g_idx.numel()) // weight.group_size):
        return None
    return weight.codes[:, perm], perm


def aten_covers(weight: IntWeight, dtype: torch.dtype) -> bool:
    """Whether tinygemm holds this layer: bfloat16 activations, its group sizes and shapes."""
    out, cols = weight.codes.shape
    return (weight.bits == 4 and dtype == torch.bfloat16 and weight.group_size in _ATEN_GROUPS
            and cols % weight.group_size == 0 and cols % 64 == 0 and out % 8 == 0)


def triton_covers(weight: IntWeight) -> bool:
    from pyserve.model.quantized.triton_w4a16 import block_k

    return weight.bits == 4 and block_k(weight.group_size, weight.codes.shape[1]) is not None


def choose_backend(weight: IntWeight, dtype: torch.dtype) -> str | None:
    """The library kernel where it covers the layer, else Triton; None:
    neither, or act-order groups no reordering makes contiguous (serve it dense)."""
    if weight.bits != 4 or contiguous_groups(weight) is None:
        return None
    if aten_covers(weight, dtype):
        return "aten"
    return "triton" if triton_covers(weight) else None


def _inner_k_tiles(cols: int) -> int:
    return next(t for t in (8, 4, 2) if cols % (t * 32) == 0)


class W4A16Linear(nn.Module):
    """y = x @ W^T + bias, W held as int4 codes with per-group scales and zero points."""

    def __init__(self, weight: IntWeight, dtype: torch.dtype, device: torch.device | str, backend: str = "auto",
                 bias: torch.Tensor | None = None):
        super().__init__()
        device = torch.device(device)
        backend = choose_backend(weight, dtype) if backend == "auto" else backend
        if backend not in BACKENDS:
            raise ValueError(f"int4 backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        if not (aten_covers(weight, dtype) if backend == "aten" else triton_covers(weight)):
            raise ValueError(f"the {backend} int4 kernel does not cover this layer "
                             f"({tuple(weight.codes.shape)}, {weight.bits} bits, group {weight.group_size}, {dtype})")
        self.backend, self.group_size, self.dtype = backend, weight.group_size, dtype
        self.out_features, self.in_features = weight.codes.shape
        grouped = contiguous_groups(weight)
        if grouped is None:
            raise ValueError("act-order g_idx whose groups are not all group_size inputs")
        codes, perm = grouped
        self.register_buffer("bias", None if bias is None else bias.to(dtype).to(device))
        self.register_buffer("perm", None if perm is None else perm.to(device))
        scales, zeros = weight.scales.float(), weight.zeros.float()
        if backend == "aten":
            self.register_buffer("packed", _aten_pack(codes, device))
            # tinygemm's layout: [groups, out, (scale, zero)], zero = (8 - z) * s.
            self.register_buffer("scales_and_zeros", torch.stack([scales, (8 - zeros) * scales], dim=-1)
                                 .transpose(0, 1).contiguous().to(torch.bfloat16).to(device))
        else:
            from pyserve.model.quantized.triton_w4a16 import SYMMETRIC_ZERO, pack

            self.register_buffer("qweight", pack(codes).to(device))
            self.register_buffer("scales", scales.T.contiguous().to(dtype).to(device))
            symmetric = bool((weight.zeros == SYMMETRIC_ZERO).all())
            self.register_buffer("zeros", None if symmetric else zeros.T.contiguous().to(dtype).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        if self.backend == "aten":
            mm = (torch.ops.aten._weight_int4pack_mm if rows.is_cuda
                  else torch.ops.aten._weight_int4pack_mm_for_cpu)
            y = mm(rows.to(torch.bfloat16).contiguous(), self.packed, self.group_size, self.scales_and_zeros)
        else:
            from pyserve.model.quantized.triton_w4a16 import w4a16_matmul

            y = w4a16_matmul(rows.to(self.dtype), self.qweight, self.scales, self.zeros, self.group_size)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)


def _aten_pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """tinygemm's packed weight: on CUDA from uint8 [out, in / 2] (even
    inputs in the high nibbles, as the op reads them), on CPU from int32 codes."""
    codes = codes.to(torch.int32)
    if device.type == "cuda":
        pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).to(device)
        return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), _inner_k_tiles(codes.shape[1]))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
