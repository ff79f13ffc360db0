"""gpt-oss's Harmony output through /v1/chat/completions under
`--reasoning-parser gpt-oss --tool-call-parser gpt-oss`: reasoning_content,
content and tool_calls, whole and streamed.

The handler tests drive the ASGI app against a scripted engine that writes
Harmony text in awkward pieces. The last test runs the whole app (the
engine too) in process on a tiny Llama with gpt-oss's special tokens and
chat template, through the official openai client, whose
output a request's regex forces to be Harmony text (with thinking off, so
the constraint holds from the first token) and whose logit_bias rules out
every ordinary token holding `<` or `|`: the markers can only be written as
gpt-oss's special tokens, which the server must keep when it detokenizes.
"""

from __future__ import annotations

import json
import re
from functools import partial

import pytest

from pyserve._rust import Tokenizer
from pyserve.api.app import App
from pyserve.api.generation.serving import ServingContext
from pyserve.chat_template import ChatTemplate
from tests.harmony_model import SPECIAL, build_harmony_tokenizer
from tests.test_api_handlers import ScriptedEngine
from tests.test_api_tools import chat as tools_chat
from tests.test_api_tools import chat_stream as tools_chat_stream
from tests.test_api_tools import rebuilt_by_openai
from tests.test_tokenize_api import tiny_server_http
from tests.tiny_models import build_tiny_model

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER]

# Split inside markers, names and arguments; two calls complete in one piece.
CALLS_SCRIPT = [
    "<|chan", "nel|>analysis<|message|>Two cities", ", two calls.<|e", "nd|><|start|>assistant<|channel|>commentary",
    "<|message|>Checking both.<|end|><|start|>assistant<|channel|>commentary to=functions.get_wea",
    'ther <|constrain|>json<|message|>{"city": "Par', 'is"}<|call|><|start|>assistant<|channel|>commentary '
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|><|start|>assistant<|channel|>'
    'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}',
]
ANSWER_SCRIPT = ["<|channel|>analysis<|message|>Known.<|end|><|start|>assistant<|chan", "nel|>final<|mess",
                 "age|>Sunny in ", "Paris."]


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory, default_model_dir):
    return build_harmony_tokenizer(tmp_path_factory.mktemp("harmony"), default_model_dir)


def harmony_app(harmony_dir, script, reasoning_parser="gpt-oss", tool_call_parser="gpt-oss"):
    engine = ScriptedEngine(Tokenizer.from_file(str(harmony_dir / "tokenizer.json")), script)
    ctx = ServingContext(engine, "gpt-oss-tiny", ChatTemplate.for_model(harmony_dir), reasoning_parser,
                         tool_call_parser)
    return App(ctx), engine


# The tool tests' request helpers, asking this file's question.
chat = partial(tools_chat, messages=MSG)
chat_stream = partial(tools_chat_stream, messages=MSG)


def test_reasoning_preamble_and_calls_whole_and_streamed(harmony_dir):
    app, engine = harmony_app(harmony_dir, CALLS_SCRIPT)
    status, data = chat(app, tools=TOOLS)
    assert status == 200, data
    choice = data["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "Two cities, two calls."
    assert message["content"] == "Checking both."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})]
    assert len({c["id"] for c in message["tool_calls"]}) == 3 and choice["finish_reason"] == "tool_calls"
    # The markers are special tokens: the request keeps them when it detokenizes.
    assert engine.requests[-1].params.skip_special_tokens is False
    assert "<|" not in json.dumps(data)

    events = chat_stream(app, tools=TOOLS, stream_options={"include_usage": True})
    rebuilt = rebuilt_by_openai(events[:-1]).choices[0]
    assert rebuilt.finish_reason == "tool_calls" and rebuilt.message.content == message["content"]
    assert rebuilt.message.model_extra["reasoning_content"] == message["reasoning_content"]
    assert [(c.function.name, c.function.arguments) for c in rebuilt.message.tool_calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    # One id per call, sent with its first delta; the last step ends one call, holds a
    # second whole and starts a third, and all three come out of it.
    firsts = [d for e in events[:-1] for d in e["choices"][0]["delta"].get("tool_calls", []) if "id" in d]
    assert [d["index"] for d in firsts] == [0, 1, 2] and all(d["id"].startswith("call_") for d in firsts)
    steps = [[d["index"] for d in e["choices"][0]["delta"].get("tool_calls", [])] for e in events[:-1]]
    assert [0, 1, 2] in steps
    assert events[-1]["usage"]["completion_tokens_details"] == data["usage"]["completion_tokens_details"]
    assert data["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(
        Tokenizer.from_file(str(harmony_dir / "tokenizer.json")).encode("Two cities, two calls."))


def test_a_final_answer_is_content(harmony_dir):
    app, _ = harmony_app(harmony_dir, ANSWER_SCRIPT)
    message = chat(app)[1]["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"], message.get("tool_calls")) == \
        ("Known.", "Sunny in Paris.", None)
    deltas = [e["choices"][0]["delta"] for e in chat_stream(app)]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Known."
    assert "".join(d.get("content") or "" for d in deltas) == "Sunny in Paris."


