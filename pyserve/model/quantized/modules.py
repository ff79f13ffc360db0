"""Which of a checkpoint's tensors make up quantized linear layers, and
their weights in the common form (weights.py)."""

from __future__ import annotations

import torch

from pyserve.model.quantized import awq, compressed, fp8, gptq
from pyserve.model.quantized.scheme import Scheme
from pyserve.model.quantized.weights import QuantizedWeight


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

    def claims(self, key: str) -> bool:
        """Whether the tensor `key` is part of a quantized layer (read through `weight`)."""
        module, _, suffix = key.rpartition(".")
        return module in self.tensors and suffix in self.tensors[module]

    def weight(self, module: str) -> QuantizedWeight:
        tensors = {suffix: handle.get_tensor(key) for suffix, (handle, key) in self.tensors[module].items()}
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


def dense_weights(modules: QuantizedModules, dtype: torch.dtype):
    """(module, its QuantizedWeight, its dense weight in `dtype`) for every quantized layer."""
    for module in sorted(modules.tensors):
        weight = modules.weight(module)
        yield module, weight, weight.dense().to(dtype)
