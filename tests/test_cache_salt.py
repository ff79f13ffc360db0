"""cache_salt: requests share cached prefixes only when their salts are
equal (no salt shares only with no salt), so one tenant cannot learn
another's prompts from prefix-cache timing. The radix cache on its own,
the engine on a tiny model (pages, cached_tokens, integrity), and the
routes, after SGLang's test_cache_salt_effectiveness."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from pyserve.api.app import App
from pyserve.api.generation.serving import ServingContext
from pyserve.api.protocol.responses import ResponsesRequest
from pyserve.api.responses.input import chat_request
from pyserve.chat_template import ChatTemplate
from pyserve.engine.kv.manager import KVManager
from pyserve.engine.kv.page_allocator import PageAllocator
from pyserve.engine.kv.radix_cache import RadixCache
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.engine.sequence import Sequence
from tests.test_api_handlers import call
from tests.test_engine import started_engine


def run(coro):
    return asyncio.run(coro)


# -- the radix cache -------------------------------------------------------------


def test_identical_prompts_under_two_salts_never_share_a_page():
    pool = PageAllocator(17, page_size=4)
    cache = RadixCache(pool)
    ids = list(range(8))
    pages_a, pages_b = pool.alloc(2), pool.alloc(2)
    slots = {salt: (pages[:, None] * 4 + torch.arange(4)).flatten() for salt, pages in (("a", pages_a),
                                                                                        ("b", pages_b))}
    assert cache.insert(ids, slots["a"], "a") == 0
    assert cache.insert(ids, slots["b"], "b") == 0  # nothing was cached for b: its own pages go in
    assert cache.match_prefix(ids + [9], "a")[0].tolist() == slots["a"].tolist()
    assert cache.match_prefix(ids + [9], "b")[0].tolist() == slots["b"].tolist()
    assert cache.match_prefix(ids + [9])[0].numel() == 0  # no salt shares only with no salt
    assert cache.match_prefix(ids + [9], "c")[0].numel() == 0
    assert cache.total_pages == 4
    # Eviction frees both trees' pages and forgets the emptied salts.
    assert cache.evict(100) == 4 and pool.num_free == pool.capacity
    assert list(cache.roots) == [None]


def test_a_locked_salted_prefix_survives_eviction():
    pool = PageAllocator(9)
    cache = RadixCache(pool)
    cache.insert([1, 2, 3], pool.alloc(3), "a")
    cache.insert([1, 2, 3], pool.alloc(3))
    _, node = cache.match_prefix([1, 2, 3], "a")
    cache.lock(node)
    assert cache.evict(100) == 3  # the unsalted copy only
    assert cache.match_prefix([1, 2, 3], "a")[0].numel() == 3
    cache.unlock(node)
    assert cache.evict(100) == 3 and list(cache.roots) == [None]


def test_the_integrity_check_covers_salted_pages():
    kv = KVManager(PageAllocator(9))
    salted = kv.allocator.alloc(3)
    kv.cache.insert([1, 2, 3], salted, "a")
    assert kv.integrity_problem([]) is None  # cached under a salt: counted as the cache's
    holder = Sequence(rid="x", prompt_ids=[1, 2, 3, 4], params=SamplingParams())
    holder.slots = salted[:1]  # a running sequence that claims a salted page as its own
    assert "held twice" in kv.integrity_problem([holder])
    kv.cache.roots["a"].children.clear()  # a salted tree that lost its pages
    assert "leaked" in kv.integrity_problem([])


# -- the engine ----------------------------------------------------------------------

PROMPT = list(range(100, 140))  # 40 tokens: 10 pages of 4


def test_equal_salts_share_and_different_salts_do_not(tiny_llama_dir):
    """cached_tokens of the same prompt sent in turn under salts s1, s1,
    s2, none, none, s2: a hit only where an earlier request had the same
    salt; the pages of the s1 and s2 trees never overlap."""
    params = SamplingParams(max_new_tokens=2, temperature=0)

    async def main():
        engine = await started_engine(tiny_llama_dir, page_size=4)
        hits = []
        for salt in ("s1", "s1", "s2", None, None, "s2"):
            async for out in engine.generate(GenerateRequest(PROMPT, params, cache_salt=salt)):
                pass
            hits.append(out.cached_tokens)
        cache = engine.kv.cache
        pages = {salt: set(cache.allocator.pages_of(torch.cat([n.slots for n in _tree(cache.roots[salt])])).tolist())
                 for salt in ("s1", "s2", None)}
        assert engine.integrity_problem() is None
        await engine.shutdown()
        return hits, pages

    hits, pages = run(main())
    assert hits == [0, 36, 0, 0, 36, 36]  # whole pages of the 39 tokens before the last
    assert not pages["s1"] & pages["s2"] and not pages["s1"] & pages[None] and not pages["s2"] & pages[None]


def _tree(root) -> list:
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def test_a_mixed_workload_of_salts_keeps_every_page_accounted_for(tiny_llama_dir):
    """Many requests at once, four salts and none, shared heads, on a pool
    small enough to evict and retract: every page free, cached or held
    throughout, and outputs the same as each prompt alone."""
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    salts = [None, "a", "b", "c", "a"]
    prompts = [PROMPT + [i % 3] for i in range(15)]

    async def main():
        engine = await started_engine(tiny_llama_dir, page_size=4, max_total_tokens=256)
        checks = []

        async def one(i: int):
            tokens = []
            async for out in engine.generate(GenerateRequest(prompts[i], params, cache_salt=salts[i % 5])):
                tokens += out.token_ids
                checks.append(engine.integrity_problem())
            return tokens

        together = await asyncio.gather(*(one(i) for i in range(15)))
        alone = []
        for p in prompts[:3]:
            alone.append([t async for out in engine.generate(GenerateRequest(p, params)) for t in out.token_ids])
        assert engine.integrity_problem() is None
        await engine.shutdown()
        return checks, together, alone

    checks, together, alone = run(main())
    assert set(checks) == {None}
    assert together == [alone[i % 3] for i in range(15)]


def test_a_server_without_the_radix_cache_accepts_a_salt_and_shares_nothing(tiny_llama_dir):
    async def main():
        engine = await started_engine(tiny_llama_dir, disable_radix_cache=True)
        hits = []
        for _ in range(2):
            async for out in engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=1),
                                                             cache_salt="a")):
                pass
            hits.append(out.cached_tokens)
        await engine.shutdown()
        return hits

    assert run(main()) == [0, 0]


# -- the routes ----------------------------------------------------------------------


def _cached_tokens(raw: bytes) -> int:
    return json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_effectiveness(tiny_llama_dir, default_model_dir):
    """SGLang's test, on chat: the same message twice under salt1 hits the
    cache the second time; under salt2 it does not; completions and
    /generate take the field too, and an empty salt is a 400."""
    chat = {"messages": [{"role": "user", "content": "What is the capital of Japan?"}], "max_tokens": 4,
            "temperature": 0}

    async def main():
        engine = await started_engine(tiny_llama_dir)
        app = App(ServingContext(engine, "m", ChatTemplate.for_model(default_model_dir)))
        try:
            answers = [await call(app, "POST", "/v1/chat/completions", {**chat, "cache_salt": salt})
                       for salt in ("salt1", "salt1", "salt2")]
            completions = [await call(app, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                                       "cache_salt": salt})
                           for salt in ("salt1", "salt2", "salt1")]
            generated = [await call(app, "POST", "/generate", {"input_ids": PROMPT, "cache_salt": "salt3",
                                                               "sampling_params": {"max_new_tokens": 1}})
                         for _ in range(2)]
            empty = await call(app, "POST", "/v1/chat/completions", {**chat, "cache_salt": ""})
        finally:
            await engine.shutdown()
        return answers, completions, generated, empty

    answers, completions, generated, empty = run(main())
    assert all(status == 200 for status, _, _ in answers + completions + generated)
    first, second, other = (_cached_tokens(raw) for _, _, raw in answers)
    prompt_tokens = json.loads(answers[0][2])["usage"]["prompt_tokens"]
    assert first == 0 and second == prompt_tokens - 1 and other == 0
    assert [_cached_tokens(raw) for _, _, raw in completions] == [0, 0, len(PROMPT) - 1]
    assert [json.loads(raw)["meta_info"]["cached_tokens"] for _, _, raw in generated] == [0, len(PROMPT) - 1]
    assert empty[0] == 400 and json.loads(empty[2])["error"]["param"] == "cache_salt"


@pytest.mark.parametrize("priority", [None, 4])
def test_the_responses_api_passes_salt_and_priority_to_the_chat_path(priority):
    req = ResponsesRequest(input="hi", cache_salt="tenant-a", priority=priority)
    chat = chat_request(req, [], "resp_1")
    assert chat.cache_salt == "tenant-a" and chat.priority == priority
