"""The Responses API's reading of chat chunks (api/responses/stream.py) and
its translation of conversation items into chat turns
(api/responses/input.py), without a server.

The events are replayed through the official openai client's own stream
accumulator (what `client.responses.stream(...)` runs), so a sequence the
client would reject fails here; the chunks include what the chat route
does not send today (tool-call arguments in fragments, reasoning) as
OpenAI's chunk semantics allow.
"""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from pyserve.http.errors import APIError
from pyserve.api.protocol.openai import (
    ChatCompletionChunk, ChatStreamChoice, Delta, FunctionCall as ChatFunction, PromptTokensDetails, ToolCallDelta,
    Usage,
)
from pyserve.api.responses.input import chat_messages, read_input
from pyserve.api.protocol.responses import FunctionCall, Message, OutputText, Reasoning, ReasoningText, Response
from pyserve.api.responses.stream import ResponseBuilder


def chunk(finish_reason: str | None = None, usage: Usage | None = None, **delta) -> ChatCompletionChunk:
    choices = [] if usage else [ChatStreamChoice(index=0, delta=Delta(**delta), finish_reason=finish_reason)]
    return ChatCompletionChunk(id="chatcmpl-1", created=0, model="m", choices=choices,
                               **({"usage": usage} if usage else {}))


def usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=3))


def whole_call(index: int, name: str, arguments: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=f"call_{index}", function=ChatFunction(name=name, arguments=arguments))


def fragment(index: int, arguments: str):
    """A later delta of a streamed call: its index and more arguments only."""
    return SimpleNamespace(index=index, id=None, function=SimpleNamespace(name=None, arguments=arguments))


def run(chunks: list[ChatCompletionChunk], fail: APIError | None = None) -> tuple[Response, list[dict], ResponseStreamState]:
    """Feed `chunks` to a builder; returns its Response, the events as JSON,
    and the openai client's accumulator after reading them."""
    builder = ResponseBuilder(Response(id="resp_1", created_at=0, status="queued", model="m"),
                              count_tokens=lambda text: len(text.split()))
    events = builder.start()
    for c in chunks:
        events += builder.feed(c)
    events += builder.fail(fail) if fail else builder.finish()
    as_json = [msgspec.json.decode(msgspec.json.encode(e)) for e in events]
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in as_json:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    return builder.response, as_json, state


def test_reasoning_then_text_events_in_the_clients_order():
    response, events, state = run([
        chunk(role="assistant", content=""),
        chunk(reasoning_content="\nThe user "),
        chunk(reasoning_content="greets me."),
        chunk(content="\n\n"),  # what separates the answer from the reasoning opens nothing
        chunk(content="Hello"),
        chunk(content=" there!"),
        chunk(finish_reason="stop"),
        chunk(usage=usage(10, 7)),
    ])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    reasoning, message = response.output
    assert isinstance(reasoning, Reasoning) and reasoning.content[0].text == "The user greets me."
    assert isinstance(message, Message) and message.content[0].text == "Hello there!"
    assert response.status == "completed" and message.status == "completed"
    assert response.usage.input_tokens == 10 and response.usage.output_tokens == 7
    assert response.usage.input_tokens_details.cached_tokens == 3
    assert response.usage.output_tokens_details.reasoning_tokens == 4  # "The user greets me." in words here
    final = state._completed_response
    assert final.output_text == "Hello there!"
    assert final.output[0].content[0].text == "The user greets me."


