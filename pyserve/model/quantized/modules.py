"""Which of a checkpoint's tensors make up quantized linear layers, and
their weights in the common form (weights.py): a whole layer's, or a
tensor-parallel rank's part of its rows or inputs, read from the stored
entries that cover it in each tensor's packed layout. An act-order part
of the inputs (GPTQ `desc_act`: its inputs name groups spread over all of
them) reads its codes and g_idx by part and the small per-group zeros and
scales whole. A part that the layout cannot cut (not on whole packed
words, groups or blocks) is read whole instead, and logged once."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

import torch

from pyserve.model.quantized import awq, compressed, fp8, gptq
from pyserve.model.quantized.scheme import Scheme
from pyserve.model.quantized.weights import IntWeight, QuantizedWeight, read_range

logger = logging.getLogger(__name__)


def _markers(scheme: Scheme) -> tuple[str, ...]:
    """Suffixes that only a quantized layer's tensors have."""
    if scheme.method in ("gptq", "awq"):
        return (gptq.MARKER,)
    if scheme.method == "fp8":
        return fp8.MARKERS
    return (compressed.MARKERS[scheme.fmt],)


def _suffixes(scheme: Scheme) -> tuple[str, ...]:
    return {"gptq": gptq.SUFFIXES, "awq": awq.SUFFIXES, "fp8": fp8.SUFFIXES}.get(scheme.method,
                                                                               compressed.SUFFIXES)


# Tensors stored one entry per group along the inputs: an act-order part's inputs name groups spread over
# all of them, so these are read whole (they are small: [groups, out]).
_PER_GROUP = ("qzeros", "scales", "weight_scale", "weight_zero_point")


def _stored_along(scheme: Scheme, suffix: str, dim: int) -> tuple[int, int | None] | None:
    """Along which axis of the stored tensor `suffix` the weight's rows
    (`dim` 0) or inputs (`dim` 1) run, and how many of them one stored
    entry covers (None: a whole row's, one group per row); None where the
    tensor is not cut along them (read whole; g_idx: weight_part)."""
    words = 32 // scheme.bits  # codes per packed int32
    group = scheme.group_size if scheme.group_size > 0 else None
    step = scheme.block[dim] if scheme.block else 1
    rows_inputs = {
        "gptq": {"qweight": ((1, 1), (0, words)), "qzeros": ((1, words), (0, group)),
                 "scales": ((1, 1), (0, group))},
        "awq": {"qweight": ((1, 8), (0, 1)), "qzeros": ((1, 8), (0, group)), "scales": ((1, 1), (0, group))},
        "fp8": {"weight": ((0, 1), (1, 1)), "weight_scale_inv": ((0, step), (1, step)),
                "weight_scale": ((0, 1), (1, None))},  # per tensor (read whole) or per row
    }.get(scheme.method)
    if rows_inputs is None:  # compressed-tensors
        packed = scheme.fmt == "pack-quantized"
        scale = ((0, step), (1, step)) if scheme.block else ((0, 1), (1, group))
        rows_inputs = {"weight": ((0, 1), (1, 1)), "weight_packed": ((0, 1), (1, words)), "weight_scale": scale,
                       "weight_zero_point": ((0, words if packed else 1), (1, group))}
    layouts = rows_inputs.get(suffix)
    return None if layouts is None else layouts[dim]


