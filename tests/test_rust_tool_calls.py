"""pyserve._rust.ToolCallParser: each format's calls, written as the
models' chat templates write them, streamed as OpenAI deltas split at every
point; random calls rendered in each format and parsed back; random soups of
call fragments giving the same result however they are split; and
pyserve._rust.tool_call_prefix."""

from __future__ import annotations

import json
import random

import pytest

from pyserve._rust import ToolCallParser, tool_call_prefix

WS = " \t\n\r"
FORMATS = ["hermes", "llama3", "mistral", "deepseekv3", "deepseekv31", "pythonic", "qwen3_coder", "minimax-m2",
           "glm45"]
# The formats whose values are text that the tools' schemas type.
TYPED_BY_SCHEMA = ("qwen3_coder", "minimax-m2", "glm45")
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def stream(fmt: str, deltas: list[str], tools: list | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) rebuilt from feed_events deltas, checking
    that each call's name comes once, in its first delta, indexes in order."""
    parser = ToolCallParser(fmt, tools)
    content, calls = "", []
    for result in [parser.feed_events(d) for d in deltas] + [parser.flush_events()]:
        content += result[0]
        for index, name, arguments in result[1]:
            if index == len(calls):
                assert name is not None, "a call's first delta names it"
                calls.append([name, ""])
            else:
                assert index == len(calls) - 1 and name is None, "later deltas extend the last call"
            calls[index][1] += arguments
    return content, [tuple(c) for c in calls]


