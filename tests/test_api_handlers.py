"""The ASGI app driven in-process against a scripted engine.

The engine here replays fixed text, so the exact bytes of responses, the
reasoning split, n fan-out, disconnects and internal failures can be
checked without a model. The same behaviour against the real engine is
covered by test_api_errors.py and test_e2e_seeds.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import pytest

from pyserve._rust import Tokenizer
from pyserve.api.app import App
from pyserve.http.proxy import CORS
from pyserve.api.generation.serving import ServingContext
from pyserve.chat_template import ChatTemplate
from pyserve.engine.admission import ServedFields
from pyserve.engine.request import GenerateOutput, GenerateRequest, RequestError, TokenLogprob

MSG = [{"role": "user", "content": "hi"}]


class ScriptedEngine:
    """Engine's interface; every request "generates" `script`, one delta per step."""

    def __init__(self, tokenizer: Tokenizer, script: list[str], fail_after: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.context_len = 256
        self.adapters = None  # a server without --enable-lora
        self.served = ServedFields()  # nor the other options requests' fields need
        self.script = script
        self.fail_after = fail_after
        self.requests: list[GenerateRequest] = []
        self.closed: list[str] = []  # rids whose generator was closed before finishing

    def validate(self, req: GenerateRequest) -> None:
        if not req.input_ids:
            raise RequestError("the prompt is empty", "prompt")

    def check_queue_room(self) -> None:
        """No queue: every request is taken."""

    async def compile_grammar(self, constraint) -> None:
        """Every constraint compiles; the script is what the model "writes"."""

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        self.requests.append(req)
        done = False
        try:
            steps = self.script[: req.params.max_new_tokens]
            for i, text in enumerate(steps):
                if self.fail_after is not None and i == self.fail_after:
                    raise KeyError("boom")
                await asyncio.sleep(0.01)
                last = i == len(steps) - 1
                done = last
                yield GenerateOutput(
                    req.rid, text, [7], finished=last,
                    finish_reason=("length" if len(steps) < len(self.script) else "stop") if last else None,
                    matched_stop=None if len(steps) < len(self.script) or not last else 2,
                    prompt_tokens=len(req.input_ids), completion_tokens=i + 1,
                    logprobs=[TokenLogprob(7, -0.5, [])] if req.params.logprobs else None,
                )
        finally:
            if not done:
                self.closed.append(req.rid)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))


def make_app(default_model_dir, tokenizer, script, reasoning_parser=None, api_key=None, fail_after=None,
             **options):
    engine = ScriptedEngine(tokenizer, script, fail_after)
    ctx = ServingContext(engine, "served-model", ChatTemplate.for_model(default_model_dir), reasoning_parser)
    return App(ctx, api_key, **options), engine


async def call(app, method: str, path: str, body=None, headers: dict | None = None,
               disconnect_after: float | None = None, raw: bytes | None = None):
    """One HTTP exchange: (status, headers, body bytes)."""
    payload = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    path, _, query = path.partition("?")
    scope = {
        "type": "http", "method": method, "path": path, "query_string": query.encode(), "http_version": "1.1",
        "client": ("127.0.0.1", 5555),
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    sent_body = False
    gone = asyncio.Event()
    if disconnect_after is not None:
        asyncio.get_running_loop().call_later(disconnect_after, gone.set)

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    out = {"status": None, "headers": [], "body": b""}

    async def send(message):
        if gone.is_set():
            raise OSError("client gone")
        if message["type"] == "http.response.start":
            out["status"], out["headers"] = message["status"], message["headers"]
        else:
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return out["status"], dict(out["headers"]), out["body"]


def sse_events(body: bytes) -> list:
    frames = body.decode().split("\n\n")
    assert frames[-1] == "" and all(f.startswith("data: ") for f in frames[:-1]), body
    return [f[6:] if f == "data: [DONE]" else json.loads(f[6:]) for f in frames[:-1]]


def run(coro):
    return asyncio.run(coro)


def test_streamed_chat_chunks_in_openai_order(default_model_dir, tokenizer):
    app, _ = make_app(default_model_dir, tokenizer, ["Hel", "lo", "!"])
    status, headers, body = run(call(app, "POST", "/v1/chat/completions", {
        "model": "anything", "messages": MSG, "stream": True, "stream_options": {"include_usage": True}}))
    assert status == 200 and headers[b"content-type"] == b"text/event-stream"
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    first, *deltas, finish, usage, _ = events
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": "", "reasoning_content": None},
                                 "logprobs": None,
                                 "finish_reason": None, "matched_stop": None}]
    # every delta carries reasoning_content, null without reasoning (as SGLang's)
    assert [d["choices"][0]["delta"] for d in deltas] == [{"content": t, "reasoning_content": None}
                                                          for t in ("Hel", "lo", "!")]
    assert finish["choices"][0]["delta"] == {"reasoning_content": None} and finish["choices"][0]["finish_reason"] == "stop"
    assert finish["choices"][0]["matched_stop"] == 2
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 3
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == "served-model" for e in events[:-1])
    assert len({e["id"] for e in events[:-1]}) == 1 and events[0]["id"].startswith("chatcmpl-")
    assert all("usage" not in e for e in events[:-2])


