"""POST /start_profile and /stop_profile (SGLang's and vLLM's): a torch
profiler trace of the steps that ran in between, written as Chrome trace
JSON where the client or the environment says; with num_steps it ends by
itself. What cannot be profiled is a 400."""

from __future__ import annotations

import asyncio
import json

from pyserve.asgi import create_app
from tests.test_api_handlers import call

COMPLETION = {"model": "m", "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True}


def _ops(trace_path) -> set[str]:
    return {e.get("name") for e in json.loads(trace_path.read_text())["traceEvents"]}


def test_a_trace_holds_the_steps_between_start_and_stop(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "env-traces"))

    async def go():
        app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path), max_total_tokens=2048)
        await app.startup()
        try:
            out = [await call(app, "POST", "/stop_profile", raw=b"")]  # none running
            out.append(await call(app, "GET", "/start_profile", raw=b""))  # an empty body; SGLang takes GET too
            out.append(await call(app, "POST", "/start_profile", {"profile_id": "again"}))
            out.append(await call(app, "POST", "/v1/completions", COMPLETION))
            out.append(await call(app, "GET", "/stop_profile", raw=b""))
            # SGLang's body: its own directory and name, ended after two steps.
            out.append(await call(app, "POST", "/start_profile", {
                "output_dir": str(tmp_path / "body-traces"), "profile_id": "two", "num_steps": 2,
                "activities": ["CPU"], "record_shapes": True}))
            out.append(await call(app, "POST", "/v1/completions", COMPLETION))
            out.append(await call(app, "POST", "/stop_profile", raw=b""))  # it has ended already
            return out
        finally:
            await app.shutdown()

    stopped_none, started, twice, completion, stopped, started_two, completion_two, stopped_two = asyncio.run(go())
    assert stopped_none[0] == 400
    assert (started[0], twice[0], completion[0], stopped[0]) == (200, 400, 200, 200)
    traces = list((tmp_path / "env-traces").glob("*-TP-0.trace.json"))
    assert len(traces) == 1 and str(traces[0]) in stopped[2].decode()
    assert any(name and name.startswith("aten::") for name in _ops(traces[0]))  # the forward pass's ops
    assert (started_two[0], completion_two[0], stopped_two[0]) == (200, 200, 400)
    assert any(name and name.startswith("aten::") for name in _ops(tmp_path / "body-traces" / "two-TP-0.trace.json"))


def test_what_cannot_be_profiled_is_refused(tiny_llama_dir, tmp_path):
    async def go():
        app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path), max_total_tokens=2048)
        await app.startup()
        try:
            return [await call(app, "POST", "/start_profile", {"output_dir": str(tmp_path), **body}) for body in (
                {"start_step": 3}, {"activities": ["GPU"]}, {"num_steps": 0}, {"merge_profiles": True})]
        finally:
            await app.shutdown()

    for (status, _, raw), param in zip(asyncio.run(go()), ["start_step", "activities", "num_steps", None]):
        assert status == 400
        assert param is None or json.loads(raw)["error"]["param"] == param
