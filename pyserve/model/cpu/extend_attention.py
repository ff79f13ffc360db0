"""A prefill chunk's attention over its sequence on the CPU, by
rust/kernels/extend_attention.rs: the k and v read from the paged cache by slot,
8 x 8 transposed tiles of 64 keys against 16 new tokens' query heads,
the softmax online: faster than torch's flash SDPA over the gathered k/v
on an AVX2 CPU (bench/README.md, K10).

The kernels' threads spin between calls, so a step takes this path only
where torch's own threads are parked: the step plan says so
(StepPlan.native_extend_attention, decided by RankModel for the 8da4w
steps that run torch on one thread).
"""

from __future__ import annotations

import torch

from pyserve import _rust
from pyserve.model.cpu import blocks
from pyserve.model.kv_buffer import KVBuffer


def fits(kv_buffer: KVBuffer, layers=()) -> bool:
    """Whether the kernel serves this cache and these decoder layers here:
    float32 on a CPU with AVX2, heads of a multiple of 8 values, V as wide
    as K (not a latent cache's view), and plain causal attention in every
    layer (no sliding window, soft-cap or sinks)."""
    k, v = kv_buffer.k_buffer[0], kv_buffer.v_buffer[0]
    plain = all(layer.self_attn.window is None and layer.self_attn.softcap is None
                and layer.self_attn.sinks is None for layer in layers)
    return (plain and k.device.type == "cpu" and k.dtype == torch.float32 and k.shape[-1] % 8 == 0
            and v.shape == k.shape and blocks.available())


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           scale: float, threads: int = 1) -> torch.Tensor:
    """q [tokens, heads, head_dim] of a sequence's new tokens; k_cache and
    v_cache [cache slots, kv_heads, head_dim] one layer's; slots int64, the
    sequence's in order, its new tokens' last. Token t of T sees the first
    len(slots) - T + t + 1 slots. `threads` share the work, the caller's
    among them (the attention backend passes RankModel's count). The
    kernel refuses (ValueError) what does not fit."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _rust.attend_extend(q.detach().contiguous().numpy(), k_cache.numpy(), v_cache.numpy(),
                        slots.to(torch.long).contiguous().numpy(), float(scale), out.numpy(), threads)
    return out