def test_whole_chat_response_shape(default_model_dir, tokenizer):
    app, _ = make_app(default_model_dir, tokenizer, ["Hel", "lo"])
    status, _, body = run(call(app, "POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 1}))
    assert status == 200
    data = json.loads(body)
    assert list(data) == ["id", "object", "created", "model", "choices", "usage"]
    assert data["choices"] == [{
        "index": 0,
        "message": {"role": "assistant", "content": "Hel", "reasoning_content": None, "tool_calls": None},
        "logprobs": None, "finish_reason": "length", "matched_stop": None,
    }]
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


SCRIPT_WITH_THINKING = ["<th", "ink>\nLet me", " see.\n</think>", "\n\nIt is", " 9.8."]


def test_reasoning_is_split_whole_and_streamed(default_model_dir, tokenizer):
    app, _ = make_app(default_model_dir, tokenizer, SCRIPT_WITH_THINKING, reasoning_parser="qwen3")
    body = {"messages": MSG, "chat_template_kwargs": {"enable_thinking": True}, "separate_reasoning": True}
    _, _, whole = run(call(app, "POST", "/v1/chat/completions", body))
    message = json.loads(whole)["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me see." and message["content"] == "It is 9.8."
    _, _, streamed = run(call(app, "POST", "/v1/chat/completions", {**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in sse_events(streamed)[:-1]]
    assert "".join((d.get("reasoning_content") or "") for d in deltas).strip() == "Let me see."
    assert "".join(d.get("content", "") for d in deltas).strip() == "It is 9.8."
    assert not any("think>" in d.get("content", "") + (d.get("reasoning_content") or "") for d in deltas)


def test_separate_reasoning_false_keeps_the_text(default_model_dir, tokenizer):
    app, _ = make_app(default_model_dir, tokenizer, SCRIPT_WITH_THINKING, reasoning_parser="qwen3")
    _, _, body = run(call(app, "POST", "/v1/chat/completions", {"messages": MSG, "separate_reasoning": False}))
    message = json.loads(body)["choices"][0]["message"]
    assert message["content"] == "".join(SCRIPT_WITH_THINKING) and message["reasoning_content"] is None


def test_n_choices_get_consecutive_seeds(default_model_dir, tokenizer):
    app, engine = make_app(default_model_dir, tokenizer, ["a", "b"])
    _, _, body = run(call(app, "POST", "/v1/chat/completions", {"messages": MSG, "n": 3, "seed": 10}))
    data = json.loads(body)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert sorted(r.params.seed for r in engine.requests) == [10, 11, 12]
    assert data["usage"]["completion_tokens"] == 6
    assert data["usage"]["prompt_tokens"] == len(engine.requests[0].input_ids)  # counted once


def test_completion_prompt_batch_and_echo(default_model_dir, tokenizer):
    app, engine = make_app(default_model_dir, tokenizer, ["x", "y"])
    _, _, body = run(call(app, "POST", "/v1/completions", {"prompt": ["ab", "c  d"], "n": 2, "echo": True}))
    data = json.loads(body)
    assert [c["text"] for c in data["choices"]] == ["abxy", "abxy", "c  dxy", "c  dxy"]
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert all(r.params.max_new_tokens == 16 for r in engine.requests)  # the legacy API's default
    _, _, streamed = run(call(app, "POST", "/v1/completions", {"prompt": [1, 2, 3], "stream": True}))
    events = sse_events(streamed)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "xy"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_client_disconnect_mid_stream_closes_the_engine_request(default_model_dir, tokenizer):
    app, engine = make_app(default_model_dir, tokenizer, ["tok"] * 200)
    run(call(app, "POST", "/v1/chat/completions", {"messages": MSG, "stream": True, "n": 2},
             disconnect_after=0.2))
    assert len(engine.requests) == 2
    assert sorted(engine.closed) == sorted(r.rid for r in engine.requests)


def test_client_disconnect_during_whole_response_closes_the_engine_request(default_model_dir, tokenizer):
    app, engine = make_app(default_model_dir, tokenizer, ["tok"] * 200)
    status, _, _ = run(call(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 200},
                            disconnect_after=0.2))
    assert status is None  # nobody to answer
    assert engine.closed == [engine.requests[0].rid]


def test_unexpected_failure_is_a_500_body_and_logged(default_model_dir, tokenizer, caplog):
    app, _ = make_app(default_model_dir, tokenizer, ["a", "b", "c"], fail_after=1)
    with caplog.at_level(logging.ERROR, logger="pyserve.http"):
        status, _, body = run(call(app, "POST", "/v1/chat/completions", {"messages": MSG}))
    assert status == 500
    assert json.loads(body) == {"error": {"message": "internal server error", "type": "server_error",
                                          "param": None, "code": None}}
    assert "KeyError" in caplog.text
    status, _, body = run(call(app, "POST", "/v1/chat/completions", {"messages": MSG, "stream": True}))
    events = sse_events(body)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error"


def test_decode_errors_name_the_field(default_model_dir, tokenizer):
    app, _ = make_app(default_model_dir, tokenizer, ["a"])
    status, _, body = run(call(app, "POST", "/v1/chat/completions", {"messages": MSG, "temperature": "hot"}))
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "temperature" and "temperature" in error["message"]
    status, _, body = run(call(app, "POST", "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": 5}]}))
    assert status == 400 and json.loads(body)["error"]["param"] == "messages[0].content"
    status, _, body = run(call(app, "POST", "/v1/chat/completions", raw=b"[1, 2"))
    assert status == 400 and "JSON" in json.loads(body)["error"]["message"]
    status, _, body = run(call(app, "POST", "/v1/chat/completions", {}))
    assert status == 400 and json.loads(body)["error"]["param"] == "messages"


def test_api_key_cors_and_access_log(default_model_dir, tokenizer, caplog):
    app, _ = make_app(default_model_dir, tokenizer, ["a"], api_key="sekrit", cors=CORS(["http://ui.example"]))
    assert run(call(app, "GET", "/v1/models"))[0] == 401
    assert run(call(app, "GET", "/v1/models", headers={"Authorization": "Bearer sekrït"}))[0] == 401
    assert run(call(app, "GET", "/health"))[0] == 200
    with caplog.at_level(logging.INFO, logger="pyserve.http"):
        status, headers, body = run(call(app, "GET", "/v1/models", headers={
            "Authorization": "Bearer sekrit", "Origin": "http://ui.example"}))
    assert status == 200 and json.loads(body)["data"][0]["id"] == "served-model"
    assert headers[b"access-control-allow-origin"] == b"http://ui.example"
    assert 'INFO:     127.0.0.1:5555 - "GET /v1/models HTTP/1.1" 200 OK' in caplog.text
    status, headers, _ = run(call(app, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}))
    assert status == 204 and b"POST" in headers[b"access-control-allow-methods"]


def test_model_routes(default_model_dir, tokenizer):
    app, _ = make_app(default_model_dir, tokenizer, ["a"])
    status, _, body = run(call(app, "GET", "/v1/models/served-model"))
    assert status == 200 and json.loads(body)["owned_by"] == "pyserve"
    status, _, body = run(call(app, "GET", "/v1/models/org/other-model"))
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_freeze_gc_takes_what_the_server_holds_out_of_the_collectors_scans(default_model_dir, tokenizer):
    import gc

    app, _ = make_app(default_model_dir, tokenizer, ["a"])
    try:
        status, _, body = run(call(app, "POST", "/freeze_gc"))
        assert status == 200 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_max_body_bytes_refuses_a_declared_length_before_reading(default_model_dir, tokenizer):
    app, engine = make_app(default_model_dir, tokenizer, ["x"], max_body_bytes=64)
    sent = []

    async def exchange():
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                 "http_version": "1.1", "client": ("127.0.0.1", 5555), "headers": [(b"content-length", b"65")]}

        async def receive():
            raise AssertionError("the body was read")

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)

    run(exchange())
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "payload_too_large"
    status, _, body = run(call(app, "POST", "/v1/completions", {"prompt": "x" * 100}))
    assert status == 413 and engine.requests == []
