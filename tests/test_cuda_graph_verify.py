"""Speculative verify steps replayed as CUDA graphs: rows of several new
tokens (a token and its drafts), padded into graphs of a fixed row length,
give the eager forward's logits and hidden states, and engines speculating
through them (NGRAM, STANDALONE, EAGLE3, EAGLE) give the tokens of an engine that
does not speculate.

Without CUDA a "graph" is the runner's captured call rerun over the same
static buffers (CudaGraphRunner(replay_on_host=True)), with the Triton
kernels in the interpreter: everything but the recording is checked (the
padded rows, the scattered tokens and kv tables, the gathered logits and
hidden states, the graph chosen per batch). With CUDA the same tests replay
recorded graphs, which the engines capture themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # in case this file runs without conftest.py

from pyserve.engine.engine import Engine  # noqa: E402
from pyserve.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from pyserve.engine.runner.cuda_graph_runner import CudaGraphRunner  # noqa: E402
from pyserve.engine.runner.rank_model import RankModel  # noqa: E402
from pyserve.model.forward_batch import ForwardBatch  # noqa: E402
from pyserve.model.layers.causal_lm import AuxCapture  # noqa: E402
from pyserve.server_args import ServerArgs  # noqa: E402
from tests.eagle3_heads import head_config, random_weights, save_head  # noqa: E402
from tests.slow import slow  # noqa: E402
from tests.test_speculative import repetitive  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

ROW = 4  # verify rows: a token and 3 drafts
MAX_BS = 4
AUX = frozenset({1, 2})
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return build_tiny_model(tmp_path_factory.mktemp("verify-graphs"), "llama", tokenizer_dir=default_model_dir,
                            num_hidden_layers=3)


def options(model_dir, **extra):
    return ServerArgs(model_path=str(model_dir), attention_backend="triton", dtype="float32",
                      torchao_config="none", max_total_tokens=1024, cuda_graph_max_bs=MAX_BS,
                      max_running_requests=MAX_BS, **extra)


@pytest.fixture(scope="module")
def rank_model(model_dir):
    model = RankModel(options(model_dir).resolved().split().model, model_dir, torch.device(DEVICE))
    model.allocate(model.num_pages())
    return model


class Sequences:
    """Token ids and KV slots of sequences; slots are taken from a counter."""

    def __init__(self):
        self.next_slot = 1
        self.slots: list[torch.Tensor] = []
        self.gen = torch.Generator().manual_seed(0)

    def step(self, rows: list[int], new: list[int], logits: str = "all", is_decode: bool = False) -> ForwardBatch:
        """Sequences `rows` (new ones appended) each add `new[i]` random tokens."""
        fresh = []
        for r, n in zip(rows, new):
            if r == len(self.slots):
                self.slots.append(torch.empty(0, dtype=torch.long))
            fresh.append(torch.arange(self.next_slot, self.next_slot + n))
            self.next_slot += n
            self.slots[r] = torch.cat([self.slots[r], fresh[-1]])
        positions = [p for r, n in zip(rows, new) for p in range(len(self.slots[r]) - n, len(self.slots[r]))]
        ends = torch.tensor(new).cumsum(0)
        wanted = list(range(sum(new))) if logits == "all" else (ends - 1).tolist()
        ids = torch.randint(3, 500, (sum(new),), generator=self.gen).tolist()
        return ForwardBatch.build(ids, positions, torch.cat(fresh), new, [self.slots[r] for r in rows], wanted,
                                  is_decode, DEVICE)


def test_verify_rows_replay_the_eager_forward(rank_model):
    """Batches of rows with up to ROW new tokens (verify rows, one-token
    rows among them, short prompt chunks), fewer rows than a graph's: the
    replayed logits and kept hidden states are the eager forward's, and a
    replay writes KV at the batch's own slots and the padding slot 0 only."""
    graphs = CudaGraphRunner(rank_model.model, rank_model.attention, MAX_BS, rank_model.context_len, ROW, AUX,
                             replay_on_host=DEVICE == "cpu")
    assert graphs.batch_sizes == {1: [1, 2, 4], ROW: [1, 2, 4]}
    seqs = Sequences()
    k_cache = rank_model.kv_buffer.k_buffer[1]
    with torch.inference_mode():
        rank_model.model(seqs.step([0, 1, 2, 3], [9, 17, 5, 12]), rank_model.attention)
        for rows, new, logits, is_decode in (
            ([0, 1, 2], [4, 1, 3], "all", False),  # verify rows padded to 4, 3 rows into a graph of 4
            ([3], [2], "all", False),
            ([0, 1, 2, 3], [4, 4, 4, 4], "last", False),  # only some rows' logits wanted
            ([2, 4], [1, 3], "all", False),  # a new sequence's first chunk beside a row
            ([0, 1, 3], [1, 1, 1], "all", True),  # a decode batch
        ):
            batch = seqs.step(rows, new, logits, is_decode)
            assert graphs.can_run(batch) and graphs.can_run(batch, AuxCapture(AUX))
            eager_capture, replay_capture = AuxCapture(AUX), AuxCapture(AUX)
            eager = rank_model.model(batch, rank_model.attention, capture=eager_capture)
            k_before = k_cache.clone()
            replayed = graphs.replay(batch, replay_capture)
            changed = (k_cache != k_before).flatten(1).any(1).nonzero().flatten().tolist()
            assert set(changed) <= set(batch.out_cache_loc.tolist()) | {0}
            assert replayed.shape == eager.shape
            torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
            assert len(replay_capture.states) == len(AUX)
            for a, b in zip(replay_capture.states, eager_capture.states):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        # Rows longer than the graphs', more rows than the largest graph, or
        # other hidden states than the graphs keep: eager.
        assert not graphs.can_run(seqs.step([0], [ROW + 1]))
        assert not graphs.can_run(seqs.step([0, 1, 2, 3, 4], [2, 2, 2, 2, 2]))
        assert not graphs.can_run(seqs.step([0], [2]), AuxCapture(frozenset({0})))


