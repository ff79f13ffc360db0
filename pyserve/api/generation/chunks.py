"""Reading the chat route's streamed chunks, as the routes built on it (the
Responses API, Anthropic's Messages API) turn them into their own events."""

from __future__ import annotations

from collections.abc import Callable

from msgspec import UNSET

from pyserve.api.protocol.openai import ChatCompletionChunk, ChatStreamChoice


def given(value) -> bool:
    """Whether a chunk's field was sent: neither None nor left unset."""
    return value is not None and value is not UNSET


def delta_events(chunk: ChatCompletionChunk, reasoning: Callable[[str], list], text: Callable[[str], list],
                 call: Callable[[object], list]) -> list:
    """The events of each delta in `chunk`, in order: `reasoning` and `text`
    take the non-empty reasoning and answer text, `call` each tool call delta."""
    events = []
    for choice in chunk.choices:
        delta = choice.delta
        if given(delta.reasoning_content) and delta.reasoning_content:
            events += reasoning(delta.reasoning_content)
        if given(delta.content) and delta.content:
            events += text(delta.content)
        for tool_call in delta.tool_calls if given(delta.tool_calls) else ():
            events += call(tool_call)
    return events


def finished(chunk: ChatCompletionChunk) -> ChatStreamChoice | None:
    """The last choice of `chunk` that carries a finish reason, if any."""
    return next((c for c in reversed(chunk.choices) if c.finish_reason is not None), None)
