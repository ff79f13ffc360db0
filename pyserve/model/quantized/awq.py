"""AWQ checkpoints (AutoAWQ's GEMM version, `quant_method: awq`):
`qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], eight
4-bit codes packed along the outputs in AutoAWQ's interleaved order (code
i of a word holds output column ORDER[i] of its eight), `scales` [groups, out]."""

from __future__ import annotations

import torch

from pyserve.model.quantized.weights import IntWeight, unpack_along_columns

MARKER = "qweight"
SUFFIXES = ("qweight", "qzeros", "scales")
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: code i of a word is output ORDER[i]
_COLUMN_AT = [ORDER.index(c) for c in range(8)]  # output c of a word is its code _COLUMN_AT[c]


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r, c / 8] -> codes [r, c] in output order."""
    codes = unpack_along_columns(packed, 4)
    return codes.view(codes.shape[0], -1, 8)[:, :, _COLUMN_AT].reshape(codes.shape[0], -1)


def read(tensors: dict[str, torch.Tensor], group_size: int) -> IntWeight:
    codes, zeros = unpack(tensors["qweight"]).T, unpack(tensors["qzeros"]).T
    return IntWeight(codes.contiguous(), zeros.contiguous(), tensors["scales"].T.contiguous(), group_size, 4)
