"""compressed-tensors checkpoints (what llm-compressor writes), by format:

- `pack-quantized` (W4A16, W8A16): `weight_packed` int32 [out, in * bits / 32]
  packed along the inputs, first code lowest, codes stored as the signed
  value plus 2^(bits-1); `weight_scale` [out, groups] (channel-wise: one
  group); `weight_zero_point` packed the same way along the outputs when
  asymmetric; `weight_g_idx` with act-order; `weight_shape`.
- `int-quantized` (W8A8): int8 `weight` with `weight_scale` [out, 1] and an
  optional `weight_zero_point`.
- `float-quantized` (FP8 W8A8, FP8-dynamic): float8 `weight` with a
  `weight_scale` per tensor, channel or block.
Activation schemes (W8A8's int8 or FP8 dynamic activations) are not
applied: the weights are served with float activations."""

from __future__ import annotations

import torch

from pyserve.model.quantized.weights import FloatWeight, IntWeight, unpack_along_columns, unpack_along_rows

MARKERS = {"pack-quantized": "weight_packed", "int-quantized": "weight_scale", "float-quantized": "weight_scale"}
SUFFIXES = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape",
            "input_scale", "input_zero_point")


def read(tensors: dict[str, torch.Tensor], fmt: str, bits: int, group_size: int | None,
         block: tuple[int, int] | None) -> IntWeight | FloatWeight:
    scales = tensors["weight_scale"]
    if fmt == "float-quantized":
        return FloatWeight(tensors["weight"], scales, block)
    offset = 1 << (bits - 1)
    if fmt == "pack-quantized":
        out, cols = (int(n) for n in tensors["weight_shape"])
        codes = unpack_along_columns(tensors["weight_packed"], bits)[:, :cols] - offset
        zero = tensors.get("weight_zero_point")
        zeros = (torch.zeros_like(scales, dtype=torch.int32) if zero is None
                 else unpack_along_rows(zero, bits)[:out] - offset)
    else:
        codes = tensors["weight"].to(torch.int32)
        zero = tensors.get("weight_zero_point")
        zeros = torch.zeros_like(scales, dtype=torch.int32) if zero is None else zero.to(torch.int32)
    if scales.dim() == 1:
        scales, zeros = scales.reshape(-1, 1), zeros.reshape(-1, 1)
    # Codes in the unsigned range, as the other formats keep them: q + offset, z + offset.
    size = group_size if group_size and group_size > 0 else codes.shape[1]
    scales = scales.expand(codes.shape[0], -1) if scales.shape[0] == 1 else scales
    zeros = zeros.expand(codes.shape[0], -1) if zeros.shape[0] == 1 else zeros
    return IntWeight(codes + offset, zeros + offset, scales, size, bits, tensors.get("weight_g_idx"))
