"""A Messages API request read into the chat route's request.

Anthropic's Messages API is served as a translation onto
/v1/chat/completions, not a second generation path: `system` becomes a
system message, text blocks message text, an assistant's `tool_use` blocks
its tool calls and its `thinking` blocks its reasoning_content, `tool_result`
blocks tool messages; `tools` become function tools, `tool_choice` chat's
("any" is "required"), `output_config.format` a json_schema response_format
(so structured outputs go through the same engine), `output_config.effort`
and `thinking` chat's reasoning_effort and the template's thinking switch.
A final assistant message is a prefill: the answer continues it. What
cannot be honoured is a 400 naming it: images, documents, server tools,
encrypted thinking.
"""

from __future__ import annotations

import json
from typing import Any

from pyserve.api.protocol.anthropic import CountTokensRequest, MessagesRequest
from pyserve.api.protocol.openai import (
    ChatCompletionRequest, ChatMessage, ContentPart, HistoryFunctionCall, HistoryToolCall, ResponseFormat,
    StreamOptions, ToolChoice, ToolChoiceFunction,
)
from pyserve.http.errors import APIError, bad_request

_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict"}
# The keys each content block may have (cache_control is accepted and ignored).
_BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control", "caller"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
}
# Output effort onto chat's reasoning_effort, whose top is "high".
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def unsupported(param: str, what: str, why: str) -> APIError:
    return bad_request(f"{param}: {what} is not supported: {why}", param)


def _string(obj: dict, key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: " + ("Field required" if value is None else "must be a string"),
                          f"{where}.{key}")
    return value


# -- content blocks --------------------------------------------------------------


def _blocks(content: str | list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Content as checked blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type")
        if kind == "redacted_thinking":
            raise unsupported(f"{at}.type", "a redacted_thinking block", "pyserve cannot read encrypted thinking")
        if kind not in _BLOCK_KEYS:
            raise unsupported(f"{at}.type", f"a content block of type {kind!r}", "pyserve serves text models with "
                              "client tools: text, tool_use, tool_result and thinking blocks")
        extra = sorted(set(block) - _BLOCK_KEYS[kind])
        if extra:
            raise unsupported(f"{at}.{extra[0]}", f"the {kind} block field {extra[0]!r}", "pyserve does not serve it")
        if kind == "text":
            _string(block, "text", at)
            if block.get("citations"):
                raise unsupported(f"{at}.citations", "citations", "pyserve serves no documents to cite")
        elif kind == "tool_use":
            _string(block, "id", at)
            _string(block, "name", at)
            if not isinstance(block.get("input"), dict):
                raise bad_request(f"{at}.input: must be an object", f"{at}.input")
            caller = block.get("caller")
            if caller is not None and (not isinstance(caller, dict) or caller.get("type") != "direct"):
                raise unsupported(f"{at}.caller", "a tool call made by a server tool", "pyserve runs no server tools")
        elif kind == "tool_result":
            _string(block, "tool_use_id", at)
        else:
            _string(block, "thinking", at)
    return content


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    """The text of text blocks, joined as chat joins text parts."""
    for j, block in enumerate(blocks):
        if block.get("type") != "text":
            raise unsupported(f"{where}[{j}].type", f"a block of type {block.get('type')!r} here",
                              "only text blocks may be given here")
    return "\n".join(block["text"] for block in blocks if block["text"])


def _parts(blocks: list[dict[str, Any]]) -> list[ContentPart]:
    return [ContentPart(type="text", text=block["text"]) for block in blocks]


def _tool_result(block: dict[str, Any], where: str) -> ChatMessage:
    content = block.get("content", "")
    if isinstance(content, list):
        content = _text(_blocks(content, f"{where}.content"), f"{where}.content")
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content: must be a string or a list of text blocks", f"{where}.content")
    if block.get("is_error"):
        content = f"Error: {content}"  # chat's tool messages have no error flag: the text says it
    return ChatMessage(role="tool", tool_call_id=block["tool_use_id"], content=content)


def _user_turns(blocks: list[dict[str, Any]], where: str, calls: set[str]) -> list[ChatMessage]:
    """A user message: its tool results as tool messages, its text blocks
    (in order, consecutive ones together) as user messages."""
    turns: list[ChatMessage] = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "tool_result":
            if block["tool_use_id"] not in calls:
                raise bad_request(f"{where}[{j}].tool_use_id: no tool_use block with id {block['tool_use_id']!r} "
                                  "precedes this tool_result", f"{where}[{j}].tool_use_id")
            turns.append(_tool_result(block, f"{where}[{j}]"))
        elif kind == "text":
            if turns and turns[-1].role == "user":
                turns[-1].content.append(ContentPart(type="text", text=block["text"]))
            else:
                turns.append(ChatMessage(role="user", content=_parts([block])))
        else:
            raise unsupported(f"{where}[{j}].type", f"a {kind} block in a user message", "the assistant writes those")
    return turns


def _assistant_turn(blocks: list[dict[str, Any]], where: str, calls: set[str]) -> ChatMessage:
    """An assistant message: its text, its tool calls, its thinking as reasoning_content."""
    texts, tool_calls, thinking = [], [], []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            texts.append(block)
        elif kind == "tool_use":
            calls.add(block["id"])
            arguments = json.dumps(block["input"], ensure_ascii=False)
            tool_calls.append(HistoryToolCall(id=block["id"], function=HistoryFunctionCall(name=block["name"],
                                                                                            arguments=arguments)))
        elif kind == "thinking":
            thinking.append(block["thinking"])
        else:
            raise unsupported(f"{where}[{j}].type", f"a {kind} block in an assistant message", "the user sends those")
    return ChatMessage(role="assistant", content=_parts(texts) if texts or not tool_calls else None,
                       tool_calls=tool_calls or None, reasoning_content="\n".join(thinking) or None)


def chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    messages = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else _text(_blocks(req.system, "system"), "system")
        messages.append(ChatMessage(role="system", content=system))
    if not req.messages:
        raise bad_request("messages: at least one message is required", "messages")
    calls: set[str] = set()  # ids of the tool calls made so far
    for i, message in enumerate(req.messages):
        where = f"messages[{i}].content"
        blocks = _blocks(message.content, where)
        if message.role == "user":
            messages += _user_turns(blocks, where, calls)
        elif message.role == "assistant":
            messages.append(_assistant_turn(blocks, where, calls))
        elif message.role == "system":
            messages.append(ChatMessage(role="system", content=_text(blocks, where)))
        else:
            raise bad_request(f"messages[{i}].role: must be 'user' or 'assistant'", f"messages[{i}].role")
    return messages


# -- tools, thinking, output -----------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Client tools (`{name, description, input_schema}`) as chat's function tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise unsupported(f"tools[{i}].type", f"the server tool {kind!r}", "pyserve runs client tools only")
        extra = sorted(set(tool) - _TOOL_KEYS)
        if extra:
            raise unsupported(f"tools[{i}].{extra[0]}", f"the tool field {extra[0]!r}", "pyserve does not serve it")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools[{i}].input_schema: Field required (a JSON schema object)",
                              f"tools[{i}].input_schema")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(req: CountTokensRequest) -> tuple[str | ToolChoice | None, bool | None]:
    """(chat's tool_choice, its parallel_tool_calls)."""
    choice = req.tool_choice
    if choice is None:
        return None, None
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request("tool_choice.name: Field required", "tool_choice.name")
        chat_choice = ToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
    else:
        chat_choice = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return chat_choice, False if choice.disable_parallel_tool_use else None


