"""The field walk: every field of every OpenAI request struct either
changes what the engine is asked (the prompt or the sampling setting it
maps to, and nothing else), changes the response's shape, is refused with
a 400 naming it, or is on the short documented no-op list
(protocol.NO_OP_FIELDS, and `model`: one model is served under any name,
as SGLang does). A field added to a struct without a line here fails
`test_every_field_is_walked`.

Driven in-process against the scripted engine of test_api_handlers.py,
with a chat template that shows every message field, so each effect is
seen without a model; what the engine then does with each setting is
tested by the sampler, engine and real-server tests.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import re

import msgspec
import pytest
import torch

from pyserve.api.app import App
from pyserve.api.protocol.openai import NO_OP_FIELDS, ChatCompletionRequest, ChatMessage, CompletionRequest, ContentPart, \
    StreamOptions
from pyserve.api.generation.serving import ServingContext
from pyserve.chat_template import ChatTemplate
from pyserve.engine.request import Constraint
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
THINK_END = "</think>"  # the qwen3 reasoning parser's: a chat constraint starts after it


def probe(effect: str, value=None, **base):
    """`value` sent on top of `base` (what the baseline request sends too)."""
    return effect, value, base, None


def engine(value, changes: dict, **base):
    """A field whose effect is on what the engine is asked: `changes` is
    what differs from the baseline request, each SamplingParams setting by
    name, "prompt" the prompt's text, "prompt_embeds" whether it is given
    as embeddings, "requests" how many requests ("each": what differs in
    each, where they differ); a callable checks a value it cannot spell in full."""
    return ENGINE, value, base, changes


def _saved(tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def prompt(text: str) -> dict:
    return {"prompt": f"thinking=unset|{text}"}


def schema_of(check):
    """A JSON-schema constraint (starting after the thinking) whose schema passes check."""
    return lambda c: c.kind == "json_schema" and c.after == THINK_END and check(json.loads(c.text))


def shared(after: str | None) -> dict:
    """The fields both routes take; `after`: where the route's constraints start."""
    return {
        "model": probe(NO_OP, "any-name"),
        **{name: probe(NO_OP, value) for name, value in zip(NO_OP_FIELDS, ["u", {"k": "v"}, True, "auto", "s", "p"])},
        "max_tokens": engine(2, {"max_new_tokens": 2}),
        "temperature": engine(0.5, {"temperature": 0.5}),
        "top_p": engine(0.5, {"top_p": 0.5}),
        "n": engine(2, {"requests": 2}),
        "stream": probe(RESPONSE, True),
        "stream_options": probe(RESPONSE, {"include_usage": True}, stream=True),
        "stop": engine(["x"], {"stop": ["x"]}),
        "presence_penalty": engine(0.5, {"presence_penalty": 0.5}),
        "frequency_penalty": engine(0.5, {"frequency_penalty": 0.5}),
        "logit_bias": engine({"5": 1.0}, {"logit_bias": {5: 1.0}}),
        "allowed_token_ids": engine([6, 5], {"allowed_token_ids": (5, 6)}),
        "bad_words": engine(["sea"], {"banned_sequences": lambda banned: len(banned) >= 1}),
        "seed": engine(3, {"seed": 3}),
        "top_k": engine(5, {"top_k": 5}),
        "min_p": engine(0.1, {"min_p": 0.1}),
        "repetition_penalty": engine(1.1, {"repetition_penalty": 1.1}),
        "stop_token_ids": engine([5], {"stop_token_ids": [5]}),
        "ignore_eos": engine(True, {"ignore_eos": True}),
        "skip_special_tokens": engine(False, {"skip_special_tokens": False}),
        "rid": probe(RESPONSE, "my-request"),
        "min_tokens": engine(1, {"min_new_tokens": 1}),
        "stop_regex": engine(["x+"], {"stop_regex": ["x+"]}),
        "no_stop_trim": engine(True, {"keep_stop": True}),
        "include_stop_str_in_output": engine(True, {"keep_stop": True}),
        "return_token_ids": probe(RESPONSE, True),
        # The scripted engine takes it; a real one without the flag refuses it (tests/test_hidden_states.py).
        "return_hidden_states": engine(True, {"return_hidden_states": True}),
        "prompt_logprobs": engine(1, {"prompt_logprobs": True, "prompt_top_logprobs": 1}),
        "response_format": engine({"type": "json_object"},
                                  {"constraint": Constraint("json_schema", '{"type": "object"}', after)}),
        "json_schema": engine('{"type": "object"}',
                              {"constraint": Constraint("json_schema", '{"type": "object"}', after)}),
        "regex": engine("a+", {"constraint": Constraint("regex", "a+", after)}),
        "ebnf": engine('root ::= "a"', {"constraint": Constraint("ebnf", 'root ::= "a"', after)}),
        "structured_outputs": engine({"regex": "a+"}, {"constraint": Constraint("regex", "a+", after)}),
        # vLLM's earlier names of structured_outputs' keys.
        "guided_json": engine({"type": "object"}, {"constraint": Constraint("json_schema", '{"type": "object"}', after)}),
        "guided_regex": engine("a+", {"constraint": Constraint("regex", "a+", after)}),
        "guided_choice": engine(["yes", "no"], {"constraint": Constraint("ebnf", 'root ::= "yes" | "no"', after)}),
        "guided_grammar": engine('root ::= "a"', {"constraint": Constraint("ebnf", 'root ::= "a"', after)}),
        "guided_decoding_backend": probe(REFUSED, "outlines"),
        "guided_whitespace_pattern": probe(REFUSED, "[ ]?"),
        # The scripted engine schedules by priority; a real one without the flag refuses it.
        "priority": engine(3, {"priority": 3}),
        "cache_salt": engine("tenant-a", {"cache_salt": "tenant-a"}),
        # The scripted engine takes any adapter; a real one checks the name (tests/test_lora_api.py).
        "lora_path": engine("alpha", {"lora": "alpha"}),
        # Refused unread by a server without --enable-custom-logit-processor (tests/test_logit_processors.py).
        "custom_logit_processor": probe(REFUSED, '{"callable": "80"}'),
        "custom_params": probe(REFUSED, {"token_ids": [5]}),  # without a processor to read it
    }


