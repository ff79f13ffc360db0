"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: gptq`), in
AutoGPTQ's layout: `qweight` int32 [in * bits / 32, out] packed along the
inputs, `qzeros` int32 [groups, out * bits / 32] packed along the outputs
(each zero stored minus one in the original `gptq` checkpoint format, as
it is in `gptq_v2`), `scales` [groups, out], `g_idx` [in] (each input's
group: act-order checkpoints, `desc_act`, permute them). First code in
the lowest bits."""

from __future__ import annotations

import torch

from pyserve.model.quantized.weights import IntWeight, unpack_along_columns, unpack_along_rows

MARKER = "qweight"
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def read(tensors: dict[str, torch.Tensor], bits: int, group_size: int, zero_offset: int) -> IntWeight:
    codes = unpack_along_rows(tensors["qweight"], bits).T
    zeros = unpack_along_columns(tensors["qzeros"], bits).T + zero_offset
    scales = tensors["scales"].T
    cols = codes.shape[1]
    size = cols if group_size <= 0 else group_size
    return IntWeight(codes.contiguous(), zeros.contiguous(), scales.contiguous(), size, bits, tensors.get("g_idx"))
