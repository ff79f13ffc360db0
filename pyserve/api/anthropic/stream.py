"""A Message built from the chat route's streamed chunks, and the Messages
API's stream events on the way.

The chunks are read with OpenAI's chunk semantics: `reasoning_content`
and `content` deltas append to the open thinking or text block, or open
one (closing the block before it); a tool call's deltas are matched by
`index`, its first opening a tool_use block with an id of its own, its
argument fragments streamed as input_json_delta. Both answers, streamed
or not, are this builder's: they cannot differ.
"""

from __future__ import annotations

import json

from msgspec.structs import replace

from pyserve.api.generation.chunks import delta_events, finished, given
from pyserve.api.generation.serving import new_id
from pyserve.api.protocol.anthropic import (
    ContentBlockDelta, ContentBlockStart, ContentBlockStop, InputJSONDelta, Message, MessageDelta, MessageStart,
    MessageStop, Ping, StopDelta, TextBlock, TextDelta, ThinkingBlock, ThinkingDelta, ToolUseBlock, Usage,
)
from pyserve.api.protocol.openai import ChatCompletionChunk, Usage as ChatUsage
from pyserve.http.errors import APIError


def anthropic_usage(usage: ChatUsage) -> Usage:
    cached = usage.prompt_tokens_details.cached_tokens
    return Usage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                 cache_read_input_tokens=cached)


class MessageBuilder:
    """One Message, filled from chat chunks; each step returns the events
    that tell a streaming client what changed."""

    def __init__(self, message: Message, omit_thinking: bool = False):
        self.message = message
        self.omit_thinking = omit_thinking  # thinking display "omitted": thinking blocks without their text
        self.started = False
        self.current: TextBlock | ThinkingBlock | ToolUseBlock | None = None  # the open block
        self.calls: dict[int, ToolUseBlock] = {}  # chat's tool call index -> its block
        self.arguments = ""  # the open tool_use block's JSON text so far
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None

    @property
    def _index(self) -> int:
        return len(self.message.content) - 1

    def feed(self, chunk: ChatCompletionChunk) -> list:
        if given(chunk.usage):
            self.message.usage = anthropic_usage(chunk.usage)
        if not self.started and all(given(choice.delta.role) for choice in chunk.choices):
            # The role chunk comes before the engine's first output; message_start
            # waits for that, which tells how much of the prompt was cached.
            return []
        events = self._start() + delta_events(chunk, self._thinking, self._text, self._call)
        if (done := finished(chunk)) is not None:
            self.finish_reason, self.matched_stop = done.finish_reason, done.matched_stop
        return events

    def _start(self) -> list:
        if self.started:
            return []
        self.started = True
        return [MessageStart(message=replace(self.message, content=[])), Ping()]

    # Leading whitespace opens no block: it is what separates thinking or
    # calls from the answer.

    def _thinking(self, text: str) -> list:
        events = []
        if not isinstance(self.current, ThinkingBlock):
            text = text.lstrip()
            if not text:
                return []
            events = self._open(ThinkingBlock(thinking=""))
        if self.omit_thinking:
            return events
        self.current.thinking += text
        return events + [ContentBlockDelta(index=self._index, delta=ThinkingDelta(thinking=text))]

    def _text(self, text: str) -> list:
        events = []
        if not isinstance(self.current, TextBlock):
            text = text.lstrip()
            if not text:
                return []
            events = self._open(TextBlock(text=""))
        self.current.text += text
        return events + [ContentBlockDelta(index=self._index, delta=TextDelta(text=text))]

    def _call(self, call) -> list:
        events = []
        block = self.calls.get(call.index)
        if block is None:
            block = self.calls[call.index] = ToolUseBlock(id=new_id("toolu_"), name=call.function.name, input={})
            events = self._open(block)
        elif block is not self.current:
            raise APIError(f"tool call {call.index} went on after the next block began", 500, "server_error")
        fragment = call.function.arguments
        if fragment:
            self.arguments += fragment
            events.append(ContentBlockDelta(index=self._index, delta=InputJSONDelta(partial_json=fragment)))
        return events

    def _open(self, block) -> list:
        events = self._close()
        self.message.content.append(block)
        self.current = block
        return events + [ContentBlockStart(index=self._index, content_block=replace(block))]

    def _close(self) -> list:
        block, self.current = self.current, None
        if block is None:
            return []
        if isinstance(block, ToolUseBlock):
            block.input = _arguments(self.arguments)
            self.arguments = ""
        return [ContentBlockStop(index=self.message.content.index(block))]

    def finish(self) -> list:
        """The chat stream ended: the last block closes, then message_delta
        (stop reason, usage) and message_stop."""
        events = self._start() + self._close()
        stop_sequence = self.matched_stop if isinstance(self.matched_stop, str) else None
        reason = {"length": "max_tokens", "tool_calls": "tool_use"}.get(self.finish_reason, "end_turn")
        if stop_sequence is not None and reason == "end_turn":
            reason = "stop_sequence"
        self.message.stop_reason, self.message.stop_sequence = reason, stop_sequence
        return events + [MessageDelta(delta=StopDelta(stop_reason=reason, stop_sequence=stop_sequence),
                                      usage=self.message.usage), MessageStop()]


def _arguments(text: str) -> dict:
    """A call's input: its JSON text, or {} when the output was cut short
    of a whole object."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
