"""pyserve._rust.ToolCallParser against a pure-Python reference on random
streams split at random points, and pyserve._rust.tool_call_prefix."""

from __future__ import annotations

import json
import random

import pytest

from pyserve._rust import ToolCallParser, tool_call_prefix

WS = " \t\n\r"
MARKERS = {"hermes": "<tool_call>", "llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
HERMES_END = "</tool_call>"


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


_JSON = json.JSONDecoder(parse_constant=_reject_constant)  # strict JSON: no NaN / Infinity


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def _call(obj) -> tuple[str, dict] | None:
    """(name, arguments) of a call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        return obj["name"], {}
    if isinstance(args, str):
        try:
            args = _JSON.decode(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _bare_opener(text: str, p: int, fmt: str, after_call: bool) -> int | None:
    """Where bare JSON opens a section at p: llama3 `{` (after a call also
    `; {`), mistral `[ {`; whitespace first."""
    start = i = _skip_ws(text, p)
    if fmt == "llama3":
        if after_call and text[i:i + 1] == ";":
            i = _skip_ws(text, i + 1)
    else:
        if text[i:i + 1] != "[":
            return None
        i = _skip_ws(text, i + 1)
    return start if text[i:i + 1] == "{" else None


def _section(text: str, s: int, marked: bool, fmt: str) -> tuple[list, int] | None:
    """(calls, end) of the section at s, or None if it holds no valid call."""
    marker = MARKERS[fmt]
    if fmt == "hermes":
        body = s + len(marker)
        e = text.find(HERMES_END, body)
        chunk, end = (text[body:], len(text)) if e < 0 else (text[body:e], e + len(HERMES_END))
        try:
            call = _call(_JSON.decode(chunk))
        except ValueError:
            return None
        return ([call], end) if call else None
    i = _skip_ws(text, s + (len(marker) if marked else 0))
    if not marked and text[i:i + 1] == ";":
        i = _skip_ws(text, i + 1)
    if text[i:i + 1] != ("{" if fmt == "llama3" else "["):
        return None
    try:
        obj, end = _JSON.raw_decode(text, i)
    except ValueError:
        return None
    if fmt == "llama3":
        call = _call(obj)
        return ([call], end) if call else None
    calls = [_call(o) for o in obj] if isinstance(obj, list) else []
    return (calls, end) if calls and all(calls) else None


def reference(text: str, fmt: str) -> tuple[str, list]:
    """(text, calls) of a whole output. A section opens at the format's
    marker, or with bare JSON at the start (llama3 and mistral) or right
    after a llama3 call. A section with valid calls drops the whitespace
    around it; one without stays text, and reading goes on right after its
    first character (or marker)."""
    marker = MARKERS[fmt]
    out, calls = [], []
    p, opening, after_call = 0, fmt != "hermes", False
    while True:
        if after_call:
            p = _skip_ws(text, p)
        s = _bare_opener(text, p, fmt, after_call) if opening else None
        marked = s is None
        if marked:
            s = text.find(marker, p)
            if s < 0:
                out.append(text[p:])
                return "".join(out), calls
        found = _section(text, s, marked, fmt)
        if found is not None:
            out.append(text[p:s].rstrip(WS))
            calls += found[0]
            p, opening, after_call = found[1], fmt == "llama3", True
        else:
            opener = len(marker) if marked else 1
            out.append(text[p:s + opener])
            p, opening, after_call = s + opener, False, False


def parse_stream(deltas: list[str], fmt: str) -> tuple[str, list]:
    parser = ToolCallParser(fmt)
    text, calls = "", []
    for delta in deltas:
        t, c = parser.feed(delta)
        text, calls = text + t, calls + c
    t, c = parser.flush()
    return text + t, [(name, json.loads(args)) for name, args in calls + c]


def call_json(fmt: str, name: str, args: str) -> str:
    key = "parameters" if fmt == "llama3" else "arguments"
    return f'{{"name": {json.dumps(name)}, "{key}": {args}}}'


def pieces_for(fmt: str) -> list[str]:
    """Fragments whose random concatenations cover calls, near-calls and text."""
    marker = MARKERS[fmt]
    calls = [call_json(fmt, "get_weather", '{"city": "Paris", "days": [1, 2]}'),
             call_json(fmt, "f", '"{\\"a\\": 1}"'), call_json(fmt, "g", "{}"), '{"name": "h"}']
    broken = ['{"name": "f", "arguments": {', '{"nam', '{"name": ""}', '{"answer": 4}', '{"name": "f"} x', "}", "]"]
    common = [marker, marker[:3], marker[2:], " ", "\n", "\n\n", "text", "想", "🎉", "{", "[", ";", '"', "\\"]
    if fmt == "hermes":
        blocks = [f"{marker}\n{c}\n{HERMES_END}" for c in calls[:2]]
        return common + calls + broken + blocks + [HERMES_END, HERMES_END[:4]]
    if fmt == "llama3":
        return common + calls + broken + [f"{marker}{calls[0]}", f"; {calls[2]}"]
    arrays = [f"[{calls[0]}, {calls[2]}]", f"[{calls[1]}]", f"{marker} [{calls[2]}]", "[ ", "[]"]
    return common + calls + broken + arrays


@pytest.mark.parametrize("fmt", list(MARKERS))
def test_random_streams_match_reference(fmt):
    rng = random.Random(0)
    pieces = pieces_for(fmt)
    found_calls = 0
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text) + 1, 6))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        want = reference(text, fmt)
        assert parse_stream(deltas, fmt) == want, deltas
        found_calls += len(want[1])
    assert found_calls > 300  # the pieces do make calls, not only text


@pytest.mark.parametrize("fmt", list(MARKERS))
def test_one_character_at_a_time(fmt):
    weather, now = call_json(fmt, "get_weather", '{"city": "東京"}'), call_json(fmt, "g", "{}")
    text = {
        "hermes": f"I will look.\n\n<tool_call>\n{weather}\n</tool_call>",
        "llama3": f"{weather}; {now}",
        "mistral": f"[TOOL_CALLS] [{weather}]",
    }[fmt]
    assert parse_stream(list(text), fmt) == reference(text, fmt)
    assert reference(text, fmt)[1][0] == ("get_weather", {"city": "東京"})


def test_text_is_held_back_only_while_it_could_open_a_call():
    parser = ToolCallParser("qwen25")
    assert parser.feed("The weather") == ("The weather", [])
    assert parser.feed(" in Paris:\n<tool_") == (" in Paris:", [])
    assert parser.feed('call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') == (
        "", [("get_weather", '{"city": "Paris"}')])
    assert parser.flush() == ("", [])
    llama = ToolCallParser("llama3")
    assert llama.feed(" ") == ("", [])  # could still be the start of bare JSON
    assert llama.feed("Hello {") == (" Hello {", [])  # bare JSON opens calls only at the start


def test_malformed_calls_come_back_as_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'  # one brace short
    assert parse_stream([text], "hermes") == (text, [])
    assert parse_stream(['[TOOL_CALLS] [{"name": NaN}]'], "mistral") == ('[TOOL_CALLS] [{"name": NaN}]', [])
    deep = "[" * 5000 + "]" * 5000  # deeper than serde_json parses: text, not a crash
    assert parse_stream([deep], "mistral") == (deep, [])


def test_unknown_format_is_a_value_error():
    with pytest.raises(ValueError, match="pythonic"):
        ToolCallParser("pythonic")
    with pytest.raises(ValueError):
        tool_call_prefix("pythonic")


@pytest.mark.parametrize("fmt", ["qwen25", "hermes", "llama3", "mistral"])
def test_prefix_of_a_forced_call_reads_as_the_start_of_a_call(fmt):
    parser = ToolCallParser(fmt)
    assert parser.feed(tool_call_prefix(fmt, 'get_"weather"')) == ("", [])
    end = {"llama3": "}", "mistral": "}]"}.get(fmt, "}\n</tool_call>")
    assert parser.feed(' {"city": "Paris"}' + end) == ("", [('get_"weather"', '{"city": "Paris"}')])
    parser = ToolCallParser(fmt)
    parser.feed(tool_call_prefix(fmt))
    key = "parameters" if fmt == "llama3" else "arguments"
    text, calls = parser.feed(f'now", "{key}": {{}}{end}')
    assert (text, calls) == ("", [("now", "{}")])
