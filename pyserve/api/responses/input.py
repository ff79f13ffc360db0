"""A Responses API request read into the chat route's request.

The Responses API is served as a translation onto /v1/chat/completions,
not a second generation path: `input` (a string or a list of items) after
the stored conversation of `previous_response_id` becomes chat messages,
`instructions` a system message, function tools chat tools, `text.format`
a response_format (so structured outputs go through the same engine), and
`max_output_tokens` max_completion_tokens. What cannot be honoured is a
400 naming it: images and files, built-in tools, encrypted reasoning.
reasoning.effort is chat's reasoning_effort (the template's thinking switch).
"""

from __future__ import annotations

from typing import Any

from pyserve.http.errors import APIError, bad_request
from pyserve.api.protocol.openai import (
    ChatCompletionRequest, ChatMessage, ContentPart, ResponseFormat, StreamOptions, ToolChoice, ToolChoiceFunction,
)
from pyserve.api.protocol.responses import (
    FunctionCall, FunctionCallOutput, InputText, Item, Message, OutputText, Reasoning, ReasoningText, Refusal,
    ResponsesRequest, SummaryText, TextFormatJSONObject, TextFormatJSONSchema,
)
from pyserve.api.generation.serving import new_id

_ROLES = ("user", "assistant", "system", "developer")
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_MAX_METADATA = 16


def unsupported(param: str, what: str, why: str = "") -> APIError:
    """A 400 for something pyserve's Responses API cannot honour."""
    return bad_request(f"{what} is not supported" + (f": {why}" if why else ""), param, "unsupported_parameter")


def _string(obj: dict, key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise bad_request(f"'{where}.{key}' must be a string", f"{where}.{key}",
                          "missing_required_parameter" if value is None else "invalid_type")
    return value


# -- what the request asks for -------------------------------------------------


def check_supported(req: ResponsesRequest) -> None:
    """Refuse the declared fields whose value pyserve cannot honour."""
    if req.reasoning is not None:
        if req.reasoning.summary is not None or req.reasoning.generate_summary is not None:
            raise unsupported("reasoning.summary", "a reasoning summary", "reasoning items carry the reasoning text")
    if req.text is not None and req.text.verbosity is not None:
        raise unsupported("text.verbosity", "text.verbosity")
    if req.include:
        raise unsupported("include", f"include {req.include!r}")
    if req.truncation not in (None, "disabled"):
        raise unsupported("truncation", f"truncation {req.truncation!r}")
    if req.service_tier not in (None, "auto", "default"):
        raise unsupported("service_tier", f"service_tier {req.service_tier!r}")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "top_logprobs")
    if req.max_tool_calls is not None and req.max_tool_calls < 0:
        # It caps calls to built-in tools, which pyserve does not run: any cap holds.
        raise bad_request("max_tool_calls must not be negative", "max_tool_calls")
    if req.stream_options is not None:
        if not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if req.stream_options.include_obfuscation:
            raise unsupported("stream_options.include_obfuscation", "stream obfuscation")
    if req.background:
        if req.stream:
            raise unsupported("background", "streaming a background response", "poll GET /v1/responses/{id}")
        if req.store is False:
            raise bad_request("background responses must be stored: drop store=false", "store")
    if req.metadata is not None and len(req.metadata) > _MAX_METADATA:
        raise bad_request(f"metadata holds at most {_MAX_METADATA} pairs", "metadata")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request("max_output_tokens must be at least 1", "max_output_tokens")


# -- input items ---------------------------------------------------------------


def read_input(value: Any) -> list[Item]:
    """The request's `input` as conversation items, ids given where missing."""
    if isinstance(value, str):
        return [Message(id=new_id("msg_"), role="user", content=[InputText(text=value)])]
    if not value:
        raise bad_request("input must be a non-empty string or list of items", "input",
                          "missing_required_parameter" if value is None else "empty_array")
    return [_item(raw, f"input[{i}]") for i, raw in enumerate(value)]


