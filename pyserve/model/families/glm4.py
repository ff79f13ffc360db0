"""GLM-4 (`Glm4ForCausalLM`): pre- and post-norms around both sublayers,
rotary embedding on the first half of each head (by default) over
interleaved pairs, q/k/v bias, gate/up fused in the checkpoint."""

from __future__ import annotations

from pyserve.model.checkpoint import GATE_UP, SEPARATE_PROJECTIONS, Column
from pyserve.model.config import partial_rotary_factor
from pyserve.model.families.family import Family


def _config_fields(cfg: dict, arch: str) -> dict:
    return dict(attention_bias=bool(cfg.get("attention_bias", True)),
                partial_rotary_factor=partial_rotary_factor(cfg, default=0.5), rotary_interleaved=True,
                post_norms=True)


FAMILY = Family(
    ("Glm4ForCausalLM",),
    _config_fields,
    SEPARATE_PROJECTIONS.with_changes(
        projections={"mlp.gate_up_proj": Column(GATE_UP, (0, 1))},
        drop=("mlp.gate_proj", "mlp.up_proj"),
        renames={"post_self_attn_layernorm": "attention_out_norm", "post_mlp_layernorm": "mlp_out_norm"},
    ),
)