STREAM_OPTIONS = {
    "stream_options.include_usage": probe(RESPONSE, {"include_usage": True}, stream=True),
    "stream_options.continuous_usage_stats": probe(RESPONSE, {"continuous_usage_stats": True}, stream=True),
}


def _calls_to_now(schema: dict) -> bool:
    """An array of calls, at least one, each naming `now`."""
    return (schema["type"] == "array" and schema["minItems"] == 1
            and schema["items"]["properties"]["name"] == {"const": "now"})


CHAT = {
    **shared(THINK_END), **STREAM_OPTIONS,
    "logprobs": engine(True, {"logprobs": True}),
    "top_logprobs": engine(2, {"top_logprobs": 2}, logprobs=True),
    "messages": engine([{"role": "user", "content": "hello"}], prompt("<user>hello<assistant>")),
    "max_completion_tokens": engine(2, {"max_new_tokens": 2}),
    "tools": engine(TOOLS, prompt(json.dumps(TOOLS) + "<user>hi<assistant>")),
    "tool_choice": engine("required", {"constraint": schema_of(lambda s: _calls_to_now(s) and "maxItems" not in s)},
                          tools=TOOLS),
    "parallel_tool_calls": engine(False, {"constraint": schema_of(lambda s: _calls_to_now(s) and s["maxItems"] == 1)},
                                  tools=TOOLS, tool_choice="required"),
    "chat_template_kwargs": engine({"enable_thinking": False}, {"prompt": "thinking=False|<user>hi<assistant>"}),
    "separate_reasoning": probe(RESPONSE, False),
    # The assistant's message is continued, not followed by a new turn.
    "continue_final_message": engine(True, prompt("<user>hi<assistant>The sea is"), messages=CONTINUED),
    "echo": probe(RESPONSE, True, messages=CONTINUED, continue_final_message=True),
    "reasoning_effort": engine("none", {"prompt": "thinking=False|<user>hi<assistant>"}),
    "add_generation_prompt": engine(False, prompt("<user>hi")),
    "return_tokens_as_token_ids": probe(RESPONSE, True, logprobs=True),
    # The rendered prompt's last three tokens.
    "truncate_prompt_tokens": engine(3, {"prompt": "assistant>"}),
    # Each field of a message, on a message of its own.
    "messages[].role": engine([{"role": "system", "content": "hi"}], prompt("<system>hi<assistant>")),
    "messages[].content": engine([{"role": "user", "content": "bye"}], prompt("<user>bye<assistant>")),
    "messages[].name": engine([{**USER, "name": "ann"}], prompt("<user:ann>hi<assistant>")),
    "messages[].tool_calls": engine(
        [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, USER],
        prompt('<user>hi<assistant>[{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": {}}}]'
               "<user>hi<assistant>")),
    "messages[].tool_call_id": engine([USER, {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}],
                                      prompt("<user>hi<tool#call_1>12:00<assistant>")),
    "messages[].reasoning_content": engine([USER, {"role": "assistant", "content": "a", "reasoning_content": "why"},
                                            USER], prompt("<user>hi<assistant>[why]a<user>hi<assistant>")),
    "messages[].reasoning": engine([USER, {"role": "assistant", "content": "a", "reasoning": "why"}, USER],
                                   prompt("<user>hi<assistant>[why]a<user>hi<assistant>")),
    "messages[].content[].type": probe(REFUSED, [{"role": "user", "content": [{"type": "image_url"}]}]),
    "messages[].content[].text": engine([{"role": "user", "content": [{"type": "text", "text": "bye"}]}],
                                        prompt("<user>bye<assistant>")),
}
COMPLETIONS = {
    **shared(None), **STREAM_OPTIONS,
    "logprobs": engine(2, {"logprobs": True, "top_logprobs": 2}),
    "top_logprobs": probe(REFUSED, 2),  # completions take logprobs as the count
    "prompt": engine("bye", {"prompt": "bye"}),
    "echo": probe(RESPONSE, True),
    "suffix": probe(REFUSED, "after"),  # the walk's tokenizer holds no fill-in-the-middle markers
    "best_of": probe(REFUSED, 2),
    "return_tokens_as_token_ids": probe(RESPONSE, True, logprobs=1),
    "truncate_prompt_tokens": engine(1, {"prompt": " world"}, prompt="hello world"),
    # A prompt of two vectors (placeholder ids stand for them) comes before the text prompt.
    "prompt_embeds": engine(base64.b64encode(_saved(torch.zeros(2, 8))).decode(), {
        "requests": 2, "each": [{"prompt_embeds": True, "prompt": lambda text: text != "hi"}, {}]}),
}
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
    asked = [(r.input_ids, r.params, r.priority, r.cache_salt, r.lora, r.prompt_embeds is not None)
             for r in engine.requests]
    return status, raw, asked


