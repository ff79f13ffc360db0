"""The Responses API with the official openai client.

Most tests run the app in process (its answers are checked, not the
server process; starlette's TestClient is the client's http_client) on a
tiny random model (float32, so greedy answers repeat exactly): what is
checked is the API's behaviour, not the answers' sense. Forced tool calls
and `text.format` schemas hold any model's output to a shape, which makes
those responses complete. On the shared real server, the embedded model
answers a real question and a client closes its socket mid-stream; the
slow suite restarts a server over its stored responses.
"""

from __future__ import annotations

import json
import time
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.conftest import ServerProcess
from tests.slow import slow_test
from tests.test_disconnect import leave_mid_stream, wait_idle
from tests.test_tokenize_api import tiny_server_http

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
LONG = 1900  # output tokens that keep the tiny model busy for seconds (its context is 2048)


class City(BaseModel):
    # Enums, so the schema alone makes the tiny model's output complete.
    name: Literal["Paris", "Rome"]
    country: Literal["France", "Italy"]


CITY_FORMAT = {"type": "json_schema", "name": "city", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"enum": ["Paris", "Rome"]}, "country": {"enum": ["France", "Italy"]}},
    "required": ["name", "country"], "additionalProperties": False}}


def tiny_server(model_dir, storage, *options: str) -> ServerProcess:
    return ServerProcess("--model", str(model_dir), "--file-storage-path", str(storage),
                         "--tool-call-parser", "qwen25", *options)


def client_of(srv) -> openai.OpenAI:
    """The openai client of a server process, or of the app in process through its TestClient."""
    http_client = None if isinstance(srv, ServerProcess) else srv
    return openai.OpenAI(api_key="EMPTY", base_url=f"{srv.base_url}/v1", http_client=http_client, timeout=120,
                         max_retries=0)


def tiny_app(model_dir, storage, **options):
    """tiny_server's app, in process: a TestClient of it."""
    return tiny_server_http(model_dir, storage, tool_call_parser="qwen25", **options)


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory):
    with tiny_app(tiny_llama_dir, tmp_path_factory.mktemp("responses")) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return client_of(http)


def wait_until_done(client, response_id: str, timeout: float = 120.0):
    deadline = time.time() + timeout
    while (r := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.time() < deadline, f"response still {r.status}"
        time.sleep(0.2)
    return r


def test_a_response_is_the_chat_routes_answer(client, http):
    instructions, question = "Answer briefly.", "Name a city."
    r = client.responses.create(model="m", instructions=instructions, input=question, temperature=0,
                                max_output_tokens=12, metadata={"run": "1"})
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.instructions == instructions and r.max_output_tokens == 12 and r.metadata == {"run": "1"}
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    chat = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=12)
    assert r.output_text == chat.choices[0].message.content.lstrip()
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.input_tokens == http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    # stored: GET returns the same response
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()


def test_streamed_with_the_clients_stream_helper(client):
    deltas, types = [], []
    with client.responses.stream(model="m", input="Where is the Eiffel tower?", text_format=City,
                                 max_output_tokens=60) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert final.status == "completed"
    assert "".join(deltas) == final.output_text
    city = final.output_parsed
    assert (city.name, city.country) in {(n, c) for n in ("Paris", "Rome") for c in ("France", "Italy")}
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_text_format_json_schema_not_streamed(client):
    r = client.responses.create(model="m", input="A city?", text={"format": CITY_FORMAT}, max_output_tokens=60)
    assert r.status == "completed"
    assert set(json.loads(r.output_text)) == {"name", "country"}
    assert r.text.format.type == "json_schema"


def test_function_call_round_trip(client):
    first = client.responses.create(model="m", input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=60)
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    second = client.responses.create(
        model="m", previous_response_id=first.id, tools=[WEATHER], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}])
    assert second.previous_response_id == first.id
    assert [item.type for item in second.output] == ["message"]
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [item.type for item in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == call.call_id and items[2].output == '{"temperature": 21}'
    newest_first = client.responses.input_items.list(second.id, limit=2).data
    assert [item.type for item in newest_first] == ["function_call_output", "function_call"]


def test_streamed_function_call_events(client):
    with client.responses.stream(model="m", input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments for call in calls]
    for call in calls:
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.item_id == call.id]
        assert "".join(deltas) == call.arguments


def test_background_response_is_cancelled(client, http):
    r = client.responses.create(model="m", input="Tell a long story.", background=True, temperature=0,
                                max_output_tokens=LONG)
    assert r.status == "queued" and r.background
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert cancelled.usage is None or cancelled.usage.output_tokens < LONG
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # again: as it is
    wait_idle(http)  # the engine request was aborted


def test_a_response_stopped_by_abort_request_is_cancelled(client, http):
    r = client.responses.create(model="m", input="Tell a long story.", background=True, temperature=0,
                                max_output_tokens=LONG)
    deadline = time.time() + 60
    while http.get("/get_server_info").json()["num_running_reqs"] == 0 and time.time() < deadline:
        time.sleep(0.02)
    assert http.post("/abort_request", json={"rid": r.id}).status_code == 200  # SGLang's, by the response's id
    done = wait_until_done(client, r.id)
    assert done.status == "cancelled" and done.usage.output_tokens < LONG
    wait_idle(http)


