"""The interface the model calls for attention over the KV cache."""

from __future__ import annotations

from typing import Protocol

import torch

from pyserve.model.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """Store k/v at batch.out_cache_loc, then attend every new token over
        its sequence up to and including itself. Returns [T, heads, head_dim]."""
        ...
