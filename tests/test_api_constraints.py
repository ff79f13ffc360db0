"""Structured-output fields read into constraints (api/constraints.py) and
the reader of forced tool calls (api/tools.py), without a model."""

from __future__ import annotations

import json

import msgspec
import pytest

from pyserve.api.generation.constraints import request_constraint
from pyserve.http.errors import APIError, from_msgspec
from pyserve.api.protocol.native import NativeSamplingParams
from pyserve.api.protocol.openai import ChatCompletionRequest, CompletionRequest
from pyserve.api.generation.tools import ToolCalling, ToolCallStream, whole_calls

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MSG = [{"role": "user", "content": "hi"}]


def chat_constraint(**body):
    try:  # a wrongly typed field is refused when the body is decoded
        req = msgspec.convert({"messages": MSG, **body}, ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise from_msgspec(e) from None
    found = request_constraint(req)
    return None if found is None else (found.constraint.kind, found.constraint.text, found.param)


@pytest.mark.parametrize("body, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json_schema", '{"type": "object"}', "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     ("json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema")),
    ({"json_schema": json.dumps(SCHEMA)}, ("json_schema", json.dumps(SCHEMA), "json_schema")),
    ({"regex": "(Paris|London)"}, ("regex", "(Paris|London)", "regex")),
    ({"ebnf": 'root ::= "a"'}, ("ebnf", 'root ::= "a"', "ebnf")),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", json.dumps(SCHEMA), "structured_outputs.json")),
    ({"structured_outputs": {"regex": "a+"}}, ("regex", "a+", "structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["yes", 'say "no"']}},
     ("ebnf", 'root ::= "yes" | "say \\"no\\""', "structured_outputs.choice")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("ebnf", 'root ::= "a"', "structured_outputs.grammar")),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, ("lark", 'start: "a"', "structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}},
     ("json_schema", '{"type": "object"}', "structured_outputs.json_object")),
])
def test_each_field_becomes_its_constraint(body, expected):
    assert chat_constraint(**body) == expected


def test_completions_and_generate_read_the_same_fields():
    req = msgspec.convert({"prompt": "x", "regex": "a+"}, CompletionRequest)
    assert request_constraint(req).constraint.kind == "regex"
    native = NativeSamplingParams(json_schema=json.dumps(SCHEMA))
    found = request_constraint(native, "sampling_params.")
    assert (found.constraint.kind, found.param) == ("json_schema", "sampling_params.json_schema")
    assert request_constraint(NativeSamplingParams(ebnf='root ::= "a"'), "sampling_params.").constraint.kind == "ebnf"


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_structural_tags_in_both_of_sglangs_forms_become_xgrammars_format():
    legacy = {"type": "structural_tag", "triggers": ["<function="],
              "structures": [{"begin": "<function=w>", "schema": WEATHER, "end": "</function>"}]}
    kind, text, param = chat_constraint(response_format=legacy)
    assert (kind, param) == ("structural_tag", "response_format")
    expected = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
        {"type": "tag", "begin": "<function=w>", "end": "</function>",
         "content": {"type": "json_schema", "json_schema": WEATHER}}]}}
    assert json.loads(text) == expected
    # The new form, with a bare schema as content (as SGLang's docs write it), is the same grammar.
    new = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
        {"begin": "<function=w>", "content": WEATHER, "end": "</function>"}]}}
    fmt = json.loads(chat_constraint(response_format=new)[1])["format"]
    assert fmt["tags"][0]["content"] == {"type": "json_schema", "json_schema": WEATHER}
    # /generate takes it as JSON text.
    native = request_constraint(NativeSamplingParams(structural_tag=json.dumps(legacy)), "sampling_params.")
    assert json.loads(native.constraint.text) == expected


@pytest.mark.parametrize("body, param, words", [
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", ["regex", "ebnf"]),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex", ["response_format", "regex"]),
    ({"structured_outputs": {"json": SCHEMA, "choice": ["a"]}}, "structured_outputs.choice",
     ["structured_outputs.json", "structured_outputs.choice"]),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ["yaml"]),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", ["schema"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format.json_schema.schema", ["JSON schema"]),
    ({"json_schema": "{not json"}, "json_schema", ["not valid JSON"]),
    ({"regex": ""}, "regex", ["non-empty"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["non-empty list"]),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     ["not supported"]),
    ({"structured_outputs": "json"}, "structured_outputs", ["object"]),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"]}}, "response_format", ["structures"]),
])
def test_bad_or_doubled_constraints_are_400s_naming_the_field(body, param, words):
    with pytest.raises(APIError) as caught:
        chat_constraint(**body)
    assert caught.value.status == 400 and caught.value.param == param
    assert all(w in caught.value.message for w in words)


def forced_reader(*names: str) -> ToolCallStream:
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    return ToolCallStream(ToolCalling(None, tools=tools))


def test_forced_calls_stream_their_arguments_split_anywhere():
    text = '[{"name": "a", "arguments": {"x": "q\\"}]{"}}, {"name": "b", "arguments": {}}]'
    for step in (1, 5, len(text)):
        reader = forced_reader("a", "b")
        deltas = []
        for i in range(0, len(text), step):
            content, more = reader.feed(text[i : i + step])
            assert content == ""
            deltas += more
        assert reader.feed("", final=True) == ("", [])
        assert [(c.function.name, c.function.arguments) for c in whole_calls(deltas)] == \
            [("a", '{"x": "q\\"}]{"}'), ("b", "{}")] and reader.count == 2
        assert step == len(text) or len([d for d in deltas if d[0] == 0]) > 1  # arguments in pieces


def test_forced_calls_cut_short_close_the_started_call_and_leave_the_rest_as_content():
    reader = forced_reader("a", "b")
    content, deltas = reader.feed('[{"name": "a", "parameters": {"x": 1}}, {"name": "b', final=True)
    assert deltas == [(0, "a", '{"x": 1}')] and content == '{"name": "b'
    content, deltas = forced_reader("a").feed('[{"name": "a", "arguments": {"x": [1, 2', final=True)
    assert [(c.function.name, c.function.arguments) for c in whole_calls(deltas)] == [("a", '{"x": [1, 2]}')]
    content, deltas = forced_reader("a").feed('[{"name": "a", "argu', final=True)
    assert deltas == [] and content == '[{"name": "a", "argu'
