"""Bodies of OpenAI's Responses API, as msgspec Structs: the request, the
conversation items (what `input` holds and what `output` returns), the
Response object, and what is stored of a response.

The request refuses fields it does not declare (a 400 naming the field):
the Responses API has many that pyserve cannot honour (built-in tools,
conversations, prompt templates...), and dropping one silently would
answer a different question than the one asked. Items and content parts
are tagged unions on their `type`, as OpenAI writes them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# -- conversation items --------------------------------------------------------


class InputText(msgspec.Struct, kw_only=True, tag_field="type", tag="input_text"):
    text: str


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class Refusal(msgspec.Struct, kw_only=True, tag_field="type", tag="refusal"):
    refusal: str


class ReasoningText(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class SummaryText(msgspec.Struct, kw_only=True, tag_field="type", tag="summary_text"):
    text: str


ContentPart = InputText | OutputText | Refusal


class Message(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: str  # user, assistant, system, developer
    content: list[ContentPart]
    status: str = "completed"


class FunctionCall(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it
    status: str = "completed"


class FunctionCallOutput(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call_output"):
    id: str
    call_id: str
    output: str
    status: str = "completed"


class Reasoning(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[SummaryText] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    encrypted_content: None = None
    status: str = "completed"


Item = Message | FunctionCall | FunctionCallOutput | Reasoning


# -- the request ---------------------------------------------------------------


class TextFormatText(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="text"):
    pass


class TextFormatJSONObject(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type",
                           tag="json_object"):
    pass


class TextFormatJSONSchema(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type",
                           tag="json_schema"):
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


TextFormat = TextFormatText | TextFormatJSONObject | TextFormatJSONSchema


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat = msgspec.field(default_factory=TextFormatText)
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    # A string, or a list of items; read by api/responses/input.py, which
    # names the item and field that is wrong.
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # SGLang's and vLLM's, as on chat: the request's priority (with
    # --enable-priority-scheduling) and the salt of the prefixes it shares.
    priority: int | None = None
    cache_salt: str | None = None
    # SGLang's and vLLM's sampling extras on this route, as on chat.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None


# -- the Response object -------------------------------------------------------


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
ACTIVE = ("queued", "in_progress")  # statuses of a response still running


class Response(msgspec.Struct, kw_only=True):
    """The Response object, field for field as OpenAI returns it (those
    pyserve can fill)."""

    id: str
    object: str = "response"
    created_at: int
    status: ResponseStatus
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[Item] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    reasoning: ReasoningConfig = msgspec.field(default_factory=ReasoningConfig)
    safety_identifier: str | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float | None = None
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_logprobs: int = 0
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    completed_at: int | None = None


class StoredResponse(msgspec.Struct, kw_only=True):
    """What `store` keeps: the Response, and the conversation items it
    answered (the previous responses' items, then its own input), which
    `previous_response_id` continues and `input_items` lists."""

    response: Response
    input: list[Item]

    @property
    def id(self) -> str:
        return self.response.id
