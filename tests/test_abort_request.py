"""SGLang's POST /abort_request: a request named by its rid (with its
choices) or every request (abort_all) stops at once, frees its KV cache,
and its client gets what was generated so far with finish_reason "abort";
other requests run on."""

from __future__ import annotations

import asyncio
import json

from pyserve.asgi import create_app
from tests.test_api_handlers import call

LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}


async def _until_running(app, count: int) -> None:
    while app._engine.num_running < count:
        await asyncio.sleep(0.01)


def test_a_named_request_and_its_choices_stop_the_others_run_on(tiny_llama_dir, tmp_path):
    async def go():
        app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path), max_total_tokens=8192)
        await app.startup()
        try:
            named = asyncio.create_task(call(app, "POST", "/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "rid": "mine", **LONG}))
            native = asyncio.create_task(call(app, "POST", "/generate", {
                "text": "Once", "rid": "native", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}))
            other = asyncio.create_task(call(app, "POST", "/v1/completions", {
                "model": "m", "prompt": "Hello", "rid": "mine-other", "max_tokens": 40, "ignore_eos": True}))
            await _until_running(app, 4)
            refused = await call(app, "POST", "/abort_request", {})
            assert (await call(app, "POST", "/abort_request", {"rid": "mine"}))[0] == 200
            assert (await call(app, "POST", "/abort_request", {"rid": "native"}))[0] == 200
            assert (await call(app, "POST", "/abort_request", {"rid": "gone"}))[0] == 200  # no such request
            results = [await t for t in (named, native, other)]
            kv = app._engine.kv_usage()
            return refused, results, kv
        finally:
            await app.shutdown()

    (status, _, body), results, kv = asyncio.run(go())
    assert status == 400 and json.loads(body)["error"]["param"] == "rid"
    (s1, _, chat), (s2, _, native), (s3, _, other) = results
    assert (s1, s2, s3) == (200, 200, 200)
    chat = json.loads(chat)
    assert [c["finish_reason"] for c in chat["choices"]] == ["abort", "abort"]
    assert chat["usage"]["completion_tokens"] < 2 * 1500
    native = json.loads(native)
    assert native["meta_info"]["finish_reason"]["type"] == "abort"
    assert native["meta_info"]["completion_tokens"] < 1500
    other = json.loads(other)  # a rid that only starts with the named one runs on
    assert other["choices"][0]["finish_reason"] == "length" and other["usage"]["completion_tokens"] == 40
    assert kv["in_use"] == 0


def test_abort_all_stops_every_request(tiny_llama_dir, tmp_path):
    async def go():
        app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path), max_total_tokens=8192)
        await app.startup()
        try:
            tasks = [asyncio.create_task(call(app, "POST", "/v1/completions", {
                "model": "m", "prompt": f"Story {i}", "stream": True, **LONG})) for i in range(3)]
            await _until_running(app, 3)
            assert (await call(app, "POST", "/abort_request", {"abort_all": True}))[0] == 200
            return [await t for t in tasks], app._engine.num_running
        finally:
            await app.shutdown()

    results, running = asyncio.run(go())
    assert running == 0
    for status, _, raw in results:
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "abort"
        assert raw.decode().rstrip().endswith("data: [DONE]")
