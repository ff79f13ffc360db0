"""The sliding layers' own KV pool (docs/sliding-window.md): a request
keeps sliding pages only for what its window still reads, and nothing is
read from a sliding page that was given back.

Without a model: the real scheduler and KV manager over both pools, with a
stand-in for the K/V (each slot holds a digest of the tokens up to its
position, written where a step writes and checked where it reads), under
chunked prefill, shared prefixes, retraction and aborts. With tiny Gemma 2,
Gemma 3 and gpt-oss checkpoints: the engine's tokens and logprobs against
transformers, in a sliding pool smaller than one prompt, with a cached
prefix whose early sliding pages are gone.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from pyserve.engine.engine import Engine
from pyserve.engine.kv.manager import KVManager
from pyserve.engine.kv.window_pages import WindowPageAllocator
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.engine.scheduler import Scheduler
from pyserve.engine.sequence import Sequence
from pyserve.server_args import ServerArgs
from tests.slow import slow
from tests.tiny_models import build_tiny_model

WINDOW = 8  # tiny_models' sliding_window for Gemma 2/3 and gpt-oss
PAGE = 4
CHUNK = 16


# -- the scheduler and KV manager, with K/V stand-ins --------------------------------------------


class StandInKV:
    """Per pool, what each slot holds: the digest of the tokens up to the
    position written there. A step writes its new tokens' digests at
    out_cache_loc (full) and window_out_cache_loc (sliding), then every
    sequence must read the right digest at each position its layers see:
    all of them in the full pool, the window's in the sliding pool."""

    def __init__(self, kv: KVManager, window: int):
        self.window = window
        self.full = {}
        self.sliding = {}
        self.windowed = kv.windowed

    @staticmethod
    def digest(ids: list[int], pos: int) -> int:
        return hash(tuple(ids[: pos + 1]))

    def run(self, step) -> None:
        batch = step.batch
        ids = [s.all_ids + s.draft_ids for s in step.seqs]
        row = 0
        loc, wloc = batch.out_cache_loc.tolist(), batch.window_out_cache_loc.tolist()
        for seq_ids, n, seq_len in zip(ids, batch.extend_lens, batch.seq_lens):
            for p in range(seq_len - n, seq_len):
                self.full[loc[row]] = self.sliding[wloc[row]] = self.digest(seq_ids, p)
                row += 1
        indptr = batch.kv_indptr.tolist()
        full, sliding = batch.kv_indices.tolist(), batch.window_kv_indices.tolist()
        for i, (seq_ids, n, seq_len) in enumerate(zip(ids, batch.extend_lens, batch.seq_lens)):
            base = indptr[i]
            for p in range(seq_len):
                assert self.full[full[base + p]] == self.digest(seq_ids, p), "a global layer read a stale slot"
            for p in range(max(0, seq_len - n - self.window + 1), seq_len):
                assert sliding[base + p] >= PAGE, "a sliding layer read a page given back"
                assert self.sliding[sliding[base + p]] == self.digest(seq_ids, p), "a sliding layer read a stale slot"


def windowed_scheduler(full_pages: int, window_pages: int, window: int = WINDOW, chunk: int = CHUNK,
                       max_running: int = 8, cache: bool = True) -> Scheduler:
    kv = KVManager(WindowPageAllocator(full_pages, window_pages, PAGE, window), use_radix_cache=cache)
    return Scheduler(kv, max_running, max_prefill_tokens=1024, chunk_size=chunk)


def held_window_pages(sched: Scheduler) -> int:
    """Sliding pages in use, as their allocator counts them."""
    pages = sched.kv.windowed.window_pages
    return pages.capacity - pages.num_free


def run_until_done(sched: Scheduler, kv_stand_in: StandInKV, rng: random.Random, aborts: float = 0.0,
                   max_steps: int = 2000) -> int:
    """Steps until every request finished (max_new_tokens), aborting some
    on the way; checks both pools after every step. Returns the most
    sliding pages any step held."""
    peak = 0
    for _ in range(max_steps):
        if not sched.requests:
            return peak
        step = sched.schedule()
        assert step is not None
        peak = max(peak, held_window_pages(sched))
        kv_stand_in.run(step)
        sched.on_launched(step)
        sched.on_results(step)
        for seq in step.sampled:
            seq.output_ids.append(rng.randrange(3, 500))
            if len(seq.output_ids) >= seq.params.max_new_tokens:
                sched.remove(seq)
        for seq in list(sched.holders()):
            if rng.random() < aborts:
                sched.remove(seq)
        assert sched.kv.integrity_problem(sched.holders()) is None
    raise AssertionError("the requests did not finish")


