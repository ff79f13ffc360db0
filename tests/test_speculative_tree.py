"""EAGLE3 draft trees (--speculative-eagle-topk above 1): each node is
verified over exactly its path, the walk down the tree emits the target's
own tokens (greedy: plain decoding's; sampled: the target's distribution),
accepted nodes' KV ends up where the sequence's next positions are, and a
fitted head gets more of its drafts kept than with a chain."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pyserve.engine.request import Constraint, SamplingParams
from pyserve.engine.speculative.rejection import walk
from pyserve.engine.speculative.tree import DraftTree, chain_order, expand
from pyserve.model.forward_batch import ForwardBatch
from tests.slow import slow, slow_test
from tests.test_speculative import same
from tests.test_speculative_eagle3 import (GREEDY, PROMPTS, heads, run_both, runs_with_stops,  # noqa: F401
                                           spec, target)
from tests.test_speculative_overlap import late_steps  # noqa: F401 (a fixture)

TREE = {"speculative_eagle_topk": 3, "speculative_num_steps": 3, "speculative_num_draft_tokens": 8}
# Root children: nodes 0 and 1; node 0's: 2 and 3; node 2's: 4.
SHAPE = DraftTree([-1, -1, 0, 0, 2])


def test_a_tree_knows_its_paths():
    assert [SHAPE.depth(n) for n in range(5)] == [1, 1, 2, 2, 3]
    assert SHAPE.ancestors(4) == [0, 2] and SHAPE.ancestors(1) == []
    assert SHAPE.children(-1) == [0, 1] and SHAPE.children(0) == [2, 3] and SHAPE.children(3) == []
    # A chain that accepted nodes 0 then 3 has their rows after the root's.
    assert chain_order(10, [0, 3], 5) == [10, 11, 14, 12, 13, 15]


def test_expand_gives_every_node_its_path_and_position():
    """A prompt chunk row beside a tree row: the chunk stays a row of 3;
    the tree row's root and five nodes become rows of one token each,
    reading the sequence's slots up to the root, their ancestors' and their own."""
    prompt_slots = torch.tensor([40, 41, 42])
    tree_slots = torch.tensor([7, 8, 9, 20, 21, 22, 23, 24, 25])  # positions 0..2, the root (20), the nodes
    host = ForwardBatch.build([5, 6, 7, 90, 10, 11, 12, 13, 14], [0, 1, 2, 3, 4, 5, 6, 7, 8],
                              torch.cat([prompt_slots, tree_slots[3:]]), [3, 6], [prompt_slots, tree_slots],
                              [3, 4, 5, 6, 7, 8], False, "cpu")
    prompt, row = object(), object()  # the sequences, as keys
    step = SimpleNamespace(batch=host, seqs=[prompt, row], sampled=[row])
    got = expand(step, host, [SHAPE])
    assert got.extend_lens == [3, 1, 1, 1, 1, 1, 1] and got.is_decode is False
    assert [t.tolist() for t in got.kv_indices.split(got.seq_lens)] == [
        [40, 41, 42],
        [7, 8, 9, 20],  # the root
        [7, 8, 9, 20, 21], [7, 8, 9, 20, 22],  # its children, nodes 0 and 1
        [7, 8, 9, 20, 21, 23], [7, 8, 9, 20, 21, 24],  # node 0's
        [7, 8, 9, 20, 21, 23, 25],  # node 2's
    ]
    assert got.positions.tolist() == [0, 1, 2, 3, 4, 4, 5, 5, 6]
    assert torch.equal(got.input_ids, host.input_ids) and torch.equal(got.out_cache_loc, host.out_cache_loc)
    assert torch.equal(got.logits_indices, host.logits_indices)


def _state(**params) -> SimpleNamespace:
    return SimpleNamespace(params=SamplingParams(**params))


def test_the_greedy_walk_follows_the_targets_argmax_down_the_tree():
    tokens = [10, 11, 12, 13, 14]
    logits = torch.zeros(6, 20)
    for row, best in enumerate([10, 13, 5, 0, 7, 0]):  # rows: the root, then nodes 0..4
        logits[row, best] = 1.0
    # The root's argmax 10 is node 0; node 0's is 13, node 3; node 3's (7) is no child: the walk ends.
    assert walk(logits, SHAPE, tokens, _state(temperature=0), torch.Generator()) == ([10, 13, 7], [0, 3])
    logits[0] = 0.0
    logits[0, 4] = 1.0
    assert walk(logits, SHAPE, tokens, _state(temperature=0), torch.Generator()) == ([4], [])


def test_a_sampled_walk_draws_the_targets_distribution():
    """At temperature 1 over a vocabulary of 4: the first token follows the
    root's distribution, and after the root's child node 0 the next follows
    node 0's, whatever the tree drafted."""
    tree, tokens = DraftTree([-1, -1, 0]), [0, 1, 2]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 4, generator=g)
    logits[0, 0] += 2.0  # node 0 drawn often: both distributions well sampled
    state, n = _state(temperature=1.0), 4000
    firsts, seconds = torch.zeros(4), torch.zeros(4)
    for _ in range(n):
        emitted, path = walk(logits, tree, tokens, state, g)
        firsts[emitted[0]] += 1
        assert len(emitted) == len(path) + 1
        if emitted[0] == 0:
            seconds[emitted[1]] += 1
    assert seconds.sum() > 0.5 * n
    # Within about 4.5 standard deviations of the counts.
    torch.testing.assert_close(firsts / n, torch.softmax(logits[0], -1), atol=0.035, rtol=0)
    torch.testing.assert_close(seconds / seconds.sum(), torch.softmax(logits[1], -1), atol=0.045, rtol=0)


