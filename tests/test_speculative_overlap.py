"""Speculative decoding with overlap scheduling: a step is scheduled while
the previous one, verifying drafts, still runs; the forward thread moves
each row back over the drafts the target rejected and finds NGRAM's drafts
from the accepted tokens. The output stays what decoding without either
gives, and every KV page comes back."""

from __future__ import annotations

import asyncio

import pytest
import torch

import pyserve.engine.runner.model_runner as model_runner
from pyserve.engine.speculative import overlap
from pyserve.engine.speculative.ngram import LateNgramDraft
from pyserve.model.forward_batch import ForwardBatch
from tests.test_sliding_pool import assert_as_transformers, engine_greedy, sliding_engine
from tests.test_speculative import (SPEC, assert_identical_on_the_embedded_model, outputs, repetitive, same,
                                    with_and_without)
from tests.test_speculative_standalone import GREEDY, assert_abort_gives_every_page_back, drafts  # noqa: F401
from tests.slow import slow_test
from tests.tiny_models import build_tiny_model
from tests.test_speculative_standalone import run_both as standalone_both

OVERLAP = {"disable_overlap_schedule": False}
TWO_RANKS = {"tp_size": 2, "device": "cpu", "torchao_config": "none"}


def test_a_moved_row_reads_and_writes_what_a_row_built_at_its_place_would():
    """Sequence 1 scheduled at position 7 with 3 drafts, after a step that
    gave back 2 slots (rejected drafts), and cut to 1 draft: it is the
    2-token row built at position 5; the logits rows of its cut tokens go."""
    slots = [torch.arange(100, 106), torch.arange(200, 211), torch.arange(300, 304)]
    scheduled = ForwardBatch.build(
        [1, 2, 3, 4, 5, 6], [5, 7, 8, 9, 10, 3], torch.tensor([105, 207, 208, 209, 210, 303]), [1, 4, 1], slots,
        [0, 1, 2, 3, 4, 5], is_decode=False, device="cpu", window_slots=lambda s: s + 1000)
    moved = overlap.relaid(scheduled, {1: (2, 2)})
    slots[1] = slots[1][:7]
    expected = ForwardBatch.build(
        [1, 2, 3, 6], [5, 5, 6, 3], torch.tensor([105, 205, 206, 303]), [1, 2, 1], slots,
        [0, 1, 2, 3], is_decode=False, device="cpu", window_slots=lambda s: s + 1000)
    for name in ("input_ids", "positions", "out_cache_loc", "kv_indptr", "kv_indices", "logits_indices",
                 "window_out_cache_loc", "window_kv_indices"):
        assert getattr(moved, name).tolist() == getattr(expected, name).tolist(), name
    assert (moved.seq_lens, moved.extend_lens) == (expected.seq_lens, expected.extend_lens)
    assert scheduled.positions.tolist() == [5, 7, 8, 9, 10, 3]  # the event loop's batch is left as it was


def test_placeholders_read_the_last_token_each_sequence_emitted():
    # Two sequences: the first had room for 3 drafts, verified 2 and kept 1
    # (+ the target's token), so 2 of its slots go back.
    runs = overlap.StepRuns.of(torch.tensor([11, 12, 13, 21]), [[7, 8], []], [2, 1], [[0, 0, 0], []])
    assert runs.dropped == [2, 0] and runs.first_rows == [0, 3]
    ids = overlap.resolve_placeholders(torch.tensor([-2, 5, -1, 0, 0]), runs)
    assert ids.tolist() == [21, 5, 12, 0, 0]


def test_a_late_ngram_draft_reads_the_accepted_tokens():
    late = LateNgramDraft(known=[1, 2, 3, 4, 9, 1], min_window=2, max_window=3, k=3)
    assert late.find([2]) == ([3, 4, 9], None)  # "1 2" matched only once the accepted 2 is known
    assert late.find([7]) == ([], None)  # no match: the row is cut to its first token


@pytest.fixture
def late_steps(monkeypatch):
    """Counts, over the engines a test runs, the following rows the forward
    thread moved back, the drafts it found late, and the rows it cut to
    fewer drafts than they had room for."""
    seen = {"moved": 0, "late": 0, "cut": 0}
    real = overlap.follow_previous

    def counted(step, runs):
        if runs is not None:
            seen["moved"] += sum(1 for f in step.following if runs.dropped[f.previous])
        seen["late"] += len(step.late_drafts)
        followed = real(step, runs)
        seen["cut"] += sum(len(a) < len(b) for a, b in zip(followed.drafts, step.drafts))
        return followed

    monkeypatch.setattr(model_runner, "follow_previous", counted)
    return seen


@pytest.mark.parametrize("page_size", [1, 4])
def test_ngram_with_overlap_is_greedy_identical(tiny_llama_dir, page_size, late_steps):
    greedy = {"temperature": 0, "ignore_eos": True}
    requests = [
        (repetitive(), {**greedy, "max_new_tokens": 30}),
        (repetitive(33), {**greedy, "max_new_tokens": 7, "logprobs": True, "top_logprobs": 3}),
        ([5, 17, 99], {**greedy, "max_new_tokens": 12}),
        (repetitive(), {**greedy, "max_new_tokens": 20, "presence_penalty": 0.5}),  # plain, not overlapped
        (repetitive(37), {**greedy, "max_new_tokens": 25}),
    ]
    plain, spec, verify_steps = outputs(tiny_llama_dir, requests, {"page_size": page_size, **OVERLAP})
    same(plain, spec)
    assert verify_steps > 0
    assert late_steps["late"] > 0 and late_steps["moved"] > 0 and late_steps["cut"] > 0


