"""NGRAM speculative decoding: greedy output identical to decoding without
it, whatever lands inside an accepted run, and every KV page back after."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pyserve.engine.engine import Engine
from pyserve.engine.request import Constraint, GenerateRequest, SamplingParams
from pyserve.engine.speculative.ngram import find_draft
from pyserve.engine.speculative.rejection import greedy_run
from pyserve.server_args import ServerArgs
from tests.slow import slow

SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4,
        "speculative_ngram_min_match_window_size": 1}  # drafts as often as possible: the most runs checked


async def started(model_dir, **kwargs) -> Engine:
    kwargs.setdefault("max_total_tokens", 4096)
    kwargs.setdefault("disable_overlap_schedule", True)
    engine = Engine.from_args(ServerArgs(model_path=str(model_dir), **kwargs))
    await engine.start()
    return engine


async def collect(engine: Engine, ids, lora: str | None = None, **params):
    text, tokens, logprobs, last = "", [], [], None
    async for out in engine.generate(GenerateRequest(list(ids), SamplingParams(**params), lora=lora)):
        text += out.text
        tokens += out.token_ids
        logprobs += out.logprobs or []
        last = out
    return text, tokens, logprobs, last


def with_and_without(model_dir, requests, speculative: dict, engine_args=None, sequential=False):
    """Each request's (text, tokens, logprobs, last output) on an engine
    without speculation and on one with the `speculative` options, all
    requests run together (or one after the other); every KV page back
    after each; and the speculative engine's metrics."""
    async def main(extra):
        engine = await started(model_dir, **(engine_args or {}), **extra)
        try:
            if sequential:
                got = [await collect(engine, ids, **params) for ids, params in requests]
            else:
                got = await asyncio.gather(*[collect(engine, ids, **params) for ids, params in requests])
            assert engine.integrity_problem() is None
            assert engine.kv_usage()["in_use"] == 0
            return got, engine.metrics
        finally:
            await engine.shutdown()
    plain, _ = asyncio.run(main({}))
    got, metrics = asyncio.run(main(speculative))
    return plain, got, metrics


def outputs(model_dir, requests, engine_args=None):
    """Each request's (text, tokens, logprobs, finish) with and without NGRAM,
    all requests run together; the verify steps taken."""
    plain, spec, metrics = with_and_without(model_dir, requests, SPEC, engine_args)
    return plain, spec, metrics.spec_verify_steps


def same(plain, spec, logprob_tol=1e-4):
    for (t0, ids0, lp0, last0), (t1, ids1, lp1, last1) in zip(plain, spec):
        assert ids1 == ids0
        assert t1 == t0
        assert (last1.finish_reason, last1.matched_stop) == (last0.finish_reason, last0.matched_stop)
        assert len(lp1) == len(lp0)
        for a, b in zip(lp0, lp1):
            assert b.token_id == a.token_id
            if logprob_tol is not None:
                assert b.logprob == pytest.approx(a.logprob, abs=logprob_tol)
                assert [t for t, _ in b.top] == [t for t, _ in a.top]


def repetitive(n=40):
    return [int(t) for t in (list(range(200, 220)) * 4)[:n]]


def test_find_draft_takes_what_most_occurrences_of_the_longest_match_go_on_with():
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert find_draft(ids, 1, 4, 3) == [7, 8, 5]  # suffix [2, 3], seen before 9 and before 7: the latest
    assert find_draft(ids, 3, 4, 3) == []  # [x, 2, 3] with x = 5 never recurs
    assert find_draft([4, 4, 4], 1, 2, 5) == [4]
    # [1, 2, 3] went on with 5, 6 twice and with 8, 9 last: the drafts follow the two.
    assert find_draft([1, 2, 3, 5, 6, 1, 2, 3, 5, 6, 1, 2, 3, 8, 9, 1, 2, 3], 1, 4, 3) == [5, 6, 1]
    # One occurrence each way: the latest's.
    assert find_draft([1, 2, 3, 5, 1, 2, 3, 8, 1, 2, 3], 1, 4, 3) == [8, 1, 2]
    # Where the latest occurrence's text runs out (it reaches the suffix itself), the others' goes on.
    assert find_draft([9, 1, 2, 1, 2, 7, 1, 2, 1, 2], 1, 2, 4) == [1, 2, 7, 1]
    # A loop of one word: the latest occurrence's continuation is one token, the earlier ones' go on.
    assert find_draft([3] + [5] * 5000, 3, 12, 6) == [5] * 6


