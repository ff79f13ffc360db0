"""Qwen2-MoE (`Qwen2MoeForCausalLM`: q/k/v bias, a shared expert scaled by
its sigmoid gate) and Qwen3-MoE (`Qwen3MoeForCausalLM`: q/k RMSNorm per
head, `norm_topk_prob`): sparse mixture-of-experts layers (layers/moe.py),
the gated MLP on the layers `mlp_only_layers` and `decoder_sparse_step`
leave dense (layers/sparse_lm.py)."""

from __future__ import annotations

from pyserve.model.config import sliding_window_fields
from pyserve.model.families.family import Family
from pyserve.model.layers.sparse_lm import MoECausalLM, MoEConfig, moe_fields

# transformers' defaults of the fields the block reads that a config.json may leave out.
_DEFAULTS = dict(norm_topk_prob=False)


def _config_fields(cfg: dict, arch: str) -> dict:
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
    cfg = {"num_experts": cfg.get("num_local_experts"), **cfg}
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if arch == "Qwen2MoeForCausalLM":
        # Every other layer below max_window_layers slides.
        below = cfg.get("max_window_layers", 28)
        windows = sliding_window_fields(cfg, window, lambda i: i % 2 == 0 and i < below)
        return dict(**moe_fields(cfg, "qwen2_moe", **_DEFAULTS), attention_bias=bool(cfg.get("qkv_bias", True)),
                    **windows)
    bias = bool(cfg.get("attention_bias", False))
    # Qwen3-MoE's window, when it has one, is every layer's.
    return dict(**moe_fields(cfg, "qwen3_moe", **_DEFAULTS), attention_bias=bias, o_proj_bias=bias,
                qk_norm="head", **sliding_window_fields(cfg, window, lambda i: True))


FAMILY = Family(("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"), _config_fields, model=MoECausalLM,
                config_class=MoEConfig)
