"""The KV manager on its own: pages that are free, cached or held, and the
figures and integrity check built on them. No model: sequences are given
slots as the scheduler would ask for them."""

from __future__ import annotations

import pytest
import torch

from pyserve.engine.kv.manager import KVManager
from pyserve.engine.kv.page_allocator import PageAllocator
from pyserve.engine.request import SamplingParams
from pyserve.engine.sequence import Sequence


def make(pages: int = 33, page_size: int = 1, cache: bool = True) -> KVManager:
    return KVManager(PageAllocator(pages, page_size), use_radix_cache=cache)


def seq(prompt: list[int], rid: str = "r", **params) -> Sequence:
    return Sequence(rid=rid, prompt_ids=prompt, params=SamplingParams(**params))


def admit_and_compute(kv: KVManager, s: Sequence, n: int | None = None) -> int:
    """Admit `s` with whatever prefix the cache has, then give it slots for
    `n` more tokens (default: the rest of its tokens), as one step would;
    returns the cache hit."""
    hit = kv.lookup(s)
    kv.admit(s, hit)
    n = s.num_tokens - s.kv_len if n is None else n
    assert kv.make_room(kv.pages_needed(s, n))
    kv.append_slots(s, kv.new_slots(s, n))
    kv.share_prompt(s)
    return hit.length


# -- the page allocator -------------------------------------------------------


def test_allocator_never_hands_out_page_0_and_runs_dry():
    pages = PageAllocator(8)
    assert pages.num_pages == 8 and pages.capacity == 7 and pages.num_free == 7
    assert pages.alloc(8) is None
    a = pages.alloc(4)
    b = pages.alloc(3)
    assert pages.num_free == 0 and pages.alloc(1) is None
    assert sorted(torch.cat([a, b]).tolist()) == list(range(1, 8))
    assert pages.alloc(0).numel() == 0
    pages.free(a)
    assert pages.num_free == 4
    assert sorted(pages.alloc(4).tolist()) == sorted(a.tolist())


def test_allocator_rejects_double_free_and_page_0():
    pages = PageAllocator(8)
    a = pages.alloc(3)
    pages.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        pages.free(a)
    with pytest.raises(RuntimeError):
        pages.free(torch.tensor([0]))
    b = pages.alloc(2)
    with pytest.raises(RuntimeError):
        pages.free(torch.cat([b, b[:1]]))
    assert pages.num_free == 5


# -- sharing prompts ----------------------------------------------------------


def test_a_computed_prompt_is_shared_at_once_and_comes_back_when_released():
    kv = make()
    first = seq(list(range(10, 30)), "a")
    assert admit_and_compute(kv, first) == 0
    # The prompt went into the cache as soon as it was computed...
    usage = kv.usage([first])
    assert usage["cached"] == 20 and usage["in_use"] == 0 and usage["cached_evictable"] == 0
    # ...so a second request with the same prompt starts from it (all but
    # the last token, whose logits it needs).
    second = seq(list(range(10, 30)), "b")
    assert admit_and_compute(kv, second) == 19
    assert second.cache_hit == 19 and torch.equal(second.slots[:19], first.slots[:19])
    assert kv.integrity_problem([first, second]) is None
    first.output_ids.append(7)
    kv.append_slots(first, kv.new_slots(first, 1))
    kv.release(first)
    kv.release(second)
    usage = kv.usage([])
    assert usage["in_use"] == 0 and usage["cached"] == usage["cached_evictable"] == 21
    assert usage["free"] + usage["cached"] == usage["total"]
    assert kv.integrity_problem([]) is None


def test_the_first_admissions_hit_is_the_one_reported():
    kv = make()
    admit_and_compute(kv, seq(list(range(10, 30)), "a"))
    s = seq(list(range(10, 30)), "b")
    admit_and_compute(kv, s)
    kv.release(s)  # retracted...
    kv.evict_all()
    admit_and_compute(kv, s)  # ...and resumed with nothing cached
    assert s.cache_hit == 19


