"""Granite (`GraniteForCausalLM`): Llama's layers with four multipliers:
of the embeddings, of each sublayer's output before its residual add, the
attention's softmax scale, and a divisor of the logits."""

from __future__ import annotations

from pyserve.model.families.family import Family
from pyserve.model.families.llama import biases


def _config_fields(cfg: dict, arch: str) -> dict:
    return dict(
        **biases(cfg),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        attention_scale=float(cfg.get("attention_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
    )


FAMILY = Family(("GraniteForCausalLM",), _config_fields)