def graphed_engine(model_dir, speculative: dict) -> tuple[Engine, Counter]:
    """An engine speculating through graphs (host-replayed ones without
    CUDA, in the target and in a STANDALONE draft model), and a count of
    replays per (model: "target" or "draft", row length), and of the steps
    that verified drafts ("drafted")."""
    engine = Engine.from_args(options(model_dir, **{"disable_overlap_schedule": True, **speculative}))
    draft = engine.runner.draft
    models = [engine.runner.rank_model] + ([draft.model] if hasattr(draft, "model") else [])
    replays = Counter()
    for model in models:
        if DEVICE == "cpu":
            model.cuda_graphs = CudaGraphRunner(model.model, model.attention, MAX_BS, model.context_len,
                                                engine.drafter.num_draft_tokens + 1,
                                                getattr(draft, "aux_layers", None) if model is models[0] else None,
                                                replay_on_host=True)
        graphs = model.cuda_graphs
        assert graphs.row_lengths == [1, engine.drafter.num_draft_tokens + 1]
        name = "target" if model is models[0] else "draft"
        for (row, bs), replay in list(graphs.graphs.items()):
            graphs.graphs[row, bs] = lambda key=(name, row), replay=replay: (replays.update([key]), replay())[1]
    step = engine.runner.step

    def counted(s):
        output = step(s)
        # With overlap the forward thread may cut a row's drafts to none.
        verified = output.drafted if output.drafted is not None else [len(d) for d in s.drafts]
        replays.update(["drafted"] * any(verified))
        return output

    engine.runner.step = counted
    return engine, replays


@pytest.fixture
def expanded(monkeypatch):
    """The tree-expanded batches (speculative/tree.expand) of a test."""
    from pyserve.engine.speculative import tree

    batches = []
    expand = tree.expand
    monkeypatch.setattr(tree, "expand", lambda *args: batches.append(expand(*args)) or batches[-1])
    return batches


def served(model_dir, requests, speculative: dict | None):
    """Each request's (tokens, logprobs) run together, the replays
    (graphed_engine's), and the decode rows that verified drafts."""
    async def main():
        if speculative is None:
            engine, replays = Engine.from_args(options(model_dir, disable_overlap_schedule=True)), Counter()
        else:
            engine, replays = graphed_engine(model_dir, speculative)
        await engine.start()
        try:
            async def one(ids, params):
                tokens, logprobs = [], []
                async for out in engine.generate(GenerateRequest(ids, SamplingParams(**params))):
                    tokens += out.token_ids
                    logprobs += [lp.logprob for lp in out.logprobs or []]
                return tokens, logprobs

            got = await asyncio.gather(*[one(ids, params) for ids, params in requests])
            assert engine.integrity_problem() is None
            assert engine.kv_usage()["in_use"] == 0
            return got, replays, engine.metrics.spec_verify_steps
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def eagle3_head(model_dir, out):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    cfg = head_config(model_dir, 256, [-1, 0, 1])  # the embeddings and the outputs of layers 0 and 1
    return save_head(out, cfg, random_weights(cfg, seed=1), torch.arange(256) * 2, vocab)


def eagle_head(model_dir, out):
    """An EAGLE-1/2 head: it reads the stream after the target's last layer."""
    from tests.test_speculative_eagle import head_config as eagle_config, random_weights as eagle_weights
    from tests.test_speculative_eagle import save_head as save_eagle_head

    cfg = eagle_config(model_dir)
    return save_eagle_head(out, cfg, eagle_weights(cfg, seed=1))


