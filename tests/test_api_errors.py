"""Bad input gets a 4xx with an OpenAI error body, and the server keeps serving.

The app runs in process on a tiny random model with a short context, so
the context-length checks have small, exact numbers: what is checked is
the routes' answers (a 413 over a real socket is test_api_peer's).
"""

from __future__ import annotations

import httpx
import pytest

from tests.test_tokenize_api import tiny_server_http

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
CONTEXT = 256
MAX_PAYLOAD = 256 << 10


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory):
    with tiny_server_http(tiny_llama_dir, tmp_path_factory.mktemp("errors"), context_length=CONTEXT,
                          max_total_tokens=4096, reasoning_parser="qwen3", max_payload_size=MAX_PAYLOAD) as c:
        yield c


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


BAD_CHAT_BODIES = {
    "max_tokens zero": ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"messages": MSG, "max_tokens": -5}, "max_tokens"),
    "max_completion_tokens zero": ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    "temperature negative": ({"messages": MSG, "temperature": -0.1}, "temperature"),
    "temperature too high": ({"messages": MSG, "temperature": 2.5}, "temperature"),
    "top_p zero": ({"messages": MSG, "top_p": 0}, "top_p"),
    "top_p above one": ({"messages": MSG, "top_p": 1.5}, "top_p"),
    "n zero": ({"messages": MSG, "n": 0}, "n"),
    "n too large": ({"messages": MSG, "n": 1000}, "n"),
    "presence penalty": ({"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
    "frequency penalty": ({"messages": MSG, "frequency_penalty": -2.5}, "frequency_penalty"),
    "repetition penalty": ({"messages": MSG, "repetition_penalty": 0}, "repetition_penalty"),
    "min_p": ({"messages": MSG, "min_p": 1.5}, "min_p"),
    "top_k": ({"messages": MSG, "top_k": -3}, "top_k"),
    "seed beyond 64 bits": ({"messages": MSG, "seed": 2**70}, "seed"),
    "max_tokens as string": ({"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
    "temperature as string": ({"messages": MSG, "temperature": "hot"}, "temperature"),
    "stream as string": ({"messages": MSG, "stream": "yes"}, "stream"),
    "messages missing": ({"model": "x"}, "messages"),
    "messages empty": ({"messages": []}, "messages"),
    "messages not a list": ({"messages": "hi"}, "messages"),
    "message without role": ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    "role unknown": ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    "content a number": ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    "image content part": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content"),
    "empty stop string": ({"messages": MSG, "stop": [""]}, "stop"),
    "stop token outside vocab": ({"messages": MSG, "stop_token_ids": [10**8]}, "stop_token_ids"),
    "logit bias key": ({"messages": MSG, "logit_bias": {"abc": 1}}, "logit_bias"),
    "logit bias outside vocab": ({"messages": MSG, "logit_bias": {"99999999": 1}}, "logit_bias"),
    "logit bias value": ({"messages": MSG, "logit_bias": {"5": 500}}, "logit_bias"),
    "logprobs a number": ({"messages": MSG, "logprobs": 3}, "logprobs"),
    "top_logprobs without logprobs": ({"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    "top_logprobs too many": ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "tool_choice required": ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    "too long for the context": ({"messages": MSG, "max_tokens": 10**6}, "max_tokens"),
    "stream_options without stream": ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    "response_format type": ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    "continue without text": ({"messages": [{"role": "assistant"}], "continue_final_message": True}, "messages"),
}


@pytest.mark.parametrize("case", list(BAD_CHAT_BODIES))
def test_bad_chat_request(http, case):
    body, param = BAD_CHAT_BODIES[case]
    assert_error(http.post(CHAT, json=body), 400, param)


@pytest.mark.parametrize("case", ["too long for the context", "max_tokens zero"])
def test_bad_streamed_request_is_a_plain_400(http, case):
    body, param = BAD_CHAT_BODIES[case]
    assert_error(http.post(CHAT, json={**body, "stream": True}), 400, param)


BAD_COMPLETION_BODIES = {
    "token id outside vocabulary": ({"prompt": [1, 2, 10**9]}, "prompt"),
    "negative token id": ({"prompt": [-1]}, "prompt"),
    "token id lists with a string": ({"prompt": [[1, "a"]]}, "prompt[0][1]"),
    "empty token list": ({"prompt": []}, "prompt"),
    "empty string": ({"prompt": ""}, "prompt"),
    "prompt wrong type": ({"prompt": 42}, "prompt"),
    "prompt missing": ({"max_tokens": 3}, "prompt"),
    "prompt longer than context": ({"prompt": [5] * (CONTEXT + 10)}, "prompt"),
    "n too large": ({"prompt": "hi", "n": 1000}, "n"),
    "suffix": ({"prompt": "hi", "suffix": "end"}, "suffix"),
    "logprobs too many": ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    "logprobs a boolean": ({"prompt": "hi", "logprobs": True}, "logprobs"),
    "best_of": ({"prompt": "hi", "best_of": 3}, "best_of"),
}


@pytest.mark.parametrize("case", list(BAD_COMPLETION_BODIES))
def test_bad_completion_request(http, case):
    body, param = BAD_COMPLETION_BODIES[case]
    assert_error(http.post(COMPLETIONS, json=body), 400, param)


def test_context_length_message_reads_like_vllm(http):
    error = assert_error(http.post(COMPLETIONS, json={"prompt": [5] * 100, "max_tokens": 200}), 400, "max_tokens")
    assert error["message"].startswith(
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested 300 tokens "
        "(100 in the prompt, 200 in the completion).")
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("raw", [b'{"messages": [', b"", b"[1, 2]", b"not json", b'{"messages": [}'])
def test_malformed_json(http, raw):
    r = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert "JSON" in assert_error(r, 400)["message"]


def test_unknown_route_and_wrong_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.post("/v1/chat/completions/extra", json={}), 404)
    assert_error(http.get(CHAT), 405)
    assert_error(http.delete("/v1/models"), 405)


def test_native_generate_bad_input(http):
    assert_error(http.post("/generate", json={"text": "hi", "sampling_params": {"temperature": "hot"}}), 400)
    assert_error(http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 0}}), 400)
    assert_error(http.post("/generate", json={"text": "hi", "sampling_params": {"regex": "(a|"}}), 400,
                 "sampling_params.regex")
    assert_error(http.post("/generate", json={"text": "hi", "sampling_params": {"outlines": "a+"}}), 400)
    assert_error(http.post("/generate", json={"input_ids": [10**9]}), 400, "input_ids")
    assert_error(http.post("/generate", json={"sampling_params": {}}), 400)
    assert_error(http.post("/generate", json={"text": "hi", "input_ids": [1]}), 400)


def test_unknown_fields_are_refused_and_metadata_is_accepted(http):
    """A setting the server does not honour is never dropped silently; the
    documented metadata fields change nothing."""
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2, "some_future_option": {"x": 1}})
    assert_error(r, 400, "some_future_option")
    assert_error(http.post(CHAT, json={"messages": MSG, "stream": True, "stream_options": {"every": 1}}), 400,
                 "stream_options.every")
    assert_error(http.post(CHAT, json={"messages": [{**MSG[0], "mood": "x"}]}), 400, "messages[0].mood")
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2, "parallel_tool_calls": False, "service_tier": "auto",
                              "user": "u", "metadata": {"k": "v"}, "store": False, "safety_identifier": "s",
                              "prompt_cache_key": "p"})
    assert r.status_code == 200, r.text


