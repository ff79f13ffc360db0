"""NGRAM draft trees (--speculative-ngram-max-bfs-breadth above 1, or
--speculative-ngram-match-type PROB): drafts from a trie of every
request's tokens, verified as trees. Greedy output stays what decoding
without speculation gives; a request drafts what another one wrote, unless
it has a cache_salt; every KV page comes back."""

from __future__ import annotations

import asyncio

import pytest

import pyserve.engine.speculative.tree as tree
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.engine.speculative.options import drafter_of
from pyserve.server_args import ServerArgs
from tests.slow import slow, slow_test
from tests.test_speculative import (COPY, assert_identical_on_the_embedded_model, collect, repetitive, same,
                                    started, with_and_without)

TREES = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6,
         "speculative_ngram_min_match_window_size": 1, "speculative_ngram_max_bfs_breadth": 4}
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture
def tree_rows(monkeypatch):
    """Counts the rows verified as trees, over the engines a test runs."""
    seen = {"trees": 0}
    real = tree.expand

    def counted(step, batch, trees):
        seen["trees"] += sum(t is not None for t in trees)
        return real(step, batch, trees)

    monkeypatch.setattr(tree, "expand", counted)
    return seen


PAGE1, PAGE4_OVERLAP = {"page_size": 1}, {"page_size": 4, "disable_overlap_schedule": False}


# Each match type and each layout by default; their other two pairings are slow.
@pytest.mark.parametrize("match_type, engine_args", [
    pytest.param("BFS", PAGE1, id="page1-BFS"), pytest.param("PROB", PAGE4_OVERLAP, id="page4-overlap-PROB"),
    pytest.param("PROB", PAGE1, id="page1-PROB", marks=slow),
    pytest.param("BFS", PAGE4_OVERLAP, id="page4-overlap-BFS", marks=slow)])
def test_ngram_trees_are_greedy_identical(tiny_llama_dir, match_type, engine_args):
    """Requests one after the other, each drafting from the earlier ones'
    tokens: the same tokens, logprobs and finish as without speculation,
    and the prompts asked again keep drafts."""
    requests = [
        (repetitive(), {**GREEDY, "max_new_tokens": 30}),
        (repetitive(), {"temperature": 1.0, "seed": 3, "max_new_tokens": 12, "ignore_eos": True}),
        (repetitive(), {**GREEDY, "max_new_tokens": 30, "logprobs": True, "top_logprobs": 3}),
        (repetitive(), {**GREEDY, "max_new_tokens": 20, "presence_penalty": 0.5}),
        ([5, 17, 99], {**GREEDY, "max_new_tokens": 12}),
    ]
    plain, spec, metrics = with_and_without(tiny_llama_dir, requests,
                                            {**TREES, "speculative_ngram_match_type": match_type}, engine_args,
                                            sequential=True)
    del plain[1], spec[1]  # sampled: its draws differ with drafts
    same(plain, spec)
    assert metrics.accepted_drafts() >= 20  # the third request's answer is the first's


def test_sampled_requests_draft_trees_and_give_every_page_back(default_model_dir, tree_rows):
    """Sampled rows walk their trees with the target's draws (the walk's
    distribution: tests/test_speculative_tree.py)."""
    from pyserve._rust import Tokenizer

    ids = Tokenizer.from_file(str(default_model_dir / "tokenizer.json")).encode(COPY)
    requests = [(ids, {"temperature": 0.5, "seed": s, "max_new_tokens": 30, "ignore_eos": True}) for s in range(4)]
    _, spec, metrics = with_and_without(default_model_dir, requests, TREES)  # every page back: checked inside
    assert all(len(tokens) == 30 for _, tokens, _, _ in spec)
    assert metrics.accepted_drafts() > 0 and tree_rows["trees"] > 0


@pytest.mark.parametrize("match_type", ["BFS", pytest.param("PROB", marks=slow)])  # PROB's trees: slow
def test_ngram_trees_on_the_embedded_model_with_stops_in_accepted_runs(default_model_dir, tree_rows, match_type):
    """The copy prompt repeats a sentence that goes on two ways: the rows
    that reach it verify trees."""
    metrics = assert_identical_on_the_embedded_model(
        default_model_dir, {**TREES, "speculative_ngram_match_type": match_type}, {}, 1e-6)
    assert metrics.spec_verify_steps > 0 and tree_rows["trees"] > 0


def test_a_request_drafts_what_an_earlier_request_wrote_unless_salted(tiny_llama_dir):
    """The same prompt asked again: its whole answer is in the trie, so
    most drafts are kept; asked again with a cache_salt, it drafts from its
    own tokens only, as the chain drafter would."""
    prompt = [7, 301, 45, 999, 12, 640, 88, 3]

    async def main():
        engine = await started(tiny_llama_dir, **TREES)
        try:
            kept = []
            for salt in (None, None, "tenant-b"):
                before = (engine.metrics.spec_verify_steps, engine.metrics.accepted_drafts())
                out = []
                request = GenerateRequest(prompt, SamplingParams(max_new_tokens=40, **GREEDY), cache_salt=salt)
                async for o in engine.generate(request):
                    out += o.token_ids
                steps = engine.metrics.spec_verify_steps - before[0]
                kept.append((out, engine.metrics.accepted_drafts() - before[1], steps))
            assert engine.kv_usage()["in_use"] == 0
            return kept
        finally:
            await engine.shutdown()

    (first, kept1, _), (again, kept2, steps2), (salted, kept3, _) = asyncio.run(main())
    assert first == again == salted
    assert kept2 >= 0.6 * len(again) and kept2 > kept1
    assert kept3 < kept2


