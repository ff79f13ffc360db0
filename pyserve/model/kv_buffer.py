"""The KV cache memory: per layer, K and V pages of `page_size` tokens.

Each layer's K (and V) is one tensor [num_pages, page_size, kv_heads,
head_dim]. Attention addresses it by token slot, `page * page_size +
offset`, through the flat views `k_buffer[layer]` / `v_buffer[layer]`
[num_pages * page_size, kv_heads, head_dim].

A latent cache (DeepSeek's multi-head latent attention, layers/mla.py)
has a head dim of type LatentDim: its one KV head holds a token's
compressed latent and its rotated key part, and V is the latent, the
head's first `value_dim` values: `v_buffer[layer]` is a view of K, no
second copy.

With a sliding pool (`window_layers`, `window_pages`), the sliding-window
layers' K/V lives in pages of their own, fewer than the full pool's: a
token's full slot addresses it in the global layers, its sliding slot
(ForwardBatch's `window_*` tables) in the sliding ones. A sliding layer
reads only its window's keys, so a page no window reaches any more gives
its sliding memory back (engine/kv/window_pages.py) while its full page
stays.

This is only the memory. Which pages are free and who holds which is the
engine's business (engine/kv/manager.py); page 0 is never handed out, so
its slots are the harmless target of padded rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# --kv-cache-dtype: "auto" stores K/V in the model's dtype. FP8 holds a
# token in a quarter of float32's bytes, half of bfloat16's; values cast
# to e4m3 saturate at +-448 (no per-tensor scales are read).
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class LatentDim(int):
    """The head dim of a cache whose V is the first `value_dim` values of
    each K head (a view), as a config's `head_dim` carries it to the cache."""

    value_dim: int

    def __new__(cls, dim: int, value_dim: int):
        if not 0 < value_dim <= dim:
            raise ValueError(f"a latent value of {value_dim} values in a head of {dim}")
        self = super().__new__(cls, dim)
        self.value_dim = value_dim
        return self

    def __getnewargs__(self):
        return int(self), self.value_dim

    def __repr__(self) -> str:
        return f"LatentDim({int(self)}, value_dim={self.value_dim})"


@dataclass(frozen=True)
class SlotCopies:
    """K/V to copy in every layer, slot `src[i]` to slot `dst[i]` (int64
    tensors on the cache's device); in the sliding layers by their sliding
    slots, `window_src` and `window_dst` (None without a sliding pool)."""

    src: torch.Tensor
    dst: torch.Tensor
    window_src: torch.Tensor | None = None
    window_dst: torch.Tensor | None = None


class KVBuffer:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
        window_layers: frozenset[int] = frozenset(),
        window_pages: int | None = None,
        cache_dtype: torch.dtype | None = None,
    ):
        """`dtype`: the model's, which attention computes in; `cache_dtype`:
        what K/V are stored as, if not that (an FP8 one: --kv-cache-dtype),
        cast on the way in and out. `window_layers`: the sliding layers whose
        K/V has `window_pages` pages of its own (both or neither)."""
        if bool(window_layers) != (window_pages is not None):
            raise ValueError("a sliding pool takes its layers and its pages")
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        cache_dtype = cache_dtype or dtype
        self.window_layers = frozenset(window_layers)
        self.window_pages = window_pages

        def pages(layer: int) -> tuple[int, ...]:
            return (window_pages if layer in self.window_layers else num_pages, page_size, num_kv_heads, head_dim)

        self.k_pages = [torch.zeros(pages(i), dtype=cache_dtype, device=device) for i in range(num_layers)]
        self.k_buffer = [k.view(-1, num_kv_heads, head_dim) for k in self.k_pages]
        self.latent = isinstance(head_dim, LatentDim)
        if self.latent:  # V is a view of K's first values
            self.v_pages = [k[..., :head_dim.value_dim] for k in self.k_pages]
            self.v_buffer = [k[..., :head_dim.value_dim] for k in self.k_buffer]
        else:
            self.v_pages = [torch.zeros(pages(i), dtype=cache_dtype, device=device) for i in range(num_layers)]
            self.v_buffer = [v.view(-1, num_kv_heads, head_dim) for v in self.v_pages]

    def copy_slots(self, copies: SlotCopies) -> None:
        """Every layer's K and V at the sources, read before any is written,
        to the destinations."""
        for layer, (k, v) in enumerate(zip(self.k_buffer, self.v_buffer)):
            windowed = layer in self.window_layers
            src, dst = (copies.window_src, copies.window_dst) if windowed else (copies.src, copies.dst)
            k[dst] = k[src]
            if not self.latent:  # a latent cache's V is a view of K: copied with it
                v[dst] = v[src]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token across all layers (K alone for a latent cache)."""
        tensors = 1 if isinstance(head_dim, LatentDim) else 2
        return tensors * num_layers * num_kv_heads * head_dim * dtype.itemsize
