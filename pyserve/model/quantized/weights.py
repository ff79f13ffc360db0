"""The common form every quantized format is read into, one linear layer's weight at a time.

`IntWeight`: integer codes q [out, in] with, for each output row and group
of inputs, a scale s and a zero point z (in the codes' own units), so that
w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]; g(k) is k // group_size, or
the checkpoint's g_idx[k] (GPTQ's act-order). `FloatWeight`: FP8 values
times a scale per tensor, per output row or per block of the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def unpack_along_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [r, c] holding 32 / bits codes each, the first in the lowest
    bits -> [r * 32 / bits, c], code i of packed row j on row j * 32 / bits + i."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.reshape(-1, packed.shape[1])


def unpack_along_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [r, c] -> [r, c * 32 / bits], code i of packed column j on column j * 32 / bits + i."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.to(torch.int32)[:, :, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1)


@dataclass
class IntWeight:
    codes: torch.Tensor  # int [out, in]
    zeros: torch.Tensor  # [out, groups], in code units
    scales: torch.Tensor  # [out, groups]
    group_size: int
    bits: int
    g_idx: torch.Tensor | None = None  # [in]: each input's group, where not k // group_size

    def _group_of_inputs(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.codes.shape[1]) // self.group_size

    def dense(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        g = self._group_of_inputs()
        return (self.codes.float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]

    def only_groups_used(self) -> IntWeight:
        """The weight with only the groups its g_idx names, renumbered in
        order: an act-order part of the inputs, whose inputs name groups
        spread over all of them (a group may be named by fewer than
        group_size of them)."""
        used, g_idx = torch.unique(self.g_idx.long(), return_inverse=True)
        return IntWeight(self.codes, self.zeros[:, used].contiguous(), self.scales[:, used].contiguous(),
                         self.group_size, self.bits, g_idx.to(self.g_idx.dtype))

    def contiguous_groups(self) -> bool:
        """Whether each group is a run of group_size inputs (no act-order reordering)."""
        return self.g_idx is None or torch.equal(
            self.g_idx.long(), torch.arange(self.codes.shape[1]) // self.group_size)

    def int4_groups(self, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """This weight as quant.py's int4 groups of `group_size` (codes 0..15,
        w = (codes - 8) * scale + zero), exactly; None where that cannot be:
        not 4 bits, act-order groups, or groups that `group_size` does not divide."""
        if self.bits != 4 or not self.contiguous_groups() or self.group_size % group_size:
            return None
        repeat = self.group_size // group_size
        scales = self.scales.float().repeat_interleave(repeat, dim=1)
        zeros = ((8 - self.zeros.float()) * self.scales.float()).repeat_interleave(repeat, dim=1)
        return self.codes.to(torch.uint8), scales, zeros


@dataclass
class FloatWeight:
    values: torch.Tensor  # float8 [out, in]
    scale: torch.Tensor  # [], [1], [out, 1] or per block [ceil(out / b0), ceil(in / b1)]
    block: tuple[int, int] | None = None

    def dense(self) -> torch.Tensor:
        w = self.values.float()
        scale = self.scale.float()
        if self.block is not None:
            out, cols = w.shape
            scale = scale.repeat_interleave(self.block[0], 0)[:out].repeat_interleave(self.block[1], 1)[:, :cols]
        elif scale.dim() == 1 and scale.numel() == w.shape[0] and scale.numel() > 1:
            scale = scale[:, None]
        return w * scale

    def int4_groups(self, group_size: int) -> None:
        """FP8 values are no 4-bit codes: a 4-bit mode quantizes the dense weight."""
        return None


QuantizedWeight = IntWeight | FloatWeight


def read_range(view, axis: int, step: int | None, part: range) -> torch.Tensor | None:
    """The stored entries of a checkpoint tensor (`view`, a safetensors
    slice) that cover `part` of the weight's rows or columns, stored along
    `axis` with `step` of them per entry (a packed word's codes, a group's
    inputs, a block). The whole tensor where it holds one entry along
    `axis` (a scale shared by every row); None where `part` does not begin
    and end on entries (or `step` is None: one entry per whole row)."""
    shape = view.get_shape()
    if axis >= len(shape) or shape[axis] == 1:
        return view[...]
    if step is None or part.start % step:
        return None
    first, stop = part.start // step, -(-part.stop // step)
    if part.stop % step and stop != shape[axis]:
        return None
    return view[(slice(None),) * axis + (slice(first, stop),)]
