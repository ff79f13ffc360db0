"""MXFP4 weights, as gpt-oss checkpoints ship their experts
(`quantization_config.quant_method` "mxfp4"), dequantized at load.

MXFP4 is the OCP Microscaling format with FP4 elements: a tensor's last
dimension is cut into blocks of 32 elements that share one power-of-two
scale. A checkpoint stores a tensor `<name>` [..., rows, cols] as two:
  `<name>_blocks` uint8 [..., rows, cols / 32, 16]: each block's 32 e2m1
      codes, two to a byte, the element of even index in the low nibble;
  `<name>_scales` uint8 [..., rows, cols / 32]: each block's e8m0 scale,
      the exponent plus 127 (the block's elements are code * 2**(scale - 127)).
An e2m1 code is a sign bit, two exponent bits and one mantissa bit: 0, 0.5,
1, 1.5, 2, 3, 4, 6 and their negatives. gpt-oss's experts are stored in
nn.Linear's orientation, [experts, out, in], blocks along the inputs.
"""

from __future__ import annotations

import torch

BLOCK = 32  # elements per scale
_BIAS = 127  # e8m0's exponent bias
PARTS = ("blocks", "scales")
# The value of each e2m1 code, 0-15 (bit 3 is the sign).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _E2M1 + tuple(-v for v in _E2M1)


def packed_part(name: str) -> tuple[str, str] | None:
    """(the dense tensor's name, "blocks" or "scales") for one half of an
    MXFP4 pair; None for any other name."""
    for part in PARTS:
        if name.endswith("_" + part):
            return name.removesuffix("_" + part), part
    return None


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense tensor [..., rows, cols] of a `_blocks` / `_scales` pair, in
    `dtype`: exact in float32 and bfloat16, whose 8-bit exponents hold every
    scale a real checkpoint has, and each element's 2 significant bits."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks of shape {tuple(blocks.shape)} do not match scales of shape "
                         f"{tuple(scales.shape)} (blocks [..., groups, {BLOCK // 2}], scales [..., groups])")
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    byte = torch.arange(256, device=blocks.device)
    pairs = torch.stack([values[byte & 0x0F], values[byte >> 4]], dim=-1)  # each byte's two elements, in order
    dense = pairs[blocks.long()].flatten(-2) * torch.exp2(scales.float() - _BIAS)[..., None]  # [..., groups, 32]
    return dense.flatten(-2).to(dtype)


class PairedHalves:
    """Collects the two halves of each MXFP4 pair, which a checkpoint may
    store in any order and in different shards."""

    def __init__(self):
        self._waiting: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """Keeps one half (`name` is `<dense name>_blocks` or `_scales`); once
        both are in, returns (dense name, blocks, scales) and forgets them."""
        dense, part = packed_part(name)
        halves = self._waiting.setdefault(dense, {})
        if part in halves:
            raise ValueError(f"repeated tensor {name}")
        halves[part] = tensor
        if len(halves) < len(PARTS):
            return None
        del self._waiting[dense]
        return dense, halves["blocks"], halves["scales"]
