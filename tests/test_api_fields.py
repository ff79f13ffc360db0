"""The field walk: every field of every OpenAI request struct either
changes what the engine is asked (prompt or sampling settings), changes
the response's shape, is refused with a 400 naming it, or is on the short
documented no-op list (protocol.NO_OP_FIELDS, and `model`: one model is
served under any name, as SGLang does). A field added to a struct without
a line here fails `test_every_field_is_walked`.

Driven in-process against the scripted engine of test_api_handlers.py,
with a chat template that shows every message field, so each effect is
seen without a model; what the engine then does with each setting is
tested by the sampler, engine and real-server tests.
"""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from pyserve.api.app import App
from pyserve.api.protocol.openai import NO_OP_FIELDS, ChatCompletionRequest, ChatMessage, CompletionRequest, ContentPart, \
    StreamOptions
from pyserve.api.generation.serving import ServingContext
from pyserve.chat_template import ChatTemplate
from tests.test_api_handlers import SCRIPT_WITH_THINKING, ScriptedEngine, call, run
from tests.test_api_handlers import tokenizer  # noqa: F401 (a fixture)
from tests.test_chat_template import model_dir_with

# Shows the thinking switch, the tools and every message field.
SHOW_ALL = """{{- 'thinking=' ~ (enable_thinking if enable_thinking is defined else 'unset') ~ '|' }}
{%- if tools %}{{ tools | tojson }}{% endif %}
{%- for m in messages %}<{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}
{%- if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}>{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}
{{- m.content }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{% endfor %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""

USER = {"role": "user", "content": "hi"}
CONTINUED = [USER, {"role": "assistant", "content": "The sea is"}]
TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}

ENGINE, RESPONSE, REFUSED, NO_OP = "engine", "response", "refused", "no-op"


def probe(effect: str, value=None, **base):
    """`value` sent on top of `base` (what the baseline request sends too)."""
    return effect, value, base


SHARED = {
    "model": probe(NO_OP, "any-name"),
    **{name: probe(NO_OP, value) for name, value in zip(NO_OP_FIELDS, ["u", {"k": "v"}, True, "auto", "s", "p"])},
    "max_tokens": probe(ENGINE, 2),
    "temperature": probe(ENGINE, 0.5),
    "top_p": probe(ENGINE, 0.5),
    "n": probe(ENGINE, 2),
    "stream": probe(RESPONSE, True),
    "stream_options": probe(RESPONSE, {"include_usage": True}, stream=True),
    "stop": probe(ENGINE, ["x"]),
    "presence_penalty": probe(ENGINE, 0.5),
    "frequency_penalty": probe(ENGINE, 0.5),
    "logit_bias": probe(ENGINE, {"5": 1.0}),
    "seed": probe(ENGINE, 3),
    "top_k": probe(ENGINE, 5),
    "min_p": probe(ENGINE, 0.1),
    "repetition_penalty": probe(ENGINE, 1.1),
    "stop_token_ids": probe(ENGINE, [5]),
    "ignore_eos": probe(ENGINE, True),
    "skip_special_tokens": probe(ENGINE, False),
    "rid": probe(RESPONSE, "my-request"),
    "min_tokens": probe(ENGINE, 1),
    "stop_regex": probe(ENGINE, ["x+"]),
    "return_token_ids": probe(RESPONSE, True),
    "prompt_logprobs": probe(ENGINE, 1),
    "response_format": probe(ENGINE, {"type": "json_object"}),
    "json_schema": probe(ENGINE, '{"type": "object"}'),
    "regex": probe(ENGINE, "a+"),
    "ebnf": probe(ENGINE, 'root ::= "a"'),
    "structured_outputs": probe(ENGINE, {"regex": "a+"}),
    "priority": probe(ENGINE, 3),  # the scripted engine schedules by priority; a real one without it refuses
    "cache_salt": probe(ENGINE, "tenant-a"),
}
STREAM_OPTIONS = {
    "stream_options.include_usage": probe(RESPONSE, {"include_usage": True}, stream=True),
    "stream_options.continuous_usage_stats": probe(RESPONSE, {"continuous_usage_stats": True}, stream=True),
}
CHAT = {
    **SHARED, **STREAM_OPTIONS,
    "logprobs": probe(ENGINE, True),
    "top_logprobs": probe(ENGINE, 2, logprobs=True),
    "messages": probe(ENGINE, [{"role": "user", "content": "hello"}]),
    "max_completion_tokens": probe(ENGINE, 2),
    "tools": probe(ENGINE, TOOLS),
    "tool_choice": probe(ENGINE, "required", tools=TOOLS),
    "parallel_tool_calls": probe(ENGINE, False, tools=TOOLS, tool_choice="required"),
    "chat_template_kwargs": probe(ENGINE, {"enable_thinking": False}),
    "separate_reasoning": probe(RESPONSE, False),
    "continue_final_message": probe(ENGINE, True, messages=CONTINUED),
    "echo": probe(RESPONSE, True, messages=CONTINUED, continue_final_message=True),
    "reasoning_effort": probe(ENGINE, "none"),
    # Each field of a message, on a message of its own.
    "messages[].role": probe(ENGINE, [{"role": "system", "content": "hi"}]),
    "messages[].content": probe(ENGINE, [{"role": "user", "content": "bye"}]),
    "messages[].name": probe(ENGINE, [{**USER, "name": "ann"}]),
    "messages[].tool_calls": probe(ENGINE, [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, USER]),
    "messages[].tool_call_id": probe(ENGINE, [USER, {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]),
    "messages[].reasoning_content": probe(ENGINE, [USER, {"role": "assistant", "content": "a",
                                                          "reasoning_content": "why"}, USER]),
    "messages[].reasoning": probe(ENGINE, [USER, {"role": "assistant", "content": "a", "reasoning": "why"}, USER]),
    "messages[].content[].type": probe(REFUSED, [{"role": "user", "content": [{"type": "image_url"}]}]),
    "messages[].content[].text": probe(ENGINE, [{"role": "user", "content": [{"type": "text", "text": "bye"}]}]),
}
COMPLETIONS = {
    **SHARED, **STREAM_OPTIONS,
    "logprobs": probe(ENGINE, 2),
    "top_logprobs": probe(REFUSED, 2),  # completions take logprobs as the count
    "prompt": probe(ENGINE, "bye"),
    "echo": probe(RESPONSE, True),
    "suffix": probe(REFUSED, "after"),
    "best_of": probe(REFUSED, 2),
}
# Where each walked name sends its value: the top-level field, or messages.
TARGET = {"messages": ("messages",), "stream_options": ("stream_options",)}


def _names(struct: type, prefix: str = "") -> set[str]:
    return {prefix + f.name for f in msgspec.structs.fields(struct)}


def test_every_field_is_walked():
    assert set(CHAT) == (_names(ChatCompletionRequest) | _names(StreamOptions, "stream_options.")
                         | _names(ChatMessage, "messages[].") | _names(ContentPart, "messages[].content[]."))
    assert set(COMPLETIONS) == _names(CompletionRequest) | _names(StreamOptions, "stream_options.")


@pytest.fixture(scope="module")
def app_and_engine(tmp_path_factory, default_model_dir, tokenizer):
    engine = ScriptedEngine(tokenizer, SCRIPT_WITH_THINKING)
    template = ChatTemplate.for_model(model_dir_with(tmp_path_factory, default_model_dir, SHOW_ALL))
    return App(ServingContext(engine, "served", template, "qwen3", tool_call_parser="qwen25")), engine


def _normalized(raw: bytes) -> str:
    """The body without what differs between any two requests."""
    text = re.sub(r'"created":\s*\d+', "", raw.decode())
    text = re.sub(r'"(chatcmpl|cmpl)-[0-9a-f]{32}', '"GENERATED', text)
    return re.sub(r"call_[0-9a-f]{24}", "call_X", text)


def _send(app, engine, path: str, body: dict):
    engine.requests.clear()
    status, _, raw = run(call(app, "POST", path, body))
    asked = [(r.input_ids, r.params, r.priority, r.cache_salt) for r in engine.requests]
    return status, raw, asked


def _field_body(name: str, value, base: dict) -> dict:
    top = name.split(".")[0].split("[")[0]
    if name.startswith("stream_options."):
        return {**base, "stream_options": value}
    return {**base, top: value}


@pytest.mark.parametrize("route, walk", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETIONS)])
def test_each_field_changes_the_output_or_is_refused_or_a_documented_no_op(app_and_engine, route, walk):
    app, engine = app_and_engine
    start = {"messages": [USER]} if "chat" in route else {"prompt": "hi"}
    start["max_tokens"] = 8
    for name, (effect, value, base) in walk.items():
        base = {**start, **base}
        status0, raw0, asked0 = _send(app, engine, route, base)
        assert status0 == 200, (name, raw0)
        status, raw, asked = _send(app, engine, route, _field_body(name, value, base))
        if effect == REFUSED:
            top = name.split(".")[0].split("[")[0]
            assert status == 400 and json.loads(raw)["error"]["param"].startswith(top), (name, raw)
            continue
        assert status == 200, (name, raw)
        if effect == ENGINE:
            assert asked != asked0, name
        elif effect == RESPONSE:
            assert asked == asked0 and _normalized(raw) != _normalized(raw0), name
        else:
            assert asked == asked0 and _normalized(raw) == _normalized(raw0), name
