"""The interface the model calls for attention over the KV cache.

Per forward pass the model calls `prepare(batch)` once, then `forward` once
per layer. Backends build whatever per-batch metadata they need (slot
tables, masks, kernel work lists) in `prepare`, so the layers reuse it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pyserve.model.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build the per-batch metadata every layer's `forward` reuses."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim], the new tokens of all sequences
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """Store k/v at `batch.out_cache_loc` in layer `layer_id`'s cache, then
        attend every new token over its own sequence (its stretch of
        `batch.kv_indices`, see ForwardBatch),
        causally: the new token at absolute position p sees positions <= p.
        Query head h reads kv head h // (heads // kv_heads). Returns
        [T, heads, head_dim] in q's dtype."""
