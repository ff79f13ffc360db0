"""A Response built from the chat route's streamed chunks, and the
Responses API's stream events on the way.

The chunks are read with OpenAI's chunk semantics: `reasoning_content` and
`content` deltas append to the current reasoning or message item, and a
tool call's deltas are matched by `index` (id and name in its first delta,
argument fragments appended), so calls sent whole and calls streamed in
pieces read alike. Each output item opens with `response.output_item.added`
and closes with `response.output_item.done` before the next one opens, the
order `client.responses.stream(...)` accumulates.
"""

from __future__ import annotations

import msgspec

from pyserve.http.errors import APIError
from pyserve.api.protocol.openai import ChatCompletionChunk, Usage
from pyserve.api.protocol.responses import (
    FunctionCall, IncompleteDetails, InputTokensDetails, Item, Message, OutputText, OutputTokensDetails, Reasoning,
    ReasoningText, Response, ResponseError, ResponseUsage,
)
from pyserve.api.generation.chunks import delta_events, finished, given
from pyserve.api.generation.serving import new_id, now

# -- events --------------------------------------------------------------------


class Event(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int = 0  # set when the event is sent


class ResponseCreated(Event, kw_only=True, tag="response.created"):
    response: Response


class ResponseInProgress(Event, kw_only=True, tag="response.in_progress"):
    response: Response


class ResponseCompleted(Event, kw_only=True, tag="response.completed"):
    response: Response


class ResponseIncomplete(Event, kw_only=True, tag="response.incomplete"):
    response: Response


class ResponseFailed(Event, kw_only=True, tag="response.failed"):
    response: Response


class ErrorEvent(Event, kw_only=True, tag="error"):
    code: str | None
    message: str
    param: str | None = None


class OutputItemAdded(Event, kw_only=True, tag="response.output_item.added"):
    output_index: int
    item: Item


class OutputItemDone(Event, kw_only=True, tag="response.output_item.done"):
    output_index: int
    item: Item


class ContentEvent(Event, kw_only=True):
    """An event about one content part of an output item."""

    item_id: str
    output_index: int
    content_index: int = 0


class ContentPartAdded(ContentEvent, kw_only=True, tag="response.content_part.added"):
    part: OutputText | ReasoningText


class ContentPartDone(ContentEvent, kw_only=True, tag="response.content_part.done"):
    part: OutputText | ReasoningText


class OutputTextDelta(ContentEvent, kw_only=True, tag="response.output_text.delta"):
    delta: str
    logprobs: list = msgspec.field(default_factory=list)


class OutputTextDone(ContentEvent, kw_only=True, tag="response.output_text.done"):
    text: str
    logprobs: list = msgspec.field(default_factory=list)


class ReasoningTextDelta(ContentEvent, kw_only=True, tag="response.reasoning_text.delta"):
    delta: str


class ReasoningTextDone(ContentEvent, kw_only=True, tag="response.reasoning_text.done"):
    text: str


class ArgumentsDelta(Event, kw_only=True, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(Event, kw_only=True, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


def snapshot(value):
    """A deep copy of a Struct: events carry the object as it is now."""
    return msgspec.json.decode(msgspec.json.encode(value), type=type(value))


# -- the builder ---------------------------------------------------------------


class ResponseBuilder:
    """One Response, filled from chat chunks; each step returns the events
    that tell a streaming client what changed, numbered in order."""

    def __init__(self, response: Response, count_tokens):
        self.response = response
        self.count_tokens = count_tokens  # text -> its number of tokens
        self.sequence = 0
        self.current: Item | None = None  # the open output item
        self.calls: dict[int, FunctionCall] = {}  # chat's tool call index -> its item
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    def _numbered(self, events: list[Event]) -> list[Event]:
        for event in events:
            event.sequence_number = self.sequence
            self.sequence += 1
        return events

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    def start(self) -> list[Event]:
        self.response.status = "in_progress"
        return self._numbered([ResponseCreated(response=snapshot(self.response)),
                               ResponseInProgress(response=snapshot(self.response))])

    def feed(self, chunk: ChatCompletionChunk) -> list[Event]:
        if given(chunk.usage):
            self.usage = chunk.usage
        events = delta_events(chunk, self._reasoning, self._text, self._call)
        if (done := finished(chunk)) is not None:
            self.finish_reason = done.finish_reason
        return self._numbered(events)

    # Each kind of delta goes to an open item of its kind, or opens one
    # (closing the item before it). Leading whitespace does not open an
    # item: it is what separates reasoning or calls from the answer.

    def _reasoning(self, text: str) -> list[Event]:
        events = []
        if not isinstance(self.current, Reasoning):
            text = text.lstrip()
            if not text:
                return []
            events = self._open(Reasoning(id=new_id("rs_"), status="in_progress"), ReasoningText(text=""))
        self.current.content[0].text += text
        return events + [ReasoningTextDelta(item_id=self.current.id, output_index=self._index, delta=text)]

    def _text(self, text: str) -> list[Event]:
        events = []
        if not isinstance(self.current, Message):
            text = text.lstrip()
            if not text:
                return []
            events = self._open(Message(id=new_id("msg_"), role="assistant", content=[], status="in_progress"),
                                OutputText(text=""))
        self.current.content[0].text += text
        return events + [OutputTextDelta(item_id=self.current.id, output_index=self._index, delta=text)]

    def _call(self, call) -> list[Event]:
        function = getattr(call, "function", None)
        fragment = getattr(function, "arguments", None)
        events = []
        item = self.calls.get(call.index)
        if item is None:
            item = FunctionCall(id=new_id("fc_"), call_id=call.id, name=function.name, arguments="",
                                status="in_progress")
            self.calls[call.index] = item
            events = self._open(item)
        elif item is not self.current:
            raise APIError(f"tool call {call.index} went on after the next item began", 500, "server_error")
        if given(fragment) and fragment:
            item.arguments += fragment
            events.append(ArgumentsDelta(item_id=item.id, output_index=self._index, delta=fragment))
        return events

    def _open(self, item: Item, part: OutputText | ReasoningText | None = None) -> list[Event]:
        events = self._close()
        self.response.output.append(item)
        self.current = item
        events.append(OutputItemAdded(output_index=self._index, item=snapshot(item)))
        if part is not None:
            item.content.append(part)
            events.append(ContentPartAdded(item_id=item.id, output_index=self._index, part=snapshot(part)))
        return events

    def _close(self, status: str = "completed") -> list[Event]:
        item, self.current = self.current, None
        if item is None:
            return []
        item.status = status
        index = self.response.output.index(item)
        if isinstance(item, FunctionCall):
            events = [ArgumentsDone(item_id=item.id, output_index=index, name=item.name, arguments=item.arguments)]
        else:
            part = item.content[0]
            done = (ReasoningTextDone if isinstance(item, Reasoning) else OutputTextDone)
            events = [done(item_id=item.id, output_index=index, text=part.text),
                      ContentPartDone(item_id=item.id, output_index=index, part=snapshot(part))]
        return events + [OutputItemDone(output_index=index, item=snapshot(item))]

    # -- endings -----------------------------------------------------------------

    def finish(self) -> list[Event]:
        """The chat stream ended: completed; incomplete when the output hit
        max_output_tokens; cancelled when /abort_request stopped it (its
        stream then ends as an incomplete one does)."""
        cut = self.finish_reason in ("length", "abort")
        events = self._close("incomplete" if cut else "completed")
        self.response.usage = self._usage()
        self.response.completed_at = now()
        if self.finish_reason == "abort":
            self.response.status = "cancelled"
            return self._numbered(events + [ResponseIncomplete(response=snapshot(self.response))])
        if cut:
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            return self._numbered(events + [ResponseIncomplete(response=snapshot(self.response))])
        self.response.status = "completed"
        return self._numbered(events + [ResponseCompleted(response=snapshot(self.response))])

    def fail(self, err: APIError) -> list[Event]:
        """Generation failed: an `error` event, then `response.failed`."""
        self._close("incomplete")
        self.response.status = "failed"
        self.response.error = ResponseError(code=err.code or "server_error", message=err.message)
        return self._numbered([ErrorEvent(code=err.code or "server_error", message=err.message, param=err.param),
                               ResponseFailed(response=snapshot(self.response))])

    def cancel(self) -> None:
        self._close("incomplete")
        self.response.status = "cancelled"

    def _usage(self) -> ResponseUsage | None:
        if self.usage is None:
            return None
        reasoning = "".join(part.text for item in self.response.output if isinstance(item, Reasoning)
                            for part in item.content)
        u = self.usage
        return ResponseUsage(
            input_tokens=u.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens),
            output_tokens=u.completion_tokens,
            # The chat route counts output tokens as one; the reasoning's
            # share is its text tokenized again (the markers around it aside).
            output_tokens_details=OutputTokensDetails(reasoning_tokens=min(self.count_tokens(reasoning),
                                                                           u.completion_tokens)),
            total_tokens=u.total_tokens,
        )
