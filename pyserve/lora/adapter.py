"""Reading an adapter in PEFT's format: adapter_config.json and
adapter_model.safetensors, low-rank pairs (A [r, in], B [out, r]) on any
of the attention and MLP projections."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r".*\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter pyserve cannot serve, and why."""


@dataclass
class Adapter:
    rank: int
    # (layer, target) -> (A [r, in], B [out, r] with the scaling folded in), float32.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str | Path, max_rank: int) -> Adapter:
    path = Path(path)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        tensors = load_file(path / "adapter_model.safetensors")
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path} is not a PEFT adapter directory: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config['peft_type']} is not LORA")
    for key, off in (("use_dora", False), ("bias", "none"), ("modules_to_save", None), ("rank_pattern", {}),
                     ("alpha_pattern", {})):
        if config.get(key, off) not in (off, None, {}, []):
            raise AdapterError(f"{path}: {key}={config[key]!r} is not supported")
    rank = int(config["r"])
    if not 0 < rank <= max_rank:
        raise AdapterError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in TARGETS:
            raise AdapterError(f"{path}: weight {key} is not on one of {', '.join(TARGETS)}")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor.float()
    weights = {}
    for where, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{path}: layer {where[0]} {where[1]} lacks its lora_A or lora_B")
        weights[where] = (pair["A"], pair["B"] * scaling)
    return Adapter(rank, weights)