def test_ngram_drafts_follow_the_run_the_last_verify_step_kept():
    """Up to --speculative-num-draft-tokens at first; then at most twice the
    run the last verify step kept plus one, at least 2."""
    from pyserve.engine.request import SamplingParams
    from pyserve.engine.sequence import Sequence
    from pyserve.engine.speculative.ngram import NgramDrafter

    drafter = NgramDrafter(16, 3, 12)
    seq = Sequence("r", list(range(100, 140)) * 3, SamplingParams(max_new_tokens=100, temperature=0))
    assert len(drafter.propose(seq)) == 16
    for accepted, room in ((0, 2), (1, 4), (3, 8), (16, 16), (2, 6)):
        drafter.on_verified(seq, drafted=room, accepted=accepted)
        assert drafter.budget(seq) == room
        assert len(drafter.propose(seq)) == room


@pytest.mark.parametrize("accepted, drafts_on", [([1] * 8, True), ([1] * 7 + [0], False), ([0] * 7, True)])
def test_a_request_stops_drafting_once_its_drafts_keep_less_than_they_cost(accepted, drafts_on):
    """Judged from the 8th verify step on: a request that kept fewer than
    15% of its drafted tokens (7 of 48 here) decodes plainly from then on;
    8 of 48 is enough, and 7 failed steps are not judged yet."""
    from pyserve.engine.request import SamplingParams
    from pyserve.engine.sequence import Sequence
    from pyserve.engine.speculative.ngram import NgramDrafter

    drafter = NgramDrafter(6, 3, 12)
    seq = Sequence("r", list(range(100, 140)) * 3, SamplingParams(max_new_tokens=100, temperature=0))
    for kept in accepted:
        drafter.on_verified(seq, drafted=6, accepted=kept)
    assert (drafter.propose(seq) != []) == drafts_on


def drafts_scheduled(shares_kept: list[float], draft_cost: float | None, drafter=None,
                     verify_steps: int = 8) -> list[bool]:
    """Whether each of len(shares_kept) requests, all decoding in one step,
    gets drafts, each having kept that share of the 6 tokens drafted in
    each of its `verify_steps` (8: judged) verify steps (from `drafter`, by
    default NGRAM's with `draft_cost`)."""
    from pyserve.engine.kv.manager import KVManager
    from pyserve.engine.kv.page_allocator import PageAllocator
    from pyserve.engine.request import SamplingParams
    from pyserve.engine.scheduler import Scheduler
    from pyserve.engine.sequence import Sequence
    from pyserve.engine.speculative.ngram import NgramDrafter

    sched = Scheduler(KVManager(PageAllocator(4096, 1), use_radix_cache=False), len(shares_kept),
                      max_prefill_tokens=4096, chunk_size=None, drafter=drafter or NgramDrafter(6, 3, 12, draft_cost))
    seqs = [Sequence(f"r{i}", list(range(100, 140)) * 3, SamplingParams(max_new_tokens=100, temperature=0))
            for i in range(len(shares_kept))]
    for seq in seqs:
        sched.add(seq)
    step = sched.schedule()  # the prompts
    sched.on_launched(step)
    sched.on_results(step)
    for seq, share in zip(seqs, shares_kept):
        seq.output_ids.append(100)  # the text repeats on: the n-gram lookup has drafts for every row
        seq.verify_steps, seq.drafted = verify_steps, 6 * verify_steps
        seq.accepted = round(seq.drafted * share)
    step = sched.schedule()
    # A request skipped for the step still counts as drafting: a draft model follows every row.
    assert step.draft_rows is None and all(seq.drafting for seq in seqs)
    return [bool(seq.draft_ids) for seq in seqs]


