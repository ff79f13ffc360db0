"""Jump-forward decoding on the embedded model: the text a grammar forces
is appended at once, encoded as the tokenizer encodes it, so the model
reads the JSON it was trained on and answers in its own words; outputs
stay in the grammar's language, every limit and stop applies inside a
forced stretch, and every KV page comes back."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from pyserve._rust import Tokenizer
from pyserve.chat_template import ChatTemplate
from pyserve.engine.engine import Engine
from pyserve.engine.grammar import GrammarBackend, tokenizer_info
from pyserve.engine.request import Constraint, GenerateRequest, SamplingParams
from tests.slow import slow
from tests.test_speculative import started
from tests.test_structured_outputs import CITY_GRAMMAR, CITY_LANGUAGE, PERSON, in_language, json_language

CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20}},
        "required": ["name", "country"]}
# Cities of Japan (the Wikipedia list's largest, and towns the model may name).
JAPANESE_CITIES = {"Tokyo", "Osaka", "Kyoto", "Yokohama", "Nagoya", "Sapporo", "Kobe", "Fukuoka", "Kawasaki",
                   "Hiroshima", "Sendai", "Chiba", "Kitakyushu", "Sakai", "Niigata", "Hamamatsu", "Kumamoto",
                   "Sagamihara", "Okayama", "Shizuoka", "Kagoshima", "Nara", "Nagasaki", "Kanazawa", "Sakura",
                   "Hakodate", "Nikko", "Kamakura", "Matsuyama", "Takayama", "Himeji", "Naha", "Yokosuka",
                   "Osaka City", "Tokyo City", "Kyoto City"}
PATTERN = r"(yes|no), the answer is [a-z ]{3,20}\. Confidence: (high|low)\."
FLOAT32 = {"torchao_config": "none"}


def json_constraint(schema: dict) -> Constraint:
    return Constraint("json_schema", json.dumps(schema))


def chat(engine: Engine, text: str) -> list[int]:
    prompt = ChatTemplate.for_model(engine.model_dir).render([{"role": "user", "content": text}])
    return engine.tokenizer.encode(prompt)


async def deltas(engine: Engine, ids: list[int], **params) -> list:
    return [out async for out in engine.generate(GenerateRequest(list(ids), SamplingParams(**params)))]


def joined(outs: list) -> tuple[str, list[int]]:
    return "".join(o.text for o in outs), [t for o in outs for t in o.token_ids]


def with_engine(model_dir, check, **engine_args):
    """Run `check(engine)` on a fresh engine; every page is back after."""
    async def main():
        engine = await started(model_dir, **engine_args)
        try:
            result = await check(engine)
            assert engine.integrity_problem() is None
            assert engine.kv_usage()["in_use"] == 0
            return result
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def test_forced_text_is_encoded_with_the_sampled_token(default_model_dir):
    """`{` sampled, `"name": "` forced: the output gets the tokenizer's
    encoding of the two together, `{"` replacing `{`; the matcher is where
    that text leaves it, and with nothing forced the token stays alone."""
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    info = tokenizer_info(tokenizer, (default_model_dir / "tokenizer.json").read_text(), tokenizer.vocab_size, [2])
    backend = GrammarBackend(info, tokenizer)

    async def state():
        return backend.new_state(await backend.compile(json_constraint(CITY)), None)

    grammar = asyncio.run(state())
    brace = tokenizer.token_to_id("{")
    tokens = grammar.jump_forward(brace)
    assert tokens == tokenizer.encode('{"name": "') and tokens[0] != brace
    sakura = tokenizer.encode("Sakura")
    assert [grammar.jump_forward(t) for t in sakura] == [[t] for t in sakura]  # free text: nothing forced
    quote = tokenizer.encode('"')[0]
    assert tokenizer.decode(grammar.jump_forward(quote)) == '", "country": "'
    backend.shutdown()


def test_the_text_forced_after_a_reasoning_block_follows_the_token_that_ends_it(default_model_dir):
    """A constraint that starts after `</think>`: the token that ends the
    marker is free text, never in the grammar, and the grammar's first
    stretch (`{"name": "`) is appended after it as the tokenizer encodes it."""
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    info = tokenizer_info(tokenizer, (default_model_dir / "tokenizer.json").read_text(), tokenizer.vocab_size, [2])
    backend = GrammarBackend(info, tokenizer)

    async def state():
        return backend.new_state(await backend.compile(json_constraint(CITY)), "</think>")

    grammar = asyncio.run(state())
    *thinking, last = tokenizer.encode("Kyoto, I think.</think>")
    assert [grammar.jump_forward(t) for t in thinking] == [[t] for t in thinking]
    tokens = grammar.jump_forward(last)
    assert tokens[0] == last and tokenizer.decode(tokens[1:]) == '{"name": "' and not grammar.failed
    backend.shutdown()


# The 4-bit case (~27 s on 2 cores) is slow; float32 stays in the default suite.
@pytest.mark.parametrize("mode", [pytest.param(FLOAT32, id="float32"),
                                  pytest.param({}, id="4-bit", marks=slow)])
def test_the_japan_prompt_names_a_japanese_city(default_model_dir, mode):
    async def city(engine):
        ids = chat(engine, "Give me a city in Japan.")
        outs = await deltas(engine, ids, temperature=0, max_new_tokens=60, constraint=json_constraint(CITY))
        text, tokens = joined(outs)
        # Token by token the name may run to max_tokens: what it wrote of it.
        return re.match(r'\{"name": "([^"]*)', text).group(1), tokens, engine.tokenizer.encode('{"name": "')

    name, tokens, canonical = with_engine(default_model_dir, city, **mode)
    # The key is written as the tokenizer writes it, and the model names a city.
    assert tokens[:len(canonical)] == canonical
    assert name in JAPANESE_CITIES, name
    # Sampled token by token, the key is spelt `n`, `am`, `e` and the name is no city.
    off, off_tokens, _ = with_engine(default_model_dir, city, disable_jump_forward=True, **mode)
    assert off_tokens[:len(canonical)] != canonical
    assert off not in JAPANESE_CITIES and not re.fullmatch("[A-Za-z ]+", off), off


# Without overlap (the CPU's default) by default; with it, slow.
@pytest.mark.parametrize("overlap", [pytest.param(False, id="no-overlap"), pytest.param(True, id="overlap", marks=slow)])
def test_sampled_outputs_stay_in_the_grammars_language(default_model_dir, overlap):
    """JSON schema, regex and EBNF, n = 3 each, all at once, beside an
    unconstrained request; the forced stretches arrive in one delta each."""
    async def run(engine):
        person, answer = chat(engine, "Give me a person as JSON."), chat(engine, "Is the sea blue?")
        capital = chat(engine, "Tell me about a capital city.")
        jobs = [(person, json_constraint(PERSON)), (answer, Constraint("regex", PATTERN)),
                (capital, Constraint("ebnf", CITY_GRAMMAR))]
        runs = [deltas(engine, ids, temperature=0.9, seed=seed, max_new_tokens=200, constraint=c)
                for ids, c in jobs for seed in range(3)]
        free = deltas(engine, answer, temperature=0.9, seed=1, max_new_tokens=30, ignore_eos=True)
        return await asyncio.gather(*runs, free)

    outs = with_engine(default_model_dir, run, disable_overlap_schedule=not overlap)
    *constrained, free = outs
    assert len(joined(free)[1]) == 30
    for i, run_outs in enumerate(constrained):
        text, tokens = joined(run_outs)
        assert run_outs[-1].finish_reason == "stop", text
        if i < 3:
            jsonschema.validate(json.loads(text), PERSON)
        elif i < 6:
            assert re.fullmatch(PATTERN, text), text
        else:
            assert text in CITY_LANGUAGE, text
        assert len(tokens) == run_outs[-1].completion_tokens
    # Forced text came in several tokens at once (`, "age": ` and the like).
    assert any(len(o.token_ids) > 2 for run_outs in constrained[:6] for o in run_outs)


def test_overlap_and_streaming_do_not_change_the_tokens(default_model_dir):
    """Greedy: the same tokens with overlap on and off; the deltas' texts
    join to the decoded tokens (what a whole response returns)."""
    async def run(engine):
        return await deltas(engine, chat(engine, "Give me a person as JSON."), temperature=0, max_new_tokens=200,
                            constraint=json_constraint(PERSON))

    plain = with_engine(default_model_dir, run)
    overlapped = with_engine(default_model_dir, run, disable_overlap_schedule=False)
    assert joined(plain) == joined(overlapped)
    text, tokens = joined(plain)
    jsonschema.validate(json.loads(text), PERSON)
    assert text == _decode(default_model_dir, tokens)
    assert any(len(o.token_ids) > 2 for o in plain)


def _decode(model_dir, tokens: list[int]) -> str:
    from pyserve._rust import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(tokens)


def test_limits_and_stops_inside_a_forced_stretch(default_model_dir):
    """max_tokens and a stop string that land inside a stretch the grammar
    forced end the output there, as token by token they would."""
    async def run(engine):
        ids = chat(engine, "Give me a person as JSON.")
        params = dict(temperature=0, constraint=json_constraint(PERSON))
        full = await deltas(engine, ids, max_new_tokens=200, **params)
        # The first delta after the first one that carries a forced stretch of 3+ tokens.
        at = next(i for i, o in enumerate(full) if i and len(o.token_ids) >= 3)
        before = sum(len(o.token_ids) for o in full[:at])
        cut = await deltas(engine, ids, max_new_tokens=before + 2, **params)
        stopped = await deltas(engine, ids, max_new_tokens=200, stop=['"age'], **params)
        return full, before, cut, stopped

    full, before, cut, stopped = with_engine(default_model_dir, run)
    text, tokens = joined(full)
    cut_text, cut_tokens = joined(cut)
    assert cut[-1].finish_reason == "length" and cut[-1].completion_tokens == before + 2
    assert cut_tokens == tokens[:before + 2] and text.startswith(cut_text)
    assert in_language(json_language(PERSON), cut_text, "length")
    stop_text, stop_tokens = joined(stopped)
    assert stopped[-1].finish_reason == "stop" and stopped[-1].matched_stop == '"age'
    assert stop_text == text[:text.index('"age')]
    # `"age` is inside `, "age": `, which the grammar forces: the stop ended a stretch.
    assert len(stopped[-1].token_ids) > 1 and stop_tokens == tokens[:len(stop_tokens)]


def test_logprobs_requests_decode_token_by_token(default_model_dir):
    """Forced tokens have no log-probabilities: a request that asks for
    them gets exactly what jump-forward off gives."""
    async def run(engine):
        return await deltas(engine, chat(engine, "Is the sea blue?"), temperature=0, max_new_tokens=60,
                            logprobs=True, top_logprobs=2, constraint=Constraint("regex", PATTERN))

    on = with_engine(default_model_dir, run, **FLOAT32)
    off = with_engine(default_model_dir, run, disable_jump_forward=True, **FLOAT32)
    assert joined(on) == joined(off)
    assert all(len(o.token_ids) == len(o.logprobs) for o in on)
    assert [e.logprob for o in on for e in o.logprobs] == [e.logprob for o in off for e in o.logprobs]


def test_abort_in_the_middle_frees_everything(default_model_dir):
    async def run(engine):
        stream = engine.generate(GenerateRequest(chat(engine, "Give me a person as JSON."), SamplingParams(
            temperature=0.8, seed=3, max_new_tokens=200, constraint=json_constraint(PERSON))))
        got = [await anext(stream) for _ in range(3)]
        await stream.aclose()  # the caller stops listening: the request is aborted
        await asyncio.sleep(0.2)
        return got

    got = with_engine(default_model_dir, run, disable_overlap_schedule=False)
    assert not got[-1].finished


RECORD = {"type": "object", "properties": {k: {"type": "string", "maxLength": 40}
                                           for k in ("first", "last", "city", "street", "job")},
          "required": ["first", "last", "city", "street", "job"]}
RECORD_TEXT = ('Copy this record exactly as JSON: {"first": "Johanna", "last": "Smithson-Whitfield", '
               '"city": "Saint Petersburg", "street": "Old Harbour Lane", "job": "marine biologist"}')


def test_speculation_drafts_constrained_requests_which_still_jump(default_model_dir):
    """NGRAM drafts the values a JSON record copies from its prompt, the
    grammar forces its keys: the output is what jump-forward alone gives,
    in far fewer steps."""
    async def run(engine):
        outs = await deltas(engine, chat(engine, RECORD_TEXT), temperature=0, max_new_tokens=200,
                            constraint=json_constraint(RECORD))
        return outs, engine.metrics

    spec = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6,
            "speculative_ngram_min_match_window_size": 1}
    drafted, metrics = with_engine(default_model_dir, run, **spec)
    jumped, _ = with_engine(default_model_dir, run)
    assert joined(drafted) == joined(jumped)
    assert json.loads(joined(drafted)[0])["street"] == "Old Harbour Lane"
    assert metrics.accepted_drafts() > 10
    assert len(drafted) < len(jumped) / 2