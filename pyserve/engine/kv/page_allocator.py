"""Which KV pages are free: a free list over the pages of the KV buffer.

A request owns whole pages; the radix cache shares whole pages between
requests. Page 0 is never handed out: its slots are the target of padded
rows (decode batches and CUDA-graph batches pad with slot 0).

The free list is a CPU tensor used as a stack: alloc and free never touch
the device, so they never wait on a running forward pass.
"""

from __future__ import annotations

import torch


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int = 1):
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages (page 0 is reserved)")
        if page_size < 1:
            raise ValueError("the page size must be at least 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = torch.arange(1, num_pages, dtype=torch.long)  # [: _num_free] are free
        self._num_free = num_pages - 1
        self._in_use = torch.zeros(num_pages, dtype=torch.bool)  # catches double frees

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the padding page)."""
        return self.num_pages - 1

    @property
    def capacity_tokens(self) -> int:
        return self.capacity * self.page_size

    @property
    def num_free(self) -> int:
        """Free pages."""
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free pages as a CPU int64 tensor of page ids, or None if fewer are free."""
        if n > self._num_free:
            return None
        out = self._free[self._num_free - n : self._num_free].clone()
        self._num_free -= n
        self._in_use[out] = True
        return out

    def free(self, pages: torch.Tensor) -> None:
        pages = pages.to("cpu", torch.long)
        n = pages.numel()
        if n == 0:
            return
        if not bool(self._in_use[pages].all()) or pages.unique().numel() != n:
            raise RuntimeError("freeing KV pages that are not allocated (double free?)")
        self._in_use[pages] = False
        self._free[self._num_free : self._num_free + n] = pages
        self._num_free += n

    def free_slots(self, slots: torch.Tensor) -> None:
        """Free the pages under a page-aligned run of token slots."""
        self.free(self.pages_of(slots))

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Page ids under a run of token slots that starts on a page boundary."""
        return slots[:: self.page_size] // self.page_size

    def free_page_ids(self) -> torch.Tensor:
        return self._free[: self._num_free]
