"""What a checkpoint's `quantization_config` (config.json) says its weights
are, and the `--quantization` choice that forces or refuses it. A method or
scheme not served here is an error naming it, never a load of packed
integers as weights."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

METHODS = ("awq", "gptq", "fp8", "compressed-tensors")
CHOICES = ("auto", *METHODS, "none")


@dataclass(frozen=True)
class Scheme:
    method: str  # one of METHODS
    kind: str  # "int" or "float"
    bits: int  # 4 or 8
    group_size: int = -1  # int: inputs sharing a scale; -1 a whole row
    block: tuple[int, int] | None = None  # block-wise FP8: the scale's block
    zero_offset: int = 0  # GPTQ's `gptq` format stores each zero minus one
    fmt: str = ""  # compressed-tensors: pack-quantized, int-quantized or float-quantized
    ignore: tuple[str, ...] = ()  # module names or `re:` patterns left unquantized

    @property
    def name(self) -> str:
        what = f"int{self.bits}" if self.kind == "int" else "fp8"
        group = f" group {self.group_size}" if self.kind == "int" and self.group_size > 0 else ""
        block = f" blocks {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"{self.method} {what}{group}{block}"

    def ignores(self, module: str) -> bool:
        """Whether `module` (a checkpoint name without its tensor suffix) is left unquantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif module == pattern or module.endswith("." + pattern) or fnmatch.fnmatch(module, pattern):
                return True
        return False


def _error(what: str) -> ValueError:
    return ValueError(f"quantization_config: {what} is not served (pyserve serves {', '.join(METHODS)}: "
                      "int4/int8 GPTQ, int4 AWQ, FP8 per tensor or block, compressed-tensors pack-quantized "
                      "int4/int8, int-quantized int8 and float-quantized fp8)")


def _int_bits(bits, what: str, allowed=(4, 8)) -> int:
    if bits not in allowed:
        raise _error(f"{what} with {bits} bits")
    return int(bits)


def _gptq(qc: dict) -> Scheme:
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _error(f"gptq checkpoint_format {fmt!r}")
    return Scheme("gptq", "int", _int_bits(qc.get("bits"), "gptq"), int(qc.get("group_size", -1)),
                  zero_offset=1 if fmt == "gptq" else 0, ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _awq(qc: dict) -> Scheme:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _error(f"awq version {version!r}")
    return Scheme("awq", "int", _int_bits(qc.get("bits", qc.get("w_bit")), "awq", (4,)),
                  int(qc.get("group_size", qc.get("q_group_size", -1))),
                  ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _fp8(qc: dict) -> Scheme:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _error(f"fp8 fmt {qc['fmt']!r}")
    block = qc.get("weight_block_size")
    return Scheme("fp8", "float", 8, block=tuple(block) if block else None,
                  ignore=tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()))


def _compressed(qc: dict) -> Scheme:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _error(f"compressed-tensors with {len(groups)} config groups")
    if qc.get("kv_cache_scheme"):
        raise _error("compressed-tensors kv_cache_scheme")
    group = groups[0]
    fmt = group.get("format") or qc.get("format")
    weights = group.get("weights") or {}
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if fmt == "pack-quantized" and kind == "int":
        bits = _int_bits(bits, "compressed-tensors pack-quantized")
    elif fmt == "int-quantized" and kind == "int":
        bits = _int_bits(bits, "compressed-tensors int-quantized", (8,))
    elif fmt == "float-quantized" and kind == "float" and bits == 8:
        pass
    else:
        raise _error(f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise _error(f"compressed-tensors weight strategy {strategy!r}")
    block = tuple(weights["block_structure"]) if strategy == "block" else None
    if block and kind == "int":
        raise _error("compressed-tensors int weights in blocks")
    group_size = int(weights.get("group_size") or -1) if strategy == "group" else -1
    return Scheme("compressed-tensors", kind, int(bits), group_size, block, fmt=fmt,
                  ignore=tuple(qc.get("ignore") or ()))


_READERS = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "compressed-tensors": _compressed}


def detect(config: dict, requested: str = "auto", flag: str = "--quantization") -> Scheme | None:
    """The scheme of a checkpoint's config.json (as a dict); None for
    unquantized weights. `requested` (the option `flag`): auto takes what
    the config says, a method insists on it, none refuses a quantized one."""
    requested = (requested or "auto").lower()
    if requested not in CHOICES:
        raise ValueError(f"{flag} {requested!r}: expected one of {', '.join(CHOICES)}")
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        if requested not in ("auto", "none"):
            raise ValueError(f"{flag} {requested}: the checkpoint's config.json has no quantization_config")
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4" and requested == "auto":
        # gpt-oss's experts: the MoE blocks dequantize their blocks and scales at load (model/mxfp4.py).
        return None
    if method not in _READERS:
        raise _error(f"quant_method {method!r}")
    if requested == "none":
        raise ValueError(f"{flag} none: the checkpoint's weights are {method}-quantized")
    if requested not in ("auto", method):
        raise ValueError(f"{flag} {requested}: the checkpoint's quantization_config says {method}")
    return _READERS[method](qc)
