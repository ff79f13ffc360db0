"""--max-queued-requests (SGLang's): while that many requests wait to run,
a new one is refused at once with a 503 the client may retry, in each
route's own error shape; batch jobs are neither counted nor refused; a
request of more sequences than the limit is taken whole by an idle server;
once the queue drains, requests are taken again."""

from __future__ import annotations

import asyncio
import json

from pyserve.api.app import App
from pyserve.api.generation.serving import ServingContext, fan_out
from pyserve.chat_template import ChatTemplate
from pyserve.engine.request import GenerateRequest, SamplingParams
from tests.test_api_handlers import call
from tests.test_engine import started_engine

COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 2}
MESSAGE = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def test_a_full_queue_refuses_interactive_requests_with_a_503(tiny_llama_dir):
    async def main():
        engine = await started_engine(tiny_llama_dir, max_running_requests=1, max_queued_requests=1)
        ctx = ServingContext(engine, "m", ChatTemplate.for_model(tiny_llama_dir))
        app = App(ctx)
        long = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
        started = asyncio.Event()

        async def run(rid: str):
            async for _ in engine.generate(GenerateRequest([5, 6, 7], long, rid)):
                started.set()

        running = asyncio.create_task(run("running"))
        await started.wait()
        queued = asyncio.create_task(run("queued"))
        while engine.num_waiting < 1:
            await asyncio.sleep(0)
        try:
            full = await call(app, "POST", "/v1/completions", COMPLETION)
            anthropic = await call(app, "POST", "/v1/messages", MESSAGE)
            # A batch job still gets in.
            await fan_out(ctx, [[1, 2, 3]], SamplingParams(max_new_tokens=2), 1,
                          "batch-1", {}, batch=True)
        finally:
            running.cancel()
            queued.cancel()
            await asyncio.gather(running, queued, return_exceptions=True)
        again = await call(app, "POST", "/v1/completions", {**COMPLETION, "n": 3})
        await engine.shutdown()
        return full, anthropic, again

    full, anthropic, again = asyncio.run(main())
    status, _, body = full
    error = json.loads(body)["error"]
    assert status == 503 and error["code"] == "queue_full" and "--max-queued-requests 1" in error["message"]
    status, _, body = anthropic
    assert status == 503 and json.loads(body)["error"]["type"] == "overloaded_error"
    assert again[0] == 200
