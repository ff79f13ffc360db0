"""The engine on a tiny random model: batching, sampling, stops, aborts, and
KV slots that always come back."""

from __future__ import annotations

import asyncio

import pytest

from pyserve.engine.engine import Engine
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.server_args import ServerArgs


def run(coro):
    return asyncio.run(coro)


async def started_engine(model_dir, **kwargs) -> Engine:
    kwargs.setdefault("max_total_tokens", 4096)
    kwargs.setdefault("dtype", "float32")  # the tests' references are float32, on a GPU too
    engine = Engine.from_args(ServerArgs(model_path=str(model_dir), **kwargs))
    await engine.start()
    return engine


async def collect(engine: Engine, ids, **params):
    text, tokens, last = "", [], None
    async for out in engine.generate(GenerateRequest(ids, SamplingParams(**params))):
        text += out.text
        tokens += out.token_ids
        last = out
    return text, tokens, last


def idle(engine: Engine) -> bool:
    """No request holds KV; what the prefix cache keeps can all be evicted."""
    kv = engine.kv_usage()
    return kv["in_use"] == 0 and kv["cached"] == kv["cached_evictable"] and engine.num_running == 0


PROMPTS = [[5, 17, 99], [42] * 9, list(range(100, 131)), [7], [300, 301, 302, 303, 304]]

