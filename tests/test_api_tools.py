"""Function calling through /v1/chat/completions.

The handler tests drive the ASGI app in-process against a scripted engine
whose "model" writes tool calls, so the exact response and chunk shapes
are checked without a model that can call tools. The last tests send
tools to the real server through the official `openai` client.
"""

from __future__ import annotations

import json

import pytest

from pyserve.api.app import App
from pyserve.api.generation.serving import ServingContext
from pyserve.chat_template import ChatTemplate
from tests.test_api_handlers import ScriptedEngine, call, run, sse_events
from tests.test_api_handlers import tokenizer  # noqa: F401 (a fixture)
from tests.test_chat_template import model_dir_with

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOW]

HERMES_SCRIPT = ["I will check.", "\n<tool_", 'call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
                 "\n</tool_call>\n<tool_call>\n", '{"name": "now", "arguments": {}}\n</tool_call>']

# The tool-calling parts of Qwen2.5's template, in its style: tools in the
# system turn, calls as <tool_call> blocks, results as <tool_response> in a user turn.
QWEN25_STYLE = """
{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory, default_model_dir):
    return model_dir_with(tmp_path_factory, default_model_dir, QWEN25_STYLE)


def tool_app(model_dir, tokenizer, script, parser="qwen25", reasoning_parser=None):
    engine = ScriptedEngine(tokenizer, script)
    ctx = ServingContext(engine, "served-model", ChatTemplate.for_model(model_dir), reasoning_parser,
                         tool_call_parser=parser)
    return App(ctx), engine


def chat(app, **body):
    status, _, raw = run(call(app, "POST", CHAT, {"messages": MSG, **body}))
    return status, json.loads(raw)


def chat_stream(app, **body) -> list[dict]:
    status, _, raw = run(call(app, "POST", CHAT, {"messages": MSG, "stream": True, **body}))
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    return events[:-1]


def assemble(events: list[dict]) -> tuple[str, list[dict], str]:
    """What a client builds from the deltas: (content, calls by index, finish_reason)."""
    content, calls, finish = "", {}, None
    for event in events:
        if not event["choices"]:  # the usage chunk
            continue
        choice = event["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for d in delta.get("tool_calls", []):
            entry = calls.setdefault(d["index"], {"id": None, "type": None, "name": "", "arguments": ""})
            entry["id"] = d.get("id") or entry["id"]
            entry["type"] = d.get("type") or entry["type"]
            entry["name"] += d["function"].get("name") or ""
            entry["arguments"] += d["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_whole_response_carries_tool_calls(default_model_dir, tokenizer):
    app, _ = tool_app(default_model_dir, tokenizer, HERMES_SCRIPT)
    status, data = chat(app, tools=TOOLS)
    assert status == 200
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert list(message) == ["role", "content", "reasoning_content", "tool_calls"]
    assert message["content"] == "I will check."
    calls = message["tool_calls"]
    assert [list(c) for c in calls] == [["id", "type", "function"]] * 2
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 and c["type"] == "function" for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                              {"name": "now", "arguments": "{}"}]


def test_streamed_tool_call_deltas(default_model_dir, tokenizer):
    app, _ = tool_app(default_model_dir, tokenizer, HERMES_SCRIPT)
    events = chat_stream(app, tools=TOOLS, stream_options={"include_usage": True})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    with_calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert with_calls == [
        [{"index": 0, "id": with_calls[0][0]["id"], "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        [{"index": 1, "id": with_calls[1][0]["id"], "type": "function",
          "function": {"name": "now", "arguments": "{}"}}],
    ]
    assert not any("tool_call" in (d.get("content") or "") for d in deltas)
    content, calls, finish = assemble(events)
    assert content == "I will check." and finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather", "now"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(HERMES_SCRIPT)


def test_only_calls_means_null_content(default_model_dir, tokenizer):
    script = ['<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>']
    app, _ = tool_app(default_model_dir, tokenizer, script)
    message = chat(app, tools=TOOLS)[1]["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "now"


@pytest.mark.parametrize("parser, script", [
    ("llama3", [' {"name": "get_weather", "parameters": {"city": ', '"Paris"}}; {"name": "now", "parameters": {}}']),
    ("mistral", [" [TOOL_CALLS] [", '{"name": "get_weather", "arguments": {"city": "Paris"}}, ',
                 '{"name": "now", "arguments": {}}]']),
    ("mistral", [' [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]']),
])
def test_llama3_and_mistral_formats(default_model_dir, tokenizer, parser, script):
    app, _ = tool_app(default_model_dir, tokenizer, script, parser=parser)
    choice = chat(app, tools=TOOLS)[1]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Paris"}), ("now", {})]
    content, calls, finish = assemble(chat_stream(app, tools=TOOLS))
    assert content == "" and finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather", "now"]


def test_a_broken_call_is_closed_at_its_last_complete_value(default_model_dir, tokenizer):
    # The outer object never closes: the call started (name and arguments
    # begun), so it is a call, its arguments closed where they were complete.
    script = ["<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Paris"}\n', "</tool_call>"]
    app, _ = tool_app(default_model_dir, tokenizer, script)
    choice = chat(app, tools=TOOLS)[1]["choices"][0]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Paris"})]
    content, calls, finish = assemble(chat_stream(app, tools=TOOLS))
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("script", [
    ["<tool_call>\n", '{"name": 42, "arguments": {}}\n', "</tool_call>"],  # no name: never a call
    ["<tool_call>\n", '{"name": "launch", "arguments": {}}\n', "</tool_call>"],  # not one of the tools
])
def test_a_section_that_starts_no_call_is_plain_content(default_model_dir, tokenizer, script):
    app, _ = tool_app(default_model_dir, tokenizer, script)
    choice = chat(app, tools=TOOLS)[1]["choices"][0]
    assert choice["message"]["content"] == "".join(script)
    assert choice["message"]["tool_calls"] is None and choice["finish_reason"] == "stop"
    assert assemble(chat_stream(app, tools=TOOLS)) == ("".join(script), [], "stop")


def test_arguments_stream_as_the_model_writes_them(default_model_dir, tokenizer):
    script = ["<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Pa', 'ris", "unit', '": "C"}}',
              "\n</tool_call>"]
    app, _ = tool_app(default_model_dir, tokenizer, script)
    events = chat_stream(app, tools=TOOLS)
    pieces = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert len(pieces) > 1
    assert [list(p) for p in pieces] == [["index", "id", "type", "function"]] + [["index", "function"]] * (len(pieces) - 1)
    assert pieces[0]["function"]["name"] == "get_weather" and all("name" not in p["function"] for p in pieces[1:])
    _, calls, finish = assemble(events)
    assert finish == "tool_calls" and json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "C"}
    whole = chat(app, tools=TOOLS)[1]["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == \
        [(c["name"], c["arguments"]) for c in calls]


def test_a_call_cut_by_max_tokens_finishes_with_length(default_model_dir, tokenizer):
    app, _ = tool_app(default_model_dir, tokenizer, HERMES_SCRIPT)
    choice = chat(app, tools=TOOLS, max_tokens=5)[1]["choices"][0]
    assert choice["finish_reason"] == "length"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


def test_no_tools_or_tool_choice_none_leaves_the_text(default_model_dir, tokenizer):
    app, _ = tool_app(default_model_dir, tokenizer, HERMES_SCRIPT)
    for body in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        choice = chat(app, **body)[1]["choices"][0]
        assert choice["message"]["content"] == "".join(HERMES_SCRIPT) and choice["message"]["tool_calls"] is None
        assert choice["finish_reason"] == "stop"


def test_without_a_parser_auto_tools_leave_the_text(default_model_dir, tokenizer):
    app, engine = tool_app(default_model_dir, tokenizer, HERMES_SCRIPT, parser=None)
    status, data = chat(app, tools=TOOLS, tool_choice="auto")
    assert status == 200 and data["choices"][0]["message"]["content"] == "".join(HERMES_SCRIPT)
    assert engine.requests[-1].params.constraint is None


def test_parallel_tool_calls_false_keeps_the_first_call(default_model_dir, tokenizer):
    app, _ = tool_app(default_model_dir, tokenizer, HERMES_SCRIPT)
    message = chat(app, tools=TOOLS, parallel_tool_calls=False)[1]["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    _, calls, _ = assemble(chat_stream(app, tools=TOOLS, parallel_tool_calls=False))
    assert [c["name"] for c in calls] == ["get_weather"]


FORCED_SCRIPT = ['[{"name": "get_weather", "arguments": {"city": "Paris"}}', ', {"name": "now", ',
                 '"arguments": {}}]']


@pytest.mark.parametrize("parser", ["qwen25", None])
def test_required_tool_choice_is_a_grammar_over_the_offered_tools(qwen25_dir, tokenizer, parser):
    app, engine = tool_app(qwen25_dir, tokenizer, FORCED_SCRIPT, parser=parser)
    choice = chat(app, tools=TOOLS, tool_choice="required")[1]["choices"][0]
    constraint = engine.requests[-1].params.constraint
    assert constraint.kind == "json_schema"
    schema = json.loads(constraint.text)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"] for item in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                               {"const": "now"}]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    prompt = tokenizer.decode(engine.requests[-1].input_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n")  # nothing of a call in the prompt
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "now", "arguments": "{}"}]
    events = chat_stream(app, tools=TOOLS, tool_choice="required")
    # Each call is sent as soon as its object closes: the first with the first step's text.
    deltas = [e["choices"][0]["delta"].get("tool_calls") for e in events[1:-1]]
    assert [[c["function"]["name"] for c in d] for d in deltas] == [["get_weather"], ["now"]]
    content, calls, finish = assemble(events)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]


def test_named_tool_choice_is_one_call_of_that_function(qwen25_dir, tokenizer):
    app, engine = tool_app(qwen25_dir, tokenizer, ['[{"name": "get_weather", "arguments": {"city": "Paris"}}]'],
                           parser=None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        if stream:
            content, calls, finish = assemble(chat_stream(app, tools=TOOLS, tool_choice=named))
        else:
            choice = chat(app, tools=TOOLS, tool_choice=named)[1]["choices"][0]
            content, finish = choice["message"]["content"], choice["finish_reason"]
            calls = [c["function"] for c in choice["message"]["tool_calls"]]
        assert not content and finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]
        schema = json.loads(engine.requests[-1].params.constraint.text)
        assert schema["minItems"] == schema["maxItems"] == 1
        assert schema["items"]["properties"]["name"] == {"const": "get_weather"}
        prompt = tokenizer.decode(engine.requests[-1].input_ids, skip_special_tokens=False)
        assert '"name": "now"' not in prompt  # the template sees only the named tool


def test_forced_calls_use_the_parsers_arguments_key_and_one_call_without_parallel(qwen25_dir, tokenizer):
    app, engine = tool_app(qwen25_dir, tokenizer, ['[{"name": "now", "parameters": {}}]'], parser="llama3")
    choice = chat(app, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)[1]["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    schema = json.loads(engine.requests[-1].params.constraint.text)
    assert schema["maxItems"] == 1 and "parameters" in schema["items"]["anyOf"][1]["properties"]


def test_forced_calls_cut_by_max_tokens_keep_the_complete_ones(qwen25_dir, tokenizer):
    app, _ = tool_app(qwen25_dir, tokenizer, FORCED_SCRIPT, parser=None)
    choice = chat(app, tools=TOOLS, tool_choice="required", max_tokens=2)[1]["choices"][0]
    assert choice["finish_reason"] == "length"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["message"]["content"] == '{"name": "now", '


def test_a_forced_tool_choice_and_a_response_format_are_refused_together(qwen25_dir, tokenizer):
    app, engine = tool_app(qwen25_dir, tokenizer, ["x"])
    status, data = chat(app, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert status == 400 and data["error"]["param"] == "response_format"
    assert "tool_choice" in data["error"]["message"] and engine.requests == []


STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


def test_strict_tools_under_auto_constrain_calls_in_the_parsers_format(qwen25_dir, tokenizer):
    app, engine = tool_app(qwen25_dir, tokenizer, HERMES_SCRIPT)
    choice = chat(app, tools=[STRICT_WEATHER, NOW])[1]["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "now"]
    constraint = engine.requests[-1].params.constraint
    fmt = json.loads(constraint.text)["format"]
    assert constraint.kind == "structural_tag" and fmt["type"] == "triggered_tags"
    assert fmt["triggers"] == ["<tool_call>"]
    weather, now = fmt["tags"]
    assert weather["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert weather["end"] == "}\n</tool_call>"
    assert weather["content"]["json_schema"] == WEATHER["function"]["parameters"]
    assert now["content"]["json_schema"] == {"type": "object"}  # not strict: any object
    # Without strict tools nothing is constrained.
    chat(app, tools=TOOLS)
    assert engine.requests[-1].params.constraint is None
    # With a JSON response_format: the answer, or text with calls.
    chat(app, tools=[STRICT_WEATHER], response_format={"type": "json_object"})
    fmt = json.loads(engine.requests[-1].params.constraint.text)["format"]
    assert fmt["type"] == "or" and fmt["elements"][0] == {"type": "json_schema", "json_schema": {"type": "object"}}
    assert fmt["elements"][1]["at_least_one"] is True
    status, data = chat(app, tools=[STRICT_WEATHER], regex="a+")
    assert status == 400 and data["error"]["param"] == "regex"


def test_reasoning_then_tool_calls(default_model_dir, tokenizer):
    script = ["<think>\nThe user wants", " weather.\n</think>\n\n", *HERMES_SCRIPT[1:]]
    app, _ = tool_app(default_model_dir, tokenizer, script, reasoning_parser="qwen3")
    message = chat(app, tools=TOOLS)[1]["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] is None and len(message["tool_calls"]) == 2
    events = chat_stream(app, tools=TOOLS)
    assert "".join((e["choices"][0]["delta"].get("reasoning_content") or "") for e in events).strip() \
        == "The user wants weather."
    assert assemble(events)[0] == ""


TOOL_HISTORY = MSG + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22°C and sunny"},
]


def test_tool_calls_and_results_in_the_history_render(qwen25_dir, default_model_dir, tokenizer):
    app, engine = tool_app(qwen25_dir, tokenizer, ["It is 22°C."])
    status, data = chat(app, messages=TOOL_HISTORY, tools=TOOLS)
    assert status == 200 and data["choices"][0]["message"]["content"] == "It is 22°C."
    prompt = tokenizer.decode(engine.requests[-1].input_ids, skip_special_tokens=False)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22°C and sunny\n</tool_response><|im_end|>' \
           in prompt
    assert '"name": "now"' in prompt  # the tools, in the system turn
    # A template that knows nothing of tools (the default model's) still takes the conversation.
    app, _ = tool_app(default_model_dir, tokenizer, ["ok"])
    assert chat(app, messages=TOOL_HISTORY, tools=TOOLS)[0] == 200


def fn(name="get_weather", **extra):
    return {"type": "function", "function": {"name": name, **extra}}


BAD_TOOL_BODIES = {
    "tools empty": ({"tools": []}, "tools", "empty_array"),
    "tools not a list": ({"tools": {"type": "function"}}, "tools", "invalid_type"),
    "tool not an object": ({"tools": ["get_weather"]}, "tools[0]", "invalid_type"),
    "tool type missing": ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type", "missing_required_parameter"),
    "tool type": ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "invalid_value"),
    "function missing": ({"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
    "function not an object": ({"tools": [{"type": "function", "function": "f"}]}, "tools[0].function",
                               "invalid_type"),
    "name missing": ({"tools": [WEATHER, {"type": "function", "function": {}}]}, "tools[1].function.name",
                     "missing_required_parameter"),
    "name with a space": ({"tools": [fn("get weather")]}, "tools[0].function.name", "invalid_value"),
    "name too long": ({"tools": [fn("f" * 65)]}, "tools[0].function.name", "invalid_value"),
    "parameters not an object": ({"tools": [fn(parameters="{}")]}, "tools[0].function.parameters", "invalid_type"),
    "description not a string": ({"tools": [fn(description=3)]}, "tools[0].function.description", "invalid_type"),
    "tool_choice unknown string": ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "invalid_value"),
    "tool_choice a number": ({"tools": TOOLS, "tool_choice": 1}, "tool_choice", "invalid_type"),
    "tool_choice type": ({"tools": TOOLS, "tool_choice": {"type": "tool", "function": {"name": "now"}}},
                         "tool_choice.type", "invalid_value"),
    "tool_choice without name": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
                                 "tool_choice.function.name", "missing_required_parameter"),
    "tool_choice unknown function": ({"tools": TOOLS, "tool_choice": fn("nope")}, "tool_choice.function.name",
                                     "invalid_value"),
    "tool_choice required without tools": ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    "parallel_tool_calls not a bool": ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_type"),
    "history call without function": ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
                                      "messages[0].tool_calls[0].function", "missing_required_parameter"),
    "history call arguments a number": ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": 3}}]}]},
        "messages[0].tool_calls[0].function.arguments", "invalid_type"),
}


@pytest.mark.parametrize("case", list(BAD_TOOL_BODIES))
def test_bad_tools_are_openai_400s(default_model_dir, tokenizer, case):
    body, param, code = BAD_TOOL_BODIES[case]
    app, engine = tool_app(default_model_dir, tokenizer, ["x"])
    for stream in (False, True):
        status, data = chat(app, **body, stream=stream)
        assert status == 400, data
        assert set(data["error"]) == {"message", "type", "param", "code"}
        assert data["error"]["param"] == param and data["error"]["code"] == code
        assert data["error"]["type"] == "invalid_request_error" and data["error"]["message"]
    assert engine.requests == []


# -- the real server, through the official client ----------------------------


def test_openai_client_with_tools_gets_well_formed_answers(client, model_name):
    kwargs = dict(model=model_name, tools=TOOLS, temperature=0, max_tokens=48,
                  messages=[{"role": "user", "content": "Use get_weather for Paris."}])
    for tool_choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(tool_choice=tool_choice, **kwargs)
        choice = r.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        if tool_choice != "auto":  # a grammar guarantees the calls
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls or []
        assert (choice.finish_reason == "tool_calls") <= bool(calls)
        assert choice.message.content is not None or calls
        for c in calls:
            assert c.id.startswith("call_") and c.type == "function"
            assert c.function.name in ("get_weather", "now") and isinstance(json.loads(c.function.arguments), dict)
        # The stream assembles to the same answer (temperature 0).
        content, streamed, finish = "", {}, None
        for chunk in client.chat.completions.create(tool_choice=tool_choice, stream=True, **kwargs):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                streamed.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == choice.finish_reason and content == (choice.message.content or "")
        assert [streamed[i] for i in sorted(streamed)] == [[c.function.name, c.function.arguments] for c in calls]


def rebuilt_by_openai(events: list[dict]):
    """The openai client's own accumulator over a stream's chunks: the
    completion it rebuilds."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    return state.get_final_completion()


