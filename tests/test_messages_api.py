"""Anthropic's Messages API through the app with the official anthropic SDK.

The app runs in process (its answers are checked, not the server process;
starlette's TestClient is the SDK's http_client) on a tiny random model
(float32, so greedy answers repeat exactly): what is checked is the API's
behaviour, not the answers' sense. Forced tool calls and
output_config.format schemas hold any model's output to a shape, which
makes those answers complete. The main app requires an API key, which the
SDK sends as `x-api-key`. A client closing its socket mid-stream is
checked on the shared real server.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from pyserve.api.anthropic.errors import ANTHROPIC
from pyserve.api.protocol.anthropic import Ping
from pyserve.http.errors import APIError
from pyserve.http.sse import EventStream
from tests.test_disconnect import leave_mid_stream
from tests.test_tokenize_api import tiny_server_http

KEY = "sk-messages-test"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}
CITY_SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Paris", "Rome"]},
                                                "country": {"enum": ["France", "Italy"]}},
               "required": ["name", "country"], "additionalProperties": False}
GREEDY = {"temperature": 0}  # not a named argument of the current SDK: sent in the body
ASK = [{"role": "user", "content": "Name a city."}]


def blocks(message) -> list[dict]:
    """A message's content as plain dicts (the stream helper's blocks add a parsed_output)."""
    return [b.model_dump(exclude={"parsed_output"}) for b in message.content]


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory):
    """The app and an HTTP client of it that sends the key (an SDK over it sends its own)."""
    with tiny_server_http(tiny_llama_dir, tmp_path_factory.mktemp("messages"), tool_call_parser="qwen25",
                          api_key=KEY) as c:
        c.headers["x-api-key"] = KEY
        yield c


def sdk(http: httpx.Client, api_key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=api_key, base_url=str(http.base_url), http_client=http, timeout=120,
                               max_retries=0)


@pytest.fixture(scope="module")
def client(http):
    return sdk(http)


def test_a_message_is_the_chat_routes_answer(client, http):
    system = "Answer briefly."
    m = client.messages.create(model="m", system=system, messages=ASK, max_tokens=12, metadata={"user_id": "u1"},
                               extra_body=GREEDY)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    [block] = m.content
    assert block.type == "text" and block.text
    oai = openai.OpenAI(api_key=KEY, base_url=f"{http.base_url}/v1", http_client=http, max_retries=0)
    chat = oai.chat.completions.create(model="m", messages=[{"role": "system", "content": system}, *ASK],
                                       max_tokens=12, temperature=0)
    assert block.text == chat.choices[0].message.content.lstrip()
    assert m.usage.output_tokens == 12
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    # count_tokens: the same prompt, counted without running it
    count = client.messages.count_tokens(model="m", system=system, messages=ASK)
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_system_blocks_and_cache_control(client):
    as_string = client.messages.count_tokens(model="m", system="Be brief.\nBe kind.", messages=ASK)
    as_blocks = client.messages.count_tokens(model="m", messages=ASK, system=[
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}])
    assert as_blocks.input_tokens == as_string.input_tokens
    m = client.messages.create(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Name a city.", "cache_control": {"type": "ephemeral"}}]}], max_tokens=2)
    assert m.usage.output_tokens == 2


def test_streamed_equals_not_streamed_at_temperature_0(client):
    whole = client.messages.create(model="m", messages=ASK, max_tokens=16, extra_body=GREEDY)
    with client.messages.stream(model="m", messages=ASK, max_tokens=16, extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 16
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_the_event_sequence(http):
    body = {"model": "m", "messages": ASK, "max_tokens": 6, "stream": True}
    with http.stream("POST", "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names  # every frame is named by its type; no [DONE]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == 6


def test_stop_sequences(client):
    text = client.messages.create(model="m", messages=ASK, max_tokens=16, extra_body=GREEDY).content[0].text
    stop = text[len(text) // 2:][:3]
    cut = text[:text.index(stop)]
    asked = dict(model="m", messages=ASK, max_tokens=16, stop_sequences=[stop], extra_body=GREEDY)
    with client.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    for m in (client.messages.create(**asked), streamed):
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
        assert "".join(b.text for b in m.content) == cut.lstrip()


def test_forced_tool_call_and_tool_result_round_trip(client):
    m = client.messages.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                               tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=60)
    assert m.stop_reason == "tool_use"
    [call] = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_") and call.input["city"] in ("Paris", "Rome")
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]}]
    follow = client.messages.create(model="m", messages=history, tools=[WEATHER], max_tokens=4)
    assert follow.content and follow.usage.output_tokens <= 4
    # the call and its result are in the prompt
    without = client.messages.count_tokens(model="m", messages=history[:1], tools=[WEATHER])
    assert client.messages.count_tokens(model="m", messages=history, tools=[WEATHER]).input_tokens > \
        without.input_tokens + 4


def test_streamed_tool_call_blocks(client):
    with client.messages.stream(model="m", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                max_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_message()
    [call] = final.content
    assert call.type == "tool_use" and final.stop_reason == "tool_use"
    [start] = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.id == call.id and start.content_block.input == {}
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert {e.index for e in deltas} == {start.index} and {e.delta.type for e in deltas} == {"input_json_delta"}
    assert json.loads("".join(e.delta.partial_json for e in deltas)) == call.input


def test_output_config_format(client):
    m = client.messages.create(model="m", messages=ASK, max_tokens=60,
                               output_config={"format": {"type": "json_schema", "schema": CITY_SCHEMA}})
    assert m.stop_reason == "end_turn"
    assert set(json.loads(m.content[0].text)) == {"name", "country"}


def test_a_client_leaving_a_stream_frees_its_request(server):
    """Over the shared server's real socket, closed mid-stream: the
    embedded model's greedy count runs past a hundred tokens."""
    count = [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]
    body = {"model": "m", "messages": count, "max_tokens": 1900, "stream": True, **GREEDY}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        generated = leave_mid_stream(http, "/v1/messages", body, "event: content_block_delta", 4)
    assert generated < 60  # aborted: the count it was writing runs past a hundred tokens


