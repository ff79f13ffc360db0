"""Request bodies of the OpenAI and native routes, as msgspec Structs.

Unknown fields are ignored, as OpenAI-compatible servers do. Fields whose
JSON shape varies (a completion prompt, SGLang's sampling_params) are
decoded loosely and checked in code, with a clear message.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


class SamplingFields(msgspec.Struct, kw_only=True):
    """Sampling settings shared by chat and completions (OpenAI + SGLang extras)."""

    model: str | None = None
    max_tokens: int | None = None
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
    logprobs: Any = None
    top_logprobs: int | None = None
    # SGLang / vLLM extensions, sent through the client's extra_body
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    continue_final_message: bool = False


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class NativeGenerateRequest(msgspec.Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: Any = None  # list[int] | list[list[int]]
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | None = None
