"""The causal LM of the mixture-of-experts families: the shared blocks'
layers with the MoE block (moe.py) as the feed-forward block of the sparse
layers, the gated MLP on the others (Qwen-MoE's `mlp_only_layers` and
`decoder_sparse_step`).

The MoE block places its own checkpoint tensors (moe.placement), whatever
the checkpoint's expert layout; the loader hands it the tensors of its
layer that it claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from torch import nn

from pyserve.model.config import ModelConfig
from pyserve.model.layers.causal_lm import CausalLM
from pyserve.model.layers.mlp import MLP
from pyserve.model.layers.moe import MoEBlock, MoESpec
from pyserve.model.parallel import ModelShard


@dataclass
class MoEConfig(ModelConfig):
    moe: MoESpec | None = None  # the sparse layers' block
    dense_layers: frozenset[int] = frozenset()  # layers whose feed-forward block is the gated MLP
    # Multi-token-prediction layers a checkpoint holds after the model's own
    # (DeepSeek V3's and GLM-4.5's num_nextn_predict_layers): not part of
    # the model, their tensors skipped at load.
    mtp_layers: int = 0


def mtp_layers(config: MoEConfig) -> range:
    """The indices the checkpoint's multi-token-prediction layers have."""
    return range(config.num_hidden_layers, config.num_hidden_layers + config.mtp_layers)


def moe_fields(cfg: dict, model_type: str, **defaults) -> dict:
    """The MoEConfig fields of a config.json: the block's spec as
    transformers' config of `model_type` gives it (`defaults`: that
    config's defaults of fields a config.json may leave out)."""
    spec = MoESpec.from_config(SimpleNamespace(**{**defaults, **cfg, "model_type": model_type}))
    layers = cfg["num_hidden_layers"]
    # Qwen-MoE's rule (transformers' Qwen2MoeDecoderLayer): a layer is
    # sparse unless listed in mlp_only_layers, every decoder_sparse_step-th
    # (none without experts).
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    step = cfg.get("decoder_sparse_step") or 1
    dense = frozenset(i for i in range(layers) if i in only_mlp or (i + 1) % step or not spec.num_experts)
    return dict(moe=spec, dense_layers=dense)


class MoECausalLM(CausalLM):
    def build_mlp(self, config: MoEConfig, layer_id: int, shard: ModelShard, fused_kernels: bool) -> nn.Module:
        if layer_id in config.dense_layers:
            return MLP(config, shard, fused_kernels)
        return MoEBlock(config.moe, shard.tp)