def test_background_response_runs_to_the_end(client):
    r = client.responses.create(model="m", input="Hi", background=True, max_output_tokens=5)
    done = wait_until_done(client, r.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 5 and done.output_text
    with pytest.raises(openai.BadRequestError, match="cannot cancel"):
        client.responses.cancel(r.id)


def test_cancel_of_a_response_not_in_the_background(client):
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(r.id)


def test_get_and_delete(client):
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(r.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="m", input="Hi", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_../../etc/passwd")


def test_not_stored(client):
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    assert r.store is False and r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_a_client_leaving_a_stream_frees_its_request(server):
    """Over the shared server's real socket, closed mid-stream: the
    embedded model's greedy count runs past a hundred tokens."""
    body = {"model": "m", "input": "Count from 1 to 1000, one number per line.", "stream": True, "temperature": 0,
            "max_output_tokens": LONG}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        generated = leave_mid_stream(http, "/v1/responses", body, "data: ", 8)
    assert generated < 60  # aborted: the count it was writing runs past a hundred tokens


BAD_BODIES = {
    "no input": ({"model": "m"}, "input"),
    "empty input": ({"input": []}, "input"),
    "unknown field": ({"input": "x", "conversation": "conv_1"}, "conversation"),
    "image part": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://a/b.png"}]}]},
                   "input[0].content[0].type"),
    "file part": ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
                  "input[0].content[0].type"),
    "built-in tool": ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    "item reference": ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    "unknown role": ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    "reasoning effort": ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    "encrypted reasoning": ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [],
                                        "encrypted_content": "xyz"}]}, "input[0].encrypted_content"),
    "grammar format": ({"input": "x", "text": {"format": {"type": "grammar", "grammar": "x"}}}, "text.format.type"),
    "bad schema": ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 5}}}},
                   "text.format.schema"),
    "verbosity": ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    "include": ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    "truncation auto": ({"input": "x", "truncation": "auto"}, "truncation"),
    "temperature": ({"input": "x", "temperature": 3}, "temperature"),
    "max_output_tokens zero": ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    "past the context": ({"input": "x", "max_output_tokens": 100_000}, "max_output_tokens"),
    "unknown previous": ({"input": "x", "previous_response_id": "resp_0123456789abcdef01234567"},
                         "previous_response_id"),
    "output without a call": ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
                              "input[0].call_id"),
    "call without a name": ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]},
                            "input[0].name"),
    "bad tool name": ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    "unknown tool field": ({"input": "x", "tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    "choice of no tool": ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
                          "tool_choice.name"),
    "stream in the background": ({"input": "x", "background": True, "stream": True}, "background"),
    "background not stored": ({"input": "x", "background": True, "store": False}, "store"),
    "wrong type": ({"input": "x", "max_output_tokens": "ten"}, "max_output_tokens"),
}


@pytest.mark.parametrize("name", BAD_BODIES)
def test_bad_requests_are_400s_naming_the_field(http, name):
    body, param = BAD_BODIES[name]
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_unknown_response_ids_are_404s(http):
    for method, path in (("GET", "/v1/responses/resp_0123456789abcdef01234567"),
                         ("DELETE", "/v1/responses/nope"), ("POST", "/v1/responses/nope/cancel"),
                         ("GET", "/v1/responses/nope/input_items")):
        r = http.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text


@slow_test
def test_stored_responses_survive_a_restart(tiny_llama_dir, tmp_path):
    first = tiny_server(tiny_llama_dir, tmp_path)
    try:
        client = client_of(first)
        r = client.responses.create(model="m", input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=60)
        running = client.responses.create(model="m", input="Tell a long story.", background=True, temperature=0,
                                          max_output_tokens=LONG)
    finally:
        first.proc.kill()  # however the server ends, nothing stored is lost
        first.stop()
    again = tiny_server(tiny_llama_dir, tmp_path)
    try:
        client = client_of(again)
        assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
        call = next(item for item in r.output if item.type == "function_call")
        follow = client.responses.create(
            model="m", previous_response_id=r.id, max_output_tokens=4,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        assert follow.status == "incomplete" and follow.output_text
        items = client.responses.input_items.list(follow.id, order="asc").data
        assert [item.type for item in items] == ["message", "function_call", "function_call_output"]
        assert items[0].content[0].text == "What is the weather in Paris?"
        # The background response died with the first server: it is failed, not running forever.
        orphan = client.responses.retrieve(running.id)
        assert orphan.status == "failed" and "stopped" in orphan.error.message
    finally:
        again.stop()


def test_reasoning_items_and_reasoning_tokens(tiny_llama_dir, tmp_path):
    """With deepseek-r1's parser the template opens the reasoning block, so
    everything the tiny model writes (it never closes the block) is reasoning."""
    with tiny_app(tiny_llama_dir, tmp_path, reasoning_parser="deepseek-r1") as srv:
        client = client_of(srv)
        r = client.responses.create(model="m", input="Think.", max_output_tokens=16, temperature=0)
        [reasoning] = r.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text
        assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens == 16
        with client.responses.stream(model="m", input="Think.", max_output_tokens=16, temperature=0) as stream:
            deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == reasoning.content[0].text
        # Given back as input, the reasoning item is the assistant turn's reasoning.
        follow = client.responses.create(model="m", previous_response_id=r.id, input="Go on.", max_output_tokens=2)
        assert follow.usage.input_tokens > r.usage.input_tokens
        # An effort is chat's reasoning_effort: taken, and echoed as OpenAI does.
        effort = client.responses.create(model="m", input="Think.", max_output_tokens=2, reasoning={"effort": "low"})
        assert effort.reasoning.effort == "low"


def test_the_embedded_model_answers(server):
    client = client_of(server)
    r = client.responses.create(model="m", input="What is the capital of France?", temperature=0,
                                max_output_tokens=40, store=False)
    assert "Paris" in r.output_text
    with client.responses.stream(model="m", input="What is the capital of France?", temperature=0,
                                 max_output_tokens=40, store=False) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == r.output_text
