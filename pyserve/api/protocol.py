"""Request and response bodies of the OpenAI and native routes, as msgspec Structs.

Requests: unknown fields are ignored, as OpenAI-compatible servers do
(/generate's body, in generate_protocol.py, is stricter). Fields are
typed, so a wrongly typed value is a 400 naming it. Objects stay free
where their content is free JSON (a JSON schema, a structural tag's
format, chat_template_kwargs) or is checked in code with OpenAI's own
messages: `tools` (api/tools.py) and vLLM's structured_outputs
(api/constraints.py).

Responses mirror SGLang's shapes field for field, nulls included (the
openai client reads `logprobs: null`, `matched_stop: null`...). A field
that must be absent rather than null is typed `... | UnsetType = UNSET`:
msgspec never encodes UNSET.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from pyserve.api.logprobs import ChatLogprobs, CompletionLogprobs

# -- requests ----------------------------------------------------------------


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class HistoryFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] | None | UnsetType = UNSET  # JSON text (some clients send the object)


class HistoryToolCall(msgspec.Struct, kw_only=True):
    """A call of an earlier assistant turn, sent back in `messages`."""

    id: str | UnsetType = UNSET
    type: str = "function"
    function: HistoryFunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"}
    # SGLang's structural tag: xgrammar's `format`, or the legacy `structures` + `triggers`
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class ToolChoice(msgspec.Struct, kw_only=True):
    """A named function the model must call: {"type": "function", "function": {"name"}}."""

    type: str
    function: ToolChoiceFunction


class SamplingFields(msgspec.Struct, kw_only=True):
    """Sampling settings shared by chat and completions (OpenAI + SGLang extras)."""

    model: str | None = None
    max_tokens: int | None = None  # None: up to the context length
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    logprobs: bool | int | None = None  # chat: bool; completions: how many alternatives
    top_logprobs: int | None = None
    # SGLang / vLLM extensions, sent through the client's extra_body
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: str | None = None
    # Structured outputs: OpenAI's, SGLang's (a JSON string, a regex, a GBNF
    # grammar) and vLLM's object; see api/constraints.py.
    response_format: ResponseFormat | None = None
    json_schema: str | dict[str, Any] | None = None  # JSON text, or the schema itself
    regex: str | None = None
    ebnf: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's {"json" | "regex" | "choice" | ...: ...}


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | ToolChoice | None = None  # "none" | "auto" | "required", or a named function
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    continue_final_message: bool = False


class CompletionRequest(SamplingFields, kw_only=True):
    # Text, texts, token ids or token id lists. msgspec takes one array type
    # per union, so the items are typed and serving.prompt_id_lists refuses a mix.
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # the legacy API's default (OpenAI, SGLang, vLLM)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# -- responses ---------------------------------------------------------------
# Field order is SGLang's, so bodies read the same.


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """A streamed tool call. pyserve sends each call whole, in one delta,
    once the model finished writing it."""

    index: int
    id: str
    type: str = "function"
    function: FunctionCall


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    matched_stop: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(msgspec.Struct, kw_only=True):
    """A streamed message delta: only what this chunk adds."""

    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | UnsetType = UNSET  # only on the final usage chunk


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A whole completion, or (usage unset until the last) one streamed chunk."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | UnsetType = UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "pyserve"
    root: str
    parent: None = None
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
