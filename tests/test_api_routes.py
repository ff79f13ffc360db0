"""The routes besides chat/completions, and response shapes byte by byte,
against the real server on the embedded model."""

from __future__ import annotations

import json
import time

import httpx
import pytest


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def sse_events(response: httpx.Response) -> list:
    body = response.read().decode()
    frames = body.split("\n\n")
    assert frames[-1] == "" and all(f.startswith("data: ") for f in frames[:-1]), body
    return [f[6:] if f == "data: [DONE]" else json.loads(f[6:]) for f in frames[:-1]]


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.content == b""
    assert http.get("/health_generate").status_code == 200


def test_models_list_and_retrieve(http, client, model_name):
    listed = http.get("/v1/models").json()
    assert listed["object"] == "list"
    card = listed["data"][0]
    assert card["owned_by"] == "pyserve" and card["max_model_len"] > 0 and card["object"] == "model"
    assert client.models.retrieve(model_name).id == model_name
    r = http.get("/v1/models/meta-llama/Not-This-One")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_model_info_and_version(http):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] and info["tokenizer_path"]
    assert info["architecture"] == "LlamaForCausalLM"
    assert http.get("/version").json()["version"]


def test_native_generate(http):
    out = http.post("/generate", json={"text": "The capital of France is",
                                       "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    meta = out["meta_info"]
    assert out["text"] and meta["completion_tokens"] <= 8 and meta["prompt_tokens"] > 0
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == 8
    batch = http.post("/generate", json={"text": ["Hello", "The sky is"],
                                         "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert len(http.post("/generate", json={"input_ids": [1, 2, 3],
                                            "sampling_params": {"max_new_tokens": 2, "n": 2}}).json()) == 2


def test_native_generate_takes_a_setting_per_prompt(http):
    """SGLang's batch form: sampling_params, rid and the logprob options as
    lists of one per prompt; each prompt answers as it would alone."""
    prompts = ["The sky is", "Paris is"]
    each = [{"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
            {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}]
    batch = http.post("/generate", json={"text": prompts, "sampling_params": each, "rid": ["sky", "paris"],
                                         "return_logprob": [True, False]}).json()
    alone = [http.post("/generate", json={"text": t, "sampling_params": p}).json() for t, p in zip(prompts, each)]
    assert [o["text"] for o in batch] == [o["text"] for o in alone]
    assert [o["meta_info"]["completion_tokens"] for o in batch] == [2, 5]
    assert [o["meta_info"]["id"] for o in batch] == ["sky", "paris"]
    assert len(batch[0]["meta_info"]["output_token_logprobs"]) == 2
    assert "output_token_logprobs" not in batch[1]["meta_info"]


@pytest.mark.parametrize("body, param", [
    ({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 1}]}, "sampling_params"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ({"text": "a", "rid": ["x", "y"]}, "rid"),
    ({"text": ["a", "b"], "top_logprobs_num": [1, 2, 3], "return_logprob": True}, "top_logprobs_num"),
])
def test_native_generate_refuses_lists_that_do_not_fit_the_prompts(http, body, param):
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_native_generate_streams_cumulative_text(http):
    body = {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    with http.stream("POST", "/generate", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert events[-2]["meta_info"]["finish_reason"] is not None
    whole = http.post("/generate", json={**body, "stream": False}).json()
    assert texts[-1] == whole["text"]


def test_streamed_chat_bytes(http):
    """What the openai client parses: every chunk a complete object, nulls
    where OpenAI has them, usage only in the final usage chunk."""
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"] == "text/event-stream"
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert list(chunks[0]) == ["id", "object", "created", "model", "choices"]
    assert chunks[0]["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": "", "reasoning_content": None},
                                 "logprobs": None,
                                       "finish_reason": None, "matched_stop": None}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]].count(None) == len(chunks) - 2
    assert chunks[-1]["choices"] == [] and set(chunks[-1]["usage"]) == {
        "prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


def test_whole_chat_bytes(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi"}],
                                               "max_tokens": 4, "temperature": 0})
    data = r.json()
    assert list(data) == ["id", "object", "created", "model", "choices", "usage"]
    assert data["id"].startswith("chatcmpl-")
    choice = data["choices"][0]
    assert list(choice) == ["index", "message", "logprobs", "finish_reason", "matched_stop"]
    assert list(choice["message"]) == ["role", "content", "reasoning_content", "tool_calls"]


def test_completions_default_to_16_tokens_and_echo_the_prompt_as_sent(http):
    prompt = "Once upon  a time"  # two spaces survive the echo
    data = http.post("/v1/completions", json={"prompt": prompt, "echo": True, "ignore_eos": True}).json()
    assert data["usage"]["completion_tokens"] == 16
    assert data["choices"][0]["text"].startswith(prompt)
    assert data["choices"][0]["finish_reason"] == "length"


def test_client_chosen_rid_already_running_is_a_400(server, http):
    body = {"prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "rid": "same-rid", "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as other:
        with other.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)  # it is running now
            second = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
    assert second.status_code == 400 and second.json()["error"]["param"] == "rid"


