"""Llama and Mistral: the layout the shared blocks default to."""

from __future__ import annotations

from pyserve.model.families.family import Family


def biases(cfg: dict) -> dict:
    """Llama's biases: `attention_bias` on q/k/v and o_proj, `mlp_bias` on gate/up/down."""
    bias = bool(cfg.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))


def _config_fields(cfg: dict, arch: str) -> dict:
    return dict(**biases(cfg), sliding_window=cfg.get("sliding_window") if arch == "MistralForCausalLM" else None)


FAMILY = Family(("LlamaForCausalLM", "MistralForCausalLM"), _config_fields)
