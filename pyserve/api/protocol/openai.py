"""Request and response bodies of the OpenAI and native routes, as msgspec Structs.

Requests: an unknown field is a 400 naming it (a setting this server
does not honour is never silently dropped); the metadata fields that
change nothing in the output are declared, on NO_OP_FIELDS. /generate's
body is in api/protocol/native.py. Fields are typed, so a wrongly typed
value is a 400 naming it. Objects stay free where their content is free
JSON (a JSON schema, a structural tag's format, chat_template_kwargs) or
is checked in code with OpenAI's own messages: `tools` (api/tools.py)
and vLLM's structured_outputs (api/constraints.py).

Responses mirror SGLang's shapes field for field, nulls included (the
openai client reads `logprobs: null`, `matched_stop: null`...). A field
that must be absent rather than null is typed `... | UnsetType = UNSET`:
msgspec never encodes UNSET.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


# -- logprobs (built by api/generation/logprobs.py) ---------------------------

class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (None for the first, which nothing
# scores), the token's own entry and its alternatives', keyed by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]



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


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's name for reasoning_content


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage so far on every chunk


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


# Accepted and documented as changing nothing in the output (docs/api.md).
NO_OP_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
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
    allowed_token_ids: list[int] | None = None  # vLLM: only these may be sampled
    bad_words: list[str] | None = None  # vLLM: words never written (each as the tokenizer spells it)
    # NO_OP_FIELDS: metadata about the caller, for OpenAI's own records
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    logprobs: bool | int | None = None  # chat: bool; completions: how many alternatives
    top_logprobs: int | None = None
    # SGLang / vLLM extensions, sent through the client's extra_body. The
    # sampling settings left None take the model's defaults (api/generation/sampling.py).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: str | None = None
    min_tokens: int = 0  # vLLM / SGLang: EOS and stop token ids masked until this many tokens
    stop_regex: str | list[str] | None = None  # SGLang: stops that are regular expressions
    # The matched stop string or stop token's text stays in the output: SGLang's and vLLM's names.
    no_stop_trim: bool = False
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM: prompt_token_ids and each choice's token_ids
    # SGLang: each choice's hidden_states (with --enable-return-hidden-states; generation.hidden_states).
    return_hidden_states: bool = False
    prompt_logprobs: int | None = None  # vLLM: the prompt's logprobs, with this many alternatives
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens read "token_id:N"
    truncate_prompt_tokens: int | None = None  # vLLM: keep the prompt's last k tokens (-1: the context's worth)
    # SGLang / vLLM: larger runs first, on a server with --enable-priority-scheduling (refused elsewhere).
    priority: int | None = None
    # SGLang / vLLM: cached prefixes are shared only with requests of the same salt.
    cache_salt: str | None = None
    # SGLang: the LoRA adapter, by name (with --enable-lora; vLLM's way is `model`).
    lora_path: str | None = None
    # SGLang: a custom logit processor and what it reads (with --enable-custom-logit-processor).
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None
    # Structured outputs: OpenAI's, SGLang's (a JSON string, a regex, a GBNF
    # grammar) and vLLM's object; see api/constraints.py.
    response_format: ResponseFormat | None = None
    json_schema: str | dict[str, Any] | None = None  # JSON text, or the schema itself
    regex: str | None = None
    ebnf: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's {"json" | "regex" | "choice" | ...: ...}
    # vLLM's earlier names of the same: guided_json is structured_outputs.json, and so on.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # xgrammar or auto: the one backend there is
    guided_whitespace_pattern: str | None = None  # refused: xgrammar takes JSON's own whitespace


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | ToolChoice | None = None  # "none" | "auto" | "required", or a named function
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    continue_final_message: bool = False
    add_generation_prompt: bool = True  # vLLM / SGLang: false ends the prompt after the final message
    echo: bool = False  # vLLM: the answer starts with the final assistant message it continues
    reasoning_effort: str | None = None  # "none" turns the template's thinking off; see api/chat.py


class CompletionRequest(SamplingFields, kw_only=True):
    # Text, texts, token ids or token id lists. msgspec takes one array type
    # per union, so the items are typed and serving.prompt_id_lists refuses a mix.
    prompt: str | list[str | int | list[int]] | None = None
    # vLLM's (with --enable-prompt-embeds): prompts as embeddings, base64 of torch.save'd [tokens, hidden] tensors.
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16  # the legacy API's default (OpenAI, SGLang, vLLM)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# -- responses ---------------------------------------------------------------
# Field order is SGLang's, so bodies read the same.


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Chat with a --reasoning-parser: the reasoning's share of completion_tokens.
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class FunctionCallDelta(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET  # in a call's first delta only
    arguments: str = ""  # JSON text to append to the call's arguments


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """A piece of a streamed tool call, as OpenAI streams them: the first
    delta of call `index` carries its id, type and name, and every delta
    some of its arguments' JSON text."""

    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: FunctionCallDelta


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
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids
    hidden_states: list[float] | UnsetType = UNSET  # return_hidden_states


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids


class Delta(msgspec.Struct, kw_only=True):
    """A streamed message delta: only what this chunk adds, and always
    `reasoning_content` (null when it adds none), as SGLang sends it."""

    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET
    hidden_states: list[float] | UnsetType = UNSET  # return_hidden_states: on a choice's finish chunk


class ChatStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids: this chunk's tokens


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    # On the final usage chunk; on every chunk with continuous_usage_stats.
    usage: Usage | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids: on the first chunk


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET
    # return_token_ids (streamed: the prompt's on a choice's first chunk, then each chunk's tokens)
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET
    hidden_states: list[float] | UnsetType = UNSET  # return_hidden_states (streamed: on the finish chunk)


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
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