def test_load_reports_count_the_requests_running_and_the_kv_they_hold(server, http):
    body = {"prompt": "Count:", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as other:
        with other.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)
            during = http.get("/get_load").json(), http.get("/v1/loads").json()
    old, new = during
    assert old == [{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": old[0]["num_tokens"]}]
    assert old[0]["num_tokens"] > 0  # the KV it alone holds (its prompt's is shared with the prefix cache)
    load = new["loads"][0]
    assert new["dp_rank_count"] == 1 and load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 0
    assert load["num_used_tokens"] > 0 and 0 < load["token_usage"] <= 1
    deadline = time.time() + 10  # the engine frees it once the client has gone
    while http.get("/get_load").json()[0]["num_reqs"] and time.time() < deadline:
        time.sleep(0.05)
    assert http.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_access_log_lines(server, http):
    http.get("/v1/models?x=1")
    line = '"GET /v1/models?x=1 HTTP/1.1" 200 OK'
    deadline = time.time() + 5  # the line is written once the response is sent
    while line not in server.log() and time.time() < deadline:
        time.sleep(0.05)
    assert "INFO:     127.0.0.1:" in server.log() and line in server.log()


def test_metrics_count_requests_and_tokens(http):
    def scrape() -> dict[str, float]:
        r = http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        values = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    before = scrape()
    body = {"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    after = scrape()
    assert after["pyserve:generation_tokens_total"] - before["pyserve:generation_tokens_total"] == 5
    assert after["pyserve:prompt_tokens_total"] - before["pyserve:prompt_tokens_total"] == usage["prompt_tokens"]
    key = 'pyserve:num_requests_total{finish_reason="length"}'
    assert after[key] - before.get(key, 0) == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert after[f"pyserve:{name}_count"] - before.get(f"pyserve:{name}_count", 0) == 1
        assert after[f'pyserve:{name}_bucket{{le="+Inf"}}'] == after[f"pyserve:{name}_count"]
    # idle again: what the prefix cache keeps is not "in use" (SGLang's meaning)
    assert after["pyserve:token_usage"] == 0 and after["pyserve:num_running_reqs"] == 0


def test_flush_cache_empties_the_prefix_cache(http):
    prompt = "A long shared beginning of a prompt, " * 8
    http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    r = http.post("/flush_cache")
    assert r.status_code == 200
    info = http.get("/get_server_info").json()
    assert info["kv_tokens_cached"] == 0 and info["kv_integrity"] == "ok"
    http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert http.get("/flush_cache").status_code == 200  # SGLang's curl without -X POST
    assert http.get("/get_server_info").json()["kv_tokens_cached"] == 0
    again = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_server_info_carries_sglangs_internal_states(http):
    """One scheduler's state where SGLang's tools read it: the throughput
    of the last decode line (after 41 decode steps there is one), and no
    accept length without speculation."""
    http.post("/v1/completions", json={"prompt": "Count: one, two,", "max_tokens": 60, "temperature": 0,
                                       "ignore_eos": True})
    (state,) = http.get("/get_server_info").json()["internal_states"]
    assert state["last_gen_throughput"] > 0 and "avg_spec_accept_length" not in state


def test_native_generate_returns_sglang_logprobs(http):
    body = {"input_ids": [504, 3575, 282, 4649, 314], "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 2, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == body["input_ids"]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert all(e[0] < 0 and isinstance(e[2], str) for e in meta["input_token_logprobs"][1:])
    assert len(meta["output_token_logprobs"]) == 4 == len(meta["output_top_logprobs"])
    for e, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 2 and top[0][1] == e[1] and top[0][0] == e[0]  # greedy: the best
    plain = http.post("/generate", json={**body, "return_logprob": False}).json()["meta_info"]
    assert "output_token_logprobs" not in plain
    # logprob_start_len -1 (the default): output tokens only
    out_only = http.post("/generate", json={**body, "logprob_start_len": -1}).json()["meta_info"]
    assert out_only["input_token_logprobs"] == [] and len(out_only["output_token_logprobs"]) == 4


def test_sagemakers_routes_answer_as_the_routes_their_bodies_are_for(http, model_name):
    """vLLM's /ping and /invocations, which SageMaker's containers call."""
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    chat = {"model": model_name, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5,
            "temperature": 0}
    direct = http.post("/v1/chat/completions", json=chat).json()
    invoked = http.post("/invocations", json=chat).json()
    assert invoked["object"] == "chat.completion" and invoked["choices"] == direct["choices"]
    completion = http.post("/invocations", json={"model": model_name, "prompt": "Hello", "max_tokens": 2}).json()
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 2
    with http.stream("POST", "/invocations", json={**chat, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == \
        direct["choices"][0]["message"]["content"]
    r = http.post("/invocations", json={"question": "?"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_weight_version_routes_and_vllms_cache_reset(http):
    assert http.get("/get_weight_version").json() == {"weight_version": "default"}
    r = http.post("/update_weight_version", json={"new_version": "step-7"})
    assert r.status_code == 200 and r.json()["success"] is True
    assert http.get("/get_model_info").json()["weight_version"] == "step-7"
    assert http.get("/get_weight_version").json() == {"weight_version": "step-7"}
    assert http.post("/update_weight_version", json={"new_version": "default"}).status_code == 200
    r = http.post("/update_weight_version", json={})
    assert r.status_code == 400 and r.json()["success"] is False
    assert http.post("/reset_prefix_cache").status_code == 200