def test_calls_whole_or_in_fragments_read_alike():
    whole = [chunk(content="Let me check."),
             chunk(tool_calls=[whole_call(0, "get_weather", '{"city": "Paris"}')]),
             chunk(tool_calls=[whole_call(1, "get_time", '{"tz": "CET"}')]),
             chunk(finish_reason="tool_calls")]
    pieces = [chunk(content="Let me check."),
              chunk(tool_calls=[whole_call(0, "get_weather", "")]),
              chunk(tool_calls=[fragment(0, '{"city": ')]),
              chunk(tool_calls=[fragment(0, '"Paris"}')]),
              chunk(tool_calls=[whole_call(1, "get_time", '{"tz"')]),
              chunk(tool_calls=[fragment(1, ': "CET"}')]),
              chunk(finish_reason="tool_calls")]
    outputs = []
    for chunks in (whole, pieces):
        response, events, state = run(chunks)
        message, first, second = response.output
        assert message.content[0].text == "Let me check."
        assert isinstance(first, FunctionCall) and isinstance(second, FunctionCall)
        assert [(c.call_id, c.name, c.arguments) for c in (first, second)] == [
            ("call_0", "get_weather", '{"city": "Paris"}'), ("call_1", "get_time", '{"tz": "CET"}')]
        done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert [(e["output_index"], e["arguments"]) for e in done] == [(1, '{"city": "Paris"}'), (2, '{"tz": "CET"}')]
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                         and e["output_index"] == 1)
        assert deltas == '{"city": "Paris"}'
        # The first call is done before the second is added.
        kinds = [(e["type"], e.get("output_index")) for e in events]
        assert kinds.index(("response.output_item.done", 1)) < kinds.index(("response.output_item.added", 2))
        final = state._completed_response
        assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == [
            ("message", None), ("function_call", '{"city": "Paris"}'), ("function_call", '{"tz": "CET"}')]
        assert response.status == "completed"
        outputs.append([msgspec.structs.replace(o, id="") for o in response.output])
    assert outputs[0] == outputs[1]


def test_a_length_cut_is_incomplete():
    response, events, _ = run([chunk(content="Once upon"), chunk(content=" a time", finish_reason="length")])
    assert events[-1]["type"] == "response.incomplete"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.output[0].content[0].text == "Once upon a time"


def test_a_failure_is_an_error_event_then_response_failed():
    response, events, state = run([chunk(content="Hal")],
                                  fail=APIError("the request was aborted by the server", 500, "server_error"))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "server_error" and "aborted" in events[-2]["message"]
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "the request was aborted by the server"
    assert response.output[0].content[0].text == "Hal"
    assert state._completed_response is None


def test_a_call_interleaved_after_the_next_item_is_refused():
    with pytest.raises(APIError):
        run([chunk(tool_calls=[whole_call(0, "f", "{")]), chunk(content="text"), chunk(tool_calls=[fragment(0, "}")])])


# -- items into chat turns ------------------------------------------------------------


def _turns(items):
    return [msgspec.to_builtins(m) for m in chat_messages("Be brief.", items)]


def test_function_call_round_trip_becomes_one_assistant_turn_and_a_tool_message():
    items = read_input([
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris"},
                                     {"type": "input_text", "text": "and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two calls."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ])
    turns = _turns(items)
    assert [t["role"] for t in turns] == ["system", "system", "user", "assistant", "tool", "tool"]
    assert turns[0]["content"] == "Be brief."
    assert [p["text"] for p in turns[2]["content"]] == ["Weather in Paris", "and Rome?"]
    assistant = turns[3]
    assert assistant["reasoning_content"] == "Two calls."
    assert [p["text"] for p in assistant["content"]] == ["Checking."]
    assert [(c["id"], c["function"]["arguments"]) for c in assistant["tool_calls"]] == [
        ("c1", '{"city": "Paris"}'), ("c2", '{"city": "Rome"}')]
    assert [(t["tool_call_id"], t["content"]) for t in turns[4:]] == [("c1", "sunny"), ("c2", "rain")]


def test_calls_without_text_and_reasoning_without_an_answer():
    output = [Reasoning(id="rs_1", content=[ReasoningText(text="Hmm.")]),
              FunctionCall(id="fc_1", call_id="c1", name="f", arguments="{}"),
              Reasoning(id="rs_2", content=[ReasoningText(text="Only thought.")])]
    turns = _turns(read_input("Go") + output + read_input("Again"))
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "assistant", "user"]
    assert turns[2]["content"] is None and turns[2]["reasoning_content"] == "Hmm."
    assert turns[2]["tool_calls"][0]["id"] == "c1"
    assert turns[3]["content"] == "" and turns[3]["reasoning_content"] == "Only thought."


def test_assistant_text_given_back_as_input_keeps_its_part_type():
    items = read_input([{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Hey"}])
    assert isinstance(items[0].content[0], OutputText)
    assert items[0].id.startswith("msg_") and items[0].id != items[1].id