# Engine layouts the scheduling tests run under: KV page size, and whether
# step N+1 is scheduled while step N runs.
LAYOUTS = [
    pytest.param({"disable_overlap_schedule": False}, id="page1-overlap"),
    pytest.param({"page_size": 4, "disable_overlap_schedule": False}, id="page4-overlap"),
    pytest.param({"page_size": 4, "disable_overlap_schedule": True}, id="page4-serial"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_output_is_the_same_alone_and_in_a_batch(tiny_llama_dir, layout):
    async def main():
        engine = await started_engine(tiny_llama_dir, **layout)
        alone = [await collect(engine, p, max_new_tokens=10, temperature=0, ignore_eos=True) for p in PROMPTS]
        together = await asyncio.gather(
            *[collect(engine, p, max_new_tokens=10, temperature=0, ignore_eos=True) for p in PROMPTS]
        )
        assert engine.integrity_problem() is None
        await engine.shutdown()
        return alone, together

    alone, together = run(main())
    assert [t[1] for t in alone] == [t[1] for t in together]
    assert all(len(t[1]) == 10 and t[2].finish_reason == "length" for t in together)


def test_seed_reproduces_and_differs(tiny_llama_dir):
    async def main():
        engine = await started_engine(tiny_llama_dir)
        args = dict(max_new_tokens=16, temperature=1.0, ignore_eos=True)
        a = await collect(engine, PROMPTS[0], seed=1, **args)
        # the same seed inside a busy batch gives the same tokens
        b, *_ = await asyncio.gather(
            collect(engine, PROMPTS[0], seed=1, **args),
            collect(engine, PROMPTS[1], **args),
            collect(engine, PROMPTS[2], seed=5, **args),
        )
        c = await collect(engine, PROMPTS[0], seed=2, **args)
        await engine.shutdown()
        return a[1], b[1], c[1]

    a, b, c = run(main())
    assert a == b
    assert a != c


def test_stop_string_is_cut_and_never_emitted(tiny_llama_dir):
    async def main():
        engine = await started_engine(tiny_llama_dir)
        text, _, _ = await collect(engine, PROMPTS[2], max_new_tokens=24, temperature=0, ignore_eos=True)
        # stop on a piece of what the model says anyway
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut, _, last = await collect(engine, PROMPTS[2], max_new_tokens=24, temperature=0,
                                     ignore_eos=True, stop=[stop])
        await engine.shutdown()
        return text, stop, cut, last

    text, stop, cut, last = run(main())
    assert stop and stop not in cut
    assert cut == text[: text.index(stop)]
    assert last.finish_reason == "stop" and last.matched_stop == stop


def test_stop_token_id_ends_generation(tiny_llama_dir):
    async def main():
        engine = await started_engine(tiny_llama_dir)
        _, tokens, _ = await collect(engine, PROMPTS[1], max_new_tokens=12, temperature=0, ignore_eos=True)
        _, cut, last = await collect(engine, PROMPTS[1], max_new_tokens=12, temperature=0,
                                     ignore_eos=True, stop_token_ids=[tokens[4]])
        await engine.shutdown()
        return tokens, cut, last

    tokens, cut, last = run(main())
    first = tokens.index(tokens[4])
    assert cut == tokens[: first + 1]
    assert last.finish_reason == "stop" and last.matched_stop == tokens[4]


def test_aborted_request_frees_its_slots(tiny_llama_dir):
    async def main():
        engine = await started_engine(tiny_llama_dir)
        gen = engine.generate(GenerateRequest(PROMPTS[2], SamplingParams(max_new_tokens=500, ignore_eos=True)))
        for _ in range(3):
            await gen.__anext__()
        assert engine.kv_usage()["in_use"] > 0
        await gen.aclose()  # the client went away
        assert engine.integrity_problem() is None
        freed = idle(engine)
        # the engine keeps serving
        _, tokens, _ = await collect(engine, PROMPTS[0], max_new_tokens=4, ignore_eos=True)
        await engine.shutdown()
        return freed, tokens

    freed, tokens = run(main())
    assert freed
    assert len(tokens) == 4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tiny_pool_with_many_requests_retracts_and_finishes_correctly(tiny_llama_dir, layout):
    """64 requests against room for a handful: all finish, same greedy text."""
    prompts = [[10 + i, 20 + i, 30 + i, 40 + (i % 7)] for i in range(64)]

    async def main():
        reference = await started_engine(tiny_llama_dir)
        expected = [(await collect(reference, p, max_new_tokens=12, temperature=0, ignore_eos=True))[1]
                    for p in prompts[:8]]
        await reference.shutdown()
        engine = await started_engine(tiny_llama_dir, max_total_tokens=60, **layout)
        results = await asyncio.gather(
            *[collect(engine, p, max_new_tokens=12, temperature=0, ignore_eos=True) for p in prompts]
        )
        assert engine.integrity_problem() is None
        pool_full = idle(engine)
        await engine.shutdown()
        return expected, results, pool_full

    expected, results, pool_full = run(main())
    assert all(len(r[1]) == 12 for r in results)
    assert [r[1] for r in results[:8]] == expected
    assert pool_full


def test_prompt_that_cannot_fit_is_refused(tiny_llama_dir):
    async def main():
        engine = await started_engine(tiny_llama_dir, context_length=16)
        with pytest.raises(ValueError, match="context length"):
            engine.validate(GenerateRequest(list(range(3, 40))))
        with pytest.raises(ValueError, match="vocabulary"):
            engine.validate(GenerateRequest([engine.vocab_size + 5]))
        # asking for more tokens than the context holds is refused...
        with pytest.raises(ValueError, match="maximum context length is 16 tokens"):
            engine.validate(GenerateRequest(list(range(3, 13)), SamplingParams(max_new_tokens=100)))
        # ...while no limit means up to the context: it ends with "length"
        _, tokens, last = await collect(engine, list(range(3, 13)), max_new_tokens=None, ignore_eos=True)
        await engine.shutdown()
        return tokens, last

    tokens, last = run(main())
    assert len(tokens) == 6 and last.finish_reason == "length"


def test_sequence_longer_than_the_whole_pool_ends_with_length(tiny_llama_dir):
    async def main():
        engine = await started_engine(tiny_llama_dir, max_total_tokens=20)
        _, tokens, last = await collect(engine, [5, 6, 7, 8], max_new_tokens=100, ignore_eos=True)
        assert engine.integrity_problem() is None
        await engine.shutdown()
        return tokens, last

    tokens, last = run(main())
    assert last.finish_reason == "length"
    assert 4 + len(tokens) <= 21


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_prefix_is_reused_and_output_is_identical(tiny_llama_dir, layout):
    system = list(range(200, 330))  # a long shared "system prompt"
    page = layout.get("page_size", 1)

    async def main():
        cold = await started_engine(tiny_llama_dir, disable_radix_cache=True)
        expected = (await collect(cold, system + [7, 8], max_new_tokens=8, temperature=0, ignore_eos=True))[1]
        await cold.shutdown()
        engine = await started_engine(tiny_llama_dir, **layout)
        first = await collect(engine, system + [5, 6], max_new_tokens=8, temperature=0, ignore_eos=True)
        second = await collect(engine, system + [7, 8], max_new_tokens=8, temperature=0, ignore_eos=True)
        assert engine.integrity_problem() is None
        await engine.shutdown()
        return expected, first, second

    expected, first, second = run(main())
    assert first[2].cached_tokens == 0
    assert second[2].cached_tokens == len(system) - len(system) % page  # whole pages are shared
    assert second[1] == expected


def test_chunked_prefill_gives_the_same_output_and_decodes_alongside(tiny_llama_dir):
    long_prompt = [(i * 7) % 400 + 3 for i in range(700)]

    async def main():
        whole = await started_engine(tiny_llama_dir, chunked_prefill_size=-1)
        expected = (await collect(whole, long_prompt, max_new_tokens=6, temperature=0, ignore_eos=True))[1]
        await whole.shutdown()
        engine = await started_engine(tiny_llama_dir, chunked_prefill_size=128)
        steps = []  # (is_prefill, rids in the step), as scheduled
        schedule = engine.scheduler.schedule

        def recording_schedule():
            step = schedule()
            if step is not None:
                steps.append((step.is_prefill, {s.rid for s in step.seqs}))
            return step

        engine.scheduler.schedule = recording_schedule
        short = asyncio.create_task(collect(engine, PROMPTS[0], max_new_tokens=40, temperature=0, ignore_eos=True))
        while not steps:
            await asyncio.sleep(0)
        long_req = GenerateRequest(long_prompt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True),
                                   rid="long")
        tokens = [t async for out in engine.generate(long_req) for t in out.token_ids]
        await short
        assert engine.integrity_problem() is None
        await engine.shutdown()
        return expected, tokens, steps

    expected, tokens, steps = run(main())
    assert tokens == expected
    chunks = [i for i, (prefill, rids) in enumerate(steps) if prefill and "long" in rids]
    assert len(chunks) == 6  # 700 tokens in chunks of 128
    # the short stream decoded in the same steps as the chunks (mixed batches)
    assert all(len(steps[i][1]) == 2 for i in chunks)


def test_logs_follow_sglang_shape(tiny_llama_dir, caplog):
    async def main():
        engine = await started_engine(tiny_llama_dir, decode_log_interval=4)
        await collect(engine, PROMPTS[2], max_new_tokens=12, ignore_eos=True)
        await engine.shutdown()

    with caplog.at_level("INFO", logger="pyserve.engine"):
        run(main())
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("Prefill batch. #new-seq: 1, #new-token: 31, #cached-token: 0, token usage: ")
               and "#running-req: 0, #queue-req: 0" in line for line in lines)
    decode = [line for line in lines if line.startswith("Decode batch. #running-req: 1, #token: ")]
    assert len(decode) == 2  # steps 4 and 8 of 11 decode steps
    assert all("gen throughput (token/s): " in line and "#queue-req: 0" in line for line in decode)