def test_any_model_name_is_served_under_the_served_name(http):
    served = http.get("/v1/models").json()["data"][0]["id"]
    r = http.post(CHAT, json={"model": "gpt-4o", "messages": MSG, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == served


def test_reasoning_parser_leaves_output_without_thinking_as_content(http):
    body = {"messages": MSG, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": True}}
    raw = http.post(CHAT, json={**body, "separate_reasoning": False}).json()["choices"][0]["message"]
    split = http.post(CHAT, json=body).json()["choices"][0]["message"]
    assert "<think>" not in raw["content"]  # a random model does not think
    assert split["reasoning_content"] is None and split["content"] == raw["content"].lstrip()


def test_server_keeps_serving_after_bad_input(http):
    for body, _ in BAD_CHAT_BODIES.values():
        http.post(CHAT, json=body)
    for body, _ in BAD_COMPLETION_BODIES.values():
        http.post(COMPLETIONS, json=body)
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 4})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] is not None
    assert http.get("/health").status_code == 200
    info = http.get("/get_server_info").json()
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0


def test_api_key_is_enforced(tiny_llama_dir, tmp_path):
    with tiny_server_http(tiny_llama_dir, tmp_path, api_key="sekrit", max_total_tokens=2048) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sekrit"},
                        {"Authorization": "Bearer sekrït".encode("latin-1")}):
            error = assert_error(c.post(CHAT, json={"messages": MSG}, headers=headers), 401)
            assert error["type"] == "authentication_error"
        assert_error(c.get("/v1/models"), 401)
        ok = c.post(CHAT, json={"messages": MSG, "max_tokens": 2}, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200  # load balancers probe without a key


def test_a_body_over_max_payload_size_is_a_413_with_an_openai_body(http):
    import openai

    client = openai.OpenAI(api_key="EMPTY", base_url=f"{http.base_url}/v1", http_client=http, max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="m", prompt="x" * MAX_PAYLOAD, max_tokens=1)
    assert e.value.status_code == 413 and e.value.body["code"] == "payload_too_large"
    # just under the limit is read (and then judged on its merits)
    assert http.post(COMPLETIONS, json={"prompt": "hi " * 1000, "max_tokens": 1}).status_code != 413
