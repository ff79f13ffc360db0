"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): q/k/v and gate/up fused in the
checkpoint, partial rotary embedding, LongRoPE scaling (layers/rotary.py)."""

from __future__ import annotations

from pyserve.model.checkpoint import GATE_UP, QKV, SEPARATE_PROJECTIONS, Column
from pyserve.model.config import partial_rotary_factor, rope_settings, sliding_window_fields
from pyserve.model.families.family import Family


def _config_fields(cfg: dict, arch: str) -> dict:
    # Phi-3's window, when it has one, is every layer's.
    fields = dict(partial_rotary_factor=partial_rotary_factor(cfg),
                  **sliding_window_fields(cfg, cfg.get("sliding_window"), lambda i: True))
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if (rope.get("rope_type") or rope.get("type")) == "yarn":
        # transformers reads Phi-3's "yarn" as LongRoPE too.
        fields["rope_scaling"] = rope_settings({**cfg, "rope_scaling": {**rope, "rope_type": "longrope"}})[1]
    return fields


FAMILY = Family(
    ("Phi3ForCausalLM",),
    _config_fields,
    SEPARATE_PROJECTIONS.with_changes(
        projections={"self_attn.qkv_proj": Column(QKV, (0, 1, 2)), "mlp.gate_up_proj": Column(GATE_UP, (0, 1))},
        drop=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    ),
)
