"""OLMo 2 (`Olmo2ForCausalLM`): norms of the attention's and the MLP's
outputs only (none before them), q and k RMS-normalized over all heads
together, norms that scale in float32.

Under tensor parallelism the q/k norms' mean square spans every rank's
heads: the ranks all-reduce their sums of squares (layers/norms.py), and
each holds its heads' slice of the norm weights."""

from __future__ import annotations

from pyserve.model.checkpoint import ALL_HEADS_QK_NORMS, SEPARATE_PROJECTIONS
from pyserve.model.families.family import Family


def _config_fields(cfg: dict, arch: str) -> dict:
    bias = bool(cfg.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm="all", norm_style="float32", pre_norms=False,
                post_norms=True)


FAMILY = Family(
    ("Olmo2ForCausalLM",),
    _config_fields,
    SEPARATE_PROJECTIONS.with_changes(
        projections=ALL_HEADS_QK_NORMS,
        renames={"post_attention_layernorm": "attention_out_norm", "post_feedforward_layernorm": "mlp_out_norm"},
    ),
)