def _item(raw: Any, where: str) -> Item:
    if not isinstance(raw, dict):
        raise bad_request(f"'{where}' must be an object", where, "invalid_type")
    kind = raw.get("type", "message")  # a message may leave its type out
    given_id = raw.get("id")
    if given_id is not None and not isinstance(given_id, str):
        raise bad_request(f"'{where}.id' must be a string", f"{where}.id", "invalid_type")
    if kind == "message":
        role = raw.get("role")
        if role not in _ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(_ROLES)}", f"{where}.role", "invalid_value")
        return Message(id=given_id or new_id("msg_"), role=role,
                       content=_content(raw.get("content"), role, f"{where}.content"))
    if kind == "function_call":
        return FunctionCall(id=given_id or new_id("fc_"), call_id=_string(raw, "call_id", where),
                            name=_string(raw, "name", where), arguments=_string(raw, "arguments", where))
    if kind == "function_call_output":
        return FunctionCallOutput(id=given_id or new_id("fco_"), call_id=_string(raw, "call_id", where),
                                  output=_output_text(raw.get("output"), f"{where}.output"))
    if kind == "reasoning":
        if raw.get("encrypted_content") is not None:
            raise unsupported(f"{where}.encrypted_content", "encrypted reasoning")
        return Reasoning(id=given_id or new_id("rs_"),
                         summary=[SummaryText(text=t) for t in _texts(raw.get("summary"), f"{where}.summary")],
                         content=[ReasoningText(text=t) for t in _texts(raw.get("content"), f"{where}.content")])
    raise unsupported(f"{where}.type", f"input item type {kind!r}", "pyserve takes message, function_call, "
                                                                   "function_call_output and reasoning items")


def _content(value: Any, role: str, where: str) -> list:
    """Message content as text parts: input_text for the client's roles,
    output_text for the assistant's (which is how it comes back as input)."""
    part_type = OutputText if role == "assistant" else InputText
    if isinstance(value, str):
        return [part_type(text=value)]
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or a list of content parts", where,
                          "missing_required_parameter" if value is None else "invalid_type")
    parts = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append(part_type(text=_string(part, "text", at)))
        elif kind == "refusal":
            parts.append(Refusal(refusal=_string(part, "refusal", at)))
        else:
            raise unsupported(f"{at}.type", f"content of type {kind!r}",
                              "pyserve serves text models: input_text and output_text only")
    return parts


def _output_text(value: Any, where: str) -> str:
    """A function call's output: a string, or input_text parts (joined)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or a list of input_text parts", where, "invalid_type")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "input_text":
            raise unsupported(f"{where}[{j}].type", f"function call output of type {kind!r}")
        texts.append(_string(part, "text", f"{where}[{j}]"))
    return "\n".join(texts)


def _texts(value: Any, where: str) -> list[str]:
    """The texts of a reasoning item's summary or content parts."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(part, dict) for part in value):
        raise bad_request(f"'{where}' must be a list of parts", where, "invalid_type")
    return [_string(part, "text", f"{where}[{j}]") for j, part in enumerate(value)]


def check_call_outputs(items: list[Item], first_new: int) -> None:
    """Each function_call_output the request sends answers a call made before it."""
    calls: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, FunctionCall):
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutput) and item.call_id not in calls:
            where = f"input[{i - first_new}].call_id" if i >= first_new else "previous_response_id"
            raise bad_request(f"no function_call with call_id {item.call_id!r} precedes this output", where,
                              "invalid_value")


# -- the chat request ----------------------------------------------------------


def _part_text(part) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


