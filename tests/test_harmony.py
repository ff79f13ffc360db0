"""gpt-oss's Harmony format: the Rust HarmonyParser through its Python
binding, the special tokens it reads, and the chat template that writes
the prompts (tests/fixtures/gpt_oss_chat_template.jinja) rendered by
pyserve as transformers renders it."""

from __future__ import annotations

import json
import random

import pytest

from pyserve._rust import DecodeStream, HarmonyParser, Tokenizer
from pyserve.chat_template import ChatTemplate
from tests.harmony_model import SPECIAL, build_harmony_tokenizer
from tests.test_chat_template import hf_render

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather; call get_weather.<|end|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking Paris and Rome.<|end|>"
CALL_PARIS = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
              '{"city": "Paris", "unit": "c"}<|call|>')
CALL_ROME = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 20 °C in Paris."
OUTPUT = ANALYSIS + PREAMBLE + CALL_PARIS + CALL_ROME + FINAL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "array", "items": {"type": "integer"}}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time",
                                        "parameters": {"type": "object", "properties": {}}}}


def read(pieces: list[str], **kwargs) -> tuple[str, str, list[tuple[str, str]], list]:
    """(reasoning, content, whole calls, every delta) of `pieces` fed in turn."""
    parser = HarmonyParser(**kwargs)
    reasoning, content, deltas = "", "", []
    for step in [parser.feed(p) for p in pieces] + [parser.flush()]:
        reasoning, content, deltas = reasoning + step[0], content + step[1], deltas + step[2]
    calls: dict[int, list[str]] = {}
    for index, name, arguments in deltas:
        if name is not None:
            assert index not in calls, "a call's name comes in its first delta only"
            calls[index] = [name, ""]
        calls[index][1] += arguments
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], deltas


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_the_parser_splits_reasoning_content_and_calls():
    reasoning, content, calls, _ = read([OUTPUT])
    assert reasoning == "The user wants the weather; call get_weather."
    assert content == "Checking Paris and Rome.It is 20 °C in Paris."
    assert calls == [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_weather", '{"city": "Rome"}')]
    assert all(json.loads(arguments) for _, arguments in calls)


def test_streamed_in_any_pieces_it_reads_the_same():
    whole = read([OUTPUT])[:3]
    rng = random.Random(0)
    for _ in range(50):
        assert read(random_pieces(OUTPUT, rng))[:3] == whole
    for i in range(len(OUTPUT) + 1):
        assert read([OUTPUT[:i], OUTPUT[i:]])[:3] == whole, f"split at {i}"


def test_calls_stream_as_deltas_one_call_after_the_other():
    pieces = [ANALYSIS + PREAMBLE + CALL_PARIS[:-30], CALL_PARIS[-30:] + CALL_ROME]
    _, _, _, deltas = read(pieces)
    assert [(index, name) for index, name, _ in deltas] == [(0, "get_weather"), (0, None), (1, "get_weather")]
    # Both complete calls of one delta come out of it.
    parser = HarmonyParser()
    assert [d[:2] for d in parser.feed(CALL_PARIS + CALL_ROME)[2]] == [(0, "get_weather"), (1, "get_weather")]


def test_calls_the_request_does_not_read_are_content():
    _, content, calls, _ = read([ANALYSIS + CALL_PARIS], functions=["now"])
    assert calls == [] and content == '{"city": "Paris", "unit": "c"}'
    _, content, calls, _ = read([ANALYSIS + CALL_ROME], read_calls=False)
    assert calls == [] and content == '{"city": "Rome"}'


# -- the tokenizer and the template ------------------------------------------


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory, default_model_dir):
    return build_harmony_tokenizer(tmp_path_factory.mktemp("harmony"), default_model_dir)


def test_the_markers_are_special_tokens_the_parser_needs_kept(harmony_dir):
    tokenizer = Tokenizer.from_file(str(harmony_dir / "tokenizer.json"))
    special = {tokenizer.token_to_id(t) for t in SPECIAL}
    ids = tokenizer.encode(OUTPUT)
    assert special & set(ids) == {tokenizer.token_to_id(t) for t in SPECIAL[2:]} - {
        tokenizer.token_to_id("<|return|>")}
    assert tokenizer.decode(ids, skip_special_tokens=False) == OUTPUT
    # Skipped, the channels run into the text and nothing can be read.
    skipped = tokenizer.decode(ids)
    assert skipped.startswith("analysisThe user") and read([skipped])[2] == []
    # Kept, a token-by-token decode reads as the whole.
    stream = DecodeStream(tokenizer, skip_special_tokens=False)
    text = "".join(stream.step([i]) for i in ids) + stream.flush()
    assert read([text])[:3] == read([OUTPUT])[:3]


CONVERSATIONS = {
    "tools and a tool result": [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "Call get_weather.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 20}'},
    ],
    "an answered turn, then a developer's next question": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "Dropped: a final answer follows.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20"},
        {"role": "assistant", "content": "20 °C."},
        {"role": "user", "content": "And the time?"},
    ],
}


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("effort", [None, "high"])
def test_pyserve_renders_the_template_as_transformers_does(harmony_dir, name, effort):
    messages = CONVERSATIONS[name]
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    ours = ChatTemplate.for_model(harmony_dir).render(messages, add_generation_prompt=True, tools=[WEATHER, NOW],
                                                      template_kwargs=kwargs)
    assert ours == hf_render(harmony_dir, messages, tools=[WEATHER, NOW], **kwargs)
    assert f"Reasoning: {effort or 'medium'}" in ours and ours.endswith("<|start|>assistant")
    assert "type get_weather = (_: {\n// The city\ncity: string,\n" in ours
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"' in ours
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in ours
    assert ("Call get_weather." in ours) == (name == "tools and a tool result")
    assert "Dropped" not in ours