@pytest.mark.parametrize("draft_cost", [0.12, None])
def test_in_a_large_cpu_batch_only_requests_keeping_most_of_their_drafts_draft(draft_cost):
    """On a CPU a draft costs a fixed share (0.12) of a one-row decode step
    at any batch size, while a kept one saves a row's share of a step, which
    shrinks as rows share its weight reads: among 16 rows a request must
    keep over two thirds of its drafts. One keeping 30% drafts alone and
    among 3, not among 4 or 16. Where a draft costs next to nothing in a
    small batch (None: a GPU), every judged request above 15% drafts."""
    from pyserve.engine.speculative.drafter import PlaceholderDrafter

    on_cpu = draft_cost is not None
    assert drafts_scheduled([0.3], draft_cost) == [True]
    assert drafts_scheduled([0.3] * 3, draft_cost) == [True] * 3
    assert drafts_scheduled([0.3] * 4, draft_cost) == [not on_cpu] * 4
    assert drafts_scheduled([0.85] + [0.3] * 15, draft_cost) == [True] + [not on_cpu] * 15
    # A draft model's placeholders (STANDALONE) follow the same rule.
    standalone = PlaceholderDrafter(4, draft_cost, follows_steps=True)
    assert drafts_scheduled([0.85] + [0.3] * 15, draft_cost, standalone) == [True] + [not on_cpu] * 15


def test_before_it_is_judged_a_request_drafts_in_a_large_cpu_batch_until_it_keeps_too_few():
    """A new request drafts among 16 rows; after two verify steps keeping a
    third of its drafts, it counts as having kept 12 of 20 (8 trusted), too
    few among 16 (two thirds) and enough among 3. Alone, a request is
    judged after 8 steps as before."""
    assert drafts_scheduled([0.0] * 16, 0.12, verify_steps=0) == [True] * 16
    assert drafts_scheduled([1 / 3] * 16, 0.12, verify_steps=2) == [False] * 16
    assert drafts_scheduled([1 / 3] * 3, 0.12, verify_steps=2) == [True] * 3
    assert drafts_scheduled([1.0] + [1 / 3] * 15, 0.12, verify_steps=2) == [True] + [False] * 15
    assert drafts_scheduled([0.2], 0.12, verify_steps=7) == [True]


def test_greedy_run_stops_at_the_first_disagreement():
    # Drafts [5, 6, 7] against the target's argmax [5, 6, 9, 1]: two kept, then the target's 9.
    assert greedy_run([5, 6, 9, 1], [5, 6, 7]) == [5, 6, 9]
    assert greedy_run([4, 2], [3]) == [4]
    assert greedy_run([3, 8], [3]) == [3, 8]  # all kept: the target's token after them too


def plain_decoding(rows: torch.Tensor, drafts: list[int], state, sampler) -> list[int]:
    """What decoding one token a step emits over verify rows whose logits do
    not depend on the tokens before them: row j is sampled once row j - 1's
    token is output, until a token differs from its draft or the grammar
    forces text (the forced tokens follow)."""
    emitted = []
    for j, row in enumerate(rows):
        token = int(sampler.sample(row[None].clone(), [state])[0])
        forced = (sampler.take_forced() or [[]])[0]
        emitted += [token] + forced
        state.seq.output_ids.append(token)
        if forced or j == len(drafts) or token != drafts[j]:
            break
    return emitted


