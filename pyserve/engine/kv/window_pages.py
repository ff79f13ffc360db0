"""The sliding layers' own pages, for models with sliding-window layers.

The KV buffer keeps the global layers over the full pool and the sliding
layers over a smaller sliding pool (model/kv_buffer.py). Sequences and the
radix cache address tokens by full slot only; each full page in use is
backed by a sliding page (`page_map`) until no layer will read that page's
sliding K/V again, when the sliding page alone goes back and the full page
is left with none (0: the reserved padding page, never read).

`WindowPageAllocator` is the full pool's allocator with that second pool
beside it: `alloc` takes a page of each, `free` gives back both, and
`drop_window` gives back only the sliding one. Code that frees full pages
(the radix cache's eviction, the KV manager) thus frees both without
knowing about the second pool.
"""

from __future__ import annotations

import torch

from pyserve.engine.kv.page_allocator import PageAllocator


class WindowPageAllocator(PageAllocator):
    def __init__(self, num_pages: int, window_num_pages: int, page_size: int, window: int):
        super().__init__(num_pages, page_size)
        if window < 1:
            raise ValueError(f"a sliding window of {window} tokens")
        self.window = window
        self.window_pages = PageAllocator(window_num_pages, page_size)
        # Full page -> the sliding page that holds its sliding layers' K/V; 0: none.
        self.page_map = torch.zeros(num_pages, dtype=torch.long)

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` full pages, each with a sliding page; None unless both pools
        have `n` free."""
        if n > self.num_free or n > self.window_pages.num_free:
            return None
        pages = super().alloc(n)
        self.page_map[pages] = self.window_pages.alloc(n)
        return pages

    def free(self, pages: torch.Tensor) -> None:
        pages = pages.to("cpu", torch.long)
        self.drop_window(pages)
        super().free(pages)

    def drop_window(self, pages: torch.Tensor) -> int:
        """Give back the sliding pages of full `pages` (those that have one);
        returns how many."""
        backing = self.page_map[pages]
        held = backing != 0
        self.window_pages.free(backing[held])
        self.page_map[pages[held]] = 0
        return int(held.sum())

    def adopt_window(self, into: torch.Tensor, source: torch.Tensor) -> None:
        """Where full page `into[i]` has no sliding page and `source[i]` (a
        copy of the same tokens' K/V, about to be freed) has one, move it
        over: the kept copy stays readable by the sliding layers."""
        moves = (self.page_map[into] == 0) & (self.page_map[source] != 0)
        self.page_map[into[moves]] = self.page_map[source[moves]]
        self.page_map[source[moves]] = 0

    def has_window(self, slots: torch.Tensor) -> torch.Tensor:
        """Per slot, whether its page still has its sliding K/V."""
        return self.page_map[slots // self.page_size] != 0

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The sliding pool's slots of full `slots` (slot 0's page for those
        whose sliding page is gone: the sliding layers never read them)."""
        ps = self.page_size
        return self.page_map[slots // ps] * ps + slots % ps

    def window_problem(self) -> str | None:
        """None when every sliding page is exactly free or backing one full
        page in use, and no free full page keeps one; else what is wrong."""
        in_use = ~self.free_mask()
        backing = self.page_map[in_use]
        owners = torch.cat([self.window_pages.free_page_ids(), backing[backing != 0]])
        counts = torch.bincount(owners, minlength=self.window_pages.num_pages)
        counts[0] += 1  # the reserved padding page
        stray = int((self.page_map[~in_use] != 0).sum())
        if bool((counts == 1).all()) and not stray:
            return None
        lost = (counts == 0).nonzero().flatten().tolist()
        doubled = (counts > 1).nonzero().flatten().tolist()
        return (f"sliding KV pages leaked: {lost[:10]} (of {len(lost)}); held twice: {doubled[:10]} "
                f"(of {len(doubled)}); kept by free full pages: {stray}")

    def free_mask(self) -> torch.Tensor:
        """Per full page, whether it is free (page 0 counts as in use)."""
        mask = torch.zeros(self.num_pages, dtype=torch.bool)
        mask[self.free_page_ids()] = True
        return mask


def page_allocator(kv_buffer, window: int | None) -> PageAllocator:
    """The allocator of `kv_buffer`'s pages (a model.kv_buffer.KVBuffer):
    with its sliding pool beside the full one where it has one, for
    layers of sliding window `window`."""
    if kv_buffer.window_pages is None:
        return PageAllocator(kv_buffer.num_pages, kv_buffer.page_size)
    return WindowPageAllocator(kv_buffer.num_pages, kv_buffer.window_pages, kv_buffer.page_size, window)
