"""A model's quantized linear layers on the GPU: each rank's part of each
checkpoint layer (`sliced`, as a tensor-parallel rank holds it), the parts
of a fused projection stacked in row order (`stacked`: q/k/v into
qkv_proj, gate/up into gate_up_proj), and the model's nn.Linear modules
replaced by the layers cuda.py picks (`use_gpu_layers`). A part that cannot
be sliced or stacked in its quantized form (a slice across groups or FP8
blocks, fused parts with different act-order g_idx) is None: that module
keeps the dense weight it was loaded with."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.quantized.cuda import cuda_linear
from pyserve.model.quantized.weights import FloatWeight, IntWeight, QuantizedWeight


def sliced(weight: QuantizedWeight, dim: int | None, part: range) -> QuantizedWeight | None:
    """Rows (dim 0) or inputs (dim 1) `part` of the weight; dim None: all of it."""
    if dim is None:
        return weight
    rows = slice(part.start, part.stop)
    if isinstance(weight, IntWeight):
        if dim == 0:
            return IntWeight(weight.codes[rows], weight.zeros[rows], weight.scales[rows], weight.group_size,
                             weight.bits, weight.g_idx)
        if weight.g_idx is not None and not weight.contiguous_groups():
            return None  # act-order groups spread over every rank's inputs
        size = weight.group_size
        if part.start % size or len(part) % size:
            return None
        groups = slice(part.start // size, part.stop // size)
        return IntWeight(weight.codes[:, rows], weight.zeros[:, groups], weight.scales[:, groups], size, weight.bits)
    if weight.block is not None:
        step = weight.block[dim]
        if part.start % step or (len(part) % step and part.stop != weight.values.shape[dim]):
            return None
        blocks = slice(part.start // step, -(-part.stop // step))
        scale = weight.scale[blocks] if dim == 0 else weight.scale[:, blocks]
        return FloatWeight(weight.values[rows] if dim == 0 else weight.values[:, rows], scale, weight.block)
    if dim == 1:
        return FloatWeight(weight.values[:, rows], weight.scale)
    return FloatWeight(weight.values[rows], _per_row(weight)[rows])


def _per_row(weight: FloatWeight) -> torch.Tensor:
    """A per-tensor or per-row scale as [out, 1]."""
    return weight.scale.float().reshape(-1, 1).expand(weight.values.shape[0], 1)


def stacked(parts: list[tuple[int, QuantizedWeight | None]]) -> QuantizedWeight | None:
    """The (row offset, part) pieces of a fused projection as one weight, in row order."""
    weights = [w for _, w in sorted(parts, key=lambda p: p[0])]
    if any(w is None for w in weights) or len({type(w) for w in weights}) > 1:
        return None
    if len(weights) == 1:
        return weights[0]
    first = weights[0]
    if isinstance(first, IntWeight):
        same = all(w.group_size == first.group_size and w.bits == first.bits and
                   (w.g_idx is None) == (first.g_idx is None) and
                   (w.g_idx is None or torch.equal(w.g_idx, first.g_idx)) for w in weights)
        if not same:
            return None
        return IntWeight(*(torch.cat([getattr(w, f) for w in weights]) for f in ("codes", "zeros", "scales")),
                         first.group_size, first.bits, first.g_idx)
    if first.block is not None:
        if any(w.block != first.block or w.values.shape[0] % first.block[0] for w in weights[:-1]):
            return None
        return FloatWeight(torch.cat([w.values for w in weights]), torch.cat([w.scale for w in weights]), first.block)
    return FloatWeight(torch.cat([w.values for w in weights]), torch.cat([_per_row(w) for w in weights]))


def use_gpu_layers(model: nn.Module, weights: dict[str, QuantizedWeight | None], dtype: torch.dtype,
                   device: torch.device | str) -> list[str]:
    """Replace each nn.Linear named in `weights` (module name -> this rank's
    stacked weight) by its GPU layer, bias kept; the names replaced."""
    replaced = []
    for name, weight in weights.items():
        module = model.get_submodule(name)
        if weight is None or not isinstance(module, nn.Linear):
            continue
        if tuple(module.weight.shape) != tuple(weight.codes.shape if isinstance(weight, IntWeight)
                                               else weight.values.shape):
            raise ValueError(f"{name}: the quantized weight's shape does not match the layer's "
                             f"{tuple(module.weight.shape)}")
        layer = cuda_linear(weight, dtype, device, None if module.bias is None else module.bias.data)
        if layer is None:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
        replaced.append(name)
    return replaced
