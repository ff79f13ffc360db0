"""gpt-oss (`GptOssForCausalLM`), OpenAI's open-weight mixture of experts.

Its layers: biases on q, k, v and o; attention sinks, one learned logit
per head that joins the softmax's denominator (the attention backends'
`sinks` option); sliding-window layers (128 tokens) alternating with
global ones (`layer_types`, else the even layers slide); norms that scale
in float32; YaRN rope scaling (`truncate` false). Every layer's
feed-forward block is a mixture of experts (layers/moe.py): a router with
a bias whose top k logits are softmaxed, experts with biases and the
clamped SwiGLU `(clamp(up) + 1) * g * sigmoid(alpha * g)`, g = min(gate,
limit), checkpoints storing gate and up interleaved.

The published checkpoints ship the experts in MXFP4 (`_blocks` /
`_scales` pairs, quant_method "mxfp4"): the MoE block dequantizes them
at load to the model dtype (mxfp4.py); bf16 checkpoints load as they are.

Under tensor parallelism each rank attends with its heads' slice of each
layer's sinks; every rank reads the whole (tiny) sinks tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.checkpoint import SEPARATE_PROJECTIONS
from pyserve.model.config import rope_settings, sliding_window_fields
from pyserve.model.families.family import Family
from pyserve.model.layers.sparse_lm import MoECausalLM, MoEConfig, moe_fields
from pyserve.model.parallel import ModelShard

# GptOssConfig's defaults where a config.json leaves them out.
_ROPE_THETA = 150_000.0
_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}
_MOE_DEFAULTS = dict(num_local_experts=128, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0)
_SLIDING_WINDOW = 128


class GptOss(MoECausalLM):
    """MoECausalLM with attention sinks: each layer's attention holds every
    head's sink (`sink_logits`, the checkpoint's `self_attn.sinks`) and
    attends with this rank's heads' slice of it."""

    def __init__(self, config: MoEConfig, shard: ModelShard | None = None, fused_kernels: bool = True):
        super().__init__(config, shard, fused_kernels)
        for layer in self.layers:
            layer.self_attn.sink_logits = nn.Parameter(torch.empty(config.num_attention_heads), requires_grad=False)
        self._slice_sinks()

    def _slice_sinks(self) -> None:
        heads = self.shard.q_heads
        for layer in self.layers:
            attn = layer.self_attn
            attn.sinks = attn.sink_logits.detach()[heads.start:heads.stop]

    def _apply(self, fn, recurse=True):
        # A cast or move gives the parameters new storage: slice that one.
        super()._apply(fn, recurse)
        self._slice_sinks()
        return self


def _rope(cfg: dict) -> dict:
    """rope_theta and rope_scaling: the config's (as published, rope_theta
    beside rope_scaling; transformers 5, both in rope_parameters), else
    GptOssConfig's YaRN."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or _YARN
    params = {"rope_theta": cfg.get("rope_theta") or _ROPE_THETA, **params}
    theta, scaling = rope_settings({"rope_parameters": params,
                                    "max_position_embeddings": cfg.get("max_position_embeddings", 131_072)})
    return dict(rope_theta=theta, rope_scaling=scaling)


def _config_fields(cfg: dict, arch: str) -> dict:
    bias = bool(cfg.get("attention_bias", True))
    window = cfg.get("sliding_window", _SLIDING_WINDOW)
    types = cfg.get("layer_types")
    if types is not None and not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types {types} holds types other than sliding_attention and full_attention")
    return dict(
        **moe_fields(cfg, "gpt_oss", **_MOE_DEFAULTS),
        **sliding_window_fields(cfg, window, lambda i: i % 2 == 0),
        **_rope(cfg),
        attention_bias=bias,
        o_proj_bias=bias,
        norm_style="float32",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


FAMILY = Family(
    ("GptOssForCausalLM",),
    _config_fields,
    # Our attention's own `sinks` is the rank's slice of sink_logits.
    SEPARATE_PROJECTIONS.with_changes(renames={"sinks": "sink_logits"}),
    model=GptOss,
    config_class=MoEConfig,
)
