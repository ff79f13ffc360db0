"""Reasoning through /v1/chat/completions, as SGLang serves it: the
reasoning's token count in usage, reasoning_effort on the template's
thinking switch, reasoning sent back in the history. A scripted engine
plays a thinking model (tests/test_api_handlers.py)."""

from __future__ import annotations

import json

import pytest

from pyserve.api.app import App
from pyserve.api.generation.serving import ServingContext
from pyserve.chat_template import ChatTemplate
from tests.test_api_handlers import SCRIPT_WITH_THINKING, ScriptedEngine, call, run, sse_events
from tests.test_api_handlers import tokenizer  # noqa: F401 (a fixture)
from tests.test_chat_template import model_dir_with

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "g?"}]

# What the template shows of the switches and of earlier reasoning.
SWITCHES = """{%- for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}
{{- m.content }}{%- endfor %}
{{- '|thinking=' ~ (enable_thinking if enable_thinking is defined else 'unset') }}
{{- '|effort=' ~ (reasoning_effort if reasoning_effort is defined else 'unset') }}"""


@pytest.fixture(scope="module")
def switches_dir(tmp_path_factory, default_model_dir):
    return model_dir_with(tmp_path_factory, default_model_dir, SWITCHES)


def app_for(model_dir, tokenizer, script=SCRIPT_WITH_THINKING):
    engine = ScriptedEngine(tokenizer, script)
    return App(ServingContext(engine, "served-model", ChatTemplate.for_model(model_dir), "qwen3")), engine


def post(app, **body):
    status, _, raw = run(call(app, "POST", CHAT, {"messages": MSG, **body}))
    return status, raw


def test_usage_counts_the_reasoning_tokens(switches_dir, tokenizer):
    app, _ = app_for(switches_dir, tokenizer)
    status, raw = post(app)
    data = json.loads(raw)
    reasoning = data["choices"][0]["message"]["reasoning_content"]
    assert reasoning == "Let me see."
    expected = len(tokenizer.encode("\nLet me see.\n"))
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": expected}
    events = sse_events(post(app, stream=True, stream_options={"include_usage": True})[1])[:-1]
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": expected}
    assert all("reasoning_content" in e["choices"][0]["delta"] for e in events[:-1])


@pytest.mark.parametrize("effort, shown", [
    (None, "|thinking=unset|effort=unset"),
    ("none", "|thinking=False|effort=none"),
    ("high", "|thinking=True|effort=high"),
])
def test_reasoning_effort_reaches_the_templates_thinking_switch(switches_dir, tokenizer, effort, shown):
    app, engine = app_for(switches_dir, tokenizer)
    assert post(app, **({} if effort is None else {"reasoning_effort": effort}))[0] == 200
    assert tokenizer.decode(engine.requests[-1].input_ids).endswith(shown)


def test_chat_template_kwargs_win_over_reasoning_effort(switches_dir, tokenizer):
    app, engine = app_for(switches_dir, tokenizer)
    post(app, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert tokenizer.decode(engine.requests[-1].input_ids).endswith("|thinking=True|effort=none")


def test_an_unknown_reasoning_effort_is_a_400(switches_dir, tokenizer):
    app, engine = app_for(switches_dir, tokenizer)
    status, raw = post(app, reasoning_effort="extreme")
    assert status == 400 and json.loads(raw)["error"]["param"] == "reasoning_effort" and engine.requests == []


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_reasoning_sent_back_reaches_the_template(switches_dir, tokenizer, key):
    app, engine = app_for(switches_dir, tokenizer)
    history = MSG + [{"role": "assistant", "content": "9.8", key: "I recall it."}, {"role": "user", "content": "ok"}]
    assert post(app, messages=history)[0] == 200
    assert "<assistant>[I recall it.]9.8" in tokenizer.decode(engine.requests[-1].input_ids)


@pytest.mark.parametrize("parser, opened", [("qwen3", False), ("glm45", False), ("deepseek-r1", True),
                                            ("qwen3-thinking", True), ("minimax", True)])
def test_each_reasoning_parser_name_splits_its_models_output(default_model_dir, tokenizer, parser, opened):
    """Models whose template opens the block write only its end."""
    from tests.test_api_handlers import make_app

    script = (["Let me", " see.\n</think>"] if opened else ["<think>\nLet me", " see.\n</think>"]) + ["\n\nIt is 9.8."]
    app, _ = make_app(default_model_dir, tokenizer, script, reasoning_parser=parser)
    _, _, whole = run(call(app, "POST", CHAT, {"messages": MSG, "separate_reasoning": True}))
    message = json.loads(whole)["choices"][0]["message"]
    assert message["reasoning_content"].strip() == "Let me see." and message["content"] == "It is 9.8."