def verified_and_plain(model_dir, drafts: list[str], rows: list[dict], schema: str | None, after: str | None = None,
                       drawn: bool = False, **params):
    """One sequence's verify step on the embedded model's vocabulary, its
    drafts and its rows' logits (0 but the tokens named, and `ĠB` at 4.5)
    given as tokens; `after`: the text the grammar starts after; `drawn`:
    the drafts come with the (one-hot) distributions they were drawn from. Returns
    (the tokens verify_drafts emits, the forced ones after them included;
    the tokens decoding one token a step emits)."""
    from pyserve._rust import Tokenizer
    from pyserve.engine.grammar import GrammarBackend, tokenizer_info
    from pyserve.engine.sampler import Sampler
    from pyserve.engine.sampling_state import SamplingState
    from pyserve.engine.sequence import Sequence
    from pyserve.engine.speculative.rejection import verify_drafts

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = tokenizer.vocab_size
    backend = GrammarBackend(tokenizer_info(tokenizer, (model_dir / "tokenizer.json").read_text(), vocab, [2]),
                             tokenizer)
    constraint = Constraint("json_schema", schema) if schema else None
    draft = [tokenizer.token_to_id(t) for t in drafts]
    logits = torch.zeros(len(rows), vocab)
    logits[:, tokenizer.token_to_id("ĠB")] = 4.5
    for j, row in enumerate(rows):
        for token, value in row.items():
            logits[j, tokenizer.token_to_id(token)] = value
    bias = {tokenizer.token_to_id(t): v for t, v in params.pop("logit_bias", {}).items()}

    def state():
        seq = Sequence("r", [7, 8], SamplingParams(**{"temperature": 0, **params}, constraint=constraint,
                                                   logit_bias=bias))
        grammar = backend.new_state(asyncio.run(backend.compile(constraint)), after) if constraint else None
        return SamplingState(seq, grammar=grammar, stop_ids=frozenset([2]))  # 2: <|im_end|>
    try:
        q = [torch.nn.functional.one_hot(torch.tensor(draft), vocab).float()] if drawn else None
        ids, counts, forced, _ = verify_drafts(logits.clone(), [state()], [draft], q, Sampler(0))
        verified = ids[: counts[0]].tolist() + (forced[0] if forced else [])
        return verified, plain_decoding(logits, draft, state(), Sampler(0))
    finally:
        backend.shutdown()


NAME = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'


@pytest.mark.parametrize("drafts, rows, schema, params, expected", [
    # A frequency penalty counts the drafts before each row: the third `ĠA` falls below `ĠB`.
    (["ĠA"] * 3, [{"ĠA": 5.0}] * 4, None, {"frequency_penalty": 0.3}, ["ĠA", "ĠA", "ĠB"]),
    (["ĠA"] * 2, [{"ĠA": 5.0}] * 3, None, {"repetition_penalty": 1.5}, ["ĠA", "ĠB"]),
    (["ĠA", "ĠC"], [{"ĠA": 5.0}, {"ĠC": 5.0}, {}], None, {"logit_bias": {"ĠC": -1.0}}, ["ĠA", "ĠB"]),
    # min_tokens masks the stop token up to its row, and no further.
    (["ĠA", "<|im_end|>"], [{"ĠA": 5.0}, {"<|im_end|>": 5.0}, {}], None, {"min_new_tokens": 2}, ["ĠA", "ĠB"]),
    (["ĠA", "<|im_end|>"], [{"ĠA": 5.0}, {"<|im_end|>": 5.0}, {}], None, {"min_new_tokens": 1},
     ["ĠA", "<|im_end|>", "ĠB"]),
    # A grammar masks each row after the drafts before it: `Ġ` is refused after `{"`.
    (["{", '"', "Ġ"], [{"{": 5.0}, {'"': 5.0}, {"Ġ": 5.0, "name": 1.0}, {}], NAME, {"logprobs": True},
     ["{", '"', "name"]),
    # Jump-forward: the run ends at the first token the grammar forces text
    # after, `{`, and the tokenizer's encoding of the two replaces it, as
    # decoding one token a step gives, though the drafts spell the same text.
    (["{", '"', "name"], [{"{": 5.0}, {'"': 5.0}, {"name": 5.0}, {'":': 5.0}], NAME, {},
     ['{"', "name", '":', 'Ġ"']),
], ids=["frequency", "repetition", "logit-bias", "min-tokens", "min-tokens-ends", "grammar", "jump-forward"])
def test_verification_samples_each_row_as_plain_decoding_would(default_model_dir, drafts, rows, schema, params,
                                                              expected):
    from pyserve._rust import Tokenizer

    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    verified, plain = verified_and_plain(default_model_dir, drafts, rows, schema, **params)
    assert [tokenizer.id_to_token(t) for t in verified] == expected
    assert verified == plain


