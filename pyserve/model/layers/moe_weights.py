"""This rank's part of an MoE block's checkpoint tensors, read without the
rest (moe.MoEBlock.load_weight).

A source is a tensor, or a safetensors slice (`handle.get_slice(name)`):
indexing one reads only the bytes of the selected part, so under tensor
parallelism a rank reads its rows of each expert's gate and up projections
and its columns of the down projection, never the whole expert. Every
layout's part is a contiguous range along one dimension: gpt-oss's
interleaved gate/up columns 2*start..2*stop hold this rank's gate and up
columns alike, and an MXFP4 down projection's blocks of 32 inputs are read
whole blocks at a time (where the part does not fall on blocks, the expert
is read whole and cut after dequantizing).
"""

from __future__ import annotations

import torch

from pyserve.model import mxfp4


def shape_of(source) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def whole(source) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source[:]


def part_copies(target: torch.Tensor, source, param: str, half: str | None, layout: str, part: range,
                full: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, what goes there) for this rank's `part` (of `full`
    rows of the intermediate dimension) of `source` in `target`, the
    block's parameter `param` (one expert's, or the shared expert's, where
    `layout` is "linear"): w13 rows are [gate part; up part] (`half` says
    which one a per-expert tensor fills), w2 columns are the part.
    ValueError where a source's shape does not fit its destination."""
    L, s, e = len(part), part.start, part.stop
    if param in ("w13", "shared_w13") and layout == "linear":
        up = L if half == "up" else 0
        pairs = [(target[up:up + L], source[s:e])]
    elif param in ("w2", "shared_w2") and layout == "linear":
        pairs = [(target, source[:, s:e])]
    elif param == "w2":  # stacked [E, H, I], gpt-oss's [E, I, H]
        pairs = [(target, source[:, s:e].transpose(1, 2) if layout == "gpt_oss" else source[:, :, s:e])]
    elif param in ("w13", "b13") and layout == "gpt_oss":  # gate and up interleaved along the last dimension
        chunk = source[:, 2 * s:2 * e] if param == "b13" else source[:, :, 2 * s:2 * e].transpose(1, 2)
        pairs = [(target[:, :L], chunk[:, 0::2]), (target[:, L:], chunk[:, 1::2])]
    elif param == "w13":  # stacked [E, 2I, H], gate rows then up rows
        pairs = [(target[:, :L], source[:, s:e]), (target[:, L:], source[:, full + s:full + e])]
    else:
        pairs = [(target, whole(source))]
    for destination, chunk in pairs:
        if destination.shape != chunk.shape:  # copy_ would broadcast some
            raise ValueError(f"{param} takes {tuple(destination.shape)} from a tensor of shape {shape_of(source)}, "
                             f"which gives {tuple(chunk.shape)}")
    return pairs


@torch.no_grad()
def copy_part(target: torch.Tensor, source, param: str, half: str | None, layout: str, part: range,
              full: int) -> None:
    """Copy what part_copies pairs."""
    for destination, chunk in part_copies(target, source, param, half, layout, part, full):
        destination.copy_(chunk)


@torch.no_grad()
def copy_mxfp4_part(target: torch.Tensor, param: str, name: str, blocks, scales, part: range,
                    hidden: int, full: int) -> None:
    """Dequantize this rank's part of an MXFP4 pair (gpt-oss's experts, in
    nn.Linear's orientation: gate_up [E, 2I interleaved, H], down [E, H, I])
    into w13 [E, 2L, H] or w2 [E, H, L], one expert at a time (a whole
    layer's experts at once would take several times their bf16 size in
    temporaries)."""
    experts = target.shape[0]
    rows, cols = (2 * full, hidden) if param == "w13" else (hidden, full)
    expected = (experts, rows, cols // mxfp4.BLOCK)
    if shape_of(scales) != expected:
        raise ValueError(f"{name}_scales has shape {shape_of(scales)}, the config expects {expected}")
    L, s, e = len(part), part.start, part.stop
    on_blocks = s % mxfp4.BLOCK == 0 and e % mxfp4.BLOCK == 0
    for x in range(experts):
        if param == "w13":
            index = (slice(x, x + 1), slice(2 * s, 2 * e))
        elif on_blocks:
            index = (slice(x, x + 1), slice(None), slice(s // mxfp4.BLOCK, e // mxfp4.BLOCK))
        else:
            index = (slice(x, x + 1),)
        dense = mxfp4.dequantize(blocks[index].to(target.device), scales[index].to(target.device), target.dtype)[0]
        if param == "w13":
            target[x, :L].copy_(dense[0::2])
            target[x, L:].copy_(dense[1::2])
        else:
            target[x].copy_(dense if on_blocks else dense[:, s:e])


Int4Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # quant.py's: codes [out, in], scales, zeros


class ExpertGroups:
    """A quantized checkpoint's own 4-bit groups of each expert (and of the
    shared expert), this rank's part of each, so that the 4-bit modes build
    those experts from the checkpoint's codes (quant.quantize_model); keyed
    `<block module>.<param>[.<expert>]`. A part that does not fall on whole
    groups is left out: that expert is quantized from its dense weight."""

    def __init__(self, group_size: int | None):
        self.group_size = group_size
        self._parts: dict[str, list[tuple[int, Int4Groups]]] = {}

    def add(self, module: str, param: str, expert: int | None, row: int, groups: Int4Groups, part: range) -> None:
        if param.endswith("w13"):  # rows
            sliced = tuple(t[part.start:part.stop] for t in groups)
        elif part.start % self.group_size or len(part) % self.group_size:
            return
        else:  # columns, whole groups
            codes, scales, zeros = groups
            g = slice(part.start // self.group_size, part.stop // self.group_size)
            sliced = (codes[:, part.start:part.stop], scales[:, g], zeros[:, g])
        key = f"{module}.{param}" if expert is None else f"{module}.{param}.{expert}"
        self._parts.setdefault(key, []).append((row, sliced))

    def stacked(self) -> dict[str, Int4Groups]:
        """Each expert weight's groups, gate rows then up rows for w13; only those whose every part came."""
        stacked = {}
        for key, parts in self._parts.items():
            if len(parts) == (2 if key.split(".")[3].endswith("w13") else 1):
                parts.sort(key=lambda p: p[0])
                stacked[key] = tuple(torch.cat([p[1][i] for p in parts]) for i in range(3))
        return stacked