def add(sched: Scheduler, rid: str, prompt: list[int], new_tokens: int) -> Sequence:
    seq = Sequence(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=new_tokens))
    sched.add(seq)
    return seq


@pytest.mark.parametrize("cache", [False, True])
def test_a_long_request_holds_sliding_pages_for_its_window_and_chunk_only(cache):
    sched = windowed_scheduler(full_pages=129, window_pages=129, cache=cache)
    stand_in = StandInKV(sched.kv, WINDOW)
    add(sched, "long", list(range(3, 303)), new_tokens=40)
    peak = run_until_done(sched, stand_in, random.Random(0))
    assert sched.kv.integrity_problem([]) is None
    usage = sched.kv.usage([])
    if not cache:
        # Right after each step is scheduled: the window's last pages and the
        # step's new tokens (a chunk), not its 340 tokens.
        assert WINDOW + CHUNK <= peak * PAGE <= WINDOW + CHUNK + 2 * PAGE
        assert usage["window_free"] == usage["window_total"] == 128 * PAGE
        return
    # The cache keeps its full pages, and of its sliding pages those its
    # prompt's chunks left there, each of them free to give back.
    assert usage["cached"] == 336 and 0 < usage["window_cached"] == usage["window_cached_evictable"]


def test_a_prompt_longer_than_the_whole_sliding_pool_runs():
    # 12 sliding pages (48 tokens) beside 128 full ones: a 300-token prompt
    # runs only if pages its window left behind come back, its cached ones too.
    sched = windowed_scheduler(full_pages=129, window_pages=13)
    add(sched, "long", list(range(3, 303)), new_tokens=20)
    run_until_done(sched, StandInKV(sched.kv, WINDOW), random.Random(1))
    assert sched.kv.usage([])["cached"] == 316


@pytest.mark.parametrize("seed", range(8))
def test_shared_prefixes_retraction_and_aborts_never_read_a_sliding_page_given_back(seed):
    """Random prompts over a few shared prefixes, longer than the window,
    in pools small enough to evict, drop cached sliding pages and retract;
    some requests aborted mid-way; windows from 1 token to longer than
    the prompts."""
    rng = random.Random(seed)
    window = [1, 3, 8, 13, 200, 8, 5, 8][seed]
    sched = windowed_scheduler(full_pages=rng.choice([30, 40]), window_pages=rng.choice([14, 20, 30]),
                               window=window, chunk=rng.choice([8, 16, 30]), max_running=6)
    stand_in = StandInKV(sched.kv, window)
    heads = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    for i in range(14):
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]
        add(sched, f"r{i}", rng.choice(heads) + tail, new_tokens=rng.randrange(1, 25))
    run_until_done(sched, stand_in, rng, aborts=0.02)
    assert sched.kv.integrity_problem([]) is None
    sched.kv.evict_all()
    assert sched.kv.windowed.window_pages.num_free == sched.kv.windowed.window_pages.capacity
    assert sched.kv.allocator.num_free == sched.kv.allocator.capacity


def test_a_hit_is_cut_back_to_where_its_window_still_has_sliding_pages():
    sched = windowed_scheduler(full_pages=129, window_pages=129)
    stand_in = StandInKV(sched.kv, WINDOW)
    first = add(sched, "first", list(range(3, 27)), new_tokens=40)  # a prompt of 24, shared while computed
    run_until_done(sched, stand_in, random.Random(2))
    # Its 40 generated tokens were its own: their sliding pages went back as
    # its window moved on, but for the last ones.
    history = first.all_ids[:44]
    second = add(sched, "second", history + [7, 8, 9], new_tokens=2)
    run_until_done(sched, stand_in, random.Random(3))
    # Cached are 44 tokens (whole pages), but a token at 44 would read 37..43,
    # whose sliding pages are gone; at 24 it reads the prompt's, kept.
    assert second.cache_hit == 24


# -- the engine on tiny checkpoints, against transformers -----------------------------------------

NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "gpt_oss"])
def sliding_model_dir(request, tmp_path_factory, default_model_dir):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, tokenizer_dir=default_model_dir)


