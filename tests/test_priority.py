"""Priority scheduling (--enable-priority-scheduling): the waiting queue in
order of priority (larger first) then arrival, a more urgent request
admitted at once even when the queue and the running batch are full of
less urgent work, the least urgent retracted first when KV runs short,
and aging, so that nothing waits forever. The scheduler is driven without
a model (as in test_scheduler.py); the engine and the API on a tiny one."""

from __future__ import annotations

import asyncio
import json

import pytest

from pyserve.api.app import App
from pyserve.api.generation.serving import ServingContext
from pyserve.engine.kv.manager import KVManager
from pyserve.engine.kv.page_allocator import PageAllocator
from pyserve.engine.request import GenerateRequest, RequestError, SamplingParams
from pyserve.engine.scheduler import AGING_STEPS, Scheduler
from pyserve.engine.sequence import Sequence
from pyserve.server_args import ServerArgs
from tests.test_api_handlers import call
from tests.test_engine import started_engine
from tests.test_scheduler import rows, run_step


def make(pages: int = 257, max_running: int = 4, chunk: int | None = 64) -> Scheduler:
    kv = KVManager(PageAllocator(pages, 1))
    return Scheduler(kv, max_running, max_prefill_tokens=1024, chunk_size=chunk, priority_scheduling=True)


def add(sched: Scheduler, rid: str, prompt: list[int], priority: int = 0, batch: bool = False) -> Sequence:
    seq = Sequence(rid=rid, prompt_ids=prompt, params=SamplingParams(), priority=priority, batch=batch)
    sched.add(seq)
    return seq


def prompt(i: int, n: int = 8) -> list[int]:
    return list(range(100 * i + 1, 100 * i + 1 + n))


def test_the_waiting_queue_runs_by_priority_then_arrival():
    sched = make(max_running=1)
    for rid, priority in (("low-1", 0), ("high-1", 5), ("low-2", 0), ("high-2", 5), ("mid", 2)):
        add(sched, rid, prompt(len(sched.requests)), priority)
    order = []
    while sched.requests:
        step = run_step(sched)
        for seq in list(sched.running):  # each runs to its end before the next (max_running=1)
            order.append(seq.rid)
            sched.remove(seq)
        assert step is not None
    assert order == ["high-1", "high-2", "mid", "low-1", "low-2"]


def test_a_high_priority_request_is_admitted_at_the_next_step_over_a_full_queue():
    sched = make(max_running=4)
    low = [add(sched, f"low-{i}", prompt(i), priority=0) for i in range(12)]
    run_step(sched)
    run_step(sched)
    assert len(sched.running) == 4 and len(sched.waiting) == 8  # the running cap is full, the queue too
    urgent = add(sched, "urgent", prompt(50), priority=10)
    step = run_step(sched)
    assert rows(step)["urgent"] == 8 and urgent in sched.running
    # The newest running low-priority request made way; the others kept running.
    assert low[3] in sched.waiting and low[3].kv_len == 0 and len(low[3].output_ids) == 2
    assert set(low[:3]) <= set(sched.running)
    assert sched.kv.integrity_problem(sched.holders()) is None
    # It resumes first among the low ones, with the tokens it had.
    while low[3] not in sched.running:
        for seq in list(sched.running):
            if seq is not urgent:
                sched.remove(seq)
        run_step(sched)
    assert low[3].output_ids[:2] == [5, 5] and low[3].cache_hit == 0


def test_a_long_low_priority_prompt_being_chunked_lets_the_urgent_one_in_first():
    sched = make(chunk=16)
    long = add(sched, "long", prompt(1, 64), priority=0)
    run_step(sched)
    assert long in sched.prefilling
    add(sched, "urgent", prompt(2, 10), priority=3)
    step = run_step(sched)
    assert rows(step) == {"urgent": 10, "long": 6}  # the urgent prompt whole, the rest of the budget on the long one


def test_running_short_of_kv_retracts_the_lowest_priority_not_the_newest():
    sched = make(pages=27, chunk=None)
    low = add(sched, "low", prompt(1, 10), priority=0)
    high = add(sched, "high", prompt(2, 10), priority=9)
    mid = add(sched, "mid", prompt(3, 2), priority=4)  # the newest
    run_step(sched)
    assert {s.rid for s in sched.running} == {"low", "high", "mid"}
    for _ in range(2):  # 25 tokens held by then, 26 pages: the next decode rows do not all fit
        run_step(sched)
    assert low in sched.waiting and low.kv_len == 0
    assert high in sched.running and mid in sched.running
    assert sched.kv.integrity_problem(sched.holders()) is None


def test_batch_jobs_stay_behind_interactive_requests_whatever_their_priority():
    sched = make(max_running=1)
    add(sched, "batch", prompt(1), priority=100, batch=True)
    add(sched, "chat", prompt(2), priority=-5)
    assert rows(run_step(sched)) == {"chat": 8}


