"""Tensor parallelism on CPU with gloo: how a model is cut, the collectives
and the step broadcast against the one-rank result, then whole engines at
--tp-size 2 against --tp-size 1 on the tiny models and the embedded one."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.engine.tp.broadcast import copies_message, copies_size, header, payload, unpack, unpack_copies
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import SlotCopies
from pyserve.model.parallel import TensorParallel, embed
from pyserve.asgi import create_app
from pyserve.options import ModelOptions
from pyserve.server_args import ServerArgs
from tests.conftest import free_port
from tests.slow import slow
from tests.test_engine import PROMPTS, started_engine
from tests.tiny_models import build_tiny_model


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
    assert same_batch(unpack(header(batch).tolist(), payload(batch)), batch)


def test_a_batch_with_rows_given_as_embeddings_survives_packing():
    embeds = torch.randn(2, 8)
    batch = ForwardBatch.build(
        input_ids=[0, 0, 0, 8], positions=[0, 1, 2, 9], out_cache_loc=torch.tensor([3, 4, 5, 11]),
        extend_lens=[3, 1], slots=[torch.tensor([3, 4, 5]), torch.arange(2, 12)], logits_indices=[2, 3],
        is_decode=False, device="cpu", embeds=([1, 2], embeds))
    sizes = header(batch).tolist()
    got = unpack(sizes, payload(batch), torch.empty(sizes[7], sizes[8]).copy_(embeds))
    assert same_batch(got, batch)
    assert got.embeds_rows.tolist() == [1, 2] and torch.equal(got.input_embeds, embeds)


@pytest.mark.parametrize("windowed", [False, True])
def test_kv_copies_survive_packing(windowed):
    slots = [torch.tensor([9, 12]), torch.tensor([4, 5])] + ([torch.tensor([1, 2]), torch.tensor([0, 3])]
                                                             if windowed else [])
    sizes, data = copies_message(SlotCopies(*slots))
    assert data.numel() == copies_size(sizes.tolist())
    got = unpack_copies(sizes.tolist(), data)
    assert [t.tolist() for t in (got.src, got.dst, got.window_src, got.window_dst) if t is not None] == \
        [t.tolist() for t in slots]
    assert (got.window_src is None) == (not windowed)


def test_shards_and_replicated_kv_heads():
    assert [TensorParallel(r, 4).shard(32) for r in range(4)] == [range(0, 8), range(8, 16), range(16, 24),
                                                                   range(24, 32)]
    with pytest.raises(ValueError, match="evenly"):
        TensorParallel(0, 3).shard(32)
    # 2 KV heads over 4 ranks: ranks 0-1 serve KV head 0 and split its query
    # heads 0-3, ranks 2-3 serve KV head 1 (query heads 4-7)
    assert [TensorParallel(r, 4).attention_heads(8, 2) for r in range(4)] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)), (range(4, 6), range(1, 2)), (range(6, 8), range(1, 2))]
    # whole KV groups, as even as they come: 3 KV heads (9 query heads) over 2 ranks
    assert [TensorParallel(r, 2).attention_heads(9, 3) for r in range(2)] == [
        (range(0, 3), range(0, 1)), (range(3, 9), range(1, 3))]
    with pytest.raises(ValueError, match="cannot be split"):
        TensorParallel(0, 4).attention_heads(6, 2)
    # a vocabulary that does not divide: equal shards, the last one padded
    assert [TensorParallel(r, 2).vocab_shard(49153) for r in range(2)] == [range(0, 24577), range(24577, 49154)]


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
    rows_held = tp.vocab_shard(vocab)
    shard = torch.zeros(len(rows_held), hidden)
    real = table[rows_held.start : rows_held.stop]
    shard[: real.shape[0]] = real
    out = {"embed": embed(ids, shard, rows_held.start, tp)}
    # row-parallel: each rank multiplies its slice of the input, then sums
    cols = tp.shard(6)
    out["row"] = tp.all_reduce(x[:, cols.start : cols.stop] @ w[:, cols.start : cols.stop].T)
    out["logits"] = tp.gather_vocab(out["embed"] @ shard.T, vocab)
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


@pytest.mark.parametrize("options", [
    {"tp_size": 2, "enable_torch_compile": True},
    {"tp_size": 3, "nnodes": 2, "dist_init_addr": "10.0.0.1:5000"},
    {"tp_size": 2, "nnodes": 2},
    {"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "10.0.0.1:5000"},
    {"tp_size": 2, "dist_init_addr": "10.0.0.1"},
    {"tp_size": 0},
])
def test_options_tp_cannot_run_are_refused_at_start(options):
    with pytest.raises(ValueError, match="--"):
        ServerArgs(**options).validate()


def test_worker_processes_receive_the_model_options_and_never_the_api_key(tiny_llama_dir, tmp_path, monkeypatch):
    """What a served app hands its rank processes, as spawn would send it."""
    sent = []

    class Stop(Exception):
        pass

    class Unstarted:
        def __init__(self, target, args, name, daemon):
            sent.append(pickle.dumps(args))

        def start(self):
            raise Stop  # the arguments are all this test needs

    class Spawn:
        Process = Unstarted

    monkeypatch.setattr(torch.multiprocessing, "get_context", lambda method: Spawn())
    key = "sekrit-api-key"
    app = create_app(model_path=str(tiny_llama_dir), tp_size=2, api_key=key, file_storage_path=str(tmp_path))
    with pytest.raises(Stop):
        asyncio.run(app.startup())
    assert len(sent) == 1 and key.encode() not in sent[0]
    rank, _, options, model_dir, _ = pickle.loads(sent[0])
    assert rank == 1 and type(options) is ModelOptions and options.tp_size == 2
    assert model_dir == tiny_llama_dir


# -- whole engines: --tp-size 2 against --tp-size 1 ---------------------------

async def _generate(engine, prompt, **params) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, their log-probabilities, and the prompt's."""
    ids, logprobs, prompt_logprobs = [], [], []
    request = GenerateRequest(prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True,
                                                     top_logprobs=3, prompt_logprobs=True, **params))
    async for out in engine.generate(request):
        ids += out.token_ids
        logprobs += [lp.logprob for lp in out.logprobs]
        if out.prompt_logprobs is not None:
            prompt_logprobs = [lp.logprob for lp in out.prompt_logprobs[1:]]
    return ids, logprobs, prompt_logprobs