class QuantizedModules:
    """The quantized layers of a checkpoint: module name -> {suffix: (file handle, tensor name)}."""

    def __init__(self, scheme: Scheme, handles: list) -> None:
        self.scheme = scheme
        markers, suffixes = _markers(scheme), _suffixes(scheme)
        names = [(handle, key) for handle in handles for key in handle.keys()]
        modules = {key.rpartition(".")[0] for _, key in names if key.rpartition(".")[2] in markers}
        ignored = sorted(m for m in modules if scheme.ignores(m))
        if ignored:
            raise ValueError(f"{scheme.name}: {ignored[0]} is stored quantized but the config's ignore list names it")
        if not modules:
            raise ValueError(f"config.json says {scheme.name}, but no tensor of the checkpoint is quantized that way")
        self.tensors: dict[str, dict[str, tuple]] = {m: {} for m in modules}
        for handle, key in names:
            module, _, suffix = key.rpartition(".")
            if module in self.tensors and suffix in suffixes:
                self.tensors[module][suffix] = (handle, key)
        self._logged_whole = False
        self._g_idx: tuple[str | None, torch.Tensor | None] = (None, None)  # the last layer's g_idx read

    def keep(self, wanted: Callable[[str], bool]) -> None:
        """Forget the layers whose module names are not `wanted` (a part of
        the checkpoint loaded alone reads its own only)."""
        self.tensors = {module: stored for module, stored in self.tensors.items() if wanted(module)}

    def claims(self, key: str) -> bool:
        """Whether the tensor `key` is part of a quantized layer (read through `weight`)."""
        module, _, suffix = key.rpartition(".")
        return module in self.tensors and suffix in self.tensors[module]

    def shape(self, module: str) -> tuple[int, int] | None:
        """The layer's weight [out, in] by its stored shapes (inputs packed
        along a row counted in whole words); None where the tensor that
        says it is missing (reading the layer names what is)."""
        stored, words = self.tensors[module], 32 // self.scheme.bits
        packed = {"gptq": "qweight", "awq": "qweight"}.get(self.scheme.method, "weight_packed")
        name = packed if packed in stored else "weight"
        if name not in stored:
            return None
        handle, key = stored[name]
        rows, cols = handle.get_slice(key).get_shape()
        if self.scheme.method == "gptq":
            return cols, rows * words
        if self.scheme.method == "awq":
            return cols * 8, rows
        return (rows, cols * words) if name == "weight_packed" else (rows, cols)

    def weight(self, module: str) -> QuantizedWeight:
        tensors = {suffix: handle.get_tensor(key) for suffix, (handle, key) in self.tensors[module].items()}
        return self._read(module, tensors)

    def weight_part(self, module: str, dim: int, part: range) -> tuple[QuantizedWeight, bool]:
        """The layer's rows (`dim` 0) or inputs (`dim` 1) `part`, reading
        only what covers them, and True; the whole weight and False where
        its layout cannot cut that part."""
        stored = self.tensors[module]
        g_idx = next((s for s in ("g_idx", "weight_g_idx") if s in stored), None)
        tensors, act_order = {}, False
        if g_idx is not None:  # [in] int32, small: needed whole to cut the inputs, read once for a layer's parts
            handle, key = stored[g_idx]
            if self._g_idx[0] != key:
                self._g_idx = key, handle.get_slice(key)[...]
            tensors[g_idx] = self._g_idx[1]
            if dim == 1:
                size, tensors[g_idx] = self.scheme.group_size, tensors[g_idx][part.start:part.stop]
                act_order = size <= 0 or not torch.equal(tensors[g_idx].long(),
                                                         torch.arange(part.start, part.stop) // size)
                if not act_order:
                    del tensors[g_idx]  # the part's groups are its own runs of group_size inputs
        for suffix, (handle, key) in stored.items():
            if suffix == g_idx:
                continue
            layout = _stored_along(self.scheme, suffix, dim)
            view = handle.get_slice(key)
            whole = layout is None or (act_order and suffix in _PER_GROUP)
            tensor = view[...] if whole else read_range(view, *layout, part)
            if tensor is None:
                return self._whole(module, f"its {suffix} does not cut at {part.start}-{part.stop}"), False
            tensors[suffix] = tensor
        if "weight_shape" in tensors:
            tensors["weight_shape"] = tensors["weight_shape"].clone()
            tensors["weight_shape"][dim] = len(part)
        weight = self._read(module, tensors)
        if act_order:
            weight = weight.only_groups_used()
        one_group = isinstance(weight, IntWeight) and weight.scales.shape[1] == 1
        if one_group and dim == 1 and weight.group_size > len(part):
            # Inputs within one group: that group, as long as the part.
            weight = replace(weight, group_size=len(part))
        return weight, True

    def _whole(self, module: str, why: str) -> QuantizedWeight:
        if not self._logged_whole:
            logger.info("%s: reading %s whole on every rank (%s; logged for the first such layer only)",
                        self.scheme.name, module, why)
            self._logged_whole = True
        return self.weight(module)

    def _read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        s = self.scheme
        try:
            if s.method == "gptq":
                return gptq.read(tensors, s.bits, s.group_size, s.zero_offset)
            if s.method == "awq":
                return awq.read(tensors, s.group_size)
            if s.method == "fp8":
                return fp8.read(tensors, s.block)
            return compressed.read(tensors, s.fmt, s.bits, s.group_size, s.block)
        except KeyError as e:
            raise ValueError(f"{module}: a {s.name} layer without its {e.args[0]} tensor") from None


def dense_weights(modules: QuantizedModules, dtype: torch.dtype,
                  split: Callable[[str], list[tuple[int, range]]] = lambda module: []):
    """(module, [(QuantizedWeight, its dense weight in `dtype`, the part
    read)]) for every quantized layer: where `split(module)` names the
    (dim, part)s this rank holds, each of them read alone where the layout
    can cut them all, else the whole layer once (its part None)."""
    for module in sorted(modules.tensors):
        read = []
        for dim, part in split(module):
            weight, cut = modules.weight_part(module, dim, part)
            if not cut:
                read = [(weight, None)]
                break
            read.append((weight, (dim, part)))
        read = read or [(modules.weight(module), None)]
        yield module, [(weight, weight.dense().to(dtype), part) for weight, part in read]