def chat_messages(instructions: str | None, items: list[Item]) -> list[ChatMessage]:
    """Items as chat turns: an assistant's text and function calls make one
    turn, reasoning goes into the next assistant turn's reasoning_content,
    and the developer role is the system role chat templates know."""
    messages = [ChatMessage(role="system", content=instructions)] if instructions else []
    reasoning: list[str] = []

    def new_turn(content) -> ChatMessage:
        turn = ChatMessage(role="assistant", content=content, reasoning_content="\n".join(reasoning) or None)
        reasoning.clear()
        messages.append(turn)
        return turn

    def open_turn() -> ChatMessage | None:
        """The assistant turn a call or text continues: the last message,
        when it is the assistant's and no reasoning came since."""
        last = messages[-1] if messages else None
        return last if last is not None and last.role == "assistant" and not reasoning else None

    for item in items:
        if isinstance(item, Reasoning):
            reasoning.extend(part.text for part in item.content or item.summary)
        elif isinstance(item, FunctionCall):
            turn = open_turn() or new_turn(None)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            turn.tool_calls = [*(turn.tool_calls or []), call]
        elif isinstance(item, Message) and item.role == "assistant":
            text = [ContentPart(type="text", text=_part_text(p)) for p in item.content]
            turn = open_turn()
            if turn is not None and turn.content is None:
                turn.content = text  # the turn's calls came first
            else:
                new_turn(text)
        else:
            if reasoning:
                new_turn("")  # a turn that only reasoned
            if isinstance(item, FunctionCallOutput):
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
            else:
                role = "system" if item.role == "developer" else item.role
                messages.append(ChatMessage(role=role, content=[ContentPart(type="text", text=_part_text(p))
                                                                for p in item.content]))
    if reasoning:
        new_turn("")
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools (`{type, name, parameters...}`) in chat's shape."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(f"tools[{i}].type", f"tool type {kind!r}", "pyserve runs function tools only")
        extra = sorted(set(tool) - _TOOL_KEYS)
        if extra:
            raise unsupported(f"tools[{i}].{extra[0]}", f"the function tool field {extra[0]!r}")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}})
    return out


def chat_tool_choice(choice: str | dict | None, tools: list[dict] | None) -> tuple[Any, list[dict] | None]:
    """(chat's tool_choice, the tools it offers): `allowed_tools` narrows the tools."""
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        name = _string(choice, "name", "tool_choice")
        return ToolChoice(type="function", function=ToolChoiceFunction(name=name)), tools
    if kind == "allowed_tools":
        allowed = choice.get("tools")
        if not isinstance(allowed, list) or not all(isinstance(t, dict) for t in allowed):
            raise bad_request("tool_choice.tools must be a list of tools", "tool_choice.tools", "invalid_type")
        names = {t.get("name") for t in allowed}
        return choice.get("mode", "auto"), [t for t in tools or [] if t["function"]["name"] in names] or None
    raise unsupported("tool_choice.type", f"tool_choice of type {kind!r}")


def chat_response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJSONObject):
        return ResponseFormat(type="json_object")
    if isinstance(fmt, TextFormatJSONSchema):
        schema = {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict, "description": fmt.description}
        return ResponseFormat(type="json_schema", json_schema=schema)
    return None


def chat_request(req: ResponsesRequest, items: list[Item], rid: str) -> ChatCompletionRequest:
    """The chat request that answers `req`, streamed with usage (both the
    streamed and the whole response are read from its chunks)."""
    tool_choice, tools = chat_tool_choice(req.tool_choice, chat_tools(req.tools))
    return ChatCompletionRequest(
        model=req.model, messages=chat_messages(req.instructions, items), rid=rid,
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        tools=tools, tool_choice=tool_choice, parallel_tool_calls=req.parallel_tool_calls,
        response_format=chat_response_format(req), user=req.user,
        reasoning_effort=req.reasoning and req.reasoning.effort, priority=req.priority, cache_salt=req.cache_salt,
        stream=True, stream_options=StreamOptions(include_usage=True),
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty, top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop,
    )


# Chat's parameter names, as the Responses request calls them.
_PARAMS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
           ("reasoning_effort", "reasoning.effort"), ("response_format.json_schema", "text.format"),
           ("response_format", "text.format"))


def responses_error(err: APIError) -> APIError:
    """A chat route's error, its parameter named as the Responses request names it."""
    param = err.param
    if param is not None:
        for chat_name, name in _PARAMS:
            if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
                param = name + param[len(chat_name):] if name != "input" else name
                break
        if param.startswith("tools[") and ".function." in param:
            param = param.replace(".function.", ".", 1)
        elif param.startswith("tool_choice.function."):
            param = param.replace(".function.", ".", 1)
    message = err.message.replace("max_completion_tokens", "max_output_tokens")
    return APIError(message, err.status, err.type, param, err.code)
