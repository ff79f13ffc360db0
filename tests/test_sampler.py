"""Sampling on hand-made logits."""

from __future__ import annotations

import torch

from pyserve.engine.request import SamplingParams
from pyserve.engine.penalties import adjust_logits
from pyserve.engine.sampler import Sampler
from pyserve.engine.sampling_state import SamplingState
from pyserve.engine.sequence import Sequence


def seq(output=(), prompt=(1,), stop_ids=(), **params) -> SamplingState:
    """A request's sampling state, as the engine builds it."""
    s = Sequence(rid="r", prompt_ids=list(prompt), params=SamplingParams(**params), output_ids=list(output))
    generator = torch.Generator().manual_seed(s.params.seed) if s.params.seed is not None else None
    return SamplingState(s, generator, stop_ids=frozenset(stop_ids))


def test_greedy_picks_the_largest_logit():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert Sampler(0).sample(logits, [seq(temperature=0), seq(temperature=0)]).tolist() == [1, 0]


def test_frequency_and_presence_penalties_lower_repeated_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert Sampler(0).sample(logits, [seq(output=[0], temperature=0)]).tolist() == [0]
    assert Sampler(0).sample(logits, [seq(output=[0], temperature=0, presence_penalty=0.5)]).tolist() == [1]
    assert Sampler(0).sample(logits, [seq(output=[0, 0], temperature=0, frequency_penalty=0.1)]).tolist() == [1]


def test_repetition_penalty_covers_the_prompt():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    assert Sampler(0).sample(logits, [seq(prompt=[0], temperature=0, repetition_penalty=1.5)]).tolist() == [1]


def test_logit_bias_can_force_a_token():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    assert Sampler(0).sample(logits, [seq(temperature=0, logit_bias={2: 100.0})]).tolist() == [2]


def test_top_k_and_top_p_restrict_the_draw():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(0)
    drawn_k = {sampler.sample(logits, [seq(top_k=2)]).tolist()[0] for _ in range(200)}
    drawn_p = {sampler.sample(logits, [seq(top_p=0.7)]).tolist()[0] for _ in range(200)}
    drawn_min_p = {sampler.sample(logits, [seq(min_p=0.5)]).tolist()[0] for _ in range(200)}
    assert drawn_k == {0, 1}
    assert drawn_p == {0, 1}
    assert drawn_min_p == {0, 1}


def test_seeded_rows_do_not_depend_on_the_batch():
    alone = Sampler(0).sample(torch.zeros(1, 50), [seq(seed=3)]).tolist()[0]
    batched = Sampler(9).sample(torch.zeros(3, 50), [seq(), seq(seed=3), seq(top_k=5)]).tolist()[1]
    assert alone == batched


def test_penalties_follow_openai_and_ctrl_formulas():
    rows = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    s = seq(prompt=[1], output=[0, 0, 2], frequency_penalty=0.25, presence_penalty=0.5, repetition_penalty=2.0)
    adjust_logits(rows, [s])
    # repetition (prompt + output: 0, 1, 2): positive / 2, negative * 2;
    # then frequency * count + presence over the output only
    assert torch.allclose(rows[0], torch.tensor([1.0 - 0.5 - 0.5, -2.0, 0.25 - 0.25 - 0.5, 3.0]))


def test_a_mixed_batch_keeps_greedy_rows_greedy():
    logits = torch.tensor([[0.0, 1.0, 0.9], [0.0, 1.0, 0.9], [3.0, 0.0, 0.0]])
    rows = [seq(temperature=0), seq(temperature=1.0, seed=4), seq(temperature=0, presence_penalty=1.0, output=[0])]
    for _ in range(20):
        ids = Sampler(0).sample(logits, rows).tolist()
        assert ids[0] == 1 and ids[2] == 0  # presence: 3 - 1 still the largest
    assert torch.equal(logits[0], torch.tensor([0.0, 1.0, 0.9]))  # the caller's logits are untouched


def test_draws_follow_the_distribution_and_temperature_reshapes_it():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(4000, 1)
    sampler = Sampler(0)

    def freqs(**params):
        ids = sampler.sample(logits, [seq(**params) for _ in range(4000)])
        return torch.bincount(ids, minlength=3).float() / 4000

    assert torch.allclose(freqs(), torch.tensor([0.5, 0.3, 0.2]), atol=0.03)
    cold = freqs(temperature=0.25)  # p^4, renormalised
    assert torch.allclose(cold, torch.tensor([0.866, 0.112, 0.022]), atol=0.03)
    hot = freqs(temperature=10.0)
    assert hot.max() - hot.min() < 0.08


def test_top_k_one_is_greedy_and_min_p_keeps_the_best():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    assert Sampler(1).sample(logits, [seq(top_k=1) for _ in range(8)]).tolist() == best
    assert Sampler(1).sample(logits, [seq(min_p=1.0) for _ in range(8)]).tolist() == best
    assert Sampler(1).sample(logits, [seq(top_p=1e-6) for _ in range(8)]).tolist() == best


def test_unseeded_draws_follow_the_global_seed():
    logits = torch.zeros(4, 1000)
    rows = [seq() for _ in range(4)]
    assert Sampler(7).sample(logits, rows).tolist() == Sampler(7).sample(logits, rows).tolist()
    assert Sampler(7).sample(logits, rows).tolist() != Sampler(8).sample(logits, rows).tolist()


def test_a_batch_is_adjusted_as_each_row_alone():
    gen = torch.Generator().manual_seed(1)
    vocab = 300
    rows = [
        seq(prompt=[5, 6, 7], output=[1, 1, 2], repetition_penalty=1.3),
        seq(prompt=[9], output=[3, 3, 3, 4], frequency_penalty=0.7, presence_penalty=-0.4),
        seq(prompt=[2], output=[], logit_bias={10: 5.0, 299: -3.0}),
        seq(prompt=[2, 2], output=[8], temperature=0),
        seq(prompt=list(range(40)), output=[7, 7], repetition_penalty=0.8, frequency_penalty=1.0, logit_bias={7: 2.0}),
    ]
    logits = torch.randn(len(rows), vocab, generator=gen)
    batched = logits.clone()
    adjust_logits(batched, rows)
    for i, row in enumerate(rows):
        alone = logits[i : i + 1].clone()
        adjust_logits(alone, [row])
        assert torch.equal(batched[i], alone[0])
    assert torch.equal(batched[3], logits[3])  # nothing to adjust
    assert batched[2, 10] == logits[2, 10] + 5.0 and batched[2, 299] == logits[2, 299] - 3.0


def test_min_new_tokens_masks_the_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])  # 1 is EOS here, 2 a stop token id
    s = seq(temperature=0, min_new_tokens=2, stop_ids=[1, 2])
    sampler = Sampler(0)
    assert sampler.sample(logits, [s]).tolist() == [3]
    assert sampler.sample(logits, [s]).tolist() == [3]
    assert sampler.sample(logits, [s]).tolist() == [1]  # two tokens out: it may stop
    assert s.sampled == 3
