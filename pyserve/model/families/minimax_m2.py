"""MiniMax-M2 (`MiniMaxM2ForCausalLM`: MiniMax-M2, M2.1): grouped-query
attention with RMSNorm of q and k over all heads (as OLMo 2's), rotary
embedding on the first `rotary_dim` values of each head (the released
configs' name; transformers' partial_rotary_factor), its halves rotated;
every layer a mixture of experts (Mixtral's checkpoint names,
`block_sparse_moe.experts.E.w1/w2/w3`) whose router scores are sigmoids,
chosen with the block's `e_score_correction_bias` added, the chosen ones
renormalised (layers/moe.py's grouped_sigmoid over one group).
"""

from __future__ import annotations

from types import SimpleNamespace

from pyserve.model.checkpoint import ALL_HEADS_QK_NORMS, SEPARATE_PROJECTIONS
from pyserve.model.config import partial_rotary_factor
from pyserve.model.families.family import Family
from pyserve.model.layers.moe import MoESpec
from pyserve.model.layers.sparse_lm import MoECausalLM, MoEConfig


def _config_fields(cfg: dict, arch: str) -> dict:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary_dim = cfg.get("rotary_dim")
    rotary = rotary_dim / head_dim if rotary_dim else partial_rotary_factor(cfg)
    moe = MoESpec.from_config(SimpleNamespace(**{"num_local_experts": 256, "num_experts_per_tok": 8, **cfg,
                                                 "model_type": "minimax_m2"}))
    return dict(moe=moe, dense_layers=frozenset(), qk_norm="all", partial_rotary_factor=rotary)


FAMILY = Family(("MiniMaxM2ForCausalLM",), _config_fields, SEPARATE_PROJECTIONS.with_changes(ALL_HEADS_QK_NORMS),
                model=MoECausalLM, config_class=MoEConfig)
