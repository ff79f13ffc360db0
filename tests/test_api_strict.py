"""Typed request bodies and /generate's strictness, through the real server:
every malformed field is a 400 with an OpenAI error body naming it, and the
server answers normally afterwards. Also the per-request cap on prompts x n
(--max-sequences-per-request)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.test_tokenize_api import tiny_server_http

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # five tokens of the embedded model


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def assert_error(response: httpx.Response, param: str | None, code: str | None = None, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post(GENERATE, json={"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1


# -- the issue's hostile bodies ------------------------------------------------


@pytest.mark.parametrize("path, template", [
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "tool_choice": %s}'),
    (COMPLETIONS, '{"prompt": %s}'),
    (GENERATE, '{"input_ids": %s}'),
    (GENERATE, '{"text": "hi", "sampling_params": {"stop": %s}}'),
])
def test_ten_thousand_levels_of_nesting_are_400s(http, path, template):
    r = http.post(path, content=template % nested(10_000), headers={"content-type": "application/json"})
    assert "nests deeper" in assert_error(r, None)["message"]
    assert_still_serving(http)


@pytest.mark.parametrize("path, body", [
    (CHAT, b'{"messages": [{"role": "user", "content": "caf\xe9 \xff"}]}'),
    (COMPLETIONS, b'{"prompt": "\xff\xfe", "max_tokens": 1}'),
])
def test_invalid_utf8_in_a_string_is_a_400(http, path, body):
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert "UTF-8" in assert_error(r, None)["message"]
    assert_still_serving(http)


@pytest.mark.parametrize("field, value, expected", [
    ("stop", 5, "str | array | null"),
    ("stop_token_ids", "12", "array | null"),
    ("logit_bias", [1, 2], "object | null"),
    ("seed", "5", "int | null"),
    ("ignore_eos", "yes", "bool"),
    ("n", 1.5, "int"),
    ("max_new_tokens", "8", "int"),
])
def test_wrongly_typed_sampling_params_are_400s_naming_the_field(http, field, value, expected):
    r = http.post(GENERATE, json={"text": "hi", "sampling_params": {"max_new_tokens": 1, field: value}})
    error = assert_error(r, f"sampling_params.{field}", "invalid_type")
    assert expected in error["message"]
    assert_still_serving(http)


# -- typed OpenAI fields ----------------------------------------------------------

BAD_OPENAI_BODIES = {
    "tool_choice a number": (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": 1}, "tool_choice", "invalid_type"),
    "tool_choice a list": (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": ["auto"]}, "tool_choice",
                           "invalid_type"),
    "tool_choice without function": (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function"}},
                                     "tool_choice.function", "missing_required_parameter"),
    "tool_choice name a number": (CHAT, {"messages": MSG, "tools": TOOLS,
                                         "tool_choice": {"type": "function", "function": {"name": 3}}},
                                  "tool_choice.function.name", "invalid_type"),
    "tool_choice unknown string": (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": "always"}, "tool_choice",
                                   "invalid_value"),
    "prompt a number": (COMPLETIONS, {"prompt": 42}, "prompt", "invalid_type"),
    "prompt an object": (COMPLETIONS, {"prompt": {"text": "hi"}}, "prompt", "invalid_type"),
    "prompt booleans": (COMPLETIONS, {"prompt": [True, False]}, "prompt[0]", "invalid_type"),
    "prompt three levels": (COMPLETIONS, {"prompt": [[[1]]]}, "prompt[0][0]", "invalid_type"),
    "prompt floats": (COMPLETIONS, {"prompt": [1.5]}, "prompt[0]", "invalid_type"),
    "prompt texts and ids mixed": (COMPLETIONS, {"prompt": ["hi", 5]}, "prompt", None),
    "regex a number": (COMPLETIONS, {"prompt": "hi", "regex": 5}, "regex", "invalid_type"),
    "ebnf a list": (COMPLETIONS, {"prompt": "hi", "ebnf": ["root ::= x"]}, "ebnf", "invalid_type"),
    "json_schema a number": (CHAT, {"messages": MSG, "json_schema": 3}, "json_schema", "invalid_type"),
    "structured_outputs a string": (CHAT, {"messages": MSG, "structured_outputs": "json"}, "structured_outputs",
                                    "invalid_type"),
    "response_format json_schema a string": (CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": "{}"}}, "response_format.json_schema", "invalid_type"),
    "structural tag triggers not strings": (CHAT, {"messages": MSG, "response_format": {
        "type": "structural_tag", "structures": [], "triggers": [1]}}, "response_format.triggers[0]",
        "invalid_type"),
}


@pytest.mark.parametrize("case", list(BAD_OPENAI_BODIES))
def test_wrongly_typed_openai_fields_are_400s_naming_the_field(http, case):
    path, body, param, code = BAD_OPENAI_BODIES[case]
    assert_error(http.post(path, json={"max_tokens": 1, **body}), param, code)
    assert_still_serving(http)


def test_typed_fields_still_take_every_shape_they_allow(http):
    named = {"type": "function", "function": {"name": "now"}}
    for choice in ("none", "auto", named):
        r = http.post(CHAT, json={"messages": MSG, "tools": TOOLS, "tool_choice": choice, "max_tokens": 16})
        assert r.status_code == 200, r.text
    for prompt, choices in (("hi", 1), (["hi", "there"], 2), (PROMPT_IDS, 1), ([PROMPT_IDS, PROMPT_IDS[:2]], 2)):
        r = http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == choices
    r = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 4, "regex": "[0-9]{2}"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert re.fullmatch("[0-9]{2}", choice["text"]) and choice["finish_reason"] == "stop", choice


# -- /generate is as strict as the OpenAI routes ----------------------------------

BAD_GENERATE_BODIES = {
    "ignore_eos a string, top level": ({"ignore_eos": "yes"}, "ignore_eos", "unknown_parameter"),
    "unknown field": ({"max_tokens": 4}, "max_tokens", "unknown_parameter"),
    "unknown sampling param": ({"sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens",
                               "unknown_parameter"),
    # SGLang's own, which pyserve cannot honour: refused, not dropped
    "min_new_tokens a string": ({"sampling_params": {"min_new_tokens": "2"}}, "sampling_params.min_new_tokens",
                                "invalid_type"),
    "custom_params without a processor": ({"sampling_params": {"custom_params": {"k": 1}}},
                                          "sampling_params.custom_params", None),
    "custom_logit_processor without its flag": ({"custom_logit_processor": '{"callable": "80"}'},
                                                "custom_logit_processor", None),
    "image_data": ({"image_data": "http://example.com/a.png"}, "image_data", "unknown_parameter"),
    "lora_path": ({"lora_path": "adapter"}, "lora_path", "unknown_parameter"),
    "return_hidden_states without its flag": ({"return_hidden_states": True}, "return_hidden_states", None),
    "return_logprob a string": ({"return_logprob": "true"}, "return_logprob", "invalid_type"),
    "stream a number": ({"stream": 1}, "stream", "invalid_type"),
    "input_ids a string": ({"input_ids": "504 3575"}, "input_ids", "invalid_type"),
    "input_ids with a string": ({"input_ids": [[504], [3575, "282"]]}, "input_ids[1][1]", "invalid_type"),
    "input_ids ids and lists mixed": ({"input_ids": [504, [3575]]}, "input_ids", None),
    "text a number": ({"text": 5, "input_ids": None}, "text", "invalid_type"),
    "regex a number": ({"sampling_params": {"regex": 5}}, "sampling_params.regex", "invalid_type"),
    "json_schema a list": ({"sampling_params": {"json_schema": []}}, "sampling_params.json_schema", "invalid_type"),
    "logprob_start_len past the prompt": ({"return_logprob": True, "logprob_start_len": 99}, "logprob_start_len",
                                          None),
    "logprob_start_len at the prompt's length": ({"return_logprob": True, "logprob_start_len": 5},
                                                 "logprob_start_len", None),
    "logprob_start_len below -1": ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len", None),
    # What the smg gateway adds, at a value other than SGLang's default
    "no metrics": ({"log_metrics": False}, "log_metrics", "unsupported_parameter"),
    "return_entropy": ({"return_entropy": True}, "return_entropy", "unsupported_parameter"),
    "background": ({"background": True}, "background", "unsupported_parameter"),
}


def test_generate_takes_the_fields_the_smg_gateway_adds(http):
    """smg sends these on every /generate it routes (tests/test_gateway.py runs the real gateway)."""
    gateway = {"model": "unknown", "log_metrics": True, "background": False, "no_logs": False,
               "return_bytes": False, "return_entropy": False, "return_text_in_logprobs": False}
    r = http.post(GENERATE, json={"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 2}, **gateway})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("case", list(BAD_GENERATE_BODIES))
def test_generate_refuses_what_it_cannot_honour_naming_the_field(http, case):
    extra, param, code = BAD_GENERATE_BODIES[case]
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 1}, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (False, True):
        assert_error(http.post(GENERATE, json={**body, "stream": body.get("stream", stream)}), param, code)
    assert_still_serving(http)


def test_logprob_start_len_within_the_prompt_is_served(http):
    last = len(PROMPT_IDS) - 1
    r = http.post(GENERATE, json={"input_ids": PROMPT_IDS, "return_logprob": True, "logprob_start_len": last,
                                  "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    assert [e[1] for e in r.json()["meta_info"]["input_token_logprobs"]] == PROMPT_IDS[last:]


# -- the per-request cap on prompts x n ------------------------------------------


def test_the_default_cap_refuses_the_issues_fan_out_and_serves_one_at_the_cap(http):
    hostile = {"prompt": [f"Item {i}:" for i in range(200)], "n": 128, "max_tokens": 1}
    error = assert_error(http.post(COMPLETIONS, json=hostile), "n")
    assert "25600" in error["message"] and "--max-sequences-per-request" in error["message"]
    assert_still_serving(http)
    at_cap = {"prompt": ["Item 1:", "Item 2:"], "n": 128, "max_tokens": 1}  # 256, the default cap
    r = http.post(COMPLETIONS, json=at_cap)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(256))


CAP = 8


@pytest.fixture(scope="module")
def capped(tiny_llama_dir, tmp_path_factory):
    """The app on the tiny model under a cap of its own, in process: the cap's answers are checked."""
    with tiny_server_http(tiny_llama_dir, tmp_path_factory.mktemp("capped"), max_total_tokens=4096,
                          max_sequences_per_request=CAP) as c:
        yield c


