"""Bad input gets a 4xx with an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def assert_error(response: httpx.Response, status: int, param: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


BAD_CHAT_BODIES = {
    "max_tokens zero": ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"messages": MSG, "max_tokens": -5}, "max_tokens"),
    "temperature negative": ({"messages": MSG, "temperature": -0.1}, "temperature"),
    "temperature too high": ({"messages": MSG, "temperature": 2.5}, "temperature"),
    "top_p zero": ({"messages": MSG, "top_p": 0}, "top_p"),
    "n zero": ({"messages": MSG, "n": 0}, "n"),
    "presence penalty": ({"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
    "max_tokens as string": ({"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
    "messages missing": ({"model": "x"}, "messages"),
    "messages empty": ({"messages": []}, "messages"),
    "messages not a list": ({"messages": "hi"}, "messages"),
    "role unknown": ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    "logit bias key": ({"messages": MSG, "logit_bias": {"abc": 1}}, "logit_bias"),
    "logit bias outside vocab": ({"messages": MSG, "logit_bias": {"99999999": 1}}, "logit_bias"),
    "too long for the context": ({"messages": MSG, "max_tokens": 10**6}, "max_tokens"),
    "stream_options without stream": ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    "image content part": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content"),
    "response_format json": ({"messages": MSG, "response_format": {"type": "json_object"}}, "response_format"),
}


@pytest.mark.parametrize("case", list(BAD_CHAT_BODIES))
def test_bad_chat_request(http, case):
    body, param = BAD_CHAT_BODIES[case]
    assert_error(http.post(CHAT, json=body), 400, param)


BAD_COMPLETION_BODIES = {
    "token id outside vocabulary": ({"prompt": [1, 2, 10**9]}, "prompt"),
    "negative token id": ({"prompt": [-1]}, "prompt"),
    "empty token list": ({"prompt": []}, "prompt"),
    "prompt wrong type": ({"prompt": 42}, "prompt"),
    "prompt longer than context": ({"prompt": [5] * 9000}, "prompt"),
    "n too large": ({"prompt": "hi", "n": 1000}, "n"),
}


@pytest.mark.parametrize("case", list(BAD_COMPLETION_BODIES))
def test_bad_completion_request(http, case):
    body, param = BAD_COMPLETION_BODIES[case]
    assert_error(http.post(COMPLETIONS, json=body), 400, param)


def test_malformed_json(http):
    r = http.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_unknown_route_and_wrong_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get(CHAT), 405)


def test_native_generate_bad_sampling_params(http):
    assert_error(http.post("/generate", json={"text": "hi", "sampling_params": {"temperature": "hot"}}), 400)
    assert_error(http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 0}}), 400)
    assert_error(http.post("/generate", json={"input_ids": [10**9]}), 400)


def test_server_keeps_serving_after_bad_input(http):
    for body, _ in BAD_CHAT_BODIES.values():
        http.post(CHAT, json=body)
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 4})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] is not None
    assert http.get("/health").status_code == 200


def test_native_routes(http):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"]
    out = http.post("/generate", json={"text": "The capital of France is",
                                       "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert out["text"] and out["meta_info"]["completion_tokens"] <= 8
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    with http.stream("POST", "/generate", json={"text": "Hello", "stream": True,
                                                "sampling_params": {"max_new_tokens": 5, "temperature": 0}}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) >= 2


def test_api_key_is_enforced():
    from tests.conftest import ServerProcess

    srv = ServerProcess("--api-key", "sekrit", "--max-total-tokens", "2048")
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            assert_error(c.post(CHAT, json={"messages": MSG}), 401)
            assert_error(c.post(CHAT, json={"messages": MSG}, headers={"Authorization": "Bearer nope"}), 401)
            ok = c.post(CHAT, json={"messages": MSG, "max_tokens": 2}, headers={"Authorization": "Bearer sekrit"})
            assert ok.status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        srv.stop()
