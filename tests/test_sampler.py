"""Sampling on hand-made logits."""

from __future__ import annotations

import torch

from pyserve.engine.request import SamplingParams
from pyserve.engine.sampler import Sampler
from pyserve.engine.sequence import Sequence


def seq(output=(), prompt=(1,), **params) -> Sequence:
    s = Sequence(rid="r", prompt_ids=list(prompt), params=SamplingParams(**params), output_ids=list(output))
    if s.params.seed is not None:
        s.generator = torch.Generator().manual_seed(s.params.seed)
    return s


def test_greedy_picks_the_largest_logit():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert Sampler(0).sample(logits, [seq(temperature=0), seq(temperature=0)]) == [1, 0]


def test_frequency_and_presence_penalties_lower_repeated_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert Sampler(0).sample(logits, [seq(output=[0], temperature=0)]) == [0]
    assert Sampler(0).sample(logits, [seq(output=[0], temperature=0, presence_penalty=0.5)]) == [1]
    assert Sampler(0).sample(logits, [seq(output=[0, 0], temperature=0, frequency_penalty=0.1)]) == [1]


def test_repetition_penalty_covers_the_prompt():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    assert Sampler(0).sample(logits, [seq(prompt=[0], temperature=0, repetition_penalty=1.5)]) == [1]


def test_logit_bias_can_force_a_token():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    assert Sampler(0).sample(logits, [seq(temperature=0, logit_bias={2: 100.0})]) == [2]


def test_top_k_and_top_p_restrict_the_draw():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(0)
    drawn_k = {sampler.sample(logits, [seq(top_k=2)])[0] for _ in range(200)}
    drawn_p = {sampler.sample(logits, [seq(top_p=0.7)])[0] for _ in range(200)}
    drawn_min_p = {sampler.sample(logits, [seq(min_p=0.5)])[0] for _ in range(200)}
    assert drawn_k == {0, 1}
    assert drawn_p == {0, 1}
    assert drawn_min_p == {0, 1}


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.zeros(1, 50)
    alone = [Sampler(0).sample(logits, [s])[0] for s in [seq(seed=3)] for _ in range(1)]
    s = seq(seed=3)
    batched = Sampler(9).sample(torch.zeros(3, 50), [seq(), s, seq()])[1]
    assert alone == [batched]