def hf_next_tokens_and_logprobs(model, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy choice after the prompt and each prefix of
    `tokens`, and its log-probability: one causal forward pass over the
    prompt and `tokens` (no cache to get wrong), read at each position."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    logp = logits.float().log_softmax(-1)
    best = logp.argmax(-1)
    return best.tolist(), logp.gather(-1, best[:, None])[:, 0].tolist()


def sliding_engine(model_dir, window_tokens: int, **options) -> Engine:
    """An engine whose sliding pool holds `window_tokens` beside 512 full
    ones, in float32 (on CUDA too: the Triton kernels and CUDA graphs then
    read the sliding pool's tables)."""
    return Engine.from_args(ServerArgs(model_path=str(model_dir), max_total_tokens=512, page_size=PAGE,
                                       chunked_prefill_size=CHUNK, swa_full_tokens_ratio=window_tokens / 512,
                                       dtype="float32", **options))


async def engine_greedy(engine: Engine, prompt: list[int], n: int, rid: str):
    """(tokens, logprobs, cached prompt tokens) of one greedy request."""
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
    tokens, logprobs, cached = [], [], 0
    async for out in engine.generate(GenerateRequest(prompt, params, rid=rid)):
        tokens += out.token_ids
        logprobs += [lp.logprob for lp in out.logprobs or []]
        cached = out.cached_tokens
    return tokens, logprobs, cached


def assert_as_transformers(hf, prompt, got):
    """The engine's tokens are transformers' greedy ones: each is what
    transformers picks after the prompt and the tokens before it (so, from
    the first on, the same text greedy decoding gives), with its logprob."""
    tokens, logprobs, _ = got
    want_tokens, want_logprobs = hf_next_tokens_and_logprobs(hf, prompt, tokens)
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)


def test_engine_matches_transformers_with_a_sliding_pool_smaller_than_a_prompt(sliding_model_dir):
    """A 100-token prompt in chunks of 16 beside a 48-token sliding pool
    (its window's pages come back as it goes, the cached prompt's too),
    then, sharing its first 60 tokens, two prompts at once, the one
    running with overlap scheduling; each page of both pools exactly
    free, cached or held after every request."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(sliding_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(3, 500, (100,), generator=g).tolist()
    others = [long_prompt[:60] + torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 30)]

    async def run():
        engine = sliding_engine(sliding_model_dir, 48, disable_overlap_schedule=False)
        await engine.start()
        try:
            window_pages = engine.kv.windowed.window_pages
            assert window_pages.capacity_tokens == 48 and engine.kv.allocator.capacity_tokens == 512
            first = await engine_greedy(engine, long_prompt, NEW_TOKENS, "long")
            assert engine.integrity_problem() is None
            rest = await asyncio.gather(*[engine_greedy(engine, p, NEW_TOKENS, f"o{i}") for i, p in enumerate(others)])
            assert engine.integrity_problem() is None
            return [first, *rest]
        finally:
            await engine.shutdown()

    results = asyncio.run(run())
    for prompt, got in zip([long_prompt, *others], results):
        assert_as_transformers(hf, prompt, got)
    assert any(cached for _, _, cached in results[1:])  # the shared 60 tokens were reused where their window was kept


def test_engine_cuts_a_hit_back_where_sliding_pages_were_freed(sliding_model_dir):
    """A chat's next turn: the first turn's prompt (24 tokens) and its 40
    generated tokens are cached, but the generated ones kept their
    sliding pages only for the last window. The next turn, reusing 44 of
    them, must be served from 24: reading the freed pages would change
    its tokens and logprobs."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(sliding_model_dir, dtype=torch.float32)
    prompt = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(1)).tolist()

    async def run():
        # Without overlap (on by default on CUDA), whose step past the last
        # token would cache one more.
        engine = sliding_engine(sliding_model_dir, 256, disable_overlap_schedule=True)
        await engine.start()
        try:
            first = await engine_greedy(engine, prompt, 40, "turn1")
            usage = engine.kv_usage()
            assert usage["cached"] == 60 and usage["window_cached"] < 60  # full pages all kept, sliding not
            turn2 = prompt + first[0][:20] + [11, 12, 13, 14, 15]
            second = await engine_greedy(engine, turn2, NEW_TOKENS, "turn2")
            assert engine.integrity_problem() is None
            return first, turn2, second
        finally:
            await engine.shutdown()

    first, turn2, second = asyncio.run(run())
    assert_as_transformers(hf, prompt, first)
    assert_as_transformers(hf, turn2, second)
    assert second[2] == 24


