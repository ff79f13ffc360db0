"""The radix tree of cached prefixes, on its own."""

from __future__ import annotations

import torch

from pyserve.engine.kv_pool import PagePool
from pyserve.engine.radix_cache import RadixCache


def make(slots: int = 64) -> tuple[PagePool, RadixCache]:
    pool = PagePool(1, slots + 1, 1, 2, torch.float32, "cpu")
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
