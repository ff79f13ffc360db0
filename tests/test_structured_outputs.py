"""Structured outputs against the real server on the embedded model, the
way users send them: the official openai client (fields in extra_body
where OpenAI has none) and SGLang's /generate. Sampled at temperature
0.7-1.0 with n > 1, every choice must parse and validate."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field

from pyserve.api.generation.serving import ServingContext
from pyserve.chat_template import ChatTemplate
from tests.slow import slow_test
from tests.test_api_handlers import ScriptedEngine, call, run
from tests.test_api_handlers import tokenizer  # noqa: F401 (a fixture)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 16},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "role": {"enum": ["admin", "user", "guest"]},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    }, "required": ["city", "zip"], "additionalProperties": False},
}, "required": ["name", "age", "role", "address"], "additionalProperties": False}
LISTS = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 3},
}, "required": ["tags", "scores"], "additionalProperties": False}
CHOICES = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "note": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
    "size": {"enum": ["S", "M", "L"]},
}, "required": ["ok", "note", "size"], "additionalProperties": False}
CITY_GRAMMAR = """
root ::= city | description
city ::= "London" | "Paris" | "Berlin" | "Rome"
description ::= city " is " status
status ::= "the capital of " country
country ::= "England" | "France" | "Germany" | "Italy"
"""
CITIES = ["London", "Paris", "Berlin", "Rome"]
COUNTRIES = ["England", "France", "Germany", "Italy"]
CITY_LANGUAGE = set(CITIES) | {f"{c} is the capital of {k}" for c in CITIES for k in COUNTRIES}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"hours_ahead": {"type": "integer", "minimum": 0, "maximum": 12}},
        "required": ["hours_ahead"], "additionalProperties": False}}},
]


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# xgrammar reads a text by its characters: a vocabulary of one token, the
# end of text, is all its matcher needs here.
_EOS = 0
_COMPILER = xgr.GrammarCompiler(xgr.TokenizerInfo(["</s>"], stop_token_ids=[_EOS]))


def json_language(schema: dict) -> xgr.Grammar:
    """JSON as the schema allows it (strict: no properties beyond the schema's, as the server's)."""
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=True)


def in_language(grammar: xgr.Grammar, text: str, finish_reason: str) -> bool:
    """Whether `text` is in the grammar's language ("stop": the grammar
    ended it) or starts a text that is ("length": max_tokens cut it)."""
    matcher = xgr.GrammarMatcher(_COMPILER.compile_grammar(grammar))
    if not matcher.accept_string(text):
        return False
    return finish_reason == "length" or (finish_reason == "stop" and matcher.accept_token(_EOS))


@pytest.mark.parametrize("name, schema", [("person", PERSON), ("lists", LISTS), ("choices", CHOICES)])
def test_sampled_choices_validate_against_the_json_schema(client, model_name, name, schema):
    r = client.chat.completions.create(
        model=model_name, messages=ask(f"Give me a {name} record as JSON."), temperature=0.9, n=3, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"  # the grammar's end, not max_tokens
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_outputs_are_objects(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ask("Describe a cat in JSON."), temperature=0.8,
                                       n=3, max_tokens=96, response_format={"type": "json_object"})
    for choice in r.choices:
        # A free-form object may run past max_tokens: what it wrote starts an object.
        assert in_language(json_language({"type": "object"}), choice.message.content, choice.finish_reason), choice
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


def test_regex_outputs_match_in_full(client, model_name):
    pattern = r"(yes|no|maybe), because [a-z ]{3,20}\."
    r = client.chat.completions.create(model=model_name, messages=ask("Is the sea blue?"), temperature=1.0, n=4,
                                       max_tokens=60, extra_body={"regex": pattern})
    for choice in r.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.message.content)


def test_ebnf_outputs_are_in_the_grammars_language(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ask("Tell me about a capital city."),
                                       temperature=1.0, n=4, max_tokens=32, extra_body={"ebnf": CITY_GRAMMAR})
    assert all(c.message.content in CITY_LANGUAGE and c.finish_reason == "stop" for c in r.choices)


def test_vllm_structured_outputs_choice_and_completions(client, model_name):
    r = client.completions.create(model=model_name, prompt="My favourite colour is", temperature=1.0, n=4,
                                  max_tokens=10, extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert all(c.text in ("red", "blue") and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=model_name, prompt="A number:", temperature=0.8, n=2, max_tokens=10,
                                  extra_body={"json_schema": json.dumps({"type": "integer", "minimum": 1,
                                                                         "maximum": 500})})
    assert all(1 <= json.loads(c.text) <= 500 for c in r.choices)


def test_vllms_guided_fields_constrain_as_structured_outputs_do(client, model_name):
    """Clients written for vLLM's guided_* fields get their constraint."""
    r = client.completions.create(model=model_name, prompt="My favourite colour is", temperature=1.0, n=3,
                                  max_tokens=10, extra_body={"guided_choice": ["red", "blue"],
                                                             "guided_decoding_backend": "xgrammar"})
    assert all(c.text in ("red", "blue") for c in r.choices)
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Describe a person."}],
                                       temperature=0.8, max_tokens=80, extra_body={"guided_json": PERSON})
    assert in_language(json_language(PERSON), r.choices[0].message.content, r.choices[0].finish_reason)
    r = client.completions.create(model=model_name, prompt="A code:", max_tokens=12,
                                  extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", r.choices[0].text)


def test_generate_takes_sglangs_sampling_params(server):
    body = {"text": "The capital of France is", "sampling_params": {
        "temperature": 0.8, "max_new_tokens": 128, "n": 3, "json_schema": json.dumps(CHOICES)}}
    results = httpx.post(f"{server.base_url}/generate", json=body, timeout=120).json()
    assert len(results) == 3
    for result in results:
        jsonschema.validate(json.loads(result["text"]), CHOICES)
        assert result["meta_info"]["finish_reason"]["type"] == "stop"
    body = {"text": "Paris is the capital of", "sampling_params": {
        "temperature": 0, "max_new_tokens": 64, "regex": "(France|England)"}}
    assert httpx.post(f"{server.base_url}/generate", json=body, timeout=120).json()["text"] in ("France", "England")


def test_streamed_text_equals_the_whole_response_at_temperature_0(client, model_name):
    kwargs = dict(model=model_name, messages=ask("Give me a person as JSON."), temperature=0, max_tokens=300,
                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), PERSON)


