"""Speculative decoding over two tensor-parallel ranks (gloo, on the CPU):
the drafts are made on rank 0 (NGRAM's on the event loop, a STANDALONE
draft model whole on rank 0, an EAGLE-3 or EAGLE head or a checkpoint's
MTP layer (NEXTN) reading rank 0's copy of the target's hidden states and
the whole embedding (and vocabulary projection) from the checkpoint), the
verify pass runs on both ranks (and a draft tree's accepted K/V moves in
both ranks' caches), and greedy output is what two ranks give without
speculation. NGRAM's chains in the default suite; its trees and the draft
models' (a whole draft model beside a sharded target, the head's states
and trees), slow."""

from __future__ import annotations

import json

from pyserve.engine.request import Constraint
from tests.slow import slow_test
from tests.test_speculative import SPEC, repetitive, same, with_and_without
from tests.test_speculative_eagle import eagle_heads, spec as eagle_spec  # noqa: F401
from tests.test_speculative_eagle3 import GREEDY, PROMPTS, heads, runs_with_stops, spec, target  # noqa: F401
from tests.test_speculative_mtp import glm, glm_fitted, nextn  # noqa: F401
from tests.test_speculative_ngram_trees import forked_runs, tree_rows  # noqa: F401
from tests.test_speculative_tree import TREE

TWO_RANKS = {"tp_size": 2, "device": "cpu", "torchao_config": "none"}


@slow_test
def test_ngram_over_two_ranks(tiny_llama_dir):
    """Constrained and penalized requests are drafted too: rank 0 alone
    masks and penalizes the verify rows."""
    schema = {"type": "object", "properties": {k: {"type": "string", "maxLength": 4} for k in "abc"},
              "required": list("abc")}
    requests = [(repetitive(), {**GREEDY, "max_new_tokens": 30, "logprobs": True}),
                (repetitive(33), {**GREEDY, "max_new_tokens": 12}),
                (repetitive(), {"temperature": 0, "max_new_tokens": 40,
                                "constraint": Constraint("json_schema", json.dumps(schema))}),
                (repetitive(), {**GREEDY, "max_new_tokens": 20, "frequency_penalty": 0.2})]
    plain, got, metrics = with_and_without(tiny_llama_dir, requests, SPEC, TWO_RANKS)
    same(plain, got)
    assert metrics.spec_verify_steps > 0


@slow_test
def test_standalone_over_two_ranks(tiny_llama_dir):
    """The target as its own draft: every draft kept."""
    requests = [(repetitive(), {**GREEDY, "max_new_tokens": 20, "logprobs": True}),
                ([5, 17, 99], {**GREEDY, "max_new_tokens": 9})]
    speculative = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(tiny_llama_dir),
                   "speculative_num_draft_tokens": 3}
    plain, got, metrics = with_and_without(tiny_llama_dir, requests, speculative, TWO_RANKS)
    same(plain, got)
    assert metrics.spec_emitted_tokens >= 3.5 * metrics.spec_verify_steps


@slow_test
def test_eagle3_over_two_ranks_keeps_the_fitted_heads_drafts(target, heads):
    """The fitted head drafts from the hidden states rank 0 keeps of a
    target split over two ranks: its first two drafts a step are kept, as
    on one rank (tests/test_speculative_eagle3.py)."""
    requests = [(PROMPTS[0], {**GREEDY, "max_new_tokens": 40, "logprobs": True}),
                (PROMPTS[1], {**GREEDY, "max_new_tokens": 40})]
    plain, got, metrics = with_and_without(target, requests, spec(heads["fitted"]), TWO_RANKS)
    same(plain, got)
    assert metrics.spec_emitted_tokens >= 2.9 * metrics.spec_verify_steps


@slow_test
def test_eagle3_trees_over_two_ranks(target, heads):
    """The fitted head's trees: each step's accepted nodes below the first
    level sit in other slots than a chain's, and their K/V is moved on
    both ranks before the next step reads it. Tokens and log-probabilities
    are plain decoding's, stops inside accepted runs included."""
    requests, stop_text = runs_with_stops(target, heads)
    plain, got, metrics = with_and_without(target, requests, spec(heads["fitted"], **TREE), TWO_RANKS)
    same(plain, got)
    assert got[2][3].finish_reason == "stop" and stop_text not in got[2][0]
    assert metrics.spec_emitted_tokens >= 2.9 * metrics.spec_verify_steps


@slow_test
def test_eagle_over_two_ranks_keeps_the_fitted_heads_drafts(target, eagle_heads):
    """An EAGLE head reads the stream rank 0 keeps after the target's last
    layer, and the whole vocabulary projection from the checkpoint (each
    rank holds a share of it): it keeps about the drafts it keeps on one
    rank, and greedy output is two ranks' without speculation."""
    requests = [(PROMPTS[0], {**GREEDY, "max_new_tokens": 40, "logprobs": True}),
                (PROMPTS[1], {**GREEDY, "max_new_tokens": 40})]
    speculative = eagle_spec(eagle_heads["fitted"])
    _, _, one_rank = with_and_without(target, requests, speculative, {"torchao_config": "none"})
    plain, got, two_ranks = with_and_without(target, requests, speculative, TWO_RANKS)
    same(plain, got)
    assert two_ranks.accepted_drafts() >= max(20, 0.8 * one_rank.accepted_drafts())


@slow_test
def test_nextn_over_two_ranks_keeps_the_fitted_layers_drafts(glm_fitted):
    """A GLM-4.5 whose MTP layer loads whole on rank 0 beside the sharded
    target (its experts split over the ranks)."""
    requests = [(PROMPTS[0], {**GREEDY, "max_new_tokens": 30})]
    plain, got, two_ranks = with_and_without(glm_fitted, requests, nextn(), TWO_RANKS)
    same(plain, got)
    assert two_ranks.accepted_drafts() >= 0.4 * 30


@slow_test
def test_ngram_trees_over_two_ranks(tiny_llama_dir, tree_rows):
    """NGRAM's trees from rank 0's trie: the kept branch's K/V moves in
    both ranks' caches, and greedy output is two ranks' without speculation."""
    plain, got = forked_runs(tiny_llama_dir, TWO_RANKS)
    same(plain, got)
    assert tree_rows["trees"] > 0