# Pages of 4 by default (the accepted nodes' copies cross pages); pages of 1, slow.
@pytest.mark.parametrize("page_size", [pytest.param(1, marks=slow), 4])
def test_greedy_identical_with_trees_and_a_fitted_head_keeps_more(target, heads, page_size):
    """A random head's trees and a fitted head's (3 candidates a step, 3
    deep, 7 nodes): tokens and log-probabilities of plain decoding, stops
    and length limits inside accepted runs included; the fitted head's
    trees keep more tokens a step than its chain of as many drafts."""
    requests, stop_text = runs_with_stops(target, heads)
    requests.append(([5, 17, 99], {**GREEDY, "max_new_tokens": 13}))
    engine_args = {"page_size": page_size}
    for head in ("random", "fitted"):
        plain, got, metrics = run_both(target, requests, heads[head], engine_args, tree=TREE)
        same(plain, got)
        assert metrics.spec_verify_steps > 0
    assert got[2][3].finish_reason == "stop" and stop_text not in got[2][0]
    assert len(got[3][1]) == 8
    _, _, chain = run_both(target, requests, heads["fitted"], engine_args, tree={"speculative_num_steps": 7})
    assert metrics.spec_emitted_tokens / metrics.spec_verify_steps > chain.spec_emitted_tokens / chain.spec_verify_steps


def test_constrained_and_penalized_requests_are_drafted_as_trees(target, heads):
    """Each node's logits row is masked by the grammar after the node's
    path and penalized as if the path were output: a JSON-schema request
    and penalized ones give plain decoding's output, and the trees keep
    drafts."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 60}}, "required": ["a"]}
    requests = [
        (PROMPTS[0], {"temperature": 0, "max_new_tokens": 40,
                      "constraint": Constraint("json_schema", json.dumps(schema))}),
        (PROMPTS[0], {**GREEDY, "max_new_tokens": 30, "frequency_penalty": 0.2, "presence_penalty": 0.2}),
        (PROMPTS[1], {**GREEDY, "max_new_tokens": 30, "repetition_penalty": 1.1, "min_new_tokens": 25}),
    ]
    plain, got, metrics = run_both(target, requests, heads["fitted"], tree=TREE)
    same(plain, got)
    json.loads(got[0][0])
    assert metrics.accepted_drafts() > 0


# slow: the fitted head on single-token pages (more accepted drafts, the same path)
@pytest.mark.parametrize("head, page_size", [pytest.param("fitted", 1, marks=slow), ("random", 4)])
def test_trees_under_overlap_scheduling_give_plain_decodings_output(target, heads, late_steps, head, page_size):
    """Overlap scheduling (tests/test_speculative_overlap.py) with trees:
    each row scheduled while its tree was verified moves back over the
    nodes the walk did not keep, and reads the accepted ones' K/V where
    the walk moved them. The fitted head's trees keep as many tokens a
    step as without overlap, but for the length limit's trims near the end."""
    requests, stop_text = runs_with_stops(target, heads)
    requests.append(([5, 17, 99], {**GREEDY, "max_new_tokens": 13}))
    engine_args = {"page_size": page_size, "disable_overlap_schedule": False}
    plain, got, metrics = run_both(target, requests, heads[head], engine_args, tree=TREE)
    same(plain, got)
    assert got[2][3].finish_reason == "stop" and stop_text not in got[2][0]
    assert len(got[3][1]) == 8 and late_steps["moved"] > 0
    if head == "fitted":
        _, _, alone = run_both(target, requests, heads[head], {"page_size": page_size}, tree=TREE)
        kept, kept_alone = (m.spec_emitted_tokens / m.spec_verify_steps for m in (metrics, alone))
        assert kept >= 0.9 * kept_alone


@slow_test
def test_sampled_trees_follow_the_target_distribution(target, heads):
    from tests.test_speculative_sampling import assert_sampled_like_the_target

    assert_sampled_like_the_target(target, PROMPTS[0], spec(heads["fitted"], **TREE))
