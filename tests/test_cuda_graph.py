"""CUDA-graph decode replays give the eager forward's logits and tokens.

A tiny random Llama in float32 (so graph and eager differ by rounding only)
runs through a ModelRunner on CUDA with the Triton backend. Prefill is
eager; decode batches of several sizes, padded ones included, go through
ModelRunner.forward (a graph replay) and through the model directly (eager).
The tests hand out KV slots themselves (1, 2, 3, ...) and never use the
pool's allocator.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pyserve.engine.runner.cuda_graph_runner import capture_batch_sizes  # noqa: E402
from pyserve.model.forward_batch import ForwardBatch  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MAX_BS = 16


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from pyserve.engine.runner.model_runner import ModelRunner
    from pyserve.server_args import ServerArgs

    model_dir = build_tiny_model(tmp_path_factory.mktemp("graph-llama"), "llama", num_hidden_layers=3)
    args = ServerArgs(
        device="cuda", dtype="float32", attention_backend="triton", max_total_tokens=8192,
        context_length=512, cuda_graph_max_bs=MAX_BS, max_running_requests=64,
    )
    runner = ModelRunner(args.resolved().split().model, model_dir)
    graphs = runner.rank_model.cuda_graphs
    assert graphs is not None and graphs.batch_sizes == {1: [1, 2, 4, 8, 16]}  # decode graphs only
    yield runner
    runner.shutdown()


class Sequences:
    """Token ids and KV slots of sequences; slots are taken from a counter."""

    def __init__(self, first_slot: int):
        self.next_slot = first_slot
        self.tokens: list[list[int]] = []
        self.slots: list[torch.Tensor] = []

    def _take(self, n: int) -> torch.Tensor:
        self.next_slot += n
        return torch.arange(self.next_slot - n, self.next_slot)

    def prefill(self, prompts: list[list[int]]) -> ForwardBatch:
        fresh = [self._take(len(p)) for p in prompts]
        self.tokens += [list(p) for p in prompts]
        self.slots += fresh
        ids = [t for p in prompts for t in p]
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        return ForwardBatch.build(
            ids, [i for p in prompts for i in range(len(p))], torch.cat(fresh), [len(p) for p in prompts],
            fresh, ends.tolist(), is_decode=False, device="cuda",
        )

    def decode(self, rows: list[int], next_tokens: list[int]) -> ForwardBatch:
        """Sequences `rows` each add one token."""
        fresh = [self._take(1) for _ in rows]
        positions = []
        for r, token, slot in zip(rows, next_tokens, fresh):
            positions.append(len(self.tokens[r]))
            self.tokens[r].append(token)
            self.slots[r] = torch.cat([self.slots[r], slot])
        return ForwardBatch.build(
            next_tokens, positions, torch.cat(fresh), [1] * len(rows), [self.slots[r] for r in rows],
            list(range(len(rows))), is_decode=True, device="cuda",
        )


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (n,), generator=g).tolist()
    return [torch.randint(3, 500, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.gpu
@needs_cuda
def test_replayed_logits_equal_eager_logits(runner):
    seqs = Sequences(first_slot=1)
    with torch.inference_mode():
        runner.forward(seqs.prefill(random_prompts(20, seed=0)))
        g = torch.Generator().manual_seed(1)
        # 3 and 11 are padded (to 4 and 16); 20 is past the largest graph.
        for bs in (8, 3, 1, 11, 16, 20):
            rows = torch.randperm(20, generator=g)[:bs].tolist()
            batch = seqs.decode(rows, torch.randint(3, 500, (bs,), generator=g).tolist())
            assert runner.rank_model.cuda_graphs.can_run(batch) == (bs <= MAX_BS)
            k_before = runner.rank_model.kv_buffer.k_buffer[0].clone()
            replayed = runner.forward(batch)
            # A replay writes the batch's own slots and the padding slot 0, no others.
            changed = (runner.rank_model.kv_buffer.k_buffer[0] != k_before).flatten(1).any(1).nonzero().flatten()
            allowed = set(batch.out_cache_loc.tolist()) | {0}
            assert set(changed.tolist()) <= allowed
            eager = runner.rank_model.model(batch, runner.rank_model.attention)
            assert replayed.shape == (bs, 512) and replayed.dtype == torch.float32
            torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_greedy_decode_equal_with_and_without_graphs(runner):
    prompts = random_prompts(6, seed=2)

    def greedy(first_slot: int, use_graphs: bool) -> list[list[int]]:
        seqs = Sequences(first_slot)
        forward = runner.forward if use_graphs else (lambda b: runner.rank_model.model(b, runner.rank_model.attention))
        with torch.inference_mode():
            logits = forward(seqs.prefill(prompts))
            out = [[t] for t in logits.argmax(-1).tolist()]
            for _ in range(24):
                logits = forward(seqs.decode(list(range(len(prompts))), [o[-1] for o in out]))
                for o, t in zip(out, logits.argmax(-1).tolist()):
                    o.append(t)
        return out

    assert greedy(first_slot=4000, use_graphs=True) == greedy(first_slot=6000, use_graphs=False)
