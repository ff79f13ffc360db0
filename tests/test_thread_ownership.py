"""One owner thread for what the forward thread keeps: the sampler and each
request's SamplingState (generator, grammar matcher, penalty history).

With the ownership check on, every read or write of that state from
another thread is recorded; the engine, run on real requests (constrained,
penalised, seeded, finished, aborted, ended by shutdown) with the overlap
scheduler on and off, must record none, and must let go of each request's
state once it ends."""

from __future__ import annotations

import asyncio
import gc
import re
import threading

import pytest

from pyserve.engine import ownership
from pyserve.engine.engine import Engine
from pyserve.engine.ownership import check_thread_ownership
from pyserve.engine.request import Constraint, GenerateRequest, SamplingParams
from pyserve.engine.sampling_state import SamplingState
from pyserve.engine.sequence import Sequence
from pyserve.server_args import ServerArgs

ANSWER = r"(yes|no), [0-9]{2,3}!"


@pytest.fixture(autouse=True)
def checked():
    check_thread_ownership()
    ownership.violations.clear()
    yield ownership.violations
    check_thread_ownership(False)
    ownership.violations.clear()


def on_thread(fn):
    """fn() run on a thread of its own; its result."""
    result = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    return result[0]


def test_the_check_records_each_access_from_a_thread_that_does_not_own_the_state(checked):
    state = SamplingState(Sequence(rid="r", prompt_ids=[1], params=SamplingParams()))
    state.sampled = 1  # built on one thread, handed to another: free until claimed
    assert on_thread(lambda: (state.claim(), state.sampled + 1)[1]) == 2
    assert not checked
    state.sampled = 5
    assert state.grammar is None
    assert len(checked) == 2
    assert "wrote SamplingState.sampled" in checked[0] and "read SamplingState.grammar" in checked[1]
    assert __file__ in checked[1]  # where the access was made
    on_thread(lambda: state.sampled)  # a third thread is no owner either
    assert len(checked) == 3


async def on_forward_thread(engine: Engine, fn):
    return await asyncio.wrap_future(engine.runner.executor.submit(fn))


async def collect(engine: Engine, ids, rid, **params):
    text, last = "", None
    async for out in engine.generate(GenerateRequest(ids, SamplingParams(**params), rid=rid)):
        text, last = text + out.text, out
    return text, last.finish_reason


async def abandoned(engine: Engine, ids, rid, **params):
    """A request whose caller goes away after its first output."""
    stream = engine.generate(GenerateRequest(ids, SamplingParams(**params), rid=rid))
    await stream.__anext__()
    await stream.aclose()


def live_states(rids) -> list[SamplingState]:
    gc.collect()
    # object.__getattribute__: the test itself is no owner of these states.
    return [o for o in gc.get_objects()
            if type(o) is SamplingState and object.__getattribute__(o, "seq").rid in rids]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_the_event_loop_never_touches_forward_thread_state(tiny_llama_dir, checked, overlap):
    async def main():
        engine = Engine.from_args(ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=4096,
                                   disable_overlap_schedule=not overlap))
        await engine.start()
        ids = engine.tokenizer.encode("Is the sea blue?", False)
        answer = Constraint("regex", ANSWER)
        requests = [
            collect(engine, ids, "greedy-grammar", max_new_tokens=40, temperature=0, constraint=answer),
            collect(engine, ids, "seeded-grammar", max_new_tokens=40, temperature=1.0, seed=1, constraint=answer),
            collect(engine, ids, "penalised", max_new_tokens=8, temperature=0.7, seed=2, ignore_eos=True,
                    repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
            collect(engine, ids, "held", max_new_tokens=6, temperature=0, min_new_tokens=4),
            abandoned(engine, ids, "abandoned-grammar", max_new_tokens=200, temperature=1.0, constraint=answer),
            abandoned(engine, ids, "abandoned", max_new_tokens=200, temperature=0, ignore_eos=True),
        ]
        results = await asyncio.gather(*requests)
        for text, reason in results[:2]:
            assert reason == "stop" and re.fullmatch(ANSWER, text)
        assert results[2][1] == "length" and results[3][1] in ("stop", "length")
        # The forward thread drops a state after the steps queued before
        # its request ended: wait for what is queued now.
        await on_forward_thread(engine, lambda: None)
        assert live_states({"greedy-grammar", "seeded-grammar", "penalised", "held", "abandoned-grammar",
                            "abandoned"}) == []
        assert engine.integrity_problem() is None
        # Shutdown ends what still runs.
        running = engine.generate(GenerateRequest(ids, SamplingParams(max_new_tokens=200, temperature=1.0,
                                                                      constraint=answer), rid="cut"))
        await running.__anext__()
        await engine.shutdown()
        assert [out.finish_reason async for out in running][-1] == "error"

    asyncio.run(main())
    assert checked == []


def test_the_check_is_on_in_the_engine(tiny_llama_dir, checked):
    """The test above can fail: a state of a running request, read from
    the event loop, is recorded."""
    async def main():
        engine = Engine.from_args(ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=4096))
        await engine.start()
        stream = engine.generate(GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True),
                                                 rid="watched"))
        await stream.__anext__()
        seq = engine.scheduler.requests["watched"]
        state = await on_forward_thread(engine, lambda: engine.runner.sampler.states_of([seq])[0])
        assert not checked
        state.sampled  # noqa: B018  # on the event loop
        await stream.aclose()
        await engine.shutdown()

    asyncio.run(main())
    assert len(checked) == 1 and "read SamplingState.sampled" in checked[0]
