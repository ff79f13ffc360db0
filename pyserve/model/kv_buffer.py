"""The KV cache memory: per layer, K and V pages of `page_size` tokens.

Each layer's K (and V) is one tensor [num_pages, page_size, kv_heads,
head_dim]. Attention addresses it by token slot, `page * page_size +
offset`, through the flat views `k_buffer[layer]` / `v_buffer[layer]`
[num_pages * page_size, kv_heads, head_dim].

This is only the memory. Which pages are free and who holds which is the
engine's business (engine/kv/manager.py); page 0 is never handed out, so
its slots are the harmless target of padded rows.
"""

from __future__ import annotations

import torch


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
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_buffer = [k.view(-1, num_kv_heads, head_dim) for k in self.k_pages]
        self.v_buffer = [v.view(-1, num_kv_heads, head_dim) for v in self.v_pages]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token across all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