def test_a_standalone_draft_model_beside_a_sliding_pool(sliding_model_dir):
    """STANDALONE speculation: the draft model keeps its own one-pool KV over
    the target's full slots while the target's sliding pool gives pages
    back; greedy tokens stay transformers'."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(sliding_model_dir, dtype=torch.float32)
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(2)).tolist()

    async def run():
        engine = sliding_engine(sliding_model_dir, 64, speculative_algorithm="STANDALONE",
                                speculative_draft_model_path=str(sliding_model_dir), speculative_num_draft_tokens=3)
        await engine.start()
        try:
            assert engine.kv.windowed is not None
            got = await engine_greedy(engine, prompt, 24, "spec")
            assert engine.integrity_problem() is None
            return got
        finally:
            await engine.shutdown()

    assert_as_transformers(hf, prompt, asyncio.run(run()))


def test_steps_are_cut_to_what_the_sliding_pool_holds():
    kv = KVManager(WindowPageAllocator(129, 13, PAGE, WINDOW))  # 512 full tokens, 48 sliding
    room = 48 - WINDOW - 3 * PAGE  # after a window, with pages for rounding and headroom
    assert kv.fit_chunk(CHUNK) == CHUNK and kv.prompt_capacity(CHUNK) == 512
    assert kv.fit_chunk(100) == room and kv.prompt_capacity(room) == 512
    assert kv.fit_chunk(None) is None and kv.prompt_capacity(None) == room  # a whole prompt per step
    with pytest.raises(ValueError, match="--swa-full-tokens-ratio"):
        KVManager(WindowPageAllocator(129, 5, PAGE, WINDOW)).fit_chunk(CHUNK)  # 16 tokens: not even a window
    sched = windowed_scheduler(full_pages=129, window_pages=13, chunk=kv.fit_chunk(100))
    add(sched, "long", list(range(3, 303)), new_tokens=4)
    run_until_done(sched, StandInKV(sched.kv, WINDOW), random.Random(4))


# gpt-oss's alternating layers by default; Gemma 3's five sliding to one full, slow.
@pytest.mark.parametrize("arch", [pytest.param("gemma3", marks=slow), "gpt_oss"])
def test_triton_kernels_read_the_sliding_pool(tmp_path, default_model_dir, arch):
    """The Triton backend (its interpreter without CUDA) through the engine:
    a 40-token prompt in chunks of 16 beside a 36-token sliding pool, then
    a prompt sharing 24 of its tokens; decode and extend kernels read the
    sliding layers by their sliding slots."""
    import transformers

    model_dir = build_tiny_model(tmp_path, arch, tokenizer_dir=default_model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    first = torch.randint(3, 500, (40,), generator=g).tolist()
    second = first[:24] + torch.randint(3, 500, (5,), generator=g).tolist()

    async def run():
        engine = sliding_engine(model_dir, 36, attention_backend="triton")
        await engine.start()
        try:
            got = [await engine_greedy(engine, p, 5, f"r{i}") for i, p in enumerate((first, second))]
            assert engine.integrity_problem() is None
            return got
        finally:
            await engine.shutdown()

    results = asyncio.run(run())
    for prompt, got in zip((first, second), results):
        assert_as_transformers(hf, prompt, got)
    assert results[1][2] == 24


def test_cuda_graph_tables_carry_the_sliding_slots():
    """The static tables a CUDA graph reads (filled here without CUDA): the
    sliding slots beside the full ones, spare rows on both padding pages."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton backend's device
    from pyserve.model.attention.triton_backend import TritonAttention
    from pyserve.model.forward_batch import ForwardBatch
    from pyserve.model.kv_buffer import KVBuffer

    allocator = WindowPageAllocator(9, 5, PAGE, WINDOW)
    pool = KVBuffer(2, 9, 1, 8, torch.float32, device, page_size=PAGE, window_layers=frozenset({0}), window_pages=5)
    assert pool.k_buffer[0].shape[0] == 5 * PAGE and pool.k_buffer[1].shape[0] == 9 * PAGE
    attention = TritonAttention(pool, 2, context_len=64)
    pages = allocator.alloc(3)
    slots = [pages[0] * PAGE + torch.arange(3), (pages[1:, None] * PAGE + torch.arange(PAGE)).flatten()]
    allocator.drop_window(pages[1:2])  # the second sequence's first page: left behind by its window
    batch = ForwardBatch.build([5, 6], [2, 7], torch.stack([s[-1] for s in slots]), [1, 1], slots, [0, 1], True,
                               device, window_slots=allocator.window_slots)
    assert batch.window_kv_indices[3:7].tolist() == [0, 1, 2, 3]  # the padding page's slots: never read
    attention.init_cuda_graph_state(max_bs=4)
    indptr, indices, window_indices = attention.cuda_graph_kv_tables(4)
    window_indices[:20] = 7  # stale entries of an earlier batch
    attention.fill_cuda_graph_kv_tables(batch, 4)
    assert indptr.tolist() == [0, 3, 11, 12, 13]
    assert torch.equal(indices[:11], batch.kv_indices) and torch.equal(window_indices[:11], batch.window_kv_indices)
    assert not window_indices[11:13].any() and not indices[11:13].any()