def test_ngram_with_overlap_and_retraction_is_greedy_identical(tiny_llama_dir, late_steps, caplog):
    """A pool too small for every request: sequences are retracted while
    their verify step runs, and resume later."""
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 40}
    # Repeating stretches of their own: no prefix shared through the cache.
    requests = [([300 + 50 * i + t % 20 for t in range(40)], greedy) for i in range(4)]
    with caplog.at_level("INFO", logger="pyserve.engine"):
        plain, spec, verify_steps = outputs(tiny_llama_dir, requests,
                                            {"page_size": 4, "max_total_tokens": 200, **OVERLAP})
    same(plain, spec)
    assert verify_steps > 0 and late_steps["late"] > 0
    assert "retracting" in caplog.text


@slow_test  # stops in accepted runs: by default in test_speculative, without overlap
def test_ngram_with_overlap_on_the_embedded_model_with_stops_in_accepted_runs(default_model_dir, late_steps):
    metrics = assert_identical_on_the_embedded_model(default_model_dir, SPEC, {"torchao_config": "none", **OVERLAP},
                                                     1e-4)
    assert metrics.spec_verify_steps > 0 and late_steps["moved"] > 0
    # Drafting under overlap still pays on a copy: more than 2 tokens a verify step.
    assert metrics.spec_emitted_tokens > 2 * metrics.spec_verify_steps


def test_a_constrained_request_is_drafted_under_overlap(default_model_dir, late_steps):
    """A constrained request that asks for logprobs does not jump forward,
    so it is overlapped: each verify row's masks are filled on the forward
    thread once the previous step's run is in its grammar."""
    import json

    from pyserve._rust import Tokenizer
    from pyserve.engine.request import Constraint
    from tests.test_jump_forward import RECORD, RECORD_TEXT

    ids = Tokenizer.from_file(str(default_model_dir / "tokenizer.json")).encode(RECORD_TEXT)
    requests = [(ids, {"temperature": 0, "max_new_tokens": 80, "logprobs": True,
                       "constraint": Constraint("json_schema", json.dumps(RECORD))})]
    plain, got, metrics = with_and_without(default_model_dir, requests, SPEC, {"torchao_config": "none", **OVERLAP})
    same(plain, got)
    assert set(json.loads(got[0][0])) == set(RECORD["required"])
    assert metrics.accepted_drafts() > 10 and late_steps["late"] > 0


def test_standalone_with_overlap_is_greedy_identical(tiny_llama_dir, drafts, late_steps):
    """The draft model proposes each following row's drafts after the
    row moved back; stops and the length limit inside accepted runs hold."""
    requests = [
        (repetitive(), {**GREEDY, "max_new_tokens": 30}),
        (repetitive(33), {**GREEDY, "max_new_tokens": 7, "logprobs": True, "top_logprobs": 3}),
        ([5, 17, 99], {**GREEDY, "max_new_tokens": 13}),
        (repetitive(), {**GREEDY, "max_new_tokens": 20, "presence_penalty": 0.5}),
    ]
    plain, got, metrics = standalone_both(tiny_llama_dir, requests, drafts["noisy"], {"page_size": 4, **OVERLAP})
    same(plain, got)
    assert len(got[1][1]) == 7
    assert metrics.spec_emitted_tokens > 1.5 * metrics.spec_verify_steps and late_steps["moved"] > 0



def test_abort_under_overlap_gives_every_page_back(tiny_llama_dir):
    assert_abort_gives_every_page_back(tiny_llama_dir, {**SPEC, **OVERLAP}, repetitive())


def test_ngram_with_overlap_beside_a_sliding_pool_is_transformers_greedy(tmp_path, default_model_dir, late_steps):
    """Gemma 2's 8-token window in a small sliding pool: pages a window has
    left go back while a verify step runs, counted from the earliest place
    the next row can start (its drafts may all be rejected)."""
    import transformers

    model_dir = build_tiny_model(tmp_path / "gemma2", "gemma2", tokenizer_dir=default_model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = repetitive(40)

    async def run():
        engine = sliding_engine(model_dir, 32, **SPEC, **OVERLAP)
        await engine.start()
        try:
            got = await engine_greedy(engine, prompt, 30, "spec")
            assert engine.integrity_problem() is None
            return got, engine.metrics
        finally:
            await engine.shutdown()

    got, metrics = asyncio.run(run())
    assert_as_transformers(hf, prompt, got)
    assert metrics.spec_verify_steps > 0 and late_steps["moved"] > 0


@slow_test  # two ranks: tests/test_speculative_tp.py has the default suite's
def test_ngram_with_overlap_over_two_ranks(tiny_llama_dir, late_steps):
    """Rank 0 moves the rows and finds the drafts before it sends the batch."""
    requests = [(repetitive(), {**GREEDY, "max_new_tokens": 30, "logprobs": True}),
                (repetitive(33), {**GREEDY, "max_new_tokens": 12})]
    plain, got, metrics = with_and_without(tiny_llama_dir, requests, {**SPEC, **OVERLAP}, TWO_RANKS)
    same(plain, got)
    assert metrics.spec_verify_steps > 0 and late_steps["moved"] > 0