def test_flush_cache_empties_the_trie_and_keeps_the_corpora(tiny_llama_dir):
    """SGLang's /flush_cache between benchmark phases: the prompt asked
    again after it drafts no more than its first asking did."""
    prompt = [7, 301, 45, 999, 12, 640, 88, 3]

    async def main():
        engine = await started(tiny_llama_dir, **TREES)
        try:
            await engine.external_corpora.add_documents("manual", ["Turn the valve left to open it."])
            kept = []
            for _ in range(2):
                before = engine.metrics.accepted_drafts()
                await collect(engine, prompt, **GREEDY, max_new_tokens=40)
                kept.append(engine.metrics.accepted_drafts() - before)
                assert engine.flush_cache()
            return kept, list(engine.external_corpora.token_counts())
        finally:
            await engine.shutdown()

    (first, again), corpora = asyncio.run(main())
    assert again <= first + 2 and corpora == ["manual"]


@pytest.mark.parametrize("options, message", [
    ({"speculative_ngram_capacity": 1000}, "--speculative-ngram-capacity is for NGRAM trees"),
    ({"speculative_ngram_branch_length": 20}, "--speculative-ngram-branch-length is for NGRAM trees"),
    ({**TREES, "speculative_ngram_branch_length": 12}, "leaves no draft after a match of"),
    ({**TREES, "speculative_ngram_min_bfs_breadth": 5}, "1 <= --speculative-ngram-min-bfs-breadth"),
    ({**TREES, "speculative_ngram_capacity": 5}, "cannot hold one branch of 18 tokens"),
    ({**TREES, "speculative_ngram_capacity": 2**40}, "the trie holds at most 2147483647 nodes"),
    ({"speculative_eagle_topk": 4}, "NGRAM drafts trees with --speculative-ngram-max-bfs-breadth"),
])
def test_what_cannot_run_is_refused_at_start(tiny_llama_dir, options, message):
    args = ServerArgs(model_path=str(tiny_llama_dir), **{"speculative_algorithm": "NGRAM", **options}).resolved().split()
    with pytest.raises(ValueError, match=message):
        drafter_of(args.engine, args.model, tiny_llama_dir, None, None)


@slow_test
def test_the_app_with_ngram_trees_answers_the_openai_client(tiny_llama_dir):
    """`pyserve --model M --speculative-algorithm NGRAM
    --speculative-ngram-max-bfs-breadth 4` (assert_served_like_without):
    the requests after the first draft from its answer."""
    from tests.test_speculative_standalone import assert_served_like_without

    assert_served_like_without(tiny_llama_dir, "--speculative-algorithm", "NGRAM",
                               "--speculative-ngram-max-bfs-breadth", "4",
                               "--speculative-ngram-min-match-window-size", "1")


def test_the_cli_takes_sglangs_ngram_tree_flags():
    args = ServerArgs.from_cli(["--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "10",
                                "--speculative-ngram-min-bfs-breadth", "2", "--speculative-ngram-match-type", "PROB",
                                "--speculative-ngram-branch-length", "24", "--speculative-ngram-capacity", "500000"])
    engine = args.split().engine
    assert (engine.speculative_ngram_max_bfs_breadth, engine.speculative_ngram_min_bfs_breadth,
            engine.speculative_ngram_match_type, engine.speculative_ngram_branch_length,
            engine.speculative_ngram_capacity) == (10, 2, "PROB", 24, 500000)
    # SGLang's later name for the branch length.
    assert ServerArgs.from_cli(["--speculative-ngram-max-trie-depth", "30"]).speculative_ngram_branch_length == 30


def forked_runs(model_dir, engine_args: dict) -> tuple[list, list]:
    """A greedy request, a second whose prompt copies the first's answer up
    to a point and goes on otherwise there, and the first asked again: at
    that point its drafts fork, the first answer's way and the second
    prompt's. The first and third requests' (text, tokens, logprobs, last),
    without speculation and with trees."""
    prompt = [7, 301, 45, 999, 12, 640, 88, 3]
    greedy = {"max_new_tokens": 24, "logprobs": True, "top_logprobs": 2, **GREEDY}

    async def main(extra):
        engine = await started(model_dir, **engine_args, **extra)
        try:
            first = await collect(engine, prompt, **greedy)
            answer = first[1]
            await collect(engine, prompt + answer[:10] + [answer[10] + 1] + answer[:5], **greedy)
            again = await collect(engine, prompt, **greedy)
            assert engine.kv_usage()["in_use"] == 0
            return [first, again]
        finally:
            await engine.shutdown()

    return asyncio.run(main({})), asyncio.run(main(TREES))


def test_drafts_fork_where_two_requests_went_different_ways(tiny_llama_dir, tree_rows):
    plain, spec = forked_runs(tiny_llama_dir, {})
    same(plain, spec)
    assert tree_rows["trees"] > 0


def test_an_aborted_request_under_overlap_gives_every_page_back(tiny_llama_dir):
    from tests.test_speculative_standalone import assert_abort_gives_every_page_back

    assert_abort_gives_every_page_back(tiny_llama_dir, {**TREES, "disable_overlap_schedule": False}, repetitive())
