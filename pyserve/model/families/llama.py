"""Llama and Mistral: the layout the shared blocks default to."""

from __future__ import annotations

from pyserve.model.config import sliding_window_fields
from pyserve.model.families.family import Family


def biases(cfg: dict) -> dict:
    """Llama's biases: `attention_bias` on q/k/v and o_proj, `mlp_bias` on gate/up/down."""
    bias = bool(cfg.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))


def _config_fields(cfg: dict, arch: str) -> dict:
    # Mistral's window, when it has one, is every layer's.
    window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
    return dict(**biases(cfg), **sliding_window_fields(cfg, window, lambda i: True))


FAMILY = Family(("LlamaForCausalLM", "MistralForCausalLM"), _config_fields)
