"""The decoder layer: attention and MLP, each with its residual add, and
the norms around them that a family's config asks for.

Norms are named by role, as Llama's checkpoints name the first two:
`input_layernorm` (before attention) and `post_attention_layernorm`
(before the MLP), the pre-norms; `attention_out_norm` and `mlp_out_norm`
normalize the sublayers' outputs (Olmo 2, GLM-4, Gemma), the post-norms.
A family whose checkpoints name them otherwise renames them
(checkpoint.CheckpointNames.renames).
"""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.config import ModelConfig
from pyserve.model.layers.attention import Attention
from pyserve.model.layers.norms import RMSNorm, rms_norm
from pyserve.model.parallel import ModelShard


def add_norm(norm: RMSNorm | None, x: torch.Tensor, residual: torch.Tensor | None):
    """(norm(x + residual), x + residual): the residual stream's next add
    and what the next sublayer reads (the stream itself without a norm).
    With no residual yet, x starts the stream."""
    if residual is None:
        return (x if norm is None else norm(x)), x
    if norm is None:
        residual = x + residual
        return residual, residual
    return norm(x, residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, shard: ModelShard, mlp: nn.Module,
                 fused_kernels: bool = True):
        """`mlp`: the layer's feed-forward block (its family's: gated, or mixture of experts)."""
        super().__init__()

        def norms(wanted: bool) -> tuple[RMSNorm | None, RMSNorm | None]:
            if not wanted:
                return None, None
            return rms_norm(config, config.hidden_size, fused_kernels), rms_norm(config, config.hidden_size,
                                                                                  fused_kernels)

        self.input_layernorm, self.post_attention_layernorm = norms(config.pre_norms)
        self.attention_out_norm, self.mlp_out_norm = norms(config.post_norms)
        self.self_attn = Attention(config, layer_id, shard, fused_kernels)
        self.mlp = mlp
        self.residual_multiplier = config.residual_multiplier

    # A layer runs as before_attention, the attention backend, after_attention:
    # the two halves hold no layer index or cache, so one compiled decode
    # layer serves every layer (CausalLM.compile_decode).

    def before_attention(self, x, residual, cos, sin):
        """x: the previous layer's MLP output, or the embeddings (residual
        None) for the first layer. Returns q, k, v and the residual stream:
        each residual add is left to the next norm, which fuses it on CUDA."""
        h, residual = add_norm(self.input_layernorm, x, residual)
        return (*self.self_attn.project(h, cos, sin), residual)

    def after_attention(self, out, residual):
        """(this layer's MLP output, the residual stream before it)."""
        h = self._sublayer_output(self.attention_out_norm, self.self_attn.output(out))
        h, residual = add_norm(self.post_attention_layernorm, h, residual)
        return self._sublayer_output(self.mlp_out_norm, self.mlp(h)), residual

    def _sublayer_output(self, norm: RMSNorm | None, h: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as the residual stream adds it."""
        if norm is not None:
            h = norm(h)
        return h if self.residual_multiplier == 1 else h * self.residual_multiplier

    def unlike_llama(self) -> str | None:
        """What sets this layer apart from Llama's, if anything (native_layers.py runs Llama's)."""
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if any(norm is None or norm.scale_in_float32 for norm in norms):
            return "its norms are not Llama's pre-norms"
        if self.attention_out_norm is not None:
            return "it normalizes the attention's and the MLP's outputs"
        if getattr(self.mlp, "gelu", False):
            return "its MLP's activation is GELU"
        if self.residual_multiplier != 1:
            return "it scales the sublayers' outputs"
        return self.self_attn.unlike_llama()