def test_a_grammar_that_starts_after_reasoning_verifies_the_drafts_before_it_starts(default_model_dir):
    """Until `</think>` is out the output is free; the grammar's masks past
    the draft that would complete it are not known: the row verifies the
    drafts before that one, and the target's own token there may complete
    it. Decoding one token a step then goes on under the grammar."""
    from pyserve._rust import Tokenizer

    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    drafts = ["ĠA", "</", "think", ">", "{"]
    rows = [{"ĠA": 5.0}, {"</": 5.0}, {"think": 5.0}, {">": 5.0}, {"{": 5.0}, {}]
    reasoning = [tokenizer.token_to_id(t) for t in drafts[:4]]
    verified, plain = verified_and_plain(default_model_dir, drafts, rows, NAME, after="</think>", logprobs=True)
    assert verified == reasoning and plain[:5] == reasoning + [tokenizer.token_to_id("{")]
    # Sampled, drafts drawn from a distribution: the run ends with the draft that ends the block.
    sure = [{token: 30.0 for token in row} for row in rows]  # each favoured token's probability ~1
    verified, _ = verified_and_plain(default_model_dir, drafts, sure, NAME, after="</think>", drawn=True,
                                     temperature=1.0, logprobs=True)
    assert verified == reasoning
    # Jump-forward: the grammar's first stretch follows the token that ended the reasoning.
    verified, plain = verified_and_plain(default_model_dir, drafts, rows, NAME, after="</think>")
    assert verified == plain and verified[:4] == reasoning and tokenizer.decode(verified[4:]) == '{"name": "'


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_identical_on_a_tiny_checkpoint(tiny_llama_dir, page_size):
    greedy = {"temperature": 0, "ignore_eos": True}
    requests = [
        (repetitive(), {**greedy, "max_new_tokens": 30}),
        (repetitive(33), {**greedy, "max_new_tokens": 7, "logprobs": True, "top_logprobs": 3}),
        ([5, 17, 99], {**greedy, "max_new_tokens": 12}),
        (repetitive(), {**greedy, "max_new_tokens": 20, "presence_penalty": 0.5}),
        # vLLM's bad_words and allowed_token_ids: a drafted 204 after 203 is rejected.
        (repetitive(), {**greedy, "max_new_tokens": 20, "banned_sequences": ((203, 204),)}),
        (repetitive(), {**greedy, "max_new_tokens": 20, "allowed_token_ids": tuple(range(200, 230, 2))}),
    ]
    plain, spec, verify_steps = outputs(tiny_llama_dir, requests, {"page_size": page_size})
    same(plain, spec)
    assert verify_steps > 0
    banned, allowed = plain[4][1], plain[5][1]
    assert not any(banned[i:i + 2] == [203, 204] for i in range(len(banned)))
    assert set(allowed) <= set(range(200, 230, 2))


SCHEMA = '{"type": "object", "properties": {"text": {"type": "string", "maxLength": 30}}, "required": ["text"]}'
COPY = ("Rewrite this text, changing nothing: The quick brown fox jumps over the lazy dog. "
        "The quick brown fox jumps over the lazy dog again. Then the fox sleeps.\nText: ")


# Both modes: a verify row's tokens get the logits a decode step gives them
# (the default 4-bit mode attends them as decode rows, rust/kernels/decode_layer.rs),
# so tokens and logprobs agree.
def assert_identical_on_the_embedded_model(default_model_dir, speculative: dict, mode: dict, tol):
    """The copy prompt on the embedded model with and without the
    `speculative` options: the same output (logprobs within `tol`), with a
    stop string and a stop token inside accepted runs, max_tokens never
    exceeded, and a constrained request and a penalized one; the
    speculative engine's metrics."""
    from pyserve._rust import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    ids = tok.encode(COPY)
    greedy = {"temperature": 0}
    requests = [
        (ids, {**greedy, "max_new_tokens": 40}),
        (ids, {**greedy, "max_new_tokens": 9}),
        (ids, {**greedy, "max_new_tokens": 40, "stop": ["lazy"]}),
        (ids, {**greedy, "max_new_tokens": 40, "logprobs": True, "top_logprobs": 2}),
        (ids, {**greedy, "max_new_tokens": 60, "stop_token_ids": tok.encode(" jumps")[:1]}),
        (ids, {**greedy, "max_new_tokens": 30, "constraint": Constraint("json_schema", SCHEMA)}),
        (ids, {**greedy, "max_new_tokens": 30, "frequency_penalty": 0.3, "logit_bias": {tok.encode(" fox")[0]: -2.0}}),
        (ids, {**greedy, "max_new_tokens": 40, "stop": ["lazy"], "keep_stop": True}),
    ]
    plain, spec, metrics = with_and_without(default_model_dir, requests, speculative, mode)
    same(plain, spec, tol)
    assert plain[2][3].finish_reason == "stop"
    assert spec[7][0] == spec[2][0] + "lazy"  # a kept stop, and nothing after it
    assert len(spec[1][1]) == 9  # max_tokens never exceeded
    assert spec[4][3].finish_reason == "stop" and len(spec[4][1]) < 60
    return metrics