def _changes(baseline: tuple, asked: tuple, tokenizer) -> dict:
    """What differs in one engine request from the baseline's: "prompt"
    (the new prompt's text), each SamplingParams setting that differs, and
    the request's "priority", "cache_salt" and "lora"."""
    (ids0, params0, priority0, salt0, lora0, embeds0), (ids, params, priority, salt, lora, embeds) = baseline, asked
    out = {"prompt": tokenizer.decode(ids)} if ids != ids0 else {}
    out |= {"prompt_embeds": embeds} if embeds != embeds0 else {}
    out |= {"priority": priority} if priority != priority0 else {}
    out |= {"cache_salt": salt} if salt != salt0 else {}
    out |= {"lora": lora} if lora != lora0 else {}
    return out | {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
                  if getattr(params, f.name) != getattr(params0, f.name)}


def _as_expected(changes: dict, expected: dict) -> bool:
    return changes.keys() == expected.keys() and all(
        want(changes[key]) if callable(want) else changes[key] == want for key, want in expected.items())


def _field_body(name: str, value, base: dict) -> dict:
    top = name.split(".")[0].split("[")[0]
    if name.startswith("stream_options."):
        return {**base, "stream_options": value}
    return {**base, top: value}


@pytest.mark.parametrize("route, walk", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETIONS)])
def test_each_field_changes_the_output_or_is_refused_or_a_documented_no_op(app_and_engine, tokenizer,  # noqa: F811
                                                                           route, walk):
    app, engine = app_and_engine
    start = {"messages": [USER]} if "chat" in route else {"prompt": "hi"}
    start["max_tokens"] = 8
    for name, (effect, value, base, expected) in walk.items():
        base = {**start, **base}
        status0, raw0, asked0 = _send(app, engine, route, base)
        assert status0 == 200 and len(asked0) == 1, (name, raw0)
        status, raw, asked = _send(app, engine, route, _field_body(name, value, base))
        if effect == REFUSED:
            top = name.split(".")[0].split("[")[0]
            assert status == 400 and json.loads(raw)["error"]["param"].startswith(top), (name, raw)
            continue
        assert status == 200, (name, raw)
        if effect == ENGINE:
            expected = dict(expected)
            assert len(asked) == expected.pop("requests", 1), name
            for one, want in zip(asked, expected.pop("each", None) or [expected] * len(asked)):
                changes = _changes(asked0[0], one, tokenizer)
                assert _as_expected(changes, want), (name, changes)
        elif effect == RESPONSE:
            assert asked == asked0 and _normalized(raw) != _normalized(raw0), name
        else:
            assert asked == asked0 and _normalized(raw) == _normalized(raw0), name
