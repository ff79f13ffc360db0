"""OpenAI function calling: `tools` and `tool_choice` checked with
OpenAI's error bodies, how a request's output is read for calls (and the
grammar that guarantees them), and the calls found in the output shaped as
OpenAI's `tool_calls`.

"required" and a named function are enforced by a grammar: the output is
a JSON array of calls (api/tool_grammar.py), read without any
--tool-call-parser. With a parser and "auto", the model writes calls in
its own format, which the parser finds; strict functions constrain them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pyserve._rust import ToolCallParser
from pyserve.http.errors import bad_request
from pyserve.api.protocol.openai import ChatCompletionRequest, ToolCall, ToolChoice
from pyserve.api.generation.tool_grammar import CallDelta, arguments_key, forced_calls, new_call, strict_calls
from pyserve.engine.request import Constraint

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# gpt-oss's Harmony format, whose calls the Harmony reader finds beside the
# reasoning (api/generation/harmony.py) rather than a ToolCallParser.
HARMONY = "gpt-oss"
_CHOICES = ("none", "auto", "required")


@dataclass
class ToolCalling:
    """How one request's output is read for calls."""

    # The --tool-call-parser reading calls in the model's own format; None
    # for a forced tool choice, whose output is a JSON array of calls.
    parser: str | None
    parallel: bool = True  # False: only the first call is kept
    forced: Constraint | None = None  # the grammar of a forced choice's calls
    # Auto choice with strict tools: the structural-tag format calls must follow.
    strict: dict | None = None
    tools: list[dict] | None = None  # a parsed call must name one of them

    def reader(self) -> ToolCallStream:
        return ToolCallStream(self)


def _kind(value: Any) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _missing(param: str):
    return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def _wrong_type(param: str, want: str, value: Any):
    return bad_request(f"Invalid type for '{param}': expected {want}, but got {_kind(value)} instead.",
                       param, "invalid_type")


def _field(obj: dict, key: str, param: str, want: type, required: bool = True):
    """obj[key] checked to be a `want`; None when absent and not required."""
    if key not in obj or obj[key] is None:
        if required:
            raise _missing(param)
        return None
    value = obj[key]
    if not isinstance(value, want):
        raise _wrong_type(param, {str: "a string", dict: "an object", bool: "a boolean"}[want], value)
    return value


def check_tools(tools: list[dict] | None) -> None:
    if tools is None:
        return
    if not tools:
        raise bad_request("Invalid 'tools': empty array. Expected an array with minimum length 1, "
                          "but got an empty array instead.", "tools", "empty_array")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = _field(tool, "type", f"{where}.type", str)
        if kind != "function":
            raise bad_request(f"Invalid value: '{kind}'. Supported values are: 'function'.", f"{where}.type",
                              "invalid_value")
        function = _field(tool, "function", f"{where}.function", dict)
        name = _field(function, "name", f"{where}.function.name", str)
        if not _NAME.fullmatch(name):
            raise bad_request(f"Invalid '{where}.function.name': string does not match pattern. Expected a "
                              "string that matches the pattern '^[a-zA-Z0-9_-]{1,64}$'.",
                              f"{where}.function.name", "invalid_value")
        _field(function, "description", f"{where}.function.description", str, required=False)
        _field(function, "parameters", f"{where}.function.parameters", dict, required=False)
        _field(function, "strict", f"{where}.function.strict", bool, required=False)


def check_tool_choice(tool_choice: str | ToolChoice | None, tools: list[dict] | None) -> str | None:
    """"none", "auto", "required", or the name of the function the model
    must call; None when neither tools nor a choice are given."""
    if tool_choice is None:
        return None if tools is None else "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise bad_request(f"Invalid value: '{tool_choice}'. Supported values are: 'none', 'auto' and "
                              "'required'.", "tool_choice", "invalid_value")
        choice = tool_choice
    else:  # its shape and types were checked when the body was decoded
        if tool_choice.type != "function":
            raise bad_request(f"Invalid value: '{tool_choice.type}'. Supported values are: 'function'.",
                              "tool_choice.type", "invalid_value")
        choice = tool_choice.function.name
    if choice in ("none", "auto"):
        return choice
    if tools is None:
        raise bad_request("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                          "specified.", "tool_choice", "invalid_value")
    if choice != "required" and all(t["function"]["name"] != choice for t in tools):
        raise bad_request(f"Invalid value for 'tool_choice': no function named '{choice}' in 'tools'.",
                          "tool_choice.function.name", "invalid_value")
    return choice


def plan(req: ChatCompletionRequest, parser: str | None) -> tuple[list[dict] | None, ToolCalling | None]:
    """Checks the request's tools and tool_choice: (the tools the chat
    template sees, how to read calls in the output, if at all)."""
    check_tools(req.tools)
    choice = check_tool_choice(req.tool_choice, req.tools)
    if req.tools is None or choice == "none":
        return req.tools, None  # the template still sees them, to read earlier calls
    parallel = req.parallel_tool_calls is not False
    if choice == "auto":
        if parser is None:
            return req.tools, None  # the model's output stays text
        return req.tools, ToolCalling(parser, parallel, strict=strict_calls(req.tools, parser, parallel),
                                      tools=req.tools)
    if req.continue_final_message:
        raise bad_request("tool_choice 'required' or a named function cannot continue the final message",
                          "tool_choice")
    offered = req.tools if choice == "required" else [t for t in req.tools if t["function"]["name"] == choice]
    key = arguments_key(parser)
    grammar = forced_calls(offered, key, single=choice != "required" or not parallel)
    return offered, ToolCalling(None, parallel, forced=grammar, tools=offered)


class ToolCallStream:
    """One choice's content in, (content, call deltas) out: the parser's
    events, a call's name in its first delta, its arguments' JSON text as
    the model writes it."""

    def __init__(self, calling: ToolCalling):
        # A forced choice's JSON array of calls is mistral's bare-array
        # format, which its parser reads under either arguments key.
        self.parser = None if calling.parser == HARMONY else ToolCallParser(calling.parser or "mistral",
                                                                             calling.tools)
        self.parallel = calling.parallel
        self.count = 0  # calls so far, the next one's index

    def feed(self, text: str, final: bool = False, found: list[CallDelta] | None = None
             ) -> tuple[str, list[CallDelta]]:
        """`found`: the deltas the Harmony reader found in this text."""
        content, deltas = text, found or []
        if self.parser is not None:
            content, deltas = self.parser.feed_events(text)
            if final:
                rest, more = self.parser.flush_events()
                content, deltas = content + rest, deltas + more
        if not self.parallel:
            deltas = [d for d in deltas if d[0] == 0]
        self.count = max([self.count] + [index + 1 for index, _, _ in deltas])
        return content, deltas


def whole_calls(deltas: list[CallDelta]) -> list[ToolCall]:
    """The calls a choice's deltas add up to, in index order."""
    calls: dict[int, list[str]] = {}
    for index, name, arguments in deltas:
        calls.setdefault(index, [name or "", ""])[1] += arguments
    return [new_call(*calls[i]) for i in sorted(calls)]
