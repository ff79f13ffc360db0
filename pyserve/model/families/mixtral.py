"""Mixtral (`MixtralForCausalLM`): Mistral's attention, every layer's
feed-forward block a sparse mixture of experts (layers/moe.py), which its
checkpoints name `block_sparse_moe`."""

from __future__ import annotations

from pyserve.model.config import sliding_window_fields
from pyserve.model.families.family import Family
from pyserve.model.layers.sparse_lm import MoECausalLM, MoEConfig, moe_fields


def _config_fields(cfg: dict, arch: str) -> dict:
    # Mixtral's window, when it has one, is every layer's.
    return dict(**moe_fields(cfg, "mixtral"), **sliding_window_fields(cfg, cfg.get("sliding_window"), lambda i: True))


FAMILY = Family(("MixtralForCausalLM",), _config_fields, model=MoECausalLM, config_class=MoEConfig)