def test_prompt_logprobs_and_a_disabled_cache_take_no_prefix():
    kv = make(pages=65)
    admit_and_compute(kv, seq(list(range(10, 30)), "a"))
    assert admit_and_compute(kv, seq(list(range(10, 30)), "b", prompt_logprobs=True)) == 0
    off = make(pages=65, cache=False)
    admit_and_compute(off, seq(list(range(10, 30)), "a"))
    assert admit_and_compute(off, seq(list(range(10, 30)), "b")) == 0
    assert off.usage([])["cached"] == 0


def test_kv_of_a_failed_forward_is_never_cached():
    kv = make()
    s = seq(list(range(10, 30)))
    hit = kv.lookup(s)
    kv.admit(s, hit)
    kv.append_slots(s, kv.new_slots(s, 20))
    s.kv_valid = False
    kv.release(s)
    assert kv.usage([])["cached"] == 0 and kv.allocator.num_free == kv.allocator.capacity


# -- room -----------------------------------------------------------------------


def test_room_is_made_by_evicting_unlocked_prefixes_only():
    kv = make(pages=21)
    holder = seq(list(range(10, 20)), "a")
    admit_and_compute(kv, holder)  # 10 pages, cached and locked by its holder
    done = seq(list(range(50, 58)), "b")
    admit_and_compute(kv, done)
    kv.release(done)  # 8 pages cached, unlocked
    assert kv.allocator.num_free == 2
    assert kv.make_room(10)  # evicts the unlocked prefix
    assert not kv.make_room(11)  # the locked one stays
    assert kv.integrity_problem([holder]) is None


def test_pages_fill_before_new_ones_open():
    kv = make(pages=9, page_size=4)
    s = seq(list(range(10, 16)))  # 6 tokens: one whole page and half of another
    assert kv.pages_needed(s, 6) == 2
    admit_and_compute(kv, s)
    assert kv.pages_needed(s, 2) == 0 and kv.pages_needed(s, 3) == 1
    slots = kv.new_slots(s, 2)
    assert slots.tolist() == [int(s.slots[-1]) + 1, int(s.slots[-1]) + 2]  # the rest of its last page
    kv.unuse_slots(s, slots)  # nothing opened: nothing to give back
    free = kv.allocator.num_free
    s.slots = torch.cat([s.slots, slots])
    opened = kv.new_slots(s, 1)  # a new page
    assert kv.allocator.num_free == free - 1
    kv.unuse_slots(s, opened)
    assert kv.allocator.num_free == free
    assert kv.integrity_problem([s]) is None


def test_integrity_check_finds_leaks_and_pages_held_twice():
    kv = make()
    s = seq(list(range(10, 20)))
    admit_and_compute(kv, s)
    s.output_ids.append(5)
    kv.append_slots(s, kv.new_slots(s, 1))  # a page of its own, past the shared prompt
    assert kv.integrity_problem([s]) is None
    forgotten = kv.integrity_problem([])  # a holder nobody knows of
    assert forgotten is not None and f"leaked: [{int(s.slots[-1])}]" in forgotten
    leaked = kv.allocator.alloc(1)
    assert "leaked: [" + str(int(leaked[0])) in kv.integrity_problem([s])
    kv.allocator.free(leaked)
    other = seq(list(range(40, 44)), "b")
    other.slots = s.slots[-2:].clone()  # two requests writing one page
    problem = kv.integrity_problem([s, other])
    assert problem is not None and "held twice: [" in problem and "(of 0)" not in problem.split(";")[1]


def test_usage_counts_owned_cached_and_free_pages():
    kv = make(pages=17, page_size=4)
    s = seq(list(range(10, 17)))  # 7 tokens: one page shared once computed, one partial page owned
    admit_and_compute(kv, s)
    usage = kv.usage([s])
    assert usage == {"total": 64, "free": 64 - 8, "in_use": 4, "cached": 4, "cached_evictable": 0,
                     "page_size": 4}
    assert kv.owned_tokens([s]) == 3
    assert kv.token_usage() == pytest.approx(2 / 16)  # its own page and the prefix it locks
    kv.release(s)
    assert kv.token_usage() == 0  # cached, but nobody needs it