def reasoning(req: CountTokensRequest) -> tuple[str | None, dict | None]:
    """(chat's reasoning_effort, chat_template_kwargs): thinking disabled
    is effort "none" (the template's thinking switch off); an effort is
    chat's; thinking enabled without one only turns the switch on."""
    thinking = req.thinking.type if req.thinking is not None else None
    if thinking == "disabled":
        return "none", None
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None:
        return _EFFORTS[effort], None
    if thinking is not None:
        return None, {"enable_thinking": True, "thinking": True}
    return None, None


def _response_format(req: CountTokensRequest) -> ResponseFormat | None:
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return None
    return ResponseFormat(type="json_schema", json_schema={"name": "output", "schema": fmt.schema, "strict": True})


def chat_request(req: CountTokensRequest, rid: str | None = None) -> ChatCompletionRequest:
    """The chat request that answers `req`; a MessagesRequest's is streamed
    with usage on every chunk (the Message and its events are read from
    the chunks, message_start's input_tokens from the first)."""
    tool_choice, parallel = chat_tool_choice(req)
    effort, template_kwargs = reasoning(req)
    messages = chat_messages(req)
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        if req.max_tokens < 1:
            raise bad_request("max_tokens: must be at least 1", "max_tokens")
        if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
            raise bad_request("temperature: must be between 0 and 1", "temperature")
        fields = dict(max_completion_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, stop=req.stop_sequences, rid=rid, stream=True,
                      priority=req.priority, cache_salt=req.cache_salt,
                      stream_options=StreamOptions(include_usage=True, continuous_usage_stats=True))
    return ChatCompletionRequest(
        model=req.model, messages=messages, tools=chat_tools(req.tools), tool_choice=tool_choice,
        parallel_tool_calls=parallel, response_format=_response_format(req), reasoning_effort=effort,
        chat_template_kwargs=template_kwargs, continue_final_message=messages[-1].role == "assistant", **fields,
    )


# Chat's parameter names, as the Messages request calls them.
_PARAMS = (("max_completion_tokens", "max_tokens"), ("max_new_tokens", "max_tokens"), ("stop", "stop_sequences"),
           ("reasoning_effort", "output_config.effort"), ("response_format.json_schema", "output_config.format"),
           ("response_format", "output_config.format"), ("parallel_tool_calls", "tool_choice"),
           ("tool_choice.function", "tool_choice"))


def messages_error(err: APIError) -> APIError:
    """A chat route's error, its parameter named as the Messages request names it."""
    param = err.param
    if param is not None:
        if param.startswith("messages"):
            param = "messages"  # chat's messages are not numbered as Anthropic's
        for chat_name, name in _PARAMS:
            if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
                param = name + param[len(chat_name):]
                break
        if param.startswith("tools[") and ".function." in param:
            param = param.replace(".function.parameters", ".input_schema").replace(".function.", ".")
    message = err.message.replace("max_completion_tokens", "max_tokens").replace("response_format", "output_config")
    return APIError(message, err.status, err.type, param, err.code)
