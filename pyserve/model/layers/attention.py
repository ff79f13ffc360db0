"""The attention block: fused q/k/v projection, optional q/k norms,
rotary embedding, the attention backend over the KV cache, and the output
projection. Under tensor parallelism (parallel.py) a rank holds its heads:
q/k/v column-parallel, o_proj row-parallel with one all-reduce.

Options, from the config (config.py): biases on q/k/v and on o_proj; q/k
RMSNorm per head (Qwen3) or over all heads (Olmo 2); the softmax scale;
partial, interleaved, or per layer no rotary embedding (NoPE layers).
"""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.attention.base import AttentionBackend
from pyserve.model.config import ModelConfig
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.layers.norms import AllHeadsRMSNorm, rms_norm
from pyserve.model.layers.rotary import apply_rotary_qk
from pyserve.model.parallel import ModelShard


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, shard: ModelShard, fused_kernels: bool = True):
        super().__init__()
        self.layer_id = layer_id
        self.fused_kernels = fused_kernels
        self.tp = tp = shard.tp
        self.num_heads = len(shard.q_heads)
        self.num_kv_heads = len(shard.kv_heads)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.rotates = layer_id not in config.nope_layers
        self.rotary_interleaved = config.rotary_interleaved
        self.rotary_dim = config.rotary_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # Row-parallel: the ranks' partial outputs are summed, so only rank 0 adds the bias.
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias and tp.rank == 0)
        self.qk_norm = config.qk_norm
        if config.qk_norm == "all":
            kv_heads = config.num_key_value_heads
            self.q_norm = AllHeadsRMSNorm(self.q_size, config.num_attention_heads * self.head_dim,
                                          config.rms_norm_eps, tp)
            self.k_norm = AllHeadsRMSNorm(self.kv_size, kv_heads * self.head_dim, config.rms_norm_eps, tp,
                                          replicas=max(1, tp.size // kv_heads))
        elif config.qk_norm == "head":
            self.q_norm = rms_norm(config, self.head_dim, fused_kernels)
            self.k_norm = rms_norm(config, self.head_dim, fused_kernels)
        else:
            self.q_norm = self.k_norm = None
        # This layer's options to AttentionBackend.forward, None: off. A
        # family whose layers attend so sets them (a sliding window, Gemma 2's
        # soft-cap, gpt-oss's sinks); the layers built from config alone have none.
        self.window: int | None = None
        self.softcap: float | None = None
        self.sinks: torch.Tensor | None = None
        # Where the model rotates by several rope bases (rotary.RotaryTables:
        # Gemma 3's local and global layers), the table this layer's is; None: one table.
        self.rotary_table: int | None = None

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the new tokens, q and k rotated."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotates:
            if self.rotary_table is not None:
                cos, sin = cos[:, self.rotary_table], sin[:, self.rotary_table]
            q, k = apply_rotary_qk(q, k, cos, sin, self.fused_kernels, self.rotary_interleaved)
        return q, k, v

    def attend(self, q, k, v, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        return attn.forward(q, k, v, self.layer_id, batch, self.scale, window=self.window, softcap=self.softcap,
                            sinks=self.sinks)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output [T, heads, head_dim], summed over the ranks."""
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))

    def unlike_llama(self) -> str | None:
        """What sets this block apart from Llama's, if anything (native_layers.py runs Llama's)."""
        if self.qk_norm is not None:
            return "it normalizes q and k " + ("per head" if self.qk_norm == "head" else "over all heads")
        if not self.rotates:
            return "some of its layers have no rotary embedding"
        if self.rotary_interleaved or self.rotary_dim != self.head_dim:
            return "its rotary embedding is interleaved or covers part of each head"
        if self.rotary_table is not None:
            return "its layers rotate by different rope bases"
        if (self.window, self.softcap, self.sinks) != (None, None, None):
            return "its attention has a sliding window, a soft-cap or sinks"
        return None