BAD_BODIES = {
    "missing max_tokens": ({"messages": ASK}, "max_tokens"),
    "image block": ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://a/b.png"}}]}]}, "image"),
    "document block": ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "document"),
    "server tool": ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                                  "name": "web_search"}]}, "web_search_20250305"),
    "unknown field": ({"max_tokens": 4, "messages": ASK, "container": "c1"}, "container"),
    "redacted thinking": ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "xyz"}]}]}, "redacted_thinking"),
    "result without a call": ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]}, "tool_use_id"),
    "choice of no tool": ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER],
                           "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    "temperature": ({"max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature"),
    "past the context": ({"max_tokens": 100_000, "messages": ASK}, "max_tokens"),
    "bad effort": ({"max_tokens": 4, "messages": ASK, "output_config": {"effort": "extreme"}}, "effort"),
}


@pytest.mark.parametrize("name", BAD_BODIES)
def test_bad_requests_are_anthropic_400s(http, name):
    body, named = BAD_BODIES[name]
    r = http.post("/v1/messages", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"], error


def test_errors_through_the_sdk(client, http):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="image") as e:
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    wrong = sdk(http, "wrong")  # its x-api-key header replaces the one the client sends by default
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="m", max_tokens=4, messages=ASK)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    # a body that is not JSON, on these routes: Anthropic's shape too
    r = http.post("/v1/messages/count_tokens", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    # the OpenAI routes keep OpenAI's shape, and take the key either way
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, "temperature": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


# A template that shows what reaches it: earlier thinking, the thinking
# switch and the effort, each as words that change the prompt's length.
SHOWING = """{%- for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}[thought: {{ m.reasoning_content }}]
{%- endif %}{{ m.content }}{% endfor %}
{%- if enable_thinking is defined and not enable_thinking %} Do not think at all, answer right away.{% endif %}
{%- if reasoning_effort is defined %} Effort: {{ reasoning_effort }}.{% endif %}
<assistant>"""


@pytest.fixture(scope="module")
def thinking_client(tiny_llama_dir, tmp_path_factory):
    """deepseek-r1's parser: the template opens the reasoning block, so all
    that the tiny model writes (it never closes the block) is thinking."""
    template = tmp_path_factory.mktemp("template") / "showing.jinja"
    template.write_text(SHOWING)
    with tiny_server_http(tiny_llama_dir, tmp_path_factory.mktemp("thinking"), reasoning_parser="deepseek-r1",
                          chat_template=str(template)) as c:
        yield sdk(c, "EMPTY")


def test_thinking_blocks_out_and_in(thinking_client):
    client = thinking_client
    thinking = {"type": "enabled", "budget_tokens": 1024}
    m = client.messages.create(model="m", messages=ASK, max_tokens=16, thinking=thinking, extra_body=GREEDY)
    [block] = m.content
    assert block.type == "thinking" and block.thinking and m.stop_reason == "max_tokens"
    with client.messages.stream(model="m", messages=ASK, max_tokens=16, thinking=thinking,
                                extra_body=GREEDY) as stream:
        deltas = [e.delta.thinking for e in stream if e.type == "content_block_delta"]
        assert blocks(stream.get_final_message()) == blocks(m)
    assert "".join(deltas) == block.thinking
    # Sent back, a thinking block is the assistant turn's reasoning.
    turn = [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Paris is one.",
                                                    "signature": ""}, {"type": "text", "text": "Paris."}]},
            {"role": "user", "content": "Another?"}]
    shown = client.messages.count_tokens(model="m", messages=turn).input_tokens
    turn[1]["content"] = turn[1]["content"][1:]
    assert shown > client.messages.count_tokens(model="m", messages=turn).input_tokens
    # omitted display: the block without its text
    omitted = client.messages.create(model="m", messages=ASK, max_tokens=4,
                                     thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    assert [(b.type, b.thinking) for b in omitted.content] == [("thinking", "")]


def test_thinking_switch_and_effort_reach_the_template(thinking_client):
    def count(**fields) -> int:
        return thinking_client.messages.count_tokens(model="m", messages=ASK, **fields).input_tokens

    plain = count()
    assert count(thinking={"type": "enabled", "budget_tokens": 1024}) == plain
    assert count(thinking={"type": "disabled"}) > plain  # the switch off, and effort "none"
    assert count(output_config={"effort": "max"}) == count(output_config={"effort": "high"}) > plain


def test_an_error_mid_stream_is_an_error_event():
    async def events():
        yield Ping()
        raise APIError("the engine failed", 500, "server_error")

    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(EventStream(events(), ANTHROPIC).send(send))
    body = b"".join(m.get("body", b"") for m in sent[1:])
    ping, error, end = body.split(b"\n\n")
    assert ping == b'event: ping\ndata: {"type":"ping"}' and end == b""  # no [DONE]
    name, data = error.split(b"\n")
    assert name == b"event: error" and json.loads(data[len(b"data: "):]) == {
        "type": "error", "error": {"type": "api_error", "message": "the engine failed"}}
    assert sent[-1].get("more_body", False) is False


def test_cache_salt_keeps_tenants_prefixes_apart(client):
    """Only requests under the same salt read each other's cached prefix."""
    system = "You answer in one word. " + " ".join(f"Rule {i}: be brief." for i in range(40))

    def cached(salt: str) -> int:
        m = client.messages.create(model="m", system=system, messages=ASK, max_tokens=2,
                                   extra_body={"cache_salt": salt})
        return m.usage.cache_read_input_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
