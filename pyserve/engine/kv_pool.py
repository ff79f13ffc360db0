"""The KV cache memory: per layer, one K and one V tensor of token slots.

A request owns one slot per token it has seen (page size 1). Slot 0 is never
handed out: it is the harmless target of padded entries (decode batches and
CUDA-graph batches pad with it), so it stays finite (zeros) forever.

The free list is a CPU tensor used as a stack: alloc and free never touch
the device, so they never wait on a running forward pass.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if num_slots < 2:
            raise ValueError("the KV pool needs at least 2 slots (slot 0 is reserved)")
        self.num_slots = num_slots
        self.dtype = dtype
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = torch.arange(1, num_slots, dtype=torch.long)  # [: _num_free] are free
        self._num_free = num_slots - 1
        self._in_use = torch.zeros(num_slots, dtype=torch.bool)  # catches double frees

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token across all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @classmethod
    def slots_for_budget(
        cls, budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """How many slots (the reserved slot 0 included) fit in `budget_bytes`."""
        return max(budget_bytes // cls.bytes_per_slot(num_layers, num_kv_heads, head_dim, dtype), 2)

    @property
    def capacity(self) -> int:
        """Slots that can be handed out (all but the padding slot)."""
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots as a CPU int64 tensor, or None if fewer are free."""
        if n > self._num_free:
            return None
        out = self._free[self._num_free - n : self._num_free].clone()
        self._num_free -= n
        self._in_use[out] = True
        return out

    def free(self, slots: torch.Tensor) -> None:
        slots = slots.to("cpu", torch.long)
        n = slots.numel()
        if n == 0:
            return
        if not bool(self._in_use[slots].all()) or slots.unique().numel() != n:
            raise RuntimeError("freeing KV slots that are not allocated (double free?)")
        self._in_use[slots] = False
        self._free[self._num_free : self._num_free + n] = slots
        self._num_free += n
