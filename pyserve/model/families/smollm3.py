"""SmolLM3 (`SmolLM3ForCausalLM`): Llama's layers, some without rotary
embedding (NoPE): `no_rope_layers` holds 1 for each layer that rotates,
else every `no_rope_layer_interval`-th layer does not."""

from __future__ import annotations

from pyserve.model.config import sliding_window_fields
from pyserve.model.families.family import Family
from pyserve.model.families.llama import biases


def _config_fields(cfg: dict, arch: str) -> dict:
    layers = cfg["num_hidden_layers"]
    rotates = cfg.get("no_rope_layers")
    if rotates is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        rotates = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(rotates) != layers:
        raise ValueError(f"no_rope_layers has {len(rotates)} entries for {layers} layers")
    nope = frozenset(i for i, rotating in enumerate(rotates) if not rotating)
    # With use_sliding_window, the NoPE layers slide.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return dict(**biases(cfg), nope_layers=nope, **sliding_window_fields(cfg, window, lambda i: i in nope))


FAMILY = Family(("SmolLM3ForCausalLM",), _config_fields)
