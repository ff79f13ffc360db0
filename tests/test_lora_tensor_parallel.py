"""LoRA adapters over two tensor-parallel ranks (gloo on CPU): each rank
holds its shard of every adapter (column-parallel q/k/v/gate/up: whole A,
B's rows; row-parallel o/down: A's columns, whole B), the per-step
broadcast carries the adapter of each token, and an adapter loaded at run
time reaches every rank. Greedy tokens equal transformers + PEFT's."""

from __future__ import annotations

import asyncio

import pytest

from pyserve.lora.batch import LoraBatch
from pyserve.engine.tp.broadcast import header, payload, unpack
from tests.slow import slow_test
from tests.test_engine import started_engine
from tests.test_lora import generate, make_adapter, reference_tokens
from tests.test_tensor_parallel import same_batch, sample_batch

pytest.importorskip("peft")


def test_a_batch_with_adapters_survives_packing():
    batch = sample_batch()
    batch.lora = LoraBatch.of_rows([1, -1], batch.extend_lens)
    got = unpack(header(batch).tolist(), payload(batch))
    assert same_batch(got, batch) and got.lora.per_token.tolist() == [1, 1, 1, -1]
    assert [(slot, idx.tolist()) for slot, idx in got.lora.groups] == [(1, [0, 1, 2])]


@slow_test
def test_two_ranks_serve_adapters_as_transformers_peft(tmp_path, tiny_llama_dir):
    adapters = {"alpha": make_adapter(tiny_llama_dir, tmp_path / "alpha", 1),
                "beta": make_adapter(tiny_llama_dir, tmp_path / "beta", 2, r=8,
                                     targets=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"], rslora=True)}
    cases = [([5, 17, 99, 3], "alpha"), (list(range(100, 117)), "beta"), ([42] * 6, None), ([7, 8], "beta")]
    expected = [reference_tokens(tiny_llama_dir, adapters[name] if name else None, p, 8) for p, name in cases]

    async def main():
        engine = await started_engine(tiny_llama_dir, tp_size=2, enable_lora=True,
                                      lora_paths=f"alpha={adapters['alpha']}", max_lora_rank=8)
        try:
            await engine.adapters.load("beta", adapters["beta"])  # at run time, on both ranks
            got = await asyncio.gather(*(generate(engine, p, name) for p, name in cases))
            return [tokens for tokens, _ in got]
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == expected
