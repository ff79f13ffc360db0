"""--log-requests: SGLang's "Receive:" and "Finish:" lines for each
request, with what --log-requests-level asks for, in the server's log."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from pyserve.engine.request import GenerateRequest, SamplingParams
from tests.test_engine import started_engine

PROMPT = [5, 17, 99, 3, 42]


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_each_level_logs_what_it_says(tiny_llama_dir, level, caplog):
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, top_k=5)

    async def main():
        engine = await started_engine(tiny_llama_dir, log_requests=True, log_requests_level=level)
        try:
            with caplog.at_level(logging.INFO, logger="pyserve.requests"):
                tokens = [t async for out in engine.generate(GenerateRequest(PROMPT, params, "r-1"))
                          for t in out.token_ids]
            return tokens, engine.tokenizer
        finally:
            await engine.shutdown()

    tokens, tokenizer = asyncio.run(main())
    received, finished = (r.getMessage() for r in caplog.records if r.name == "pyserve.requests")
    assert received.startswith("Receive: rid=r-1, prompt_tokens=5")
    assert re.match(r"Finish: rid=r-1, finish_reason=length, prompt_tokens=5, cached_tokens=0, "
                    r"completion_tokens=6, e2e_latency=\d+\.\d{3}s", finished)
    assert ("sampling_params=" in received) == (level >= 1)
    if level >= 1:
        assert "'temperature': 0" in received and "'top_k': 5" in received and "'top_p'" not in received
    assert (f"prompt={tokenizer.decode(PROMPT, skip_special_tokens=False)!r}" in received) == (level >= 2)
    assert (f"output={tokenizer.decode(tokens, skip_special_tokens=False)!r}" in finished) == (level >= 2)


def test_without_the_flag_nothing_is_logged(tiny_llama_dir, caplog):
    async def main():
        engine = await started_engine(tiny_llama_dir)
        try:
            with caplog.at_level(logging.INFO, logger="pyserve.requests"):
                async for _ in engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=2))):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert not [r for r in caplog.records if r.name == "pyserve.requests"]


def test_configure_logging_turns_it_on_and_off_while_serving(tiny_llama_dir, tmp_path, caplog):
    from pyserve.asgi import create_app
    from tests.test_api_handlers import call

    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}

    async def main():
        app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path), max_total_tokens=4096)
        await app.startup()
        try:
            with caplog.at_level(logging.INFO, logger="pyserve.requests"):
                answers = []
                for change in ({}, {"log_requests": True, "log_requests_level": 0}, {"log_requests_level": 2},
                               {"log_requests": False}):
                    if change:
                        answers.append((await call(app, "POST", "/configure_logging", change))[0])
                    await call(app, "POST", "/v1/completions", {**body, "rid": f"after-{len(answers)}"})
                refused = await call(app, "POST", "/configure_logging", {"dump_requests_folder": "/tmp/d"})
                unknown = await call(app, "POST", "/configure_logging", {"log_level": "debug", "x": 1})
            return answers, refused, unknown
        finally:
            await app.shutdown()

    answers, refused, unknown = asyncio.run(main())
    received = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Receive:")]
    assert answers == [200, 200, 200]
    # Off at start, on at level 0, then level 2 (with the prompt's text), then off again.
    assert [m.split(",")[0] for m in received] == ["Receive: rid=after-1", "Receive: rid=after-2"]
    assert "prompt=" not in received[0] and "prompt=" in received[1]
    assert refused[0] == 400 and "dump_requests_folder" in refused[2].decode()
    assert unknown[0] == 400
