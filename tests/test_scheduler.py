"""The scheduler's policy without a model: which rows a step computes, in
what order, within which budget, and who waits when pages run out. A
sampled token is simulated by appending an id, as the output processor
does with the real one."""

from __future__ import annotations

from pyserve.engine.kv.manager import KVManager
from pyserve.engine.kv.page_allocator import PageAllocator
from pyserve.engine.request import SamplingParams
from pyserve.engine.scheduler import Scheduler
from pyserve.engine.sequence import Sequence


def make(pages: int = 257, page_size: int = 1, max_running: int = 8, chunk: int | None = 64,
         cache: bool = True) -> Scheduler:
    kv = KVManager(PageAllocator(pages, page_size), use_radix_cache=cache)
    return Scheduler(kv, max_running, max_prefill_tokens=1024, chunk_size=chunk)


def add(sched: Scheduler, rid: str, prompt: list[int], batch: bool = False, **params) -> Sequence:
    seq = Sequence(rid=rid, prompt_ids=prompt, params=SamplingParams(**params), batch=batch)
    sched.add(seq)
    return seq


def run_step(sched: Scheduler, token: int = 5):
    """Schedule a step and bring its sampled tokens back at once."""
    step = sched.schedule()
    if step is not None:
        sched.on_launched(step)
        sched.on_results(step)
        for seq in step.sampled:
            seq.output_ids.append(token)
    return step


def rows(step) -> dict[str, int]:
    """rid -> tokens the step computes for it."""
    return {s.rid: n for s, n in zip(step.seqs, step.batch.extend_lens)}


def test_running_streams_decode_while_a_long_prompt_is_chunked():
    sched = make(chunk=64)
    a = add(sched, "a", list(range(10, 20)))
    run_step(sched)
    assert a in sched.running
    add(sched, "long", list(range(100, 300)))
    step = run_step(sched)
    # the decode row first, the rest of the budget on the prompt
    assert rows(step) == {"a": 1, "long": 63} and step.is_prefill
    assert [s.rid for s in step.sampled] == ["a"]  # the long prompt is not done: nothing sampled for it
    while "long" not in {s.rid for s in sched.running}:
        step = run_step(sched)
        assert sum(step.batch.extend_lens) <= 64
    assert len(sched.requests["long"].output_ids) == 1
    assert sched.kv.integrity_problem(sched.holders()) is None


def test_interactive_requests_are_admitted_before_batch_jobs():
    sched = make(max_running=1)
    add(sched, "batch", list(range(10, 20)), batch=True)
    add(sched, "chat", list(range(30, 40)))
    assert rows(run_step(sched)) == {"chat": 10}
    assert [s.rid for s in sched.waiting] == ["batch"]  # the running cap holds it back


def test_a_prompt_step_leaves_less_urgent_decode_rows_out_and_their_pages_free():
    sched = make(page_size=4, pages=65)
    batch = add(sched, "batch", list(range(10, 18)), batch=True)  # 8 tokens: its next opens a page
    run_step(sched)
    free = sched.kv.allocator.num_free
    add(sched, "chat", list(range(40, 46)))
    step = run_step(sched)
    assert rows(step) == {"chat": 6}
    assert sched.kv.allocator.num_free == free - 2  # chat's pages only: batch's new page went back
    assert rows(run_step(sched)) == {"batch": 1, "chat": 1}
    assert batch.kv_len == 9
    assert sched.kv.integrity_problem(sched.holders()) is None


def test_the_newest_least_urgent_stream_is_retracted_when_pages_run_out():
    sched = make(pages=27, chunk=None, cache=False)
    first = add(sched, "first", list(range(10, 20)))
    second = add(sched, "second", list(range(30, 40)), batch=True)
    third = add(sched, "third", list(range(50, 52)))
    run_step(sched)
    assert {s.rid for s in sched.running} == {"first", "second", "third"}
    for _ in range(2):  # 25 tokens held by then, 26 pages: the next decode rows do not all fit
        run_step(sched)
    assert second in sched.waiting and second.kv_len == 0 and len(second.output_ids) == 2
    assert first in sched.running and third in sched.running
    assert sched.kv.integrity_problem(sched.holders()) is None
    # when room returns it resumes with its prompt and the tokens it had
    sched.remove(first)
    resumed = second.num_tokens
    assert rows(run_step(sched))["second"] == resumed


def test_a_shared_prompt_head_waits_for_the_prompt_being_computed():
    sched = make(chunk=16)
    system = list(range(100, 140))  # longer than the 32 tokens that make a head worth waiting for
    a = add(sched, "a", system + [1, 2])
    b = add(sched, "b", system + [3, 4])
    step = run_step(sched)
    assert rows(step) == {"a": 16}  # b waits instead of computing the same tokens
    while a not in sched.running:
        assert "b" not in rows(run_step(sched))
    step = run_step(sched)
    assert rows(step)["b"] == 2 and b.cache_hit == len(system)


