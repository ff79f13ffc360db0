"""DeepSeek V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`),
and GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`: V3's layers, its dense and
sparse layers named by `mlp_layer_types`).

Attention is multi-head latent attention (layers/mla.py): the KV cache
holds, per token and layer, the compressed latent and the rotated key
part, one head of kv_lora_rank + qk_rope_head_dim values whose first
kv_lora_rank are V (kv_buffer.LatentDim), not the expanded per-head K/V.
The feed-forward block is DeepSeek's mixture of experts (layers/moe.py:
V2's softmax router, greedy or group-limited; V3's sigmoid scores with
e_score_correction_bias and top-k within the best groups by their top-2
sum; the routed scaling factor; shared experts without a gate), the gated
MLP on the first `first_k_dense_replace` layers and those `moe_layer_freq`
skips.

Under YaRN rope scaling (the published V2 and V3 configs) the rope part
rotates by YaRN's frequencies and cos/sin carry mscale / mscale_all_dim
(layers/rotary.py), and the softmax scale is multiplied by
mscale(factor, mscale_all_dim) ** 2, as DeepSeek's code does.

V3 checkpoints carry `num_nextn_predict_layers` multi-token-prediction
layers after the model's own; they are no part of the model, so their
tensors are skipped at load (NEXTN speculative decoding loads the first
as its draft, model/mtp_head.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

from pyserve.model.checkpoint import GATE_UP, CheckpointNames, Column, Fused, Row
from pyserve.model.config import partial_rotary_factor
from pyserve.model.families.family import Family
from pyserve.model.kv_buffer import LatentDim
from pyserve.model.layers.mla import MLASpec, MultiHeadLatentAttention
from pyserve.model.layers.moe import MoESpec
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.layers.sparse_lm import MoECausalLM, MoEConfig, mtp_layers
from pyserve.model.parallel import ModelShard

logger = logging.getLogger(__name__)

# The transformers configs' defaults of the fields a config.json may leave out.
_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(first_k_dense_replace=0, n_group=None, topk_group=None, topk_method="greedy",
                                  n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=False,
                                  n_routed_experts=64, moe_intermediate_size=1407, q_lora_rank=1536),
    "DeepseekV3ForCausalLM": dict(first_k_dense_replace=3, n_group=8, topk_group=4, n_shared_experts=1,
                                  routed_scaling_factor=2.5, norm_topk_prob=True, n_routed_experts=256,
                                  moe_intermediate_size=2048, q_lora_rank=1536, rope_interleave=True,
                                  num_nextn_predict_layers=0),
    "Glm4MoeLiteForCausalLM": dict(n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.8,
                                   norm_topk_prob=True, n_routed_experts=64, moe_intermediate_size=1536,
                                   q_lora_rank=768, rope_interleave=True, num_nextn_predict_layers=0,
                                   kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256),
}
# V3's layers: sigmoid routing with score correction, MTP layers, the rope layout flag.
_V3_LAYERS = ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
_MLA_DEFAULTS = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


@dataclass
class DeepseekConfig(MoEConfig):
    mla: MLASpec | None = None


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _config_fields(cfg: dict, arch: str) -> dict:
    # A null field takes the default, but a null q_lora_rank means one q_proj (V2-Lite).
    given = {k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}
    cfg = {**_MLA_DEFAULTS, **_DEFAULTS[arch], **given}
    v3 = arch in _V3_LAYERS
    if partial_rotary_factor(cfg) != 1.0:
        raise ValueError(f"{arch}: a partial_rotary_factor of the rope part is not supported")
    spec = MLASpec(q_lora_rank=cfg["q_lora_rank"], kv_lora_rank=cfg["kv_lora_rank"],
                   qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                   v_head_dim=cfg["v_head_dim"], rope_interleaved=not v3 or bool(cfg["rope_interleave"]))
    scale = spec.qk_head_dim**-0.5
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default" and rope.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    moe = MoESpec.from_config(SimpleNamespace(**{**cfg, "model_type": "deepseek_v3" if v3 else "deepseek_v2"}))
    layers = cfg["num_hidden_layers"]
    if arch == "Glm4MoeLiteForCausalLM":  # its layer types, by default the first dense
        types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        dense = frozenset(i for i, kind in enumerate(types[:layers]) if kind == "dense" or not moe.num_experts)
    else:  # DeepSeek's rule: experts from first_k_dense_replace on, every moe_layer_freq-th layer
        freq = cfg.get("moe_layer_freq") or 1
        dense = frozenset(i for i in range(layers)
                          if not moe.num_experts or i < cfg["first_k_dense_replace"] or i % freq)
    return dict(
        moe=moe, dense_layers=dense, mla=spec,
        # The cache's one KV head, the latent and the rotated key part; V the latent (kv_buffer.LatentDim).
        num_key_value_heads=1, head_dim=LatentDim(spec.latent_dim, spec.kv_lora_rank),
        attention_scale=scale, attention_bias=bool(cfg.get("attention_bias", False)),
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0) if v3 else 0,
    )


class Deepseek(MoECausalLM):
    """MoECausalLM whose layers attend with multi-head latent attention,
    rotating the rope part of each head (qk_rope_head_dim values) only."""

    def __init__(self, config: DeepseekConfig, shard: ModelShard | None = None, fused_kernels: bool = True):
        super().__init__(config, shard, fused_kernels)
        # The loader builds the model on the meta device: the generic
        # attention the base class made never holds memory.
        for i, layer in enumerate(self.layers):
            layer.self_attn = MultiHeadLatentAttention(config, config.mla, i, self.shard)
        rope_dim = config.mla.qk_rope_head_dim
        self.rotary = RotaryEmbedding(replace(config, head_dim=rope_dim, partial_rotary_factor=1.0))
        if config.mtp_layers:
            logger.info("%s: num_nextn_predict_layers %d: its multi-token-prediction layers are skipped at load "
                        "(--speculative-algorithm NEXTN drafts with the first)", config.architecture,
                        config.mtp_layers)


def _head_split(config: DeepseekConfig) -> dict[str, int]:
    spec = config.mla
    return {"mla_q": spec.qk_head_dim, "mla_kv_b": spec.qk_nope_head_dim + spec.v_head_dim, "mla_o": spec.v_head_dim}


def _per_head(module: str, kind: str) -> Column:
    return Column(Fused(module, (kind,)), (0,))


CHECKPOINT = CheckpointNames(
    {
        "self_attn.q_proj": _per_head("self_attn.q_proj", "mla_q"),
        "self_attn.q_b_proj": _per_head("self_attn.q_b_proj", "mla_q"),
        "self_attn.kv_b_proj": _per_head("self_attn.kv_b_proj", "mla_kv_b"),
        "self_attn.o_proj": Row("self_attn.o_proj", "mla_o"),
        "mlp.gate_proj": Column(GATE_UP, (0,)),
        "mlp.up_proj": Column(GATE_UP, (1,)),
        "mlp.down_proj": Row("mlp.down_proj", "intermediate"),
    },
    head_split=_head_split,
    skipped_layers=mtp_layers,
)

FAMILY = Family(("DeepseekV2ForCausalLM", *_V3_LAYERS), _config_fields, CHECKPOINT, model=Deepseek,
                config_class=DeepseekConfig)
