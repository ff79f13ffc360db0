"""The KV cache memory: per layer, one K and one V tensor of token slots.

A request owns one slot per token it has seen. Slot 0 is never handed out:
it is the harmless target of padded entries (CUDA-graph batches pad with it).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if num_slots < 2:
            raise ValueError("the KV pool needs at least 2 slots")
        self.num_slots = num_slots
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = torch.arange(1, num_slots, dtype=torch.long)
        self._num_free = num_slots - 1

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    @property
    def capacity(self) -> int:
        """Slots that can be handed out (all but the padding slot)."""
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self._num_free:
            return None
        out = self._free[self._num_free - n : self._num_free].clone()
        self._num_free -= n
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        if self._num_free + n > self.capacity:
            raise RuntimeError("KV slots freed twice")
        self._free[self._num_free : self._num_free + n] = slots.to(self._free.device)
        self._num_free += n