def test_penalties_see_every_token_with_overlap(tiny_llama_dir):
    """Overlap schedules a step before the previous token is known; sampling
    with penalties must still see it, so the text equals the serial engine's."""
    params = dict(max_new_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=1.5,
                  repetition_penalty=1.3)

    async def main():
        outputs = []
        for overlap_off in (True, False):
            engine = await started_engine(tiny_llama_dir, disable_overlap_schedule=overlap_off)
            results = await asyncio.gather(*[collect(engine, p, **params) for p in PROMPTS])
            assert engine.integrity_problem() is None
            await engine.shutdown()
            outputs.append([r[1] for r in results])
        return outputs

    serial, overlapped = run(main())
    assert serial == overlapped


def test_failed_forward_aborts_its_requests_and_caches_nothing(tiny_llama_dir):
    async def main():
        engine = await started_engine(tiny_llama_dir)
        forward = engine.runner.forward
        calls = 0

        def failing_forward(batch, *rest):  # rest: an EAGLE3 step's hidden-state capture
            nonlocal calls
            calls += 1
            if calls == 3:
                raise RuntimeError("device lost")
            return forward(batch, *rest)

        engine.runner.forward = failing_forward
        _, _, last = await collect(engine, PROMPTS[2], max_new_tokens=10, temperature=0, ignore_eos=True)
        kv = engine.kv_usage()
        assert engine.integrity_problem() is None
        # the engine keeps serving, and serves the same text as before
        again = await collect(engine, PROMPTS[2], max_new_tokens=10, temperature=0, ignore_eos=True)
        await engine.shutdown()
        fresh = await started_engine(tiny_llama_dir)
        expected = await collect(fresh, PROMPTS[2], max_new_tokens=10, temperature=0, ignore_eos=True)
        await fresh.shutdown()
        return last, kv, again, expected

    last, kv, again, expected = run(main())
    assert last.finish_reason == "error"
    assert kv["in_use"] == 0 and kv["cached"] == 0  # nothing it wrote was kept
    assert again[1] == expected[1]


