"""Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm per head)."""

from __future__ import annotations

from pyserve.model.config import sliding_window_fields
from pyserve.model.families.family import Family


def _config_fields(cfg: dict, arch: str) -> dict:
    # With use_sliding_window, the layers from max_window_layers on slide.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    first_sliding = cfg.get("max_window_layers", 28)
    windows = sliding_window_fields(cfg, window, lambda i: i >= first_sliding)
    if arch == "Qwen2ForCausalLM":
        # Qwen2 always has q/k/v bias and never an o_proj bias.
        return dict(attention_bias=True, **windows)
    bias = bool(cfg.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm="head", **windows)


FAMILY = Family(("Qwen2ForCausalLM", "Qwen3ForCausalLM"), _config_fields)