def test_nothing_starves_under_a_stream_of_more_urgent_requests():
    """A priority-0 request among requests of priority 2 that keep coming
    (always one more waiting than can run): aging raises it a level per
    AGING_STEPS steps waited, so it runs within 3 * AGING_STEPS steps."""
    sched = make(max_running=2)
    starving = add(sched, "starving", prompt(0), priority=0)
    arrivals = 0
    for step_number in range(1, 4 * AGING_STEPS):
        while len(sched.waiting) < 3:
            arrivals += 1
            add(sched, f"busy-{arrivals}", prompt(1 + arrivals % 50), priority=2)
        run_step(sched)
        if starving in sched.holders():
            break
        for seq in list(sched.running):  # each busy request ends after one token
            sched.remove(seq)
    assert starving in sched.holders()
    assert 2 * AGING_STEPS <= step_number <= 3 * AGING_STEPS
    assert arrivals > 2 * AGING_STEPS  # the busy ones were admitted all along


def test_without_priority_scheduling_aging_and_preemption_are_off():
    kv = KVManager(PageAllocator(257, 1))
    sched = Scheduler(kv, 1, max_prefill_tokens=1024, chunk_size=64)
    first = add(sched, "first", prompt(1), priority=0)
    run_step(sched)
    add(sched, "second", prompt(2), priority=9)  # its priority counts for nothing here
    run_step(sched)
    assert sched.running == [first] and sched.waiting[0].waited_steps == 0


# -- the engine and the API ----------------------------------------------------


def run(coro):
    return asyncio.run(coro)


def test_the_engine_refuses_a_priority_without_the_flag(tiny_llama_dir):
    async def main():
        engine = await started_engine(tiny_llama_dir)
        try:
            engine.validate(GenerateRequest([1, 2, 3], priority=0))
        finally:
            await engine.shutdown()

    with pytest.raises(RequestError) as refused:
        run(main())
    assert refused.value.field == "priority" and refused.value.code == "unknown_parameter"


@pytest.mark.parametrize("flag", ["--enable-priority-scheduling", "--scheduling-policy=priority"])
def test_the_flag_and_its_vllm_alias_turn_it_on(flag):
    assert ServerArgs.from_cli([flag]).split().engine.enable_priority_scheduling
    assert not ServerArgs.from_cli(["--scheduling-policy", "fcfs"]).enable_priority_scheduling


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}),
])
def test_a_priority_field_is_refused_as_unknown_without_the_flag_and_honoured_with_it(tiny_llama_dir, route, body):
    async def main(enabled: bool):
        engine = await started_engine(tiny_llama_dir, enable_priority_scheduling=enabled)
        try:
            app = App(ServingContext(engine, "m", None))
            return await call(app, "POST", route, {**body, "priority": 3})
        finally:
            await engine.shutdown()

    status, _, raw = run(main(False))
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["param"] == "priority" and error["code"] == "unknown_parameter"
    assert "--enable-priority-scheduling" in error["message"]
    assert run(main(True))[0] == 200


def test_an_urgent_request_gets_its_first_token_before_the_low_priority_queue(tiny_llama_dir):
    """Six low-priority requests on a server running two at a time; an
    urgent one sent after them starts before any low one ends (one running
    makes way for it) and before every low one still waiting, and the low
    ones retracted for it lose nothing (greedy tokens as alone)."""
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 17, 99, 42 + i] for i in range(6)]

    async def main():
        engine = await started_engine(tiny_llama_dir, enable_priority_scheduling=True, max_running_requests=2)
        events: list[tuple[str, str]] = []  # ("first" or "done", rid), in order
        tokens: dict[str, list[int]] = {}

        async def one(req: GenerateRequest):
            async for out in engine.generate(req):
                if req.rid not in tokens:
                    events.append(("first", req.rid))
                tokens.setdefault(req.rid, []).extend(out.token_ids)
            events.append(("done", req.rid))

        low = [asyncio.create_task(one(GenerateRequest(p, params, f"low-{i}", priority=0)))
               for i, p in enumerate(prompts)]
        while len(tokens) < 2:  # two low ones stream, four wait
            await asyncio.sleep(0)
        waiting = {s.rid for s in engine.scheduler.waiting}
        await one(GenerateRequest([7, 8, 9], params, "urgent", priority=5))
        await asyncio.gather(*low)
        alone = []
        for p in prompts:
            alone.append([t async for out in engine.generate(GenerateRequest(p, params)) for t in out.token_ids])
        assert engine.integrity_problem() is None
        await engine.shutdown()
        return events, waiting, tokens, alone

    events, waiting, tokens, alone = run(main())
    urgent = events.index(("first", "urgent"))
    assert all(kind == "first" for kind, _ in events[:urgent])
    assert all(urgent < events.index(("first", rid)) for rid in waiting)
    assert [tokens[f"low-{i}"] for i in range(6)] == alone
