"""The drain at shutdown, in-process over a scripted engine: new requests
get a 503, requests in flight may finish, and when the drain time ends a
stream closes with an error event and its engine request is aborted. The
same through SIGTERM on a real server is in test_server_lifecycle.py."""

from __future__ import annotations

import asyncio
import json

from tests.test_api_handlers import MSG, call, make_app, run, sse_events
from tests.test_api_handlers import tokenizer  # noqa: F401 (a fixture)

LONG = ["tok "] * 400  # 4 s of scripted steps


async def stream_until_first_chunk(app, on_first_chunk) -> list:
    """A streamed chat request; `on_first_chunk()` runs once its first event is sent."""
    body = json.dumps({"messages": MSG, "stream": True}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [], "client": ("127.0.0.1", 1)}
    sent, delivered = [], [{"type": "http.request", "body": body}]

    async def receive():
        if delivered:
            return delivered.pop()
        await asyncio.Event().wait()  # the client stays to the end

    async def send(message):
        if message["type"] == "http.response.body" and not sent:
            on_first_chunk()
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    await app(scope, receive, send)
    return sse_events(b"".join(sent))


def test_new_requests_during_the_drain_get_a_503(default_model_dir, tokenizer):  # noqa: F811
    app, engine = make_app(default_model_dir, tokenizer, ["a"])

    async def scenario():
        app.drain.begin(timeout=60)
        return await call(app, "POST", "/v1/chat/completions", {"messages": MSG})

    status, _, body = run(scenario())
    assert status == 503 and json.loads(body)["error"]["message"] == "the server is shutting down"
    assert engine.requests == []


def test_a_stream_in_flight_finishes_within_the_drain_time(default_model_dir, tokenizer):  # noqa: F811
    app, engine = make_app(default_model_dir, tokenizer, ["a", "b", "c"])

    async def scenario():
        events = await stream_until_first_chunk(app, lambda: app.drain.begin(timeout=60))
        await app.drain.wait_idle()
        return events

    events = run(scenario())
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == "abc"
    assert events[-1] == "[DONE]" and engine.closed == []
    assert app.drain.in_flight == 0


def test_when_the_drain_time_ends_a_stream_ends_with_an_error_event(default_model_dir, tokenizer):  # noqa: F811
    app, engine = make_app(default_model_dir, tokenizer, LONG)

    async def scenario():
        events = await stream_until_first_chunk(app, lambda: app.drain.begin(timeout=0))
        await app.drain.wait_idle()
        return events

    events = run(scenario())
    assert events[-2] == {"error": {"message": "the server is shutting down", "type": "server_error",
                                    "param": None, "code": None}}
    assert events[-1] == "[DONE]"
    assert engine.closed == [engine.requests[0].rid]  # the engine request was aborted


def test_when_the_drain_time_ends_a_whole_response_is_a_503(default_model_dir, tokenizer):  # noqa: F811
    app, engine = make_app(default_model_dir, tokenizer, LONG)

    async def scenario():
        # the drain starts once the request is in; the script outlasts its 0.3 s
        asyncio.get_running_loop().call_soon(app.drain.begin, 0.3)
        return await call(app, "POST", "/v1/chat/completions", {"messages": MSG})

    status, _, body = run(scenario())
    assert status == 503 and json.loads(body)["error"]["type"] == "server_error"
    assert engine.closed == [engine.requests[0].rid]