def splits(text: str) -> list[list[str]]:
    """The text whole, in two at every point, and one char at a time."""
    return [[text]] + [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def check_every_split(fmt: str, text: str, want, tools: list | None = None) -> None:
    for deltas in splits(text):
        assert stream(fmt, deltas, tools) == want, deltas


# Fixtures in each model's own format (from its chat template).
WEATHER = '{"location": "東京", "unit": "celsius"}'
FIXTURES = {
    "hermes": (  # Qwen2.5 / Hermes
        "Let me check both.\n<tool_call>\n"
        f'{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>',
        "Let me check both.",
        [("get_weather", WEATHER), ("get_time", '{"tz": "Asia/Tokyo"}')],
    ),
    "llama3": (  # Llama 3.1 JSON tool calling
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
        '{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}',
        "",
        [("get_weather", WEATHER), ("get_time", '{"tz": "Asia/Tokyo"}')],
    ),
    "mistral": (
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, '
        '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]',
        "",
        [("get_weather", WEATHER), ("get_time", '{"tz": "Asia/Tokyo"}')],
    ),
    "deepseekv3": (  # DeepSeek-V3 / V3-0324
        f"Let me check both.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n{WEATHER}\n```"
        f"{DS_CALL_END}\n{DS_CALL_BEGIN}function{DS_SEP}get_time\n```json\n"
        f'{{"tz": "Asia/Tokyo"}}\n```{DS_CALL_END}{DS_CALLS_END}',
        "Let me check both.",
        [("get_weather", WEATHER), ("get_time", '{"tz": "Asia/Tokyo"}')],
    ),
    "deepseekv31": (  # DeepSeek-V3.1
        f"Let me check both.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}{WEATHER}{DS_CALL_END}"
        f'{DS_CALL_BEGIN}get_time{DS_SEP}{{"tz": "Asia/Tokyo"}}{DS_CALL_END}{DS_CALLS_END}',
        "Let me check both.",
        [("get_weather", WEATHER), ("get_time", '{"tz": "Asia/Tokyo"}')],
    ),
    "pythonic": (  # Llama 3.2 / Llama 4
        "[get_weather(location='東京', unit=\"celsius\"), get_time(tz=\"Asia/Tokyo\")]",
        "",
        [("get_weather", WEATHER), ("get_time", '{"tz": "Asia/Tokyo"}')],
    ),
    "qwen3_coder": (
        "Let me check both.\n<tool_call>\n<function=get_weather>\n<parameter=location>\n東京\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "<parameter=tz>\nAsia/Tokyo\n</parameter>\n</function>\n</tool_call>",
        "Let me check both.",
        [("get_weather", WEATHER), ("get_time", '{"tz": "Asia/Tokyo"}')],
    ),
    "minimax-m2": (
        'Let me check both.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="location">東京'
        '</parameter>\n<parameter name="unit">celsius</parameter>\n</invoke>\n<invoke name="get_time">\n'
        '<parameter name="tz">Asia/Tokyo</parameter>\n</invoke>\n</minimax:tool_call>',
        "Let me check both.",
        [("get_weather", WEATHER), ("get_time", '{"tz": "Asia/Tokyo"}')],
    ),
    "glm45": (  # GLM-4.5 / 4.6
        "Let me check both.\n<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>東京</arg_value>\n"
        "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>\n<tool_call>get_time\n"
        "<arg_key>tz</arg_key>\n<arg_value>Asia/Tokyo</arg_value>\n</tool_call>",
        "Let me check both.",
        [("get_weather", WEATHER), ("get_time", '{"tz": "Asia/Tokyo"}')],
    ),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_fixture_streams_the_same_calls_however_split(fmt):
    text, content, calls = FIXTURES[fmt]
    check_every_split(fmt, text, (content, calls))


@pytest.mark.parametrize("fmt", FORMATS)
def test_arguments_stream_as_they_are_written(fmt):
    text = FIXTURES[fmt][0]
    parser = ToolCallParser(fmt)
    pieces = [d for c in text for d in parser.feed_events(c)[1] if d[0] == 0 and d[2]]
    pieces += [d for d in parser.flush_events()[1] if d[0] == 0 and d[2]]
    assert len(pieces) >= 5, pieces
    assert pieces[0][1] == "get_weather" and all(d[1] is None for d in pieces[1:])


def test_openai_stream_accumulator_rebuilds_the_calls():
    from openai.lib.streaming.chat._completions import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    for fmt in FORMATS:
        text, content, calls = FIXTURES[fmt]
        state = ChatCompletionStreamState()
        parser = ToolCallParser(fmt)
        results = [parser.feed_events(c) for c in text] + [parser.flush_events()]
        for last, result in enumerate(results, 1 - len(results)):
            entries = [
                {"index": i, "function": {"arguments": a}} if name is None else
                {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": a}}
                for i, name, a in result[1]
            ]
            delta = {"content": result[0] or None, "tool_calls": entries or None}
            list(state.handle_chunk(ChatCompletionChunk.model_validate({
                "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": None if last else "tool_calls"}],
            })))
        message = state.get_final_completion().choices[0].message
        assert (message.content or "") == content
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == calls


def test_text_is_held_back_only_while_it_could_open_a_call():
    parser = ToolCallParser("qwen25")
    assert parser.feed_events("The weather") == ("The weather", [])
    assert parser.feed_events(" in Paris:\n<tool_") == (" in Paris:", [])
    assert parser.feed_events('call>\n{"name": "get_weather", "arguments": {"city": "Par') == (
        "", [(0, "get_weather", '{"city": "Par')])
    assert parser.feed_events('is"}}\n</tool_call>') == ("", [(0, None, 'is"}')])
    assert parser.flush_events() == ("", [])
    llama = ToolCallParser("llama3")
    assert llama.feed_events(" ") == ("", [])  # could still be the start of bare JSON
    assert llama.feed_events("Hello {") == (" Hello {", [])  # bare JSON opens calls only at the start


INVALID = {
    "hermes": ['<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
               "a <tool_call> never closed", '<tool_call>{"name": NaN}</tool_call>'],
    "llama3": ['{"answer": 4}', "The call is {\"name\": \"a\", \"parameters\": {}}", "<|python_tag|>print(1)"],
    "mistral": ["[1] is a footnote", '[TOOL_CALLS] [{"x": 1}]', "[" * 5000 + "]" * 5000],
    "deepseekv3": [f"{DS_CALLS_BEGIN}oops", f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n{{"a": 1}}'],
    "deepseekv31": [f"{DS_CALLS_BEGIN}oops", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{DS_SEP}[1]{DS_CALL_END}"],
    "pythonic": ["see [1] and [link](url)", "[f(x)]", "[f(1, 2)] and [g]", "[print('hi') for x in y]"],
    "qwen3_coder": ['<tool_call>\n{"name": "f"}\n</tool_call>', "<tool_call>\n<function=f\n", "x < y <tool_call>"],
    "minimax-m2": ['<minimax:tool_call>\n<invoke name=f>\n</invoke>\n</minimax:tool_call>', "<minimax:tool_call> x"],
    "glm45": ['<tool_call>\n{"name": "f"}\n</tool_call>', "<tool_call>f\n<arg_value>1</arg_value></tool_call>",
              "x < y <tool_call>"],
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_sections_that_are_not_calls_stay_text(fmt):
    for text in INVALID[fmt]:
        if len(text) < 200:
            check_every_split(fmt, text, (text, []))
        assert stream(fmt, [text]) == (text, [])


BROKEN_OFF = {
    "hermes": ('<tool_call>{"name": "f", "arguments": {"q": "Par', '{"q": "Par"}'),
    "llama3": ('{"name": "f", "parameters": {"a": [1, 2.', '{"a": [1, 2]}'),
    "mistral": ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1, "b', '{"a": 1}'),
    "deepseekv3": (f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{{"a": {{"b": tr', '{"a": {}}'),
    "deepseekv31": (f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{DS_SEP}{{"a": {{"b": tr', '{"a": {}}'),
    "pythonic": ("[f(a='x', b=[1, 2", '{"a": "x", "b": [1, 2]}'),
    "qwen3_coder": ("<tool_call>\n<function=f>\n<parameter=a>\nhalf a li", '{"a": "half a li"}'),
    "minimax-m2": ('<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">half a li', '{"a": "half a li"}'),
    "glm45": ("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>half a li", '{"a": "half a li"}'),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_cut_short_is_closed_into_an_object(fmt):
    text, arguments = BROKEN_OFF[fmt]
    check_every_split(fmt, text, ("", [("f", arguments)]))


def test_a_call_that_breaks_off_ends_there_and_the_rest_is_text():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call> then'
    check_every_split("hermes", text, ("]}</tool_call> then", [("f", '{"a": 1}')]))
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}\n</tool_call>\nthen'  # a brace short: the marker ends it
    check_every_split("hermes", text, ("then", [("f", '{"a": 1}')]))


def test_qwen3_coder_values_are_typed_by_the_tools_schemas():
    tools = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"},
        "dry_run": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"}}}}}]
    text = ("<tool_call>\n<function=edit>\n<parameter=path>\n/src/main.py\n</parameter>\n<parameter=line>\n42\n"
            "</parameter>\n<parameter=scale>\n1.5\n</parameter>\n<parameter=dry_run>\nTrue\n</parameter>\n"
            '<parameter=opts>\n{"indent": 4}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
            "<parameter=note>\nline one\n  line two\n</parameter>\n</function>\n</tool_call>")
    args = {"path": "/src/main.py", "line": 42, "scale": 1.5, "dry_run": True, "opts": {"indent": 4},
            "tags": ["a", "b"], "note": "line one\n  line two"}
    check_every_split("qwen3_coder", text, ("", [("edit", json.dumps(args, ensure_ascii=False))]), tools)
    assert json.loads(stream("qwen3_coder", [text])[1][0][1])["line"] == "42"  # no tools: strings
    with pytest.raises(ValueError):
        ToolCallParser("qwen3_coder", [object()])


def test_given_tools_a_call_must_name_one():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "Paris", "arguments": {"x": 1}}\n</tool_call>')
    unknown = '<tool_call>\n{"name": "Paris", "arguments": {"x": 1}}\n</tool_call>'
    check_every_split("hermes", text, (unknown, [("get_weather", '{"city": "Paris"}')]), tools)
    assert len(stream("hermes", [text])[1]) == 2  # without tools, any name
    check_every_split("pythonic", "[Paris(x=1)]", ("[Paris(x=1)]", []), tools)


def test_unknown_format_is_a_value_error():
    with pytest.raises(ValueError, match="kimi_k2"):
        ToolCallParser("kimi_k2")
    with pytest.raises(ValueError):
        tool_call_prefix("kimi_k2")


CONTINUATIONS = {  # what a model writes after the prefix: (after the bare prefix, after the named one)
    "hermes": ('now", "arguments": {"tz": "UTC"}}\n</tool_call>', ' {"tz": "UTC"}}\n</tool_call>'),
    "qwen25": ('now", "arguments": {"tz": "UTC"}}\n</tool_call>', ' {"tz": "UTC"}}\n</tool_call>'),
    "llama3": ('now", "parameters": {"tz": "UTC"}}', ' {"tz": "UTC"}}'),
    "mistral": ('now", "arguments": {"tz": "UTC"}}]', ' {"tz": "UTC"}}]'),
    "deepseekv3": ('now\n```json\n{"tz": "UTC"}\n```' + DS_CALL_END + DS_CALLS_END,
                   '{"tz": "UTC"}\n```' + DS_CALL_END + DS_CALLS_END),
    "deepseekv31": (f'now{DS_SEP}{{"tz": "UTC"}}{DS_CALL_END}{DS_CALLS_END}',
                    f'{{"tz": "UTC"}}{DS_CALL_END}{DS_CALLS_END}'),
    "pythonic": ("now(tz='UTC')]", "tz='UTC')]"),
    "qwen3_coder": ("now>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>",
                    "<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"),
    "minimax-m2": ('now">\n<parameter name="tz">UTC</parameter>\n</invoke>\n</minimax:tool_call>',
                   '<parameter name="tz">UTC</parameter>\n</invoke>\n</minimax:tool_call>'),
    "glm45": ("now\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>",
              "<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>"),
}


@pytest.mark.parametrize("fmt", list(CONTINUATIONS))
def test_a_call_prefix_starts_nothing_and_reads_as_the_start_of_a_call(fmt):
    bare, named = CONTINUATIONS[fmt]
    for prefix, rest in [(tool_call_prefix(fmt), bare), (tool_call_prefix(fmt, "now"), named)]:
        parser = ToolCallParser(fmt)
        assert parser.feed_events(prefix) == ("", [])
        assert stream(fmt, [prefix, rest]) == ("", [("now", '{"tz": "UTC"}')])
    assert tool_call_prefix("hermes", 'say "hi"') == '<tool_call>\n{"name": "say \\"hi\\"", "arguments":'


# Random calls rendered in each format, with text around them.
TEXTS = ["", "Sure.", "I'll check: ", "東京の天気 🎉", "Done!\n", "a, b; c.", "  spaced  "]
STRINGS = ["Paris", "", "東京", "🎉 emoji", 'say "hi"', "back\\slash", "tab\there", "new\nline", "a < b > c",
           "it's", "{not json}", "[1, 2]"]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "bool", "none", "list", "dict"] if depth < 2 else ["str", "int"])
    return {"str": lambda: rng.choice(STRINGS), "int": lambda: rng.randint(-10**6, 10**12),
            "float": lambda: rng.choice([1.5, -0.25, 3e-07, 2.5e+20]), "bool": lambda: rng.random() < 0.5,
            "none": lambda: None,
            "list": lambda: [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            "dict": lambda: {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}}[kind]()


def python_literal(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(python_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {python_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def render(fmt: str, calls: list[tuple[str, dict]], rng: random.Random) -> str:
    def args(a):
        return json.dumps(a, ensure_ascii=False)

    if fmt == "hermes":
        return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {args(a)}}}\n</tool_call>' for n, a in calls)
    if fmt == "llama3":
        return "<|python_tag|>" + "; ".join(f'{{"name": "{n}", "parameters": {args(a)}}}' for n, a in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS] [" + ", ".join(f'{{"name": "{n}", "arguments": {args(a)}}}' for n, a in calls) + "]"
    if fmt == "deepseekv3":
        return DS_CALLS_BEGIN + "\n".join(f"{DS_CALL_BEGIN}function{DS_SEP}{n}\n```json\n{args(a)}\n```{DS_CALL_END}"
                                          for n, a in calls) + DS_CALLS_END
    if fmt == "deepseekv31":
        return (DS_CALLS_BEGIN + "".join(f"{DS_CALL_BEGIN}{n}{DS_SEP}{args(a)}{DS_CALL_END}" for n, a in calls)
                + DS_CALLS_END)
    if fmt == "pythonic":
        inner = ", ".join(f"{n}({', '.join(f'{k}={python_literal(v)}' for k, v in a.items())})" for n, a in calls)
        return f"<|python_start|>[{inner}]<|python_end|>" if rng.random() < 0.3 else f"[{inner}]"
    def value(v):  # as the XML-style templates write values: strings as they are, the rest as JSON
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

    if fmt == "minimax-m2":
        return "<minimax:tool_call>\n" + "".join(f'<invoke name="{n}">\n' + "".join(
            f'<parameter name="{k}">{value(v)}</parameter>\n' for k, v in a.items()) + "</invoke>\n"
            for n, a in calls) + "</minimax:tool_call>"
    if fmt == "glm45":
        return "\n".join(f"<tool_call>{n}\n" + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{value(v)}</arg_value>\n" for k, v in a.items()) + "</tool_call>"
            for n, a in calls)
    return "\n".join(
        f"<tool_call>\n<function={n}>\n" + "".join(
            f"<parameter={k}>\n{value(v)}\n</parameter>\n"
            for k, v in a.items()) + "</function>\n</tool_call>" for n, a in calls)


def qwen3_tools(calls: list[tuple[str, dict]]) -> list[dict]:
    def schema(v):
        return {"type": {str: "string", bool: "boolean", int: "integer", float: "number", list: "array",
                         dict: "object", type(None): "null"}[type(v)]}
    return [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {k: schema(v) for k, v in a.items()}}}} for n, a in calls]


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text) + 1, 8))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_calls_parse_back_however_split(fmt):
    rng = random.Random(FORMATS.index(fmt))
    for _ in range(300):
        calls = [(rng.choice(["get_weather", "search", "f_2", "now"]) + str(j),
                  {rng.choice(["city", "q", "n", "opts", "x_1"]) + str(i): random_value(rng)
                   for i in range(rng.randint(0, 3))})
                 for j in range(rng.randint(1, 3))]
        if fmt == "qwen3_coder":  # a value's own leading/trailing newline is the template's
            calls = [(n, {k: v for k, v in a.items() if not (isinstance(v, str) and (v.strip(WS) != v or not v))})
                     for n, a in calls]
        before, after = rng.choice(TEXTS), rng.choice(TEXTS)
        text = before + render(fmt, calls, rng) + after
        want = (before.rstrip(WS) + after.lstrip(WS), [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls])
        tools = qwen3_tools(calls) if fmt in TYPED_BY_SCHEMA else None
        assert stream(fmt, random_split(rng, text), tools) == want, text
        assert stream(fmt, list(text), tools) == want, text


def soup_pieces(fmt: str) -> list[str]:
    """Fragments whose random concatenations hold calls, near-calls, broken calls and text."""
    calls = {n: render(fmt, [(n, a)], random.Random(0)) for n, a in
             [("get_weather", {"city": "Paris", "days": [1, 2]}), ("g", {}), ("h", {"s": "東京\n\"x\""})]}
    common = [" ", "\n", "text", "想", "🎉", "{", "[", "]", "}", "(", ")", ";", ",", '"', "'", "\\", "=", "<", ">"]
    pieces = common + list(calls.values())
    for call in calls.values():  # cut calls: their first half, or the call with a piece left out
        pieces += [call[: len(call) // 2], call[len(call) // 3:], call[: len(call) // 3] + call[len(call) // 2:]]
    return pieces


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_soups_parse_the_same_however_split(fmt):
    rng = random.Random(100 + FORMATS.index(fmt))
    pieces = soup_pieces(fmt)
    found = 0
    for _ in range(1500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        want = stream(fmt, [text])
        assert stream(fmt, random_split(rng, text)) == want, text
        for _, arguments in want[1]:
            assert isinstance(json.loads(arguments), dict)
        if not want[1]:  # no call: all of it is text
            assert want[0] == text
        found += len(want[1])
    assert found > 300  # the soups do hold calls
