"""What the HTTP layer does before a handler runs, in-process over a
scripted engine: malformed bodies are 400s with OpenAI error bodies (not
500s), CORS answers only the allowed origins, a trusted proxy's
X-Forwarded-For names the client in the access log, and routes are found
under a root path."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from pyserve.http.io import MAX_JSON_DEPTH, json_depth_exceeds
from pyserve.http.proxy import CORS, TrustedProxies
from tests.test_api_handlers import MSG, call, make_app, run
from tests.test_api_handlers import tokenizer  # noqa: F401 (a fixture)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def error_of(status: int, body: bytes) -> dict:
    assert 400 <= status < 500, (status, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "caf\xe9 \xff\xfe"}]}'),
    ("/v1/completions", '{"prompt": "\xff\xfe\xfd", "max_tokens": 2}'),
])
def test_invalid_utf8_inside_a_json_string_is_a_400(default_model_dir, tokenizer, path, body):  # noqa: F811
    app, engine = make_app(default_model_dir, tokenizer, ["a"])
    status, _, answer = run(call(app, "POST", path, raw=body.encode("latin-1")))
    assert "UTF-8" in error_of(status, answer)["message"]
    assert engine.requests == []


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tool_choice": %s}'),
    ("/v1/completions", '{"prompt": %s}'),
    ("/generate", '{"input_ids": %s}'),
    ("/generate", '{"text": "hi", "sampling_params": {"stop": %s}}'),
])
def test_ten_thousand_levels_of_nesting_are_a_400(default_model_dir, tokenizer, path, body):  # noqa: F811
    app, engine = make_app(default_model_dir, tokenizer, ["a"])
    status, _, answer = run(call(app, "POST", path, raw=(body % nested(10_000)).encode()))
    assert "nests deeper" in error_of(status, answer)["message"]
    assert engine.requests == []


def test_nesting_is_counted_outside_strings_only():
    assert json_depth_exceeds(nested(MAX_JSON_DEPTH + 1).encode())
    assert not json_depth_exceeds(nested(MAX_JSON_DEPTH).encode())
    text_full_of_brackets = json.dumps({"content": "[{" * 5000, "x": [[1]]}).encode()
    assert not json_depth_exceeds(text_full_of_brackets)
    escaped_quote = json.dumps({"content": 'a \\" [[[' + "[" * 200}).encode()
    assert not json_depth_exceeds(escaped_quote)


def test_a_body_at_the_bound_is_still_decoded(default_model_dir, tokenizer):  # noqa: F811
    app, _ = make_app(default_model_dir, tokenizer, ["a"])
    prompt = json.dumps([[1, 2, 3]] * 50)  # 2 levels, 51 brackets
    status, _, body = run(call(app, "POST", "/v1/completions", raw=f'{{"prompt": {prompt}, "max_tokens": 1}}'.encode()))
    assert status == 200, body


def test_cors_is_off_unless_origins_are_allowed(default_model_dir, tokenizer):  # noqa: F811
    app, _ = make_app(default_model_dir, tokenizer, ["a"])
    _, headers, _ = run(call(app, "GET", "/v1/models", headers={"Origin": "https://evil.example"}))
    assert not any(name.startswith(b"access-control") for name in headers)
    status, headers, _ = run(call(app, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}))
    assert status == 405 and b"access-control-allow-origin" not in headers


def test_listed_origins_only_and_never_credentials(default_model_dir, tokenizer):  # noqa: F811
    app, _ = make_app(default_model_dir, tokenizer, ["a"], cors=CORS(["https://ui.example"]))
    _, headers, _ = run(call(app, "GET", "/v1/models", headers={"Origin": "https://ui.example"}))
    assert headers[b"access-control-allow-origin"] == b"https://ui.example"
    assert headers[b"vary"] == b"Origin" and b"access-control-allow-credentials" not in headers
    _, headers, _ = run(call(app, "GET", "/v1/models", headers={"Origin": "https://evil.example"}))
    assert b"access-control-allow-origin" not in headers
    status, headers, _ = run(call(app, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"}))
    assert status == 204 and headers[b"access-control-allow-headers"] == b"authorization, content-type"


def test_any_origin_is_star_without_credentials(default_model_dir, tokenizer):  # noqa: F811
    app, _ = make_app(default_model_dir, tokenizer, ["a"], cors=CORS(["*"]))
    _, headers, _ = run(call(app, "GET", "/v1/models", headers={"Origin": "https://any.example"}))
    assert headers[b"access-control-allow-origin"] == b"*"
    assert b"access-control-allow-credentials" not in headers


def test_forwarded_client_only_from_trusted_proxies():
    proxies = TrustedProxies(["127.0.0.1", "10.0.0.0/8"])
    via_proxy = {"client": ("127.0.0.1", 4000)}
    assert proxies.client(via_proxy, {"x-forwarded-for": "203.0.113.7"}) == "203.0.113.7:0"
    # the nearest hop that is not a proxy: what a client prepends is not believed
    assert proxies.client(via_proxy, {"x-forwarded-for": "1.2.3.4, 203.0.113.7, 10.1.2.3"}) == "203.0.113.7:0"
    assert proxies.client({"client": ("198.51.100.1", 5000)}, {"x-forwarded-for": "1.2.3.4"}) == "198.51.100.1:5000"
    assert TrustedProxies([]).client(via_proxy, {"x-forwarded-for": "1.2.3.4"}) == "127.0.0.1:4000"


def test_access_log_names_the_forwarded_client(default_model_dir, tokenizer, caplog):  # noqa: F811
    app, _ = make_app(default_model_dir, tokenizer, ["a"], proxies=TrustedProxies(["127.0.0.1"]))
    with caplog.at_level(logging.INFO, logger="pyserve.http"):
        run(call(app, "GET", "/health", headers={"X-Forwarded-For": "203.0.113.7"}))
    assert 'INFO:     203.0.113.7:0 - "GET /health HTTP/1.1" 200 OK' in caplog.text


def test_routes_are_found_under_the_root_path(default_model_dir, tokenizer):  # noqa: F811
    app, _ = make_app(default_model_dir, tokenizer, ["a", "b"])

    async def under(root_path: str, path: str):
        sent, bodies = [], [{"type": "http.request", "body": json.dumps({"messages": MSG}).encode()}]

        async def receive():
            if bodies:
                return bodies.pop()
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            sent.append(message)

        await app({"type": "http", "method": "POST", "path": path, "root_path": root_path, "headers": [],
                   "query_string": b"", "client": ("127.0.0.1", 1)}, receive, send)
        return sent[0]["status"], json.loads(sent[1]["body"])

    # ASGI servers differ in whether `path` carries the root path: both route
    status, body = run(under("/llm", "/llm/v1/chat/completions"))
    assert status == 200 and body["choices"][0]["message"]["content"] == "ab"
    assert run(under("/llm", "/v1/chat/completions"))[0] == 200
    assert run(under("/llm", "/llmx/v1/chat/completions"))[0] == 404
