"""A step's plan (pyserve/model/step_plan.py): RankModel decides it from the
batch alone, and the model runs the layers it names on the threads it
names, whatever count torch had been left at."""

from __future__ import annotations

import pytest
import torch

from pyserve.engine.runner import rank_model
from pyserve.engine.runner.rank_model import RankModel
from pyserve.model.cpu import blocks, extend_attention
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.layers.causal_lm import AuxCapture
from pyserve.model.step_plan import Layers, StepPlan
from pyserve.server_args import ServerArgs
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(not blocks.available(), reason="the 8da4w kernels need AVX2")

THREADS = 2  # the rank's CPUs, whatever this machine has


class Steps:
    """Sequences over a RankModel's KV cache; `batch` builds their next step."""

    def __init__(self):
        self.slots: list[torch.Tensor] = []
        self.next_slot = 1  # slot 0 pads
        self.generator = torch.Generator().manual_seed(0)

    def batch(self, new: dict[int, int], verify: frozenset[int] = frozenset()) -> ForwardBatch:
        """`new`: tokens to add per sequence (sequences are created in order);
        `verify`: the sequences whose every new token wants its logits (a
        verify row), where the others want their last token's."""
        ids, positions, fresh = [], [], []
        for seq, count in new.items():
            if seq == len(self.slots):
                self.slots.append(torch.empty(0, dtype=torch.long))
            cached = self.slots[seq].numel()
            slots = torch.arange(self.next_slot, self.next_slot + count)
            self.next_slot += count
            self.slots[seq] = torch.cat([self.slots[seq], slots])
            ids += torch.randint(3, 500, (count,), generator=self.generator).tolist()
            positions += range(cached, cached + count)
            fresh.append(slots)
        ends = torch.tensor(list(new.values())).cumsum(0) - 1
        logits = [row for (seq, count), end in zip(new.items(), ends.tolist())
                  for row in (range(end - count + 1, end + 1) if seq in verify else [end])]
        decode = all(count == 1 for count in new.values()) and all(self.slots[s].numel() > 1 for s in new)
        return ForwardBatch.build(ids, positions, torch.cat(fresh), list(new.values()),
                                  [self.slots[s] for s in new], logits, decode, "cpu")


@pytest.fixture(scope="module")
def rank(tmp_path_factory, default_model_dir):
    """An 8da4w tiny Llama on a rank of THREADS CPUs, torch's count restored after."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("plan"), "llama", tokenizer_dir=default_model_dir)
    options = ServerArgs(model_path=str(model_dir), torchao_config="8da4w", max_total_tokens=2048,
                         device="cpu").resolved().split().model
    before = torch.get_num_threads()
    usable = rank_model.usable_cpus
    rank_model.usable_cpus = lambda: THREADS
    try:
        model = RankModel(options, model_dir, torch.device("cpu"))
        model.allocate(model.num_pages())
        assert model.native_layers is not None and model.native_extend_fits
        yield model
    finally:
        rank_model.usable_cpus = usable
        torch.set_num_threads(before)


def test_the_owner_plans_each_kind_of_step(rank):
    steps = Steps()
    prompts = steps.batch({0: 9, 1: 5})
    assert rank.plan(prompts) == StepPlan(Layers.NATIVE_EXTENDS, 1, True, THREADS)
    rank.forward(prompts)
    assert rank.plan(steps.batch({0: 1, 1: 1})) == StepPlan(Layers.NATIVE_DECODE, 1, True, THREADS)
    # A decode row beside a chunk, or beside a row of drafts (a verify step):
    # the native layers, the decode row attending as in a decode step.
    mixed = steps.batch({0: 1, 1: 6})
    assert rank.plan(mixed) == StepPlan(Layers.NATIVE_EXTENDS, 1, True, THREADS)
    rank.forward(mixed)
    assert rank.plan(steps.batch({0: 7})) == StepPlan(Layers.NATIVE_EXTENDS, 1, True, THREADS)
    long = steps.batch({2: rank_model.ONE_THREAD_BELOW_ROWS})  # all threads, SDPA
    assert rank.plan(long) == StepPlan(Layers.TORCH, THREADS, False, None)


def test_a_step_runs_the_layers_and_threads_its_plan_names(rank, monkeypatch):
    """Which native runner ran, whether the extend kernel attended, and
    torch's thread count inside each; after each step, the rank's count."""
    seen = []
    native = rank.native_layers
    for name in ("run", "run_extends"):
        method = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _n=name, _m=method: seen.append((_n, torch.get_num_threads()))
                            or _m(*a))
    attend = extend_attention.attend
    monkeypatch.setattr(extend_attention, "attend",
                        lambda *a: seen.append(("extend kernel", torch.get_num_threads())) or attend(*a))
    steps = Steps()
    for new in ({0: 9, 1: 5}, {0: 1, 1: 1}, {0: 1, 1: 6}, {2: rank_model.ONE_THREAD_BELOW_ROWS}):
        rank.forward(steps.batch(new))
        assert torch.get_num_threads() == THREADS
    layers = rank.model.config.num_hidden_layers
    assert seen == [("run_extends", 1), ("run", 1), ("run_extends", 1)]
    seen.clear()
    # Kept hidden states (an EAGLE-3 head's): the same native layers, which fill them.
    capture = AuxCapture(frozenset([0, layers - 1]))
    rank.forward(steps.batch({0: 1, 1: 3}), capture=capture)
    assert seen == [("run_extends", 1)]
    assert [tuple(s.shape) for s in capture.states] == [(4, rank.model.config.hidden_size)] * 2


def test_a_verify_row_attends_as_decode_rows_and_a_chunk_does_not(rank):
    """A verify row (every new token wants its logits, after a cached
    past) attends as decode rows, so its tokens get a decode step's bits; a
    prompt's chunk after a cached past keeps extend attention's tiles, and
    a lone new token is a decode row either way."""
    steps = Steps()
    rank.forward(steps.batch({0: 9, 1: 5, 2: 7}))
    step = steps.batch({0: 1, 1: 4, 2: 5}, verify=frozenset([1]))
    rank.attention.prepare(step, rank.plan(step))
    assert [(count, as_decode) for count, _, as_decode in rank.attention.native_extends()] == [
        (1, False), (4, True), (5, False)]
    assert rank.forward(step).shape == (1 + 4 + 1, rank.model.config.vocab_size)