def test_unseparated_reasoning_stays_in_the_content(harmony_dir):
    for body, parsers in (({"separate_reasoning": False}, ("gpt-oss", "gpt-oss")), ({}, (None, "gpt-oss"))):
        app, _ = harmony_app(harmony_dir, ANSWER_SCRIPT, *parsers)
        message = chat(app, **body)[1]["choices"][0]["message"]
        assert message["content"] == "Known.Sunny in Paris." and message.get("reasoning_content") is None


def test_without_tools_a_call_is_content(harmony_dir):
    app, _ = harmony_app(harmony_dir, CALLS_SCRIPT)
    message = chat(app)[1]["choices"][0]["message"]
    assert message.get("tool_calls") is None and message["content"].startswith('Checking both.{"city": "Paris"}')


def test_a_constrained_answer_starts_at_the_final_channel(harmony_dir):
    app, engine = harmony_app(harmony_dir, ANSWER_SCRIPT)
    assert chat(app, response_format={"type": "json_object"})[0] == 200
    assert engine.requests[-1].params.constraint.after == "<|channel|>final<|message|>"
    # With thinking off the model answers at once: the constraint holds from the start.
    assert chat(app, response_format={"type": "json_object"}, reasoning_effort="none")[0] == 200
    assert engine.requests[-1].params.constraint.after is None


def test_strict_tools_are_refused(harmony_dir):
    app, engine = harmony_app(harmony_dir, CALLS_SCRIPT)
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    status, data = chat(app, tools=[strict])
    assert status == 400 and data["error"]["param"] == "tools[0].function.strict" and engine.requests == []


# -- the whole app, in process ------------------------------------------------

FORCED = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary'
          '<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
          '<|constrain|>json<|message|>{"city": "Paris"}')


@pytest.fixture(scope="module")
def harmony_http(tmp_path_factory, harmony_dir):
    model = build_tiny_model(tmp_path_factory.mktemp("gpt-oss-tiny"), "llama", tokenizer_dir=harmony_dir)
    with tiny_server_http(model, tmp_path_factory.mktemp("gpt-oss-storage"), reasoning_parser="gpt-oss",
                          tool_call_parser="gpt-oss", torchao_config="none") as http:
        yield http


def test_openai_client_gets_reasoning_content_and_tool_calls_from_the_model(harmony_http, harmony_dir):
    import openai

    tokenizer = Tokenizer.from_file(str(harmony_dir / "tokenizer.json"))
    special = {tokenizer.token_to_id(t) for t in SPECIAL}
    ordinary = [i for i in range(tokenizer.vocab_size)
                if i not in special and any(c in (tokenizer.id_to_token(i) or "") for c in "<|")]
    client = openai.OpenAI(api_key="EMPTY", base_url=f"{harmony_http.base_url}/v1", http_client=harmony_http,
                           timeout=120)
    kwargs = dict(model="gpt-oss-tiny", messages=MSG, tools=TOOLS, temperature=0, max_tokens=160,
                  logit_bias={str(i): -100 for i in ordinary},
                  extra_body={"regex": re.escape(FORCED), "chat_template_kwargs": {"enable_thinking": False},
                              "return_token_ids": True})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert special & set(whole.model_extra["token_ids"]), "the markers were written as special tokens"
    assert whole.message.model_extra["reasoning_content"] == "Need the weather."
    assert whole.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert whole.finish_reason == "tool_calls"
    with client.chat.completions.stream(**kwargs) as stream:
        rebuilt = stream.get_final_completion().choices[0]
    assert rebuilt.finish_reason == whole.finish_reason and rebuilt.message.content == whole.message.content
    assert rebuilt.message.model_extra["reasoning_content"] == "Need the weather."
    assert [(c.function.name, c.function.arguments) for c in rebuilt.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
