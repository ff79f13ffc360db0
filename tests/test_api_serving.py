"""The request builder every generation route shares (api/serving.py,
api/generation/sampling.py, http/io.py's page), without a model."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pyserve.http.errors import APIError
from pyserve.api.protocol.native import NativeSamplingParams
from pyserve.http.io import page
from pyserve.api.protocol.openai import CompletionRequest
from pyserve.api.generation.sampling import sampling_params
from pyserve.api.generation.serving import ServingContext, fan_out, prompt_id_lists, usage
from pyserve.engine.request import Constraint, GenerateOutput, GenerateRequest, RequestError, SamplingParams
from tests.test_api_handlers import tokenizer  # noqa: F401 (a fixture)


class RefusingEngine:
    """Engine.validate's and compile_grammar's contract: refuses with the
    engine's field names."""

    def __init__(self, refusal: RequestError | None = None):
        self.refusal = refusal
        self.validated: list[GenerateRequest] = []
        self.compiled: list[Constraint] = []

    def check_queue_room(self) -> None:
        """No queue: every request is taken."""

    def validate(self, req: GenerateRequest) -> None:
        self.validated.append(req)
        if self.refusal is not None and self.refusal.field != "constraint":
            raise self.refusal

    async def compile_grammar(self, constraint: Constraint) -> None:
        self.compiled.append(constraint)
        if self.refusal is not None:
            raise self.refusal


NAMES = {"prompt": "messages", "max_new_tokens": "max_completion_tokens", "constraint": "response_format"}


def fan_out_now(engine, *args, **kwargs) -> list[GenerateRequest]:
    return asyncio.run(fan_out(ServingContext(engine, "m", None), *args, **kwargs))


def test_fan_out_numbers_choices_as_openai_and_validates_each_prompt_once():
    engine = RefusingEngine()
    requests = fan_out_now(engine, [[1, 2], [3]], SamplingParams(seed=7), 3, "cmpl-x", NAMES, batch=True,
                           priority=1, cache_salt="t")
    assert [r.rid for r in requests] == ["cmpl-x-0-0", "cmpl-x-0-1", "cmpl-x-0-2",
                                         "cmpl-x-1-0", "cmpl-x-1-1", "cmpl-x-1-2"]
    assert [r.input_ids for r in requests] == [[1, 2]] * 3 + [[3]] * 3
    assert [r.params.seed for r in requests] == [7, 8, 9] * 2
    assert all(r.batch and r.priority == 1 and r.cache_salt == "t" for r in requests)
    assert [r.rid for r in engine.validated] == ["cmpl-x-0-0", "cmpl-x-1-0"]
    single = fan_out_now(engine, [[1]], SamplingParams(), 1, "chatcmpl-y", NAMES)
    assert [r.rid for r in single] == ["chatcmpl-y"]
    assert engine.compiled == []


def test_fan_out_compiles_a_constraint_once():
    engine = RefusingEngine()
    constraint = Constraint("regex", "a+")
    requests = fan_out_now(engine, [[1], [2]], SamplingParams(constraint=constraint), 3, "r", NAMES)
    assert len(requests) == 6 and all(r.params.constraint == constraint for r in requests)
    assert engine.compiled == [constraint]


@pytest.mark.parametrize("field, param", [("prompt", "messages"), ("max_new_tokens", "max_completion_tokens"),
                                          ("rid", "rid"), ("constraint", "response_format")])
def test_engine_refusals_name_the_route_parameter(field, param):
    engine = RefusingEngine(RequestError("too long", field, "context_length_exceeded"))
    with pytest.raises(APIError) as caught:
        fan_out_now(engine, [[1]], SamplingParams(constraint=Constraint("regex", "a")), 2, "r", NAMES)
    err = caught.value
    assert (err.status, err.message, err.param, err.code) == (400, "too long", param, "context_length_exceeded")


def test_prompt_shapes(tokenizer):  # noqa: F811
    ids, single = prompt_id_lists(tokenizer, "Hello", "prompt")
    assert single and ids == [tokenizer.encode("Hello", add_special_tokens=True)]
    ids, single = prompt_id_lists(tokenizer, ["a", "b"], "prompt")
    assert not single and len(ids) == 2
    assert prompt_id_lists(tokenizer, [5, 6], "prompt") == ([[5, 6]], True)
    assert prompt_id_lists(tokenizer, [[5], [6, 7]], "input_ids", text=False) == ([[5], [6, 7]], False)
    for bad, param, text in (([[1, "a"]], "prompt", True), ([[True]], "prompt", True), (42, "prompt", True),
                             ([], "prompt", True), ("hi", "input_ids", False), ([1.5], "input_ids", False)):
        with pytest.raises(APIError) as caught:
            prompt_id_lists(tokenizer, bad, param, text=text)
        assert caught.value.param == param


def test_usage_counts_each_prompt_once():
    def final(prompt, completion, cached):
        return GenerateOutput("r", "", [], True, "stop", prompt_tokens=prompt, completion_tokens=completion,
                              cached_tokens=cached)

    body = usage([final(10, 3, 0), final(10, 4, 8), final(5, 1, 0), final(5, 2, 4)], n=2)
    assert (body.prompt_tokens, body.completion_tokens, body.total_tokens) == (15, 10, 25)
    assert body.prompt_tokens_details.cached_tokens == 12


def test_one_sampling_function_reads_openai_and_sglang_fields():
    openai = msgspec.convert({"prompt": "x", "temperature": 0, "top_k": 0, "stop": "\n", "n": 2,
                              "logit_bias": {"5": 1.5}}, CompletionRequest)
    sglang = NativeSamplingParams(temperature=0, top_k=0, stop="\n", n=2, logit_bias={"5": 1.5})
    a = sampling_params(openai, None, vocab_size=100)
    b = sampling_params(sglang, None, vocab_size=100)
    assert a == b
    assert a.top_k == -1 and a.stop == ["\n"] and a.logit_bias == {5: 1.5} and a.max_new_tokens is None
    assert not a.logprobs
    with_logprobs = sampling_params(sglang, 8, 100, top_logprobs=3, prompt_logprobs=True)
    assert (with_logprobs.logprobs, with_logprobs.top_logprobs, with_logprobs.prompt_logprobs) == (True, 3, True)
    with pytest.raises(APIError) as caught:
        sampling_params(sglang, 8, 100, top_logprobs=21, top_logprobs_param="top_logprobs_num")
    assert caught.value.param == "top_logprobs_num"


class Item(msgspec.Struct):
    id: str


def test_page_walks_a_list_by_cursor():
    items = [Item(f"i{k}") for k in range(5)]
    first = page(items, {"limit": "2"}, default_limit=20, max_limit=100)
    assert [i.id for i in first["data"]] == ["i0", "i1"] and first["has_more"]
    assert (first["first_id"], first["last_id"]) == ("i0", "i1")
    rest = page(items, {"after": "i1"}, default_limit=20, max_limit=100)
    assert [i.id for i in rest["data"]] == ["i2", "i3", "i4"] and not rest["has_more"]
    empty = page([], {}, default_limit=20, max_limit=100)
    assert empty["data"] == [] and empty["first_id"] is None
    for query in ({"limit": "x"}, {"limit": "0"}, {"limit": "101"}, {"after": "nope"}):
        with pytest.raises(APIError):
            page(items, query, default_limit=20, max_limit=100)
