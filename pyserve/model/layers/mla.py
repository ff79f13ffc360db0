"""Multi-head latent attention (DeepSeek V2 / V3), over a latent KV cache.

DeepSeek compresses each token's keys and values into one latent c_kv
(kv_lora_rank values, after kv_a_layernorm) plus one rotated key part
k_pe (qk_rope_head_dim values) that every head shares. Head h's key is
[W_UK_h c_kv, k_pe] and its value W_UV_h c_kv, W_UK and W_UV the two
halves of kv_b_proj's rows per head. So

    q_h . k_h = (W_UK_h^T q_nope_h) . c_kv + q_pe_h . k_pe
    sum_j p_j v_h,j = W_UV_h (sum_j p_j c_kv,j)

and attention runs as MQA over the latent (the "absorbed" form): the
cache holds [c_kv, k_pe] as one KV head of kv_lora_rank + qk_rope_head_dim
values (kv_buffer.LatentDim), V is that head's first kv_lora_rank values
(a view), the query is [W_UK_h^T q_nope_h, q_pe_h], and W_UV is applied
to the attention's output before o_proj. The expanded per-head K/V are
never formed.

The query comes through q_a_proj, q_a_layernorm and q_b_proj (q_lora_rank
set) or one q_proj (DeepSeek-V2-Lite). The rope part rotates in
interleaved pairs (V2 always, V3 with `rope_interleave`) or rotate-half.
The softmax scale is qk_head_dim ** -0.5, times mscale(factor,
mscale_all_dim) ** 2 under YaRN (see families/deepseek.py).

Under tensor parallelism a rank holds its query heads' rows of q / q_b
and kv_b and their columns of o_proj (one all-reduce); the latent path
(q_a, kv_a and their norms) and the cache's one head are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pyserve.model.attention.base import AttentionBackend
from pyserve.model.config import ModelConfig
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.layers.norms import RMSNorm
from pyserve.model.layers.rotary import apply_rotary
from pyserve.model.parallel import ModelShard

# DeepSeek's q_a_layernorm and kv_a_layernorm keep RMSNorm's default epsilon, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int | None  # None: one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool  # rope pairs dimensions 2i, 2i + 1 (else i, i + half)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """A token's cache entry per layer: the latent and the rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class MultiHeadLatentAttention(nn.Module):
    """The attention block of a DeepSeek decoder layer, with the interface of
    layers/attention.Attention (project, attend, output)."""

    # Read as a weight (the absorbed W_UK and W_UV), never called as a layer:
    # the quantized modes leave it dense.
    dense_linears = ("kv_b_proj",)

    def __init__(self, config: ModelConfig, spec: MLASpec, layer_id: int, shard: ModelShard):
        super().__init__()
        self.spec = spec
        self.layer_id = layer_id
        self.tp = shard.tp
        self.num_heads = heads = len(shard.q_heads)
        hidden, bias = config.hidden_size, config.attention_bias
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * spec.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, spec.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, heads * spec.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, spec.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(spec.kv_lora_rank, heads * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False)
        # Row-parallel: the ranks' partial outputs are summed, so only rank 0 adds the bias.
        self.o_proj = nn.Linear(heads * spec.v_head_dim, hidden, bias=bias and self.tp.rank == 0)
        self.scale = config.attention_scale
        # The options AttentionBackend.forward takes, none of which DeepSeek uses.
        self.window: int | None = None
        self.softcap: float | None = None
        self.sinks: torch.Tensor | None = None

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, rank] and W_UV [heads, v, rank]: views of kv_b_proj's weight."""
        spec = self.spec
        per_head = self.kv_b_proj.weight.view(self.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, -1)
        return per_head[:, :spec.qk_nope_head_dim], per_head[:, spec.qk_nope_head_dim:]

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The absorbed query [T, heads, latent_dim], the cache entry
        [T, 1, latent_dim] and the latent value [T, 1, kv_lora_rank] (a view of it)."""
        spec = self.spec
        q = self.q_proj(x) if spec.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.num_heads, spec.qk_head_dim).split(
            [spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = apply_rotary(q_pe, cos, sin, spec.rope_interleaved)
        k_pe = apply_rotary(k_pe[:, None, :], cos, sin, spec.rope_interleaved)
        w_uk, _ = self._absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, heads, rank]
        entry = torch.cat([c_kv[:, None, :], k_pe], dim=-1)
        return torch.cat([q_latent, q_pe], dim=-1), entry, entry[..., :spec.kv_lora_rank]

    def attend(self, q, k, v, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        return attn.forward(q, k, v, self.layer_id, batch, self.scale)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj of W_UV applied to the attention output [T, heads, kv_lora_rank], summed over the ranks."""
        _, w_uv = self._absorbed_weights()
        values = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, heads, v]
        return self.tp.all_reduce(self.o_proj(values.reshape(-1, self.num_heads * self.spec.v_head_dim)))

    def unlike_llama(self) -> str | None:
        return "its attention is multi-head latent attention"