@slow_test
def test_required_and_named_tool_calls_parse_and_validate(client, model_name):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = {"type": "function", "function": {"name": "get_time"}}
    for tool_choice, parallel in (("required", False), (named, True), ("required", True)):
        r = client.chat.completions.create(model=model_name, messages=ask("What is the weather in Rome?"),
                                           tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
                                           temperature=0.8, n=3, max_tokens=150)
        for choice in r.choices:
            calls = choice.message.tool_calls
            if tool_choice == "required" and parallel:
                # This small model may call again and again until max_tokens:
                # the calls it completed are there, and valid.
                assert choice.finish_reason in ("tool_calls", "length") and calls
            else:  # one call
                assert choice.finish_reason == "tool_calls" and choice.message.content is None
                assert len(calls) == 1
            for made in calls:
                if tool_choice == named:
                    assert made.function.name == "get_time"
                jsonschema.validate(json.loads(made.function.arguments), schemas[made.function.name])


def test_other_settings_keep_working_under_a_constraint(client, model_name):
    pattern = r"[a-z]{2,8}( [a-z]{2,8}){3,6}"
    kwargs = dict(model=model_name, prompt="Some words:", temperature=0.9, max_tokens=40, seed=11,
                  presence_penalty=0.5, frequency_penalty=0.3, logprobs=2, extra_body={"regex": pattern})
    a, b = (client.completions.create(n=2, **kwargs) for _ in range(2))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    for choice in a.choices:
        assert re.fullmatch(pattern, choice.text)
        # One entry per generated token: the text's, then the EOS that ended the grammar.
        assert "".join(choice.logprobs.tokens[:-1]) == choice.text
        assert len(choice.logprobs.top_logprobs) == len(choice.logprobs.tokens)
        # the 2 likeliest under the raw logits, and the sampled token (OpenAI's "up to logprobs + 1")
        assert all(len(top) <= 3 and token in top for top, token in zip(choice.logprobs.top_logprobs,
                                                                         choice.logprobs.tokens))
    cut = client.completions.create(stop=[" "], **{**kwargs, "logprobs": None}).choices[0]
    assert cut.finish_reason == "stop" and cut.matched_stop == " " and re.fullmatch("[a-z]{2,8}", cut.text)
    short = client.completions.create(**{**kwargs, "max_tokens": 2, "logprobs": None})
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format.json_schema.schema", 'Unsupported type "objec"'),
    ({"extra_body": {"regex": "(a|b"}}, "regex", "parenthesis is not closed"),
    ({"extra_body": {"ebnf": "root ::= city"}}, "ebnf", 'Rule "city" is not defined'),
    ({"extra_body": {"regex": "a", "ebnf": 'root ::= "a"'}}, "ebnf", "regex and ebnf"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}}, "structured_outputs.grammar", "EBNF"),
]


@pytest.mark.parametrize("kwargs, param, words", BAD)
def test_what_cannot_compile_is_a_400_naming_the_field(client, model_name, kwargs, param, words):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model_name, messages=ask("hi"), max_tokens=5, stream=stream,
                                           **kwargs)
        error = caught.value.body
        assert error["param"] == param and words in error["message"], error


# -- the seeds' section "Structured Outputs (JSON, Regex, EBNF)": SGLang's examples as written


class CapitalInfo(BaseModel):
    name: str = Field(..., pattern=r"^\w+$", description="Name of the capital city")
    population: int = Field(..., description="Population of the capital city")


