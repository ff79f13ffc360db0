"""GLM-4.5 and its successors (`Glm4MoeForCausalLM`: GLM-4.5, 4.5-Air,
4.6): grouped-query attention with q/k/v bias and, where the config says
`use_qk_norm`, an RMSNorm of each head's q and k; rotary embedding on the
first `partial_rotary_factor` (0.5) of each head, its halves rotated
(not GLM-4's interleaved pairs); DeepSeek V3's mixture of experts
(layers/moe.py: sigmoid scores with e_score_correction_bias, top-k within
the best groups, the routed scaling factor, shared experts) on every
layer from `first_k_dense_replace` on, the gated MLP below it.

The checkpoints carry `num_nextn_predict_layers` multi-token-prediction
layers after the model's own; they are no part of the model, so their
tensors are skipped at load (NEXTN speculative decoding loads the first
as its draft, model/mtp_head.py).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from pyserve.model.checkpoint import SEPARATE_PROJECTIONS
from pyserve.model.config import partial_rotary_factor
from pyserve.model.families.family import Family
from pyserve.model.layers.moe import MoESpec
from pyserve.model.layers.sparse_lm import MoECausalLM, MoEConfig, mtp_layers

# transformers' Glm4MoeConfig defaults of the fields a config.json may leave out.
_DEFAULTS = dict(n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                 first_k_dense_replace=1, num_nextn_predict_layers=0, num_experts_per_tok=8,
                 moe_intermediate_size=1408)


def _config_fields(cfg: dict, arch: str) -> dict:
    cfg = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    # transformers names the expert count num_local_experts too.
    cfg["n_routed_experts"] = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 128
    # The router and the experts are DeepSeek V3's, field for field.
    moe = MoESpec.from_config(SimpleNamespace(**{**cfg, "model_type": "deepseek_v3"}))
    layers = cfg["num_hidden_layers"]
    return dict(moe=moe, dense_layers=frozenset(range(min(cfg["first_k_dense_replace"], layers))),
                mtp_layers=int(cfg["num_nextn_predict_layers"]),
                attention_bias=bool(cfg.get("attention_bias", False)),
                qk_norm="head" if cfg.get("use_qk_norm") else None,
                partial_rotary_factor=partial_rotary_factor(cfg, default=0.5))


FAMILY = Family(("Glm4MoeForCausalLM",), _config_fields, replace(SEPARATE_PROJECTIONS, skipped_layers=mtp_layers),
                model=MoECausalLM, config_class=MoEConfig)
