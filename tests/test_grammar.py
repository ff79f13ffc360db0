"""Constrained decoding in the engine (engine/grammar.py, the sampler's
mask): the compiler and its cache, the mask in the sampler, and the
engine on the embedded model with constrained and free requests in one
batch, with overlap scheduling forced on, under retraction and aborts."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import weakref

import jsonschema
import pytest
import torch

import xgrammar as xgr

from pyserve._rust import Tokenizer
from pyserve.api.generation.tool_grammar import forced_calls, strict_calls, with_strict_calls
from pyserve.engine.engine import Engine
from pyserve.engine.grammar import GrammarBackend, tokenizer_info
from pyserve.engine.request import Constraint, GenerateRequest, RequestError, SamplingParams
from pyserve.engine.sampler import Sampler
from pyserve.engine.sampling_state import SamplingState
from pyserve.engine.sequence import Sequence
from pyserve.server_args import ServerArgs
from tests.slow import slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 12},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
}, "required": ["name", "age", "role", "tags"], "additionalProperties": False}
# Compiles in about a second on this machine: far past a budget of 10 ms.
# About 0.6 s to compile with xgrammar 0.2.9 on these cores: a regular
# language of up to 1000 repeats (xgrammar compiles long string lengths and
# arrays of them in milliseconds).
SLOW_SCHEMA = {"type": "string", "pattern": "^(a|b|c|d|e|f){100,1000}$"}
# How long a test waits for a compilation to land in the cache: a bound, far
# past SLOW_SCHEMA's compile on a busy machine, so a bug fails instead of hanging.
COMPILED_WITHIN_S = 120


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def info(default_model_dir, tokenizer):
    return tokenizer_info(tokenizer, (default_model_dir / "tokenizer.json").read_text(), tokenizer.vocab_size, [2])


# -- the compiler --------------------------------------------------------------


def test_compile_errors_carry_the_compilers_message_and_good_grammars_are_cached(info):
    async def main():
        backend = GrammarBackend(info)
        bad = {Constraint("regex", "(a|"): "The parenthesis is not closed",
               Constraint("ebnf", "root ::= foo"): 'Rule "foo" is not defined',
               Constraint("json_schema", '{"type": "objec"}'): 'Unsupported type "objec"',
               Constraint("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}'): "nope"}
        for constraint, words in bad.items():
            with pytest.raises(RequestError) as caught:
                await backend.compile(constraint)
            assert caught.value.field == "constraint" and words in caught.value.message
            assert not caught.value.message.startswith("[")  # no source location of the C++ code
        good = Constraint("json_schema", json.dumps(PERSON))
        first, second = await asyncio.gather(backend.compile(good), backend.compile(good))
        assert first is second is await backend.compile(good) is backend.cached(good)
        assert backend.cached(Constraint("regex", "(a|")) is None
        backend.shutdown()

    run(main())


def test_a_slow_compilation_is_refused_within_the_budget_and_cached_once_done(info):
    async def main():
        backend = GrammarBackend(info)
        backend.timeout_s = 0.01
        slow = Constraint("json_schema", json.dumps(SLOW_SCHEMA))
        with pytest.raises(RequestError) as caught:
            await backend.compile(slow)
        assert "took longer than 0.01 s" in caught.value.message
        # The loop was never blocked, and the compilation goes on: once done
        # it is cached for the next request.
        async def until_cached():
            while backend.cached(slow) is None:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(until_cached(), COMPILED_WITHIN_S)
        assert await backend.compile(slow) is backend.cached(slow)
        backend.shutdown()

    run(main())


WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}
CALLS = {
    "qwen25": 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}',
    "mistral": '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {"a": 1}}]',
}


@pytest.mark.parametrize("parser", list(CALLS))
def test_tool_call_grammars_accept_valid_calls_only(info, parser):
    async def main():
        backend = GrammarBackend(info)
        strict = await backend.compile(with_strict_calls(strict_calls([WEATHER, NOW], parser, True), None, None))
        assert xgr.GrammarMatcher(strict).accept_string(CALLS[parser])
        assert not xgr.GrammarMatcher(strict).accept_string(CALLS[parser].replace('"city"', '"town"'))
        key = "parameters" if parser == "llama3" else "arguments"
        forced = await backend.compile(forced_calls([WEATHER, NOW], key, single=False))
        good = f'[{{"name": "now", "{key}": {{}}}}, {{"name": "get_weather", "{key}": {{"city": "Rome"}}}}]'
        assert xgr.GrammarMatcher(forced).accept_string(good)
        for bad in (f'[{{"name": "later", "{key}": {{}}}}]', "[]", f'[{{"name": "get_weather", "{key}": {{}}}}]'):
            assert not xgr.GrammarMatcher(forced).accept_string(bad)
        backend.shutdown()

    run(main())


# -- the sampler ---------------------------------------------------------------


def constrained_seq(backend, constraint, temperature, seed=None, after=None) -> SamplingState:
    compiled = run(backend.compile(constraint))
    seq = Sequence(rid="r", prompt_ids=[1], params=SamplingParams(temperature=temperature, seed=seed))
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingState(seq, generator, backend.new_state(compiled, after))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_mask_keeps_constrained_rows_in_the_grammar_and_leaves_the_others_alone(info, tokenizer, temperature):
    backend = GrammarBackend(info)
    pattern = r"(yes|no), [0-9]{2,3}!"
    seqs = [constrained_seq(backend, Constraint("regex", pattern), temperature, seed=i) for i in range(3)]
    free = SamplingState(Sequence(rid="f", prompt_ids=[1], params=SamplingParams(temperature=0)))
    sampler, plain = Sampler(0), Sampler(0)
    gen = torch.Generator().manual_seed(0)
    out = [[] for _ in seqs]
    for _ in range(20):
        logits = torch.randn(4, tokenizer.vocab_size, generator=gen)
        before = logits.clone()
        ids = sampler.sample(logits, [*seqs, free]).tolist()
        assert torch.equal(logits, before)  # reported logprobs read the raw logits
        assert ids[3] == plain.sample(logits[3:], [free]).item()
        for row, token in enumerate(ids[:3]):
            if 2 not in out[row]:
                out[row].append(token)
    for tokens in out:
        assert tokens[-1] == 2  # the grammar's end allows only EOS
        assert re.fullmatch(pattern, tokenizer.decode(tokens[:-1], skip_special_tokens=True))
    backend.shutdown()


def test_a_constraint_after_a_marker_starts_where_the_marker_ends(info, tokenizer):
    backend = GrammarBackend(info)
    seq = constrained_seq(backend, Constraint("regex", "[0-9]+"), 0.0, after="</think>")
    sampler = Sampler(0)
    thinking = tokenizer.encode("<think>hmm, </th", False) + tokenizer.encode("ink>", False)
    letter = tokenizer.encode("x", False)[0]
    for token in thinking:  # free text: the model's choice goes through
        logits = torch.zeros(1, tokenizer.vocab_size)
        logits[0, token] = 10.0
        assert sampler.sample(logits, [seq]).item() == token
    logits = torch.zeros(1, tokenizer.vocab_size)
    logits[0, letter] = 10.0
    digit = sampler.sample(logits, [seq]).item()
    assert digit != letter and tokenizer.decode([digit], skip_special_tokens=True).isdigit()
    backend.shutdown()


# -- the engine on the embedded model ------------------------------------------


async def started_engine(**kwargs) -> Engine:
    kwargs.setdefault("max_total_tokens", 4096)
    engine = Engine.from_args(ServerArgs(**kwargs))
    await engine.start()
    return engine


def chat_prompt(engine: Engine, text: str) -> list[int]:
    from pyserve.chat_template import ChatTemplate

    template = ChatTemplate.for_model(engine.model_dir)
    return engine.tokenizer.encode(template.render([{"role": "user", "content": text}], add_generation_prompt=True))


async def generate(engine: Engine, ids: list[int], **params) -> tuple[str, list[int], str]:
    text, tokens, reason = "", [], None
    async for out in engine.generate(GenerateRequest(ids, SamplingParams(**params))):
        text, tokens, reason = text + out.text, tokens + out.token_ids, out.finish_reason
    return text, tokens, reason


# The overlapped case takes ~30-45 s on 2 cores: slow; the serial one stays in the default suite.
@pytest.mark.parametrize("overlap", [pytest.param(True, id="overlap", marks=slow),
                                     pytest.param(False, id="serial")])
def test_constrained_and_free_requests_in_one_batch(default_model_dir, overlap):
    """The free request's greedy tokens are the same beside constrained
    requests as beside the same requests unconstrained (no bitmask reaches
    its row); every constrained output fits its schema.

    Both runs must go through the same steps: a token computed in another
    step shape (a prompt alone or in a prefill long enough for the dense
    product, a decode row in a step that also extends prompts) may round
    its 8-bit activations differently and take another greedy path. So
    both prompts are cached and the schema compiled before either run:
    an uncached schema would hold the constrained requests back while the
    free one starts alone. And the model runs in float32: the text the
    grammar forces comes as multi-token rows (jump-forward), which make
    the constrained run's steps extend prompts where the other's decode."""
    async def main():
        engine = await started_engine(disable_overlap_schedule=not overlap, torchao_config="none")
        free_ids = chat_prompt(engine, "Tell me about the sea.")
        person_ids = chat_prompt(engine, "Describe a person as JSON.")
        schema = Constraint("json_schema", json.dumps(PERSON))
        await generate(engine, free_ids, max_new_tokens=1, temperature=0)
        await generate(engine, person_ids, max_new_tokens=1, temperature=0, constraint=schema)

        async def beside_people(**constraint):
            # Unconstrained, the people only need to run beside the free
            # request's 40 tokens: what they say after that is never read.
            return await asyncio.gather(
                generate(engine, free_ids, max_new_tokens=40, temperature=0, ignore_eos=True),
                *[generate(engine, person_ids, max_new_tokens=300 if constraint else 40, temperature=0.9, seed=i,
                           **constraint)
                  for i in range(4)])

        unconstrained = await beside_people()
        results = await beside_people(constraint=schema)
        assert results[0] == unconstrained[0]
        for text, tokens, reason in results[1:]:
            assert reason == "stop" and tokens[-1] in engine.eos_token_ids
            jsonschema.validate(json.loads(text), PERSON)
        assert engine.integrity_problem() is None
        await engine.shutdown()

    run(main())


def test_grammar_end_stops_the_request_even_with_ignore_eos(default_model_dir):
    async def main():
        engine = await started_engine()
        ids = chat_prompt(engine, "Is the sea blue?")
        for seed in range(3):
            text, tokens, reason = await generate(engine, ids, max_new_tokens=50, temperature=1.0, seed=seed,
                                                  ignore_eos=True, constraint=Constraint("regex", "(yes|no)"))
            assert text in ("yes", "no") and reason == "stop" and tokens[-1] in engine.eos_token_ids
        await engine.shutdown()

    run(main())


def test_retracted_requests_keep_their_place_in_the_grammar(default_model_dir, caplog):
    async def main():
        engine = await started_engine(max_total_tokens=240, disable_radix_cache=True, disable_overlap_schedule=False)
        ids = chat_prompt(engine, "Describe a person as JSON.")
        schema = Constraint("json_schema", json.dumps(PERSON))
        results = await asyncio.gather(*[
            generate(engine, ids + [i + 100], max_new_tokens=200, temperature=0.9, seed=i, constraint=schema)
            for i in range(6)])
        for text, _, reason in results:
            assert reason == "stop"
            jsonschema.validate(json.loads(text), PERSON)
        assert engine.integrity_problem() is None
        await engine.shutdown()

    with caplog.at_level(logging.INFO, logger="pyserve.engine"):
        run(main())
    assert "retracting request" in caplog.text


def test_an_aborted_request_lets_go_of_its_matcher(default_model_dir):
    async def main():
        engine = await started_engine()
        ids = chat_prompt(engine, "Describe a person as JSON.")
        params = SamplingParams(max_new_tokens=200, temperature=0.8,
                                constraint=Constraint("json_schema", json.dumps(PERSON)))
        stream = engine.generate(GenerateRequest(ids, params, rid="gone"))
        await stream.__anext__()
        seq = engine.scheduler.requests["gone"]
        sampler = engine.runner.sampler
        # The matcher belongs to the forward thread: ask there.
        state = await asyncio.wrap_future(
            engine.runner.executor.submit(lambda: weakref.ref(sampler.states_of([seq])[0].grammar)))
        await stream.aclose()  # the client went away
        # The forward thread drops it after the steps queued before the
        # abort: wait for what is queued now.
        await asyncio.wrap_future(engine.runner.executor.submit(lambda: None))
        gc.collect()
        assert state() is None and not engine.scheduler.requests
        assert engine.integrity_problem() is None
        await engine.shutdown()

    run(main())


def test_a_constraint_after_a_marker_frees_the_text_before_it(default_model_dir):
    """The reasoning parser's case, with a marker this small model writes:
    free text up to the first ".", the grammar from there on."""
    async def main():
        engine = await started_engine()
        ids = chat_prompt(engine, "Tell me about the sea.")
        text, _, reason = await generate(engine, ids, max_new_tokens=120, temperature=0,
                                         constraint=Constraint("regex", " ?(yes|no)", after="."))
        before, marker, after = text.partition(".")
        assert marker and reason == "stop" and len(before.split()) > 2
        assert re.fullmatch(" ?(yes|no)", after)
        await engine.shutdown()

    run(main())


def test_grammar_backend_none_refuses_constraints(tiny_llama_dir):
    async def main():
        engine = await started_engine(model_path=str(tiny_llama_dir), grammar_backend="none")
        request = GenerateRequest([5, 6], SamplingParams(constraint=Constraint("regex", "a")))
        with pytest.raises(RequestError) as caught:
            engine.validate(request)
        assert caught.value.field == "constraint" and "--grammar-backend none" in caught.value.message
        with pytest.raises(RequestError):
            await engine.compile_grammar(Constraint("regex", "a"))
        engine.validate(GenerateRequest([5, 6], SamplingParams()))
        await engine.shutdown()

    run(main())
