"""The radix tree of cached prefixes, on its own."""

from __future__ import annotations

import pytest
import torch

from pyserve.engine.kv.page_allocator import PageAllocator
from pyserve.engine.kv.radix_cache import RadixCache


def make(slots: int = 64) -> tuple[PageAllocator, RadixCache]:
    pool = PageAllocator(slots + 1)
    return pool, RadixCache(pool)


def test_match_insert_and_split():
    pool, cache = make()
    a = pool.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], a) == 0
    slots, node = cache.match_prefix([1, 2, 3, 9])
    assert slots.tolist() == a[:3].tolist()  # the edge was split after 3 tokens
    b = pool.alloc(3)
    assert cache.insert([1, 2, 3, 7, 8, 9], torch.cat([a[:3], b])) == 3
    assert cache.match_prefix([1, 2, 3, 7, 8, 9, 10])[0].tolist() == a[:3].tolist() + b.tolist()
    assert cache.total_pages == 8


def test_locked_prefixes_survive_eviction_and_lru_goes_first():
    pool, cache = make()
    old, new = pool.alloc(4), pool.alloc(4)
    cache.insert([1, 1, 1, 1], old)
    cache.insert([2, 2, 2, 2], new)
    cache.match_prefix([2, 2])  # touch: [2...] is now the most recent
    assert cache.evict(1) == 4
    assert cache.match_prefix([1, 1, 1])[0].numel() == 0
    _, node = cache.match_prefix([2, 2, 2, 2])
    cache.lock(node)
    assert cache.evict(10) == 0  # locked
    cache.unlock(node)
    assert cache.evict(10) == 4
    assert pool.num_free == pool.capacity and cache.total_pages == 0


def test_evicting_a_leaf_can_free_its_parent():
    pool, cache = make()
    s = pool.alloc(6)
    cache.insert([1, 2, 3, 4], s[:4])
    cache.insert([1, 2, 5, 6], torch.cat([s[:2], s[4:]]))
    assert cache.evict(100) == 6
    assert pool.num_free == pool.capacity


def make_paged(pages: int = 16, page_size: int = 4) -> tuple[PageAllocator, RadixCache]:
    pool = PageAllocator(pages + 1, page_size=page_size)
    return pool, RadixCache(pool)


def page_slots(pool: PageAllocator, n_pages: int) -> torch.Tensor:
    pages = pool.alloc(n_pages)
    return (pages[:, None] * pool.page_size + torch.arange(pool.page_size)).flatten()


def test_pages_match_and_split_only_on_page_boundaries():
    pool, cache = make_paged()
    a = page_slots(pool, 3)
    ids = list(range(100, 112))
    assert cache.insert(ids, a) == 0
    # 10 common tokens are 2 whole pages; the edge splits after 8 tokens
    slots, _ = cache.match_prefix(ids[:10] + [1, 2, 3])
    assert slots.tolist() == a[:8].tolist()
    # a prefix shorter than a page shares nothing
    assert cache.match_prefix(ids[:3] + [9] * 5)[0].numel() == 0
    # a sibling that differs inside the first page is its own child
    b = page_slots(pool, 2)
    assert cache.insert([100, 101, 7, 7, 8, 8, 8, 8], b) == 0
    assert cache.match_prefix([100, 101, 7, 7, 8, 8, 8, 8, 5])[0].tolist() == b.tolist()
    assert cache.match_prefix(ids)[0].tolist() == a.tolist()
    assert cache.total_pages == 5


def test_pages_refuse_partial_inserts_and_evict_whole_pages():
    pool, cache = make_paged()
    partial = page_slots(pool, 1)[:3]
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1, 2, 3], partial)
    pool.free_slots(partial)
    s = page_slots(pool, 4)
    cache.insert(list(range(16)), s)
    cache.insert(list(range(8)) + [50] * 8, torch.cat([s[:8], page_slots(pool, 2)]))
    free_before = pool.num_free
    assert cache.evict(1) == 2  # the least recently used leaf: 2 pages
    assert pool.num_free == free_before + 2
    assert cache.evict(100) == 4
    assert pool.num_free == pool.capacity and cache.total_pages == 0