@pytest.mark.parametrize("path, over, under, param", [
    (CHAT, {"messages": MSG, "n": CAP + 1}, {"messages": MSG, "n": CAP}, "n"),
    (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 3}, {"prompt": ["a", "b"], "n": 4}, "n"),
    (COMPLETIONS, {"prompt": [[5]] * (CAP + 1)}, {"prompt": [[5]] * CAP}, "prompt"),
    (GENERATE, {"input_ids": [[5], [6], [7]], "sampling_params": {"n": 3}},
     {"input_ids": [[5], [6]], "sampling_params": {"n": 4}}, "sampling_params.n"),
    (GENERATE, {"text": ["a"] * (CAP + 1)}, {"text": ["a"] * CAP}, "text"),
])
def test_over_the_cap_is_a_400_naming_what_to_cut_and_at_it_is_served(capped, path, over, under, param):
    limit = {"sampling_params": {**over.get("sampling_params", {}), "max_new_tokens": 1}} if path == GENERATE \
        else {"max_tokens": 1}
    assert_error(capped.post(path, json={**over, **limit}), param)
    limit = {"sampling_params": {**under.get("sampling_params", {}), "max_new_tokens": 1}} if path == GENERATE \
        else {"max_tokens": 1}
    r = capped.post(path, json={**under, **limit})
    assert r.status_code == 200, r.text
    answers = r.json() if path == GENERATE else r.json()["choices"]
    assert len(answers) == CAP
    assert capped.get("/health").status_code == 200
