"""Attention in plain torch: gather a sequence's slots, then SDPA.

The CPU production path and the reference the Triton kernels are checked
against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyserve.engine.kv_pool import KVPool
from pyserve.model.forward_batch import ForwardBatch


class TorchAttention:
    def __init__(self, kv_pool: KVPool):
        self.kv_pool = kv_pool

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch, scale: float) -> torch.Tensor:
        k_cache = self.kv_pool.k_buffer[layer_id]
        v_cache = self.kv_pool.v_buffer[layer_id]
        k_cache[batch.out_cache_loc] = k
        v_cache[batch.out_cache_loc] = v
        if batch.is_decode:
            return self._decode(q, k_cache, v_cache, batch, scale)
        out = torch.empty_like(q)
        start = 0
        for n_new, seq_len, slots in zip(batch.extend_lens, batch.seq_lens, batch.kv_indices):
            # [heads, tokens, dim] layout for SDPA
            qs = q[start : start + n_new].transpose(0, 1)
            ks = k_cache[slots].transpose(0, 1)
            vs = v_cache[slots].transpose(0, 1)
            # New token i sits at position seq_len - n_new + i and sees every
            # position up to itself.
            q_pos = torch.arange(seq_len - n_new, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start : start + n_new] = o.transpose(0, 1)
            start += n_new
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
        # One query per sequence: pad every sequence to the longest and mask
        # the padding, so the whole batch is a single SDPA call.
        max_len = max(batch.seq_lens)
        bs = batch.batch_size
        slots = torch.zeros(bs, max_len, dtype=torch.long, device=q.device)
        for i, s in enumerate(batch.kv_indices):
            slots[i, : s.numel()] = s
        lens = torch.tensor(batch.seq_lens, device=q.device)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, L]
        ks = k_cache[slots].permute(0, 2, 1, 3)  # [B, kv_heads, L, D]
        vs = v_cache[slots].permute(0, 2, 1, 3)
        qs = q[:, :, None, :]  # [B, heads, 1, D]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        return o[:, :, 0, :]