def test_idle_check_reports_a_leaked_page(tiny_llama_dir, caplog):
    async def main():
        engine = await started_engine(tiny_llama_dir)
        await collect(engine, PROMPTS[0], max_new_tokens=3, ignore_eos=True)
        await asyncio.sleep(0.05)  # the loop goes idle: the check passes
        healthy = engine.integrity_problem()
        engine.kv.allocator.alloc(1)  # a page nobody owns: a leak
        engine.kv._last_idle_check = -float("inf")
        await collect(engine, PROMPTS[1], max_new_tokens=3, ignore_eos=True)
        await asyncio.sleep(0.05)
        await engine.shutdown()
        return healthy

    with caplog.at_level("ERROR", logger="pyserve.engine"):
        healthy = run(main())
    assert healthy is None
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith("KV cache integrity check failed while idle: KV pages leaked")


def test_logprobs_match_transformers_and_ride_with_their_tokens(tiny_llama_dir):
    import torch
    import transformers

    prompt = PROMPTS[2]

    async def main():
        engine = await started_engine(tiny_llama_dir, dtype="float32")
        outs = []
        params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
        async for out in engine.generate(GenerateRequest(prompt, params)):
            outs.append(out)
        plain = await collect(engine, prompt, max_new_tokens=2, temperature=0, ignore_eos=True)
        await engine.shutdown()
        return outs, plain[2]

    outs, plain = run(main())
    tokens = [t for o in outs for t in o.token_ids]
    entries = [e for o in outs for e in o.logprobs]
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
    assert [e.token_id for e in entries] == tokens
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, dim=-1)
    for e, row in zip(entries, expected):
        assert abs(e.logprob - row[e.token_id].item()) < 1e-4
        top_vals, top_ids = row.topk(3)
        assert [i for i, _ in e.top] == top_ids.tolist()  # greedy: the token is the best
        assert all(abs(v - w) < 1e-4 for (_, v), w in zip(e.top, top_vals.tolist()))
    assert plain.logprobs is None  # only when asked


def test_prompt_logprobs_match_transformers_across_chunks_and_a_cached_prefix(tiny_llama_dir):
    import torch
    import transformers

    prompt = PROMPTS[2]  # 31 tokens, in chunks of 8

    async def main():
        engine = await started_engine(tiny_llama_dir, dtype="float32", chunked_prefill_size=8)
        await collect(engine, prompt, max_new_tokens=2, temperature=0)  # the prefix is now cached
        params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=True,
                                top_logprobs=2)
        outs = [out async for out in engine.generate(GenerateRequest(prompt, params))]
        assert engine.integrity_problem() is None
        await engine.shutdown()
        return outs

    outs = run(main())
    entries = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert len(entries) == len(prompt) and entries[0] is None
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    for i, e in enumerate(entries[1:], start=1):
        assert e.token_id == prompt[i]
        assert abs(e.logprob - expected[i - 1, prompt[i]].item()) < 1e-4
        assert [t for t, _ in e.top] == expected[i - 1].topk(2).indices.tolist()
    assert outs[-1].cached_tokens == 0  # computed whole, not taken from the cache


def test_concurrent_requests_share_a_prompt_while_it_is_still_running(tiny_llama_dir):
    """A prompt goes into the prefix cache once computed, not when its
    request ends: a request arriving meanwhile reuses it."""
    system = list(range(200, 330))

    async def main():
        engine = await started_engine(tiny_llama_dir, page_size=4)
        first = engine.generate(GenerateRequest(system + [5], SamplingParams(max_new_tokens=50, ignore_eos=True)))
        await first.__anext__()  # its prompt is computed and it keeps decoding
        second = await collect(engine, system + [6, 7], max_new_tokens=4, temperature=0, ignore_eos=True)
        assert engine.integrity_problem() is None
        await first.aclose()
        fresh = await started_engine(tiny_llama_dir, page_size=4, disable_radix_cache=True)
        expected = await collect(fresh, system + [6, 7], max_new_tokens=4, temperature=0, ignore_eos=True)
        assert engine.integrity_problem() is None
        await engine.shutdown()
        await fresh.shutdown()
        return second, expected

    second, expected = run(main())
    assert second[2].cached_tokens == 128  # 130 shared tokens, in whole pages of 4
    assert second[1] == expected[1]


