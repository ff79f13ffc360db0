"""Attention for models whose prompts attend both ways (ModelConfig.causal
False: encoders, and decoders trained bidirectionally such as
EmbeddingGemma): each prompt, computed whole in one step, over its own
new rows. The KV cache holds no layer of such a model, and nothing writes
or reads it. A sliding layer's token sees `window // 2` positions either
side, as transformers' bidirectional Gemma 3 does."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyserve.model.attention.base import AttentionBackend, check_options
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.step_plan import TORCH_STEP, StepPlan


def attend_within(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float | None = None,
                  reach: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """[tokens, heads, head_dim] attention of q [tokens, heads, head_dim]
    over k, v [tokens, kv_heads, head_dim], each prompt (`lengths` rows
    each, in order) over all of its own rows, or (`reach`) those at most
    `reach` positions away either side. Query head h reads kv head
    h // (heads // kv_heads); `scale` None: head_dim ** -0.5; `softcap`:
    each score s becomes softcap * tanh(s / softcap) before the softmax."""
    out = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (qs, ks, vs))  # [1, heads, n, head_dim]
        n = qs.shape[2]
        seen = None
        if reach is not None and n > reach + 1:
            at = torch.arange(n, device=q.device)
            seen = (at[:, None] - at[None, :]).abs() <= reach
        if softcap is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen, scale=scale, enable_gqa=True)
        else:
            group = qs.shape[1] // ks.shape[1]
            ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            scores = (qs @ ks.transpose(-1, -2)) * (scale if scale is not None else qs.shape[-1] ** -0.5)
            scores = torch.tanh(scores / softcap) * softcap
            if seen is not None:
                scores = scores.masked_fill(~seen, float("-inf"))
            o = scores.softmax(-1, dtype=torch.float32).to(qs.dtype) @ vs
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def whole_prompt_lengths(batch: ForwardBatch) -> list[int]:
    """Each prompt's length in the step; ValueError for a step that does not
    compute each of its prompts whole, in one piece."""
    if list(batch.extend_lens) != list(batch.seq_lens):
        raise ValueError("a model attending both ways computes whole prompts: this step has one in chunks or "
                         "after a cached prefix")
    return list(batch.extend_lens)


class BidirectionalAttention(AttentionBackend):
    def __init__(self, kv_buffer: KVBuffer):
        self.kv_buffer = kv_buffer

    def prepare(self, batch: ForwardBatch, plan: StepPlan = TORCH_STEP) -> None:
        whole_prompt_lengths(batch)
        self._batch = batch

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch, scale: float, *, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        check_options(q.shape[1], window, softcap, sinks)
        if sinks is not None:
            raise ValueError("attention sinks are not served in a model attending both ways")
        if batch is not self._batch:
            raise RuntimeError("BidirectionalAttention.prepare(batch) must be called before forward")
        return attend_within(q, k, v, batch.extend_lens, scale, None if window is None else window // 2, softcap)