def test_openai_accumulator_rebuilds_parallel_calls_streamed_in_pieces(default_model_dir, tokenizer):
    script = ["Sure.", "\n<tool_call>\n", '{"name": "get_weather", "arguments": {"ci', 'ty": "Pa', 'ris"}}\n',
              "</tool_call>\n<tool_call>\n", '{"name": "now", "argu', 'ments": {}}\n</tool_call>']
    app, _ = tool_app(default_model_dir, tokenizer, script)
    message = chat(app, tools=TOOLS)[1]["choices"][0]["message"]
    rebuilt = rebuilt_by_openai(chat_stream(app, tools=TOOLS)).choices[0]
    assert rebuilt.finish_reason == "tool_calls" and rebuilt.message.content == message["content"] == "Sure."
    assert [c.id for c in rebuilt.message.tool_calls] == [c.id for c in rebuilt.message.tool_calls if c.id.startswith("call_")]
    assert [(c.type, c.function.name, c.function.arguments) for c in rebuilt.message.tool_calls] == \
        [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert len(rebuilt.message.tool_calls) == 2


def test_openai_stream_helper_rebuilds_the_forced_calls(client, model_name):
    """client.chat.completions.stream's final completion equals the
    non-streamed answer at temperature 0, parallel calls included (its
    content is "" where the whole answer's is null: the role chunk carries
    content "", as SGLang's and vLLM's do)."""
    kwargs = dict(model=model_name, tools=TOOLS, temperature=0, max_tokens=64,
                  messages=[{"role": "user", "content": "Weather in Paris and in Rome, then the time."}])
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole = client.chat.completions.create(tool_choice=tool_choice, **kwargs).choices[0]
        with client.chat.completions.stream(tool_choice=tool_choice, **kwargs) as stream:
            rebuilt = stream.get_final_completion().choices[0]
        assert whole.message.tool_calls
        assert rebuilt.finish_reason == whole.finish_reason
        assert rebuilt.message.content == (whole.message.content or "")
        assert [(c.function.name, c.function.arguments) for c in rebuilt.message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_openai_client_sends_back_tool_results(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=TOOL_HISTORY, tools=TOOLS, max_tokens=8)
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)


def test_strict_tools_with_a_format_no_grammar_can_hold_are_refused(default_model_dir, tokenizer):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    app, engine = tool_app(default_model_dir, tokenizer, HERMES_SCRIPT, parser="pythonic")
    status, data = chat(app, tools=[NOW, strict])
    assert status == 400 and data["error"]["param"] == "tools[1].function.strict"
    assert engine.requests == []


@pytest.mark.parametrize("parser, script", [
    ("pythonic", ['[get_weather(city="Pa', 'ris"), now()]']),
    ("qwen3_coder", ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
                     "</tool_call>"]),
    ("glm45", ["<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Pa", "ris</arg_value>\n</tool_call>"]),
    ("minimax-m2", ['<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Pa',
                    "ris</parameter>\n</invoke>\n</minimax:tool_call>"]),
    ("deepseekv31", ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Pa",
                     'ris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>']),
])
def test_the_newer_formats_through_the_route(default_model_dir, tokenizer, parser, script):
    app, _ = tool_app(default_model_dir, tokenizer, script, parser=parser)
    choice = chat(app, tools=TOOLS)[1]["choices"][0]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert calls[0] == ("get_weather", {"city": "Paris"}) and choice["finish_reason"] == "tool_calls"
    _, streamed, finish = assemble(chat_stream(app, tools=TOOLS))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls and finish == "tool_calls"