def test_a_decode_row_reads_a_token_still_in_flight_through_a_placeholder():
    sched = make()
    a = add(sched, "a", list(range(10, 14)))
    b = add(sched, "b", list(range(20, 26)))
    first = sched.schedule()
    sched.on_launched(first)  # first's tokens are not back yet
    assert a.pending == 1 and b.pending == 1 and b.pending_row == 1
    second = sched.schedule()
    assert [(f.row, f.sampled, f.previous) for f in second.following] == [(0, 0, 0), (1, 1, 1)]
    assert second.batch.input_ids.tolist() == [-1, -2]  # rows 0 and 1 of the first step's ids
    assert second.batch.positions.tolist() == [4, 6]
    sched.on_launched(second)  # the engine launches a step before it reads the previous one's ids
    assert a.pending == b.pending == 2
    sched.on_results(first)
    assert a.pending == b.pending == 1  # second's tokens are still in flight
    sched.on_results(second)
    assert a.pending == b.pending == 0


def test_penalised_streams_need_their_tokens_before_the_next_step():
    sched = make()
    add(sched, "plain", [10, 11])
    run_step(sched)
    assert not sched.needs_known_tokens()
    add(sched, "penalised", [12, 13], repetition_penalty=1.2)
    run_step(sched)
    assert sched.needs_known_tokens()


def test_remove_forgets_a_request_wherever_it_is():
    sched = make(max_running=1)
    running = add(sched, "running", [10, 11, 12])
    waiting = add(sched, "waiting", [20, 21])
    run_step(sched)
    sched.remove(waiting)
    sched.remove(running)
    assert not sched.requests and not sched.waiting and not sched.holders()
    assert sched.kv.integrity_problem([]) is None


def _first_admitted(policy: str, waiting: list[tuple[str, list[int], int]], seed: int = 0) -> str:
    """The request a step of one free row admits under `policy`, after a
    64-token prompt was computed and cached."""
    from pyserve.engine.schedule_policy import WaitingOrder

    sched = make(max_running=1, chunk=None)
    sched.order = WaitingOrder(policy, sched.kv, seed)
    cached = add(sched, "cached", list(range(100, 164)), max_new_tokens=1)
    run_step(sched)
    sched.remove(cached)  # finished: its prompt stays in the cache
    assert sched.kv.cache.cached_length(list(range(100, 164))) == 64
    for rid, prompt, max_new in waiting:
        add(sched, rid, prompt, max_new_tokens=max_new)
    return next(s.rid for s in run_step(sched).seqs)


WAITING = [("new", list(range(300, 340)), 8), ("shares-prefix", list(range(100, 150)) + [7, 8], 8),
           ("long-output", list(range(400, 420)), 500)]


def test_schedule_policies_order_requests_of_equal_urgency():
    assert _first_admitted("fcfs", WAITING) == "new"  # arrival order
    assert _first_admitted("lpm", WAITING) == "shares-prefix"  # 50 of its tokens are cached
    assert _first_admitted("lof", WAITING) == "long-output"
    picks = [_first_admitted("random", WAITING, seed) for seed in range(20)]
    assert set(picks) == {"new", "shares-prefix", "long-output"}  # --random-seed's draw
    assert picks == [_first_admitted("random", WAITING, seed) for seed in range(20)]


def test_a_policy_orders_only_within_an_urgency():
    """Interactive requests still come before batch jobs under lpm."""
    from pyserve.engine.schedule_policy import WaitingOrder

    sched = make(max_running=1, chunk=None)
    sched.order = WaitingOrder("lpm", sched.kv)
    add(sched, "warm", list(range(100, 164)), max_new_tokens=1)
    run_step(sched)
    sched.remove(sched.requests["warm"])
    job = Sequence(rid="job", prompt_ids=list(range(100, 150)), params=SamplingParams(max_new_tokens=4), batch=True)
    sched.add(job)
    add(sched, "chat", list(range(300, 320)), max_new_tokens=4)
    assert next(s.rid for s in run_step(sched).seqs) == "chat"


def test_the_engine_schedules_by_the_policy_it_is_given(tiny_llama_dir):
    import asyncio

    from tests.test_engine import collect, started_engine

    async def go():
        engine = await started_engine(tiny_llama_dir, schedule_policy="lpm", max_running_requests=1)
        try:
            shared = list(range(100, 164))
            await collect(engine, shared + [5], max_new_tokens=2, temperature=0)
            # One row: of two waiting requests the one sharing the cached prefix starts first.
            first = []

            async def one(prompt, name):
                await collect(engine, prompt, max_new_tokens=2, temperature=0)
                first.append(name)

            await asyncio.gather(one(list(range(300, 340)), "new"), one(shared + [9], "shares"))
            return engine.scheduler.order.policy, first
        finally:
            await engine.shutdown()

    policy, order = asyncio.run(go())
    assert policy == "lpm" and order == ["shares", "new"]