def test_engine_retraction_and_abort_leave_both_pools_whole(sliding_model_dir):
    """Three requests of 80 tokens each in a 160-token full pool (and a
    96-token sliding one): the newest are retracted and resumed from the
    cache, one more is aborted mid-way; tokens stay transformers' and
    every page of both pools is free or cached afterwards."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(sliding_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (40,), generator=g).tolist() for _ in range(3)]
    retracted = []

    async def run():
        engine = Engine.from_args(ServerArgs(model_path=str(sliding_model_dir), max_total_tokens=160, page_size=PAGE,
                                             chunked_prefill_size=CHUNK, swa_full_tokens_ratio=0.6, dtype="float32"))
        retract = engine.scheduler._retract
        engine.scheduler._retract = lambda seq: (retracted.append(seq.rid), retract(seq))
        await engine.start()
        try:
            params = SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True)
            stream = engine.generate(GenerateRequest(prompts[0], params, rid="aborted"))
            async for out in stream:
                if out.token_ids:
                    break
            await stream.aclose()
            got = await asyncio.gather(*[engine_greedy(engine, p, 40, f"r{i}") for i, p in enumerate(prompts)])
            assert engine.integrity_problem() is None
            usage = engine.kv_usage()
            assert usage["in_use"] == usage["window_in_use"] == 0
            return got
        finally:
            await engine.shutdown()

    results = asyncio.run(run())
    assert retracted
    for prompt, got in zip(prompts, results):
        assert_as_transformers(hf, prompt, got)


def test_kv_copies_move_sliding_layers_by_their_sliding_slots():
    """A draft tree's accepted K/V moves (speculative/tree.py): full layers
    from and to the full slots, sliding layers by the sliding ones, every
    source read before a destination is written."""
    from pyserve.model.kv_buffer import KVBuffer, SlotCopies

    pool = KVBuffer(2, 6, 1, 2, torch.float32, "cpu", page_size=2, window_layers=frozenset({0}), window_pages=3)
    for buffer in pool.k_buffer + pool.v_buffer:
        buffer.copy_(torch.arange(buffer.numel(), dtype=torch.float32).reshape(buffer.shape))
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    # Full slots 7 -> 5 and 8 -> 7 (7 is read before it is written); sliding 3 -> 1 and 4 -> 3.
    pool.copy_slots(SlotCopies(torch.tensor([7, 8]), torch.tensor([5, 7]), torch.tensor([3, 4]),
                               torch.tensor([1, 3])))
    k_window, k_full, v_window, v_full = before
    expected_full, expected_window = k_full.clone(), k_window.clone()
    expected_full[[5, 7]] = k_full[[7, 8]]
    expected_window[[1, 3]] = k_window[[3, 4]]
    assert torch.equal(pool.k_buffer[1], expected_full) and torch.equal(pool.k_buffer[0], expected_window)
    expected_full, expected_window = v_full.clone(), v_window.clone()
    expected_full[[5, 7]] = v_full[[7, 8]]
    expected_window[[1, 3]] = v_window[[3, 4]]
    assert torch.equal(pool.v_buffer[1], expected_full) and torch.equal(pool.v_buffer[0], expected_window)



@pytest.mark.parametrize("ratio", ["0", "1.5"])
def test_a_sliding_pool_ratio_outside_0_to_1_is_refused(ratio, capsys):
    assert ServerArgs.from_cli(["--swa-full-tokens-ratio", "0.25"]).swa_full_tokens_ratio == 0.25
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--swa-full-tokens-ratio", ratio])
    assert "--swa-full-tokens-ratio must be in (0, 1]" in capsys.readouterr().err


def test_kv_copies_of_a_latent_cache_move_the_latent_once():
    """A latent cache's V is a view of K's first values: the copy moves
    K, and V comes with it."""
    from pyserve.model.kv_buffer import KVBuffer, LatentDim, SlotCopies

    pool = KVBuffer(2, 4, 1, LatentDim(6, value_dim=4), torch.float32, "cpu", page_size=2)
    for k in pool.k_buffer:
        k.copy_(torch.arange(k.numel(), dtype=torch.float32).reshape(k.shape))
    before = [k.clone() for k in pool.k_buffer]
    pool.copy_slots(SlotCopies(torch.tensor([5, 6]), torch.tensor([2, 5])))
    for k, v, old in zip(pool.k_buffer, pool.v_buffer, before):
        expected = old.clone()
        expected[[2, 5]] = old[[5, 6]]
        assert torch.equal(k, expected) and torch.equal(v, expected[..., :4])
