"""Attention in plain torch: gather a sequence's slots, then SDPA.

The CPU production path and the reference the Triton kernels are checked
against. Inputs to scaled_dot_product_attention are always 4-D with
`enable_gqa`: on CPU that takes the fused flash kernel, several times faster
than 3-D inputs or repeating the kv heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from pyserve.engine.attention.base import AttentionBackend
from pyserve.engine.kv_pool import KVPool
from pyserve.model.forward_batch import ForwardBatch


@dataclass
class _ExtendSeq:
    start: int  # first row of this sequence in q/k/v
    num_new: int
    slots: torch.Tensor | None  # [seq_len] to gather; None: no cached prefix, use k/v as given
    mask: torch.Tensor | None  # [num_new, seq_len] bool; None: causal (no prefix) or sees all


class TorchAttention(AttentionBackend):
    def __init__(self, kv_pool: KVPool):
        self.kv_pool = kv_pool
        self._batch: ForwardBatch | None = None
        self._extend: list[_ExtendSeq] = []
        self._decode_slots: torch.Tensor | None = None  # [B, max_len], padded with slot 0
        self._decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_len]; None when no padding

    def prepare(self, batch: ForwardBatch) -> None:
        self._batch = batch
        device = batch.input_ids.device
        if batch.is_decode:
            per_seq = batch.kv_indices.split(batch.seq_lens)
            self._decode_slots = pad_sequence(per_seq, batch_first=True, padding_value=0)
            lens = batch.seq_lens
            self._decode_mask = None
            if min(lens) != max(lens):
                lens_t = torch.tensor(lens, device=device)
                valid = torch.arange(max(lens), device=device)[None, :] < lens_t[:, None]
                self._decode_mask = valid[:, None, None, :]
            return
        self._extend = []
        start = 0
        per_seq = batch.kv_indices.split(batch.seq_lens)
        for num_new, seq_len, slots in zip(batch.extend_lens, batch.seq_lens, per_seq):
            if num_new == seq_len:
                plan = _ExtendSeq(start, num_new, None, None)
            else:
                # New token i sits at position seq_len - num_new + i and sees
                # every position up to itself.
                mask = None
                if num_new > 1:
                    q_pos = torch.arange(seq_len - num_new, seq_len, device=device)
                    mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
                plan = _ExtendSeq(start, num_new, slots, mask)
            self._extend.append(plan)
            start += num_new

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch, scale: float) -> torch.Tensor:
        if batch is not self._batch:
            raise RuntimeError("TorchAttention.prepare(batch) must be called before forward")
        k_cache = self.kv_pool.k_buffer[layer_id]
        v_cache = self.kv_pool.v_buffer[layer_id]
        k_cache[batch.out_cache_loc] = k
        v_cache[batch.out_cache_loc] = v
        if batch.is_decode:
            return self._decode(q, k_cache, v_cache, scale)
        out = torch.empty_like(q)
        for s in self._extend:
            rows = slice(s.start, s.start + s.num_new)
            if s.slots is None:
                ks, vs = k[rows], v[rows]
            else:
                ks, vs = k_cache[s.slots], v_cache[s.slots]
            # [tokens, heads, dim] -> [1, heads, tokens, dim]
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None],
                ks.transpose(0, 1)[None],
                vs.transpose(0, 1)[None],
                attn_mask=s.mask,
                is_causal=s.slots is None,
                scale=scale,
                enable_gqa=True,
            )
            out[rows] = o[0].transpose(0, 1)
        return out

    def _decode(self, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        # One query per sequence: every sequence is padded to the longest
        # (padding reads slot 0, masked out), so the batch is one SDPA call.
        slots = self._decode_slots
        ks = k_cache[slots].transpose(1, 2)  # [B, kv_heads, max_len, D]
        vs = v_cache[slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], ks, vs, attn_mask=self._decode_mask, scale=scale, enable_gqa=True
        )
        return o[:, :, 0, :]
