"""Bodies of Anthropic's Messages API, as msgspec Structs: the request of
POST /v1/messages and /v1/messages/count_tokens, the Message it answers,
and the events of its stream.

The request refuses fields it does not declare (a 400 naming the field):
the API has many pyserve cannot honour (server tools, containers, MCP
servers...), and dropping one silently would answer another question.
Content blocks stay free JSON here: api/anthropic/input.py reads them, so
that an image or document block is refused by name, not as a bad tag.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# -- the request ---------------------------------------------------------------


class MessageParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str  # user, assistant (and system, as the SDK may send it)
    content: str | list[dict[str, Any]]


class ToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool the model must call
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    # Taken, not enforced on its own: thinking counts toward max_tokens (docs/api.md).
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class JSONOutputFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


Effort = Literal["low", "medium", "high", "xhigh", "max"]


class OutputConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: Effort | None = None
    format: JSONOutputFormat | None = None


class Metadata(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    user_id: str | None = None  # about the caller; changes nothing in the answer


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What makes the prompt: the body of /v1/messages/count_tokens, and
    the part of a /v1/messages body that is not about sampling."""

    model: str | None = None
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None  # a string or text blocks
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # accepted and ignored: the prefix cache is automatic


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    # Not named arguments of the current SDK; honoured when a client puts them in the body.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: changes nothing
    # SGLang's and vLLM's, as on chat: the request's priority (with
    # --enable-priority-scheduling) and the salt of the prefixes it shares.
    priority: int | None = None
    cache_salt: str | None = None


# -- the Message -----------------------------------------------------------------


class TextBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str
    citations: None = None


class ThinkingBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""  # pyserve signs nothing; a thinking block sent back is read as it is


class ToolUseBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(msgspec.Struct, kw_only=True):
    """Anthropic's counts: input_tokens are the prompt tokens not read from
    the prefix cache, cache_read_input_tokens those that were."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    content: list[ContentBlock] = msgspec.field(default_factory=list)
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(msgspec.Struct, kw_only=True):
    input_tokens: int


# -- stream events ---------------------------------------------------------------
# Each event carries its `type`, which also names its SSE frame (`event: ...`).


class TextDelta(msgspec.Struct, kw_only=True):
    type: str = "text_delta"
    text: str


class ThinkingDelta(msgspec.Struct, kw_only=True):
    type: str = "thinking_delta"
    thinking: str


class InputJSONDelta(msgspec.Struct, kw_only=True):
    type: str = "input_json_delta"
    partial_json: str


class MessageStart(msgspec.Struct, kw_only=True):
    type: str = "message_start"
    message: Message


class Ping(msgspec.Struct, kw_only=True):
    type: str = "ping"


class ContentBlockStart(msgspec.Struct, kw_only=True):
    type: str = "content_block_start"
    index: int
    content_block: ContentBlock


class ContentBlockDelta(msgspec.Struct, kw_only=True):
    type: str = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJSONDelta


class ContentBlockStop(msgspec.Struct, kw_only=True):
    type: str = "content_block_stop"
    index: int


class StopDelta(msgspec.Struct, kw_only=True):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDelta(msgspec.Struct, kw_only=True):
    type: str = "message_delta"
    delta: StopDelta
    usage: Usage  # totals, which overwrite message_start's


class MessageStop(msgspec.Struct, kw_only=True):
    type: str = "message_stop"