# Slow, every case (engines through the graph runner, on Triton's CPU
# interpreter): NGRAM; with overlap scheduling (rows moved back over rejected
# drafts on the host before the replay); the draft models' cases (their own
# graphs, the kept hidden states, trees on the decode graphs). The default
# suite checks the replayed verify rows against the eager forward (above).
@pytest.mark.parametrize("algorithm", [pytest.param("NGRAM", marks=slow), pytest.param("NGRAM-overlap", marks=slow),
                                       pytest.param("STANDALONE", marks=slow),
                                       pytest.param("EAGLE3", marks=slow), pytest.param("EAGLE3-tree", marks=slow),
                                       pytest.param("EAGLE", marks=slow)])
def test_speculating_through_verify_graphs_gives_the_plain_tokens(model_dir, tiny_llama_dir, tmp_path, algorithm,
                                                                   expanded):
    """Greedy requests, run together so that verify rows of different
    lengths and plain rows share batches: the tokens and log-probabilities
    of an engine without speculation, with verify steps replayed. (NGRAM
    runs on the two-layer tiny Llama, whose greedy text repeats a token
    within 30, where its drafts come from.)"""
    speculative = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": ROW - 1}
    if algorithm.startswith("NGRAM"):
        speculative.update(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=1,
                           disable_overlap_schedule=algorithm == "NGRAM")
        model_dir = tiny_llama_dir
    elif algorithm == "STANDALONE":
        speculative["speculative_draft_model_path"] = str(model_dir)  # the target drafts for itself: all kept
    elif algorithm == "EAGLE":
        speculative["speculative_draft_model_path"] = str(eagle_head(model_dir, tmp_path / "head"))
    else:
        speculative["speculative_draft_model_path"] = str(eagle3_head(model_dir, tmp_path / "head"))
    if algorithm == "EAGLE3-tree":  # trees of 3 nodes: one-token rows, replayed by the decode graphs
        speculative.update(speculative_algorithm="EAGLE3", speculative_eagle_topk=2, speculative_num_steps=2)
    requests = [(repetitive(), {**GREEDY, "max_new_tokens": 30 if algorithm.startswith("NGRAM") else 14, "logprobs": True}),
                (repetitive(23), {**GREEDY, "max_new_tokens": 9}),
                ([5, 17, 99], {**GREEDY, "max_new_tokens": 6, "logprobs": True})]
    plain, _, _ = served(model_dir, requests, None)
    got, replays, verify_steps = served(model_dir, requests, speculative)
    for (tokens, logprobs), (want, want_logprobs) in zip(got, plain):
        assert tokens == want
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)
    assert verify_steps > 0
    if algorithm == "EAGLE3-tree":  # tree steps of at most MAX_BS rows replayed
        small = [b for b in expanded if b.is_decode and b.batch_size <= MAX_BS]
        assert small and replays["target", 1] >= len(small)
        return
    assert replays["target", ROW] >= replays["drafted"] > 0  # every verify step replayed (short prompts too)
    if algorithm == "STANDALONE":  # the draft model's own steps, and its run over the verify rows
        assert replays["draft", 1] > 0 and replays["draft", ROW] >= replays["drafted"]


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3", "EAGLE"])
def test_the_target_captures_its_graphs_once_with_what_speculation_reads(model_dir, tmp_path, monkeypatch,
                                                                          algorithm):
    """At start, before any draft is loaded, the target captures its graphs
    once: verify rows of a token and the drafts, and for EAGLE3 and EAGLE
    every graph keeping the hidden states the head reads (a second capture would cost
    start-up time, and over several ranks one rank capturing alone would
    wait forever on the others' collectives)."""
    from pyserve.engine.runner import cuda_graph_runner

    captures = []

    class Recorded:
        def __init__(self, model, attention, max_bs, context_len, verify_tokens=0, aux_layers=None):
            captures.append((verify_tokens, aux_layers))

    monkeypatch.setattr(cuda_graph_runner, "CudaGraphRunner", Recorded)
    monkeypatch.setattr(RankModel, "_graphs_fit", lambda self: True)
    speculative = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": ROW - 1}
    head = {"EAGLE3": eagle3_head, "EAGLE": eagle_head}.get(algorithm)
    if head is not None:
        speculative["speculative_draft_model_path"] = str(head(model_dir, tmp_path / "head"))
    engine = Engine.from_args(options(model_dir, **speculative))
    engine.runner.shutdown()
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    kept = {"EAGLE3": frozenset({0, 1, 2}), "EAGLE": frozenset({layers})}.get(algorithm)  # EAGLE: after the last
    assert captures == [(ROW, kept)]