async def _run(model_dir, tp_size: int, **options) -> list[tuple]:
    """Each prompt alone, then all of them as one batch (prefill and decode
    rows mixed), on an engine of `tp_size` ranks."""
    options.setdefault("device", "cpu")  # two gloo ranks, also where one GPU is
    engine = await started_engine(model_dir, tp_size=tp_size, **options)
    try:
        alone = [await _generate(engine, p) for p in PROMPTS[:2]]
        together = await asyncio.gather(*[_generate(engine, p) for p in PROMPTS])
        assert engine.integrity_problem() is None
    finally:
        await engine.shutdown()
    return alone + list(together)


def _one_and_two_ranks(model_dir, **options) -> tuple[list, list]:
    return asyncio.run(_run(model_dir, 1, **options)), asyncio.run(_run(model_dir, 2, **options))


def assert_same_generation(one: list, two: list, atol: float = 1e-4) -> None:
    assert [ids for ids, _, _ in two] == [ids for ids, _, _ in one]
    for (_, lp1, prompt1), (_, lp2, prompt2) in zip(one, two):
        assert lp2 == pytest.approx(lp1, abs=atol)
        assert prompt2 == pytest.approx(prompt1, abs=atol)


TINY_MODELS = [
    pytest.param("llama", {}, id="llama-gqa"),
    # one KV head: both ranks hold it and split its query heads; an odd
    # vocabulary leaves the last rank's shard a padded row
    pytest.param("qwen2", {"num_key_value_heads": 1, "vocab_size": 49153}, id="qwen2-bias-replicated-kv",
                 marks=slow),
    # slow: q/k norms per head (each rank's own) and tied embeddings, split as an untied head
    pytest.param("qwen3", {"tie_word_embeddings": True}, id="qwen3-qk-norm-tied", marks=slow),
    # slow: Phi-3's fused qkv/gate_up read apart per rank (by default in
    # test_quantized_tp_reads' phi3-fused-qkv-gate-up)
    pytest.param("phi3", {}, id="phi3-fused-checkpoint", marks=slow),
    # slow: Granite's multipliers and SmolLM3's NoPE layers act on whole
    # tensors or per head, where the ranks split a Llama's layers
    # (llama-gqa here); one rank against transformers: test_model_vs_hf
    pytest.param("granite", {}, id="granite-multipliers", marks=slow),
    # q/k normalized over all heads: the ranks all-reduce their sums of
    # squares, the one KV head replicated on both ranks counted once
    pytest.param("olmo2", {"num_key_value_heads": 1}, id="olmo2-all-heads-qk-norm-replicated-kv"),
    # slow: split KV heads (the replicated case above is the harder one), and
    # GLM-4's rotary acting per head, as Granite's multipliers
    pytest.param("olmo2", {}, id="olmo2-all-heads-qk-norm", marks=slow),
    pytest.param("glm4", {}, id="glm4-partial-interleaved-rotary", marks=slow),
    pytest.param("smollm3", {}, id="smollm3-nope-layers", marks=slow),
]


@pytest.mark.parametrize("arch, overrides", TINY_MODELS)
def test_two_ranks_generate_what_one_does_on_tiny_models(tmp_path, default_model_dir, arch, overrides):
    model_dir = build_tiny_model(tmp_path, arch, tokenizer_dir=default_model_dir, **overrides)
    assert_same_generation(*_one_and_two_ranks(model_dir))