# float32 slow: the tiny checkpoints' tests run in float32; here the embedded model's default 4-bit mode.
@pytest.mark.parametrize("mode,tol", [pytest.param({"torchao_config": "none"}, 1e-4, id="float32", marks=slow),
                                      pytest.param({}, 1e-6, id="4bit")])
def test_greedy_identical_on_the_embedded_model_with_stops_in_accepted_runs(default_model_dir, mode, tol):
    metrics = assert_identical_on_the_embedded_model(default_model_dir, SPEC, mode, tol)
    assert metrics.spec_verify_steps > 0


def test_greedy_identical_when_the_kv_pool_forces_retraction(tiny_llama_dir, caplog):
    """A pool too small for every request at once: requests are retracted
    and resumed mid-draft, and still decode as without speculation."""
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 40}
    # Repeating stretches of their own: no prefix shared through the cache.
    requests = [([300 + 50 * i + t % 20 for t in range(40)], greedy) for i in range(4)]
    with caplog.at_level("INFO", logger="pyserve.engine"):
        plain, spec, verify_steps = outputs(tiny_llama_dir, requests, {"page_size": 4, "max_total_tokens": 200})
    same(plain, spec)
    assert verify_steps > 0
    assert "retracting" in caplog.text


def test_accept_length_and_rate_are_reported_under_each_familys_names(default_model_dir, caplog):
    """The decode log line's accept len; /metrics' series under pyserve's,
    SGLang's and vLLM's names (vLLM counts drafts and kept drafts, SGLang
    reports the mean length and rate); /get_server_info's internal state."""
    from pyserve._rust import Tokenizer
    from pyserve.engine.metrics import FAMILIES

    ids = Tokenizer.from_file(str(default_model_dir / "tokenizer.json")).encode(COPY)

    async def main():
        engine = await started(default_model_dir, **SPEC, decode_log_interval=2)
        try:
            await collect(engine, ids, temperature=0, max_new_tokens=30)
            # What SGLang's tools read from /get_server_info: the same mean.
            assert engine.internal_state()["avg_spec_accept_length"] == engine.metrics.accept_length()
            return engine.metrics.render({}, FAMILIES, "m"), engine.metrics.spec_verify_steps
        finally:
            await engine.shutdown()
    with caplog.at_level("INFO", logger="pyserve.engine"):
        text, verify_steps = asyncio.run(main())
    assert any("accept len: " in r.getMessage() for r in caplog.records if "Decode batch." in r.getMessage())
    series = {line.split()[0].split("{")[0]: float(line.split()[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    calls, drafted, kept = (series[f"vllm:spec_decode_num_{n}_total"] for n in ("drafts", "draft_tokens",
                                                                                "accepted_tokens"))
    assert calls == series["pyserve:spec_verify_calls_total"] == series["sglang:spec_verify_calls_total"] == verify_steps
    assert 0 < kept <= drafted <= SPEC["speculative_num_draft_tokens"] * calls
    assert kept == series["pyserve:spec_accepted_drafts_total"] and drafted == series["pyserve:spec_draft_tokens_total"]
    assert series["sglang:spec_accept_length"] == pytest.approx(1 + kept / calls)
    assert series["sglang:spec_accept_length"] > 1.5  # the copy is drafted and kept several tokens a step
    assert series["sglang:spec_accept_rate"] == pytest.approx(kept / drafted)
    assert "sglang:spec_draft_tokens_total" not in series and "vllm:spec_accept_length" not in series
    # vLLM's kept drafts by position: a draft is kept only after every one before it.
    by_position = [float(line.split()[1]) for line in text.splitlines()
                   if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert len(by_position) == SPEC["speculative_num_draft_tokens"] and sum(by_position) == kept
    assert by_position == sorted(by_position, reverse=True) and by_position[0] > 0
    assert "sglang:spec_accepted_drafts_per_position_total" not in series