def test_seed_examples_json(client, model_name):
    r = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=128,
        messages=ask("Please generate the information of the capital of France in the JSON format."),
        response_format={"type": "json_schema", "json_schema": {"name": "foo",
                                                                "schema": CapitalInfo.model_json_schema()}})
    choice = r.choices[0]
    # The small model may write a population longer than max_tokens; what it wrote follows the schema.
    assert in_language(json_language(CapitalInfo.model_json_schema()), choice.message.content,
                       choice.finish_reason), choice
    if choice.finish_reason == "stop":
        CapitalInfo.model_validate_json(choice.message.content)
    else:
        assert re.match(r'\{"name": "\w+", "population": -?[0-9]+$', choice.message.content)
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[\\w]+$"},
                                               "population": {"type": "integer"}},
              "required": ["name", "population"]}
    r = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=128,
        messages=ask("Give me the information of the capital of France in the JSON format."),
        response_format={"type": "json_schema", "json_schema": {"name": "foo", "schema": schema}})
    choice = r.choices[0]
    assert in_language(json_language(schema), choice.message.content, choice.finish_reason), choice
    assert choice.message.content.startswith('{"name": "')
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_seed_examples_ebnf_and_regex(client, model_name):
    r = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=32, extra_body={"ebnf": CITY_GRAMMAR},
        messages=[{"role": "system", "content": "You are a helpful geography bot."},
                  {"role": "user", "content": "Give me the information of the capital of France."}])
    assert r.choices[0].message.content in CITY_LANGUAGE
    r = client.chat.completions.create(model=model_name, messages=ask("What is the capital of France?"),
                                       temperature=0, max_tokens=128, extra_body={"regex": "(Paris|London)"})
    assert r.choices[0].message.content in ("Paris", "London")


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "state": {"type": "string"}},
           "required": ["city", "state"]}
DATE = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
FUNCTIONS = {"get_current_weather": WEATHER, "get_current_date": DATE}


def function_tags(content) -> list[dict]:
    """One tag per function, its content the function's parameters' schema as content(schema) writes it."""
    return [{"begin": f"<function={name}>", "content": content(schema), "end": "</function>"}
            for name, schema in FUNCTIONS.items()]


def triggered_tags(content, at_least_one: bool, stop_after_first: bool) -> dict:
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<function="], "at_least_one": at_least_one,
        "stop_after_first": stop_after_first, "tags": function_tags(content)}}


def as_xgrammar(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": schema}


def bounded(schema: dict) -> dict:
    """The schema with each string at most 12 characters: a call then fits in max_tokens."""
    return {**schema, "properties": {k: {**v, "maxLength": 12} for k, v in schema["properties"].items()}}


def test_seed_examples_structural_tags(client, model_name):
    messages = [{"role": "system", "content": "To call a function reply <function=NAME>{parameters}</function>"},
                {"role": "user", "content": "You are in New York. Please get the current date and time."}]
    legacy = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": f"<function={name}>", "schema": schema, "end": "</function>"} for name, schema in FUNCTIONS.items()]}
    # The seeds' examples, and what each one's language is, as xgrammar spells it.
    examples = [
        (legacy, xgr.Grammar.from_structural_tag(
            [xgr.StructuralTagItem(begin=f"<function={name}>", schema=schema, end="</function>")
             for name, schema in FUNCTIONS.items()], ["<function="])),
        (triggered_tags(lambda s: s, False, False),
         xgr.Grammar.from_structural_tag(json.dumps(triggered_tags(as_xgrammar, False, False)))),
    ]
    for response_format, language in examples:
        r = client.chat.completions.create(model=model_name, messages=messages, response_format=response_format,
                                           max_tokens=64, temperature=0.8, n=2)
        for choice in r.choices:
            assert in_language(language, choice.message.content, choice.finish_reason), choice
            # Every call the model completed is valid.
            for name, args in re.findall(r"<function=(\w+)>(.*?)</function>", choice.message.content):
                jsonschema.validate(json.loads(args), FUNCTIONS[name])
    # at_least_one: the answer starts with a call; stop_after_first: it is one call, and the end.
    forced = triggered_tags(bounded, True, True)
    r = client.chat.completions.create(model=model_name, messages=messages, response_format=forced,
                                       max_tokens=64, temperature=0.8, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        name, args = re.fullmatch(r"<function=(\w+)>(.*)</function>", choice.message.content, re.S).groups()
        jsonschema.validate(json.loads(args), bounded(FUNCTIONS[name]))


# -- with a reasoning parser, through the app and a scripted engine


@pytest.mark.parametrize("kwargs, after", [({}, "</think>"), ({"enable_thinking": False}, None)])
def test_with_a_reasoning_parser_the_constraint_starts_after_the_thinking(default_model_dir, tokenizer,  # noqa: F811
                                                                          kwargs, after):
    from pyserve.api.app import App

    engine = ScriptedEngine(tokenizer, ["<think>hmm</think>", '{"a": 1}'])
    app = App(ServingContext(engine, "m", ChatTemplate.for_model(default_model_dir), "qwen3"))
    body = {"messages": ask("hi"), "response_format": {"type": "json_object"}, "chat_template_kwargs": kwargs}
    status, _, raw = run(call(app, "POST", "/v1/chat/completions", body))
    assert status == 200 and engine.requests[-1].params.constraint.after == after
    if after:
        message = json.loads(raw)["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("hmm", '{"a": 1}')
