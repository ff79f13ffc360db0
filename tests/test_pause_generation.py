"""SGLang's POST /pause_generation and /continue_generation: while paused
no token is generated, new requests wait, /health_generate says so, and
the requests in flight end (mode abort) or stay to finish after
/continue_generation with the tokens they would have had unpaused (mode
in_place keeps their KV; retract gives it to the prefix cache, which a
flush may drop, and they recompute it). vLLM's /pause, /resume and
/is_paused are the same pause, with vLLM's "wait" mode besides."""

from __future__ import annotations

import asyncio
import json

import pytest

from pyserve.asgi import create_app
from tests.test_api_handlers import call

PROMPT = [5, 17, 99, 300, 301]
LONG = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}


async def serve(model_dir, tmp_path):
    app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path), max_total_tokens=4096,
                     dtype="float32", torchao_config="none")
    await app.startup()
    return app


async def generating(app, tokens: int = 3):
    """The one request in the engine, once it has `tokens` output tokens."""
    engine = app._engine
    while not engine.request_ids or len(engine.scheduler.requests[engine.request_ids[0]].output_ids) < tokens:
        await asyncio.sleep(0.002)
    return engine.scheduler.requests[engine.request_ids[0]]


def output_ids(raw: bytes) -> list[int]:
    return json.loads(raw)["output_ids"]


async def alone_then_running(app):
    """LONG's greedy tokens run alone, then LONG running: (those tokens,
    its task, its sequence once it has a few tokens)."""
    reference = output_ids((await call(app, "POST", "/generate", LONG))[2])
    running = asyncio.create_task(call(app, "POST", "/generate", LONG))
    return reference, running, await generating(app)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_paused_requests_finish_as_unpaused_ones_after_continue(tiny_llama_dir, tmp_path, mode):
    async def go():
        app = await serve(tiny_llama_dir, tmp_path)
        try:
            reference, running, seq = await alone_then_running(app)
            paused = await call(app, "POST", "/pause_generation", {"mode": mode})
            held = len(seq.output_ids)
            late = asyncio.create_task(call(app, "POST", "/generate", LONG))
            await asyncio.sleep(0.3)
            during = {"generated": len(seq.output_ids) - held, "done": running.done() or late.done(),
                      "health": (await call(app, "GET", "/health_generate"))[0],
                      "flush": (await call(app, "POST", "/flush_cache"))[0],
                      "in_use": app._engine.kv_usage()["in_use"]}
            resumed = await call(app, "POST", "/continue_generation")  # SGLang's clients may send no body
            results = [output_ids((await t)[2]) for t in (running, late)]
            return reference, paused, held, during, resumed, results, app._engine.integrity_problem()
        finally:
            await app.shutdown()

    reference, paused, held, during, resumed, results, problem = asyncio.run(go())
    assert paused[0] == 200 and json.loads(paused[2])["status"] == "ok"
    assert 3 <= held < 200 and during["generated"] == 0 and not during["done"]
    assert during["health"] == 503
    if mode == "retract":  # nothing holds KV: a flush drops the paused request's too
        assert during["flush"] == 200 and during["in_use"] == 0
    else:
        assert during["flush"] == 400 and during["in_use"] > 0
    assert resumed[0] == 200
    assert results == [reference, reference] and problem is None


def test_abort_mode_ends_the_requests_in_flight_and_later_ones_wait(tiny_llama_dir, tmp_path):
    async def go():
        app = await serve(tiny_llama_dir, tmp_path)
        try:
            reference, running, _ = await alone_then_running(app)
            assert (await call(app, "POST", "/pause_generation", raw=b""))[0] == 200  # mode abort, by default
            aborted = json.loads((await running)[2])
            late = asyncio.create_task(call(app, "POST", "/generate", LONG))
            await asyncio.sleep(0.3)
            waited = not late.done()
            refused = await call(app, "POST", "/pause_generation", {"mode": "later"})
            assert (await call(app, "POST", "/continue_generation", {"torch_empty_cache": True}))[0] == 200
            return reference, aborted, waited, output_ids((await late)[2]), refused, app._engine.kv_usage()
        finally:
            await app.shutdown()

    reference, aborted, waited, late, refused, kv = asyncio.run(go())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted["output_ids"] == reference[:len(aborted["output_ids"])] and len(aborted["output_ids"]) < 200
    assert waited and late == reference and kv["in_use"] == 0
    status, _, raw = refused
    assert status == 400 and json.loads(raw)["success"] is False and "mode" in json.loads(raw)["message"]


def test_vllms_pause_keeps_waits_for_or_aborts_the_requests_in_flight(tiny_llama_dir, tmp_path):
    short = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}}

    async def go():
        app = await serve(tiny_llama_dir, tmp_path)
        try:
            reference, kept, seq = await alone_then_running(app)
            assert json.loads((await call(app, "POST", "/pause?mode=keep"))[2]) == {"status": "paused"}
            held = len(seq.output_ids)
            await asyncio.sleep(0.3)
            frozen = (len(seq.output_ids) == held, json.loads((await call(app, "GET", "/is_paused"))[2]))
            assert json.loads((await call(app, "POST", "/resume"))[2]) == {"status": "resumed"}
            kept = output_ids((await kept)[2])
            # wait: what runs finishes first; then new requests wait
            running = asyncio.create_task(call(app, "POST", "/generate", short))
            await generating(app, 1)
            await call(app, "POST", "/pause?wait_for_inflight_requests=true&clear_cache=true")
            finished = json.loads((await running)[2])["meta_info"]["finish_reason"]
            late = asyncio.create_task(call(app, "POST", "/generate", short))
            await asyncio.sleep(0.3)
            waited, cache = not late.done(), app._engine.kv_usage()["cached"]
            await call(app, "POST", "/resume")
            late = json.loads((await late)[2])["meta_info"]["finish_reason"]
            aborting = asyncio.create_task(call(app, "POST", "/generate", LONG))
            await generating(app)
            await call(app, "POST", "/pause")
            aborted = json.loads((await aborting)[2])["meta_info"]["finish_reason"]["type"]
            refusals = [(await call(app, "POST", f"/pause?{q}"))[0] for q in ("mode=later", "clear_cache=maybe")]
            await call(app, "POST", "/resume")
            paused_after = json.loads((await call(app, "GET", "/is_paused"))[2])
            return reference, kept, frozen, finished, waited, cache, late, aborted, refusals, paused_after
        finally:
            await app.shutdown()

    reference, kept, frozen, finished, waited, cache, late, aborted, refusals, paused_after = asyncio.run(go())
    assert kept == reference and frozen == (True, {"is_paused": True})
    assert finished == {"type": "length", "length": 30} and waited and cache == 0
    assert late["type"] == "length" and aborted == "abort"
    assert refusals == [400, 400] and paused_after == {"is_paused": False}