def test_n_choices_compute_their_shared_prompt_once(tiny_llama_dir):
    """Requests that arrive together with one long prompt: the first
    computes it, the others wait a step and take it from the cache."""
    prompt = list(range(200, 330))

    async def main():
        engine = await started_engine(tiny_llama_dir)
        results = await asyncio.gather(
            *[collect(engine, prompt, max_new_tokens=4, temperature=0, ignore_eos=True) for _ in range(4)]
        )
        assert engine.integrity_problem() is None
        await engine.shutdown()
        return results

    results = run(main())
    assert sorted(r[2].cached_tokens for r in results) == [0, 129, 129, 129]
    assert all(r[1] == results[0][1] for r in results)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_interactive_prompt_step_leaves_batch_streams_out(tiny_llama_dir, layout):
    async def main():
        engine = await started_engine(tiny_llama_dir, **layout)
        steps = []  # rids in each step, and which of them are prefilled
        schedule = engine.scheduler.schedule

        def recording_schedule():
            step = schedule()
            if step is not None:
                steps.append(({s.rid for s in step.seqs}, {s.rid for s in step.seqs[: step.num_prefill_seqs]}))
            return step

        engine.scheduler.schedule = recording_schedule
        batch_req = GenerateRequest(PROMPTS[2], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True),
                                    rid="batch", batch=True)
        batch_tokens = []

        async def run_batch():
            async for out in engine.generate(batch_req):
                batch_tokens.extend(out.token_ids)

        task = asyncio.create_task(run_batch())
        while len(batch_tokens) < 3:
            await asyncio.sleep(0.01)
        interactive = GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),
                                      rid="chat")
        chat_tokens = [t async for out in engine.generate(interactive) for t in out.token_ids]
        await task
        assert engine.integrity_problem() is None
        await engine.shutdown()
        fresh = await started_engine(tiny_llama_dir)
        alone = await collect(fresh, PROMPTS[2], max_new_tokens=30, temperature=0, ignore_eos=True)
        await fresh.shutdown()
        return steps, batch_tokens, chat_tokens, alone[1]

    steps, batch_tokens, chat_tokens, alone = run(main())
    chat_prefill = [rids for rids, prefilled in steps if "chat" in prefilled]
    assert chat_prefill == [{"chat"}]  # the batch stream waited that one step
    assert len(chat_tokens) == 3 and batch_tokens == alone  # and lost nothing


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_load_with_aborts_on_a_tiny_pool_leaks_nothing(tiny_llama_dir, layout):
    """Many requests at once with every kind of setting, some abandoned
    mid-stream, on a pool that forces retraction: each one ends properly and
    every page comes back."""
    import random

    rng = random.Random(7)

    def params() -> SamplingParams:
        kind = rng.randrange(5)
        return SamplingParams(
            max_new_tokens=rng.randint(1, 24), ignore_eos=True,
            temperature=0 if kind < 2 else 0.8, seed=rng.randrange(100) if kind == 2 else None,
            frequency_penalty=0.5 if kind == 3 else 0.0, logprobs=kind == 4, top_logprobs=2 if kind == 4 else 0,
            prompt_logprobs=kind == 4 and rng.random() < 0.5,
        )

    shared = list(range(300, 340))
    prompts = [(shared if rng.random() < 0.5 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
               for _ in range(40)]

    async def main():
        engine = await started_engine(tiny_llama_dir, max_total_tokens=160, chunked_prefill_size=32, **layout)

        async def one(i, ids):
            p = params()
            gen = engine.generate(GenerateRequest(ids, p, rid=f"r{i}"))
            quit_after = rng.randint(1, 6) if rng.random() < 0.3 else None
            n, last = 0, None
            async for out in gen:
                n += len(out.token_ids)
                last = out
                if quit_after is not None and n >= quit_after and not out.finished:
                    await gen.aclose()  # the client went away
                    return "gone", n, p
            assert last.finished and last.finish_reason == "length" and n == p.max_new_tokens
            return "done", n, p

        results = await asyncio.gather(*[one(i, ids) for i, ids in enumerate(prompts)])
        assert engine.integrity_problem() is None
        settled = idle(engine)
        await engine.shutdown()
        return results, settled

    results, settled = run(main())
    assert settled and {r[0] for r in results} == {"done", "gone"}
