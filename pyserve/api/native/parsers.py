"""SGLang's POST /parse_function_call and POST /separate_reasoning: the
server's tool-call and reasoning parsers run over a text the client holds
(a completion it parses itself, or output from elsewhere), answering as
the chat route would split that output."""

from __future__ import annotations

from typing import Any

import msgspec

from pyserve._rust import ReasoningSplitter, ToolCallParser
from pyserve.api.generation.serving import ServingContext
from pyserve.api.generation.tools import HARMONY, check_tools, whole_calls
from pyserve.api.openai.chat import REASONING_PARSERS
from pyserve.http.errors import bad_request


class ParseFunctionCallRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str
    tools: list[dict[str, Any]] = []  # OpenAI's tools: a call must name one, and tool_index is its place
    tool_call_parser: str | None = None  # default: the server's --tool-call-parser


class SeparateReasoningRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str
    reasoning_parser: str | None = None  # default: the server's --reasoning-parser


def _format(asked: str | None, served: str | None, param: str, flag: str) -> str:
    name = asked or served
    if name is None:
        raise bad_request(f"name a {param}: this server runs without {flag}", param)
    if name == HARMONY:  # its channels are read on the chat route, where the special tokens are kept
        raise bad_request(f"{param} {HARMONY} reads Harmony output on the chat routes only", param)
    return name


async def parse_function_call(ctx: ServingContext, req: ParseFunctionCallRequest) -> dict:
    """{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}:
    the text outside the calls, and each call's arguments as JSON text."""
    name = _format(req.tool_call_parser, ctx.tool_call_parser, "tool_call_parser", "--tool-call-parser")
    if req.tools:  # none given: any name is a call
        check_tools(req.tools)
    try:
        parser = ToolCallParser(name, req.tools or None)
    except ValueError as e:
        raise bad_request(str(e), "tool_call_parser") from None
    text, deltas = parser.feed_events(req.text)
    rest, more = parser.flush_events()
    places = {tool.get("function", {}).get("name"): i for i, tool in enumerate(req.tools)}
    return {"normal_text": text + rest,
            "calls": [{"tool_index": places.get(c.function.name, -1), "name": c.function.name,
                       "parameters": c.function.arguments} for c in whole_calls(deltas + more)]}


async def separate_reasoning(ctx: ServingContext, req: SeparateReasoningRequest) -> dict:
    """{"text", "reasoning_text"}: the content, and the reasoning block's text."""
    name = _format(req.reasoning_parser, ctx.reasoning_parser, "reasoning_parser", "--reasoning-parser")
    if name not in REASONING_PARSERS:
        raise bad_request(f"unknown reasoning_parser {name!r}: choose from {', '.join(REASONING_PARSERS)}",
                          "reasoning_parser")
    splitter = ReasoningSplitter(*REASONING_PARSERS[name])
    reasoning, content = splitter.feed(req.text)
    more_reasoning, more_content = splitter.flush()
    return {"text": content + more_content, "reasoning_text": reasoning + more_reasoning}
