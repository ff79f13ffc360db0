"""Tool calls with a guarantee: the grammars that make the model's calls
parse and fit the tools' parameter schemas.

`tool_choice: "required"` or a named function: the output is a JSON array
of calls, `[{"name": ..., "arguments": {...}}, ...]` ("parameters" for
llama3's format), each item one of the offered functions with arguments
valid under its schema. It needs no --tool-call-parser: the array is
mistral's bare-array format, which api/tools.py streams with that parser.

`strict: true` on a function under `tool_choice: "auto"`: when the model
starts a call in the --tool-call-parser's format, the call must name an
offered function and its arguments fit that function's schema (a
structural tag that xgrammar triggers on the format's opening text).
"""

from __future__ import annotations

import json
import uuid

from pyserve.http.errors import bad_request
from pyserve.api.protocol.openai import FunctionCall, ToolCall
from pyserve.engine.request import Constraint

ANY_ARGUMENTS = {"type": "object"}

# Per --tool-call-parser: (text that starts a call, the call's text before
# the function name, between the name and the arguments, after them).
# llama3's and mistral's markers are special tokens, which a grammar cannot
# produce; their parsers also read a bare call, which is what these match.
_CALL_TEXT = {
    "qwen25": ("<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"),
    "hermes": ("<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"),
    "llama3": ('{"name": "', '{"name": "', '", "parameters": ', "}"),
    "mistral": ('{"name": "', '{"name": "', '", "arguments": ', "}"),
}


def arguments_key(parser: str | None) -> str:
    """The key forced calls carry their arguments under: the one the
    model's own call format uses."""
    return "parameters" if parser == "llama3" else "arguments"


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or ANY_ARGUMENTS


def forced_calls(tools: list[dict], key: str, single: bool) -> Constraint:
    """The array of one call (`single`) or more to the offered `tools`."""
    items = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]}, key: _parameters(t)},
              "required": ["name", key], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if single:
        schema["maxItems"] = 1
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))


def strict_calls(tools: list[dict], parser: str, parallel: bool) -> dict | None:
    """xgrammar's structural-tag format for auto tool choice when a tool is
    strict: text is free, but a call the model starts must be complete and
    valid (strict tools' arguments under their schema, the others' any
    object). None when no tool is strict."""
    strict = [i for i, t in enumerate(tools) if t["function"].get("strict")]
    if not strict:
        return None
    if parser not in _CALL_TEXT:  # arguments that are not JSON text, or special-token markers
        raise bad_request(f"strict tools are not enforced with the {parser} tool-call format",
                          f"tools[{strict[0]}].function.strict")
    trigger, before_name, before_args, end = _CALL_TEXT[parser]
    tags = [{"type": "tag", "begin": before_name + t["function"]["name"] + before_args, "end": end,
             "content": {"type": "json_schema",
                         "json_schema": _parameters(t) if t["function"].get("strict") else ANY_ARGUMENTS}}
            for t in tools]
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": not parallel}


def with_strict_calls(calls: dict, answer: Constraint | None, answer_param: str | None) -> Constraint:
    """The structural tag of strict calls, alone or as the alternative to a
    JSON answer (a response_format): either the answer, or text with calls."""
    if answer is None:
        fmt = calls
    elif answer.kind == "json_schema":
        fmt = {"type": "or", "elements": [{"type": "json_schema", "json_schema": json.loads(answer.text)},
                                          {**calls, "at_least_one": True}]}
    else:
        raise bad_request(f"strict tools combine with a JSON response_format only, not with {answer_param}",
                          answer_param)
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False))


# One streamed piece of a call: (its index among the choice's calls, its
# name in its first piece only, else None, JSON text to add to its arguments).
CallDelta = tuple[int, str | None, str]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))
