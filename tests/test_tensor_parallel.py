"""Tensor-parallel pieces on CPU with gloo: shards, collectives, and the
step broadcast, each against the one-rank result."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pyserve.engine.tp_broadcast import pack, receive_batch, send_batch, send_stop, unpack
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.parallel import TensorParallel, embed
from tests.conftest import free_port


def sample_batch() -> ForwardBatch:
    return ForwardBatch.build(
        input_ids=[5, 6, 7, 8], positions=[0, 1, 2, 9], out_cache_loc=torch.tensor([3, 4, 5, 11]),
        extend_lens=[3, 1], slots=[torch.tensor([3, 4, 5]), torch.arange(2, 12)], logits_indices=[2, 3],
        is_decode=False, device="cpu",
    )


def same_batch(a: ForwardBatch, b: ForwardBatch) -> bool:
    tensors = ("input_ids", "positions", "out_cache_loc", "kv_indptr", "kv_indices", "logits_indices")
    return (all(torch.equal(getattr(a, t), getattr(b, t)) for t in tensors)
            and (a.extend_lens, a.seq_lens, a.is_decode) == (b.extend_lens, b.seq_lens, b.is_decode))


def test_a_batch_survives_packing():
    batch = sample_batch()
    assert same_batch(unpack(pack(batch)), batch)


def test_shards_and_replicated_kv_heads():
    assert [TensorParallel(r, 4).shard(32) for r in range(4)] == [(0, 8), (8, 8), (16, 8), (24, 8)]
    with pytest.raises(ValueError, match="evenly"):
        TensorParallel(0, 3).shard(32)
    # 2 KV heads over 4 ranks: ranks 0-1 serve head 0, ranks 2-3 head 1, as
    # their query heads (8 each of 32) belong to those groups
    assert [TensorParallel(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [TensorParallel(r, 2).kv_heads(8) for r in range(2)] == [(0, 4), (4, 4)]
    # a vocabulary that does not divide: equal shards, the last one padded
    assert [TensorParallel(r, 2).vocab_shard(49153) for r in range(2)] == [(0, 24577), (24577, 24577)]


def _rank_main(rank: int, size: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    tp = TensorParallel(rank, size, dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    vocab, hidden, rows = 11, 4, 5
    table = torch.randn(vocab, hidden, generator=g)
    x = torch.randn(rows, 6, generator=g)
    w = torch.randn(hidden, 6, generator=g)
    ids = torch.tensor([0, 3, 10, 6, 5])
    first, count = tp.vocab_shard(vocab)
    shard = torch.zeros(count, hidden)
    real = table[first : first + count]
    shard[: real.shape[0]] = real
    out = {"embed": embed(ids, shard, first, tp)}
    # row-parallel: each rank multiplies its slice of the input, then sums
    start, n = tp.shard(6)
    out["row"] = tp.all_reduce(x[:, start : start + n] @ w[:, start : start + n].T)
    out["logits"] = tp.gather_vocab(out["embed"] @ shard.T, vocab)
    if rank == 0:
        send_batch(sample_batch(), tp)
        send_stop(tp, torch.device("cpu"))
    else:
        out["received"] = receive_batch(tp, torch.device("cpu"))
        out["stopped"] = receive_batch(tp, torch.device("cpu")) is None
    results[rank] = out
    dist.destroy_process_group()


def test_two_ranks_compute_what_one_does():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(2, free_port(), results), nprocs=2, join=True)
        results = dict(results)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(11, 4, generator=g)
    x = torch.randn(5, 6, generator=g)
    w = torch.randn(4, 6, generator=g)
    ids = torch.tensor([0, 3, 10, 6, 5])
    for rank in (0, 1):
        assert torch.equal(results[rank]["embed"], table[ids])
        assert torch.allclose(results[rank]["row"], x @ w.T, atol=1e-6)
        assert torch.allclose(results[rank]["logits"], table[ids] @ table.T, atol=1e-6)
    assert same_batch(results[1]["received"], sample_batch()) and results[1]["stopped"]
