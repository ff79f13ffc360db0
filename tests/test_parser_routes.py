"""SGLang's POST /parse_function_call and POST /separate_reasoning: the
server's parsers over a text the client holds, answering as the chat route
splits the same output."""

from __future__ import annotations

import json

import pytest

from pyserve.api.app import App
from pyserve.api.generation.serving import ServingContext
from pyserve.chat_template import ChatTemplate
from tests.test_api_handlers import SCRIPT_WITH_THINKING, ScriptedEngine, call, run
from tests.test_api_handlers import tokenizer  # noqa: F401 (a fixture)

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_time", "get_weather")]
TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.fixture(scope="module")
def app(default_model_dir, tokenizer):  # noqa: F811
    ctx = ServingContext(ScriptedEngine(tokenizer, SCRIPT_WITH_THINKING), "served", ChatTemplate.for_model(
        default_model_dir), reasoning_parser="qwen3", tool_call_parser="qwen25")
    return App(ctx)


def post(app, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = run(call(app, "POST", path, body))
    return status, json.loads(raw)


def test_function_calls_are_parsed_with_the_tools_places(app):
    status, body = post(app, "/parse_function_call", {"text": TWO_CALLS, "tools": TOOLS,
                                                      "tool_call_parser": "qwen25"})
    assert status == 200
    assert body["normal_text"] == "Let me check."
    assert body["calls"] == [
        {"tool_index": 1, "name": "get_weather", "parameters": '{"city": "Paris"}'},
        {"tool_index": 0, "name": "get_time", "parameters": "{}"},
    ]
    # The server's --tool-call-parser when none is named; a tool not offered is text.
    status, only_time = post(app, "/parse_function_call", {"text": TWO_CALLS, "tools": TOOLS[:1]})
    assert status == 200 and [c["name"] for c in only_time["calls"]] == ["get_time"]
    assert "get_weather" in only_time["normal_text"]
    # Another format, named in the body.
    status, llama = post(app, "/parse_function_call", {
        "text": '{"name": "get_time", "parameters": {}}', "tools": TOOLS, "tool_call_parser": "llama3"})
    assert status == 200 and llama["calls"] == [{"tool_index": 0, "name": "get_time", "parameters": "{}"}]


def test_reasoning_is_separated(app):
    status, body = post(app, "/separate_reasoning", {"text": "<think>Paris is in France.</think>It is Paris.",
                                                     "reasoning_parser": "qwen3"})
    assert (status, body) == (200, {"text": "It is Paris.", "reasoning_text": "Paris is in France."})
    # deepseek-r1's template opens the block: the text starts as reasoning.
    status, body = post(app, "/separate_reasoning", {"text": "Hmm.</think>Yes.", "reasoning_parser": "deepseek-r1"})
    assert (status, body) == (200, {"text": "Yes.", "reasoning_text": "Hmm."})
    status, body = post(app, "/separate_reasoning", {"text": "<think>a</think>b"})  # the server's parser
    assert (status, body) == (200, {"text": "b", "reasoning_text": "a"})


@pytest.mark.parametrize("path, body, param", [
    ("/parse_function_call", {"text": "x", "tool_call_parser": "nope"}, "tool_call_parser"),
    ("/parse_function_call", {"text": "x", "tool_call_parser": "gpt-oss"}, "tool_call_parser"),
    ("/parse_function_call", {"text": "x", "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/separate_reasoning", {"text": "x", "reasoning_parser": "nope"}, "reasoning_parser"),
    ("/separate_reasoning", {"text": "x", "reasoning": "qwen3"}, "reasoning"),
])
def test_what_cannot_be_parsed_is_a_400_naming_the_field(app, path, body, param):
    status, error = post(app, path, body)
    assert status == 400 and error["error"]["param"] == param, error


def test_without_a_server_parser_the_body_must_name_one(default_model_dir, tokenizer):  # noqa: F811
    bare = App(ServingContext(ScriptedEngine(tokenizer, SCRIPT_WITH_THINKING), "served", None))
    for path, param in (("/parse_function_call", "tool_call_parser"), ("/separate_reasoning", "reasoning_parser")):
        status, error = post(bare, path, {"text": "x"})
        assert status == 400 and error["error"]["param"] == param
