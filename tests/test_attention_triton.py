"""The Triton attention backend against TorchAttention and a float64 reference.

Without CUDA the kernels run on CPU in Triton's interpreter: tests/conftest.py
sets TRITON_INTERPRET=1 before any test module imports a kernel (Triton reads
it when a kernel is decorated). With CUDA they run compiled on the GPU.
Shapes are small because the interpreter runs each program in Python.
Sequences get scattered slots, ragged lengths, cached prefixes, grouped kv
heads and head dims that are not powers of two.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # in case this file runs without conftest.py

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pyserve.model.attention import triton_decode  # noqa: E402
from pyserve.model.attention.torch_backend import TorchAttention  # noqa: E402
from pyserve.model.attention.triton_backend import TritonAttention  # noqa: E402
from pyserve.model.forward_batch import ForwardBatch  # noqa: E402
from tests.test_attention_torch import reference_attention, step_batch  # noqa: E402

if DEVICE == "cpu" and not isinstance(triton_decode._decode_split_kernel, InterpretedFunction):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

LAYERS, SLOTS = 2, 1024


class Harness:
    """A KV pool shared by both backends, and the true K/V of every sequence.
    `step` runs one forward through Triton and Torch on the same inputs."""

    def __init__(self, heads, kv_heads, head_dim, dtype=torch.float32, max_kv_splits=4, seed=0):
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        shape = (SLOTS, kv_heads, head_dim)
        self.pool = SimpleNamespace(
            dtype=dtype,
            k_buffer=[torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(LAYERS)],
            v_buffer=[torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(LAYERS)],
        )
        self.triton = TritonAttention(self.pool, heads, context_len=SLOTS, max_kv_splits=max_kv_splits)
        self.torch = TorchAttention(self.pool)
        self.gen = torch.Generator().manual_seed(seed)
        # Slots handed out in a scattered order, as a long-running pool does; 0 is reserved.
        self.free = (torch.randperm(SLOTS - 1, generator=self.gen) + 1).tolist()
        self.slots: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def batch(self, new_lens: list[int], decode: bool) -> tuple[ForwardBatch, list[int]]:
        """Give sequences 0..B-1 (created on first use) `new_lens` new slots;
        returns the batch and each sequence's first new position."""
        while len(self.slots) < len(new_lens):
            self.slots.append(torch.empty(0, dtype=torch.long))
            self.keys.append(self.randn(0, self.kv_heads, self.head_dim))
            self.values.append(self.randn(0, self.kv_heads, self.head_dim))
        fresh, first_pos = [], []
        for i, n in enumerate(new_lens):
            first_pos.append(self.slots[i].numel())
            fresh.append(torch.tensor([self.free.pop() for _ in range(n)], dtype=torch.long))
            self.slots[i] = torch.cat([self.slots[i], fresh[-1]])
        return step_batch(self.slots[: len(new_lens)], fresh, first_pos, decode, DEVICE), first_pos

    def fill(self, lens: list[int], layer_id: int = 0) -> None:
        """Cache `lens` tokens of random K/V per sequence without attending
        (a cheap history for decode tests)."""
        self.batch(lens, decode=False)
        for i, n in enumerate(lens):
            k, v = self.randn(n, self.kv_heads, self.head_dim), self.randn(n, self.kv_heads, self.head_dim)
            self.keys[i] = torch.cat([self.keys[i], k])
            self.values[i] = torch.cat([self.values[i], v])
            new = self.slots[i][-n:].to(DEVICE)
            self.pool.k_buffer[layer_id][new] = k.to(DEVICE)
            self.pool.v_buffer[layer_id][new] = v.to(DEVICE)

    def step(self, new_lens: list[int], decode: bool = False, layer_id: int = 0):
        """(triton output, torch output, float64 reference), all on CPU."""
        batch, first_pos = self.batch(new_lens, decode)
        T = sum(new_lens)
        q = self.randn(T, self.heads, self.head_dim)
        k = self.randn(T, self.kv_heads, self.head_dim)
        v = self.randn(T, self.kv_heads, self.head_dim)
        starts = [sum(new_lens[:i]) for i in range(len(new_lens))]
        for i, (s, n) in enumerate(zip(starts, new_lens)):
            self.keys[i] = torch.cat([self.keys[i], k[s : s + n]])
            self.values[i] = torch.cat([self.values[i], v[s : s + n]])
        scale = self.head_dim**-0.5
        outs = []
        for backend in (self.triton, self.torch):  # the second rewrites the same k/v: harmless
            backend.prepare(batch)
            outs.append(backend.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), layer_id, batch, scale).cpu())
        expected = torch.cat([
            reference_attention(q[s : s + n], self.keys[i], self.values[i], first_pos[i], scale)
            for i, (s, n) in enumerate(zip(starts, new_lens))
        ])
        return outs[0], outs[1], expected


def assert_matches(out, torch_out, expected, tol=2e-5):
    assert out.dtype == torch_out.dtype
    torch.testing.assert_close(out, torch_out, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


# heads, kv_heads, head_dim: plain multi-head, GQA, MQA; 80 and 48 are not powers of two.
SHAPES = [(2, 2, 64), (4, 2, 80), (4, 1, 48)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_ragged_prefill_then_extend_over_cached_prefixes(heads, kv_heads, head_dim):
    h = Harness(heads, kv_heads, head_dim)
    # 70 new tokens span two query blocks and two key blocks.
    out = h.step([1, 7, 33, 70])
    assert out[0].shape == (111, heads, head_dim)
    assert_matches(*out)
    # Prefix hits: every sequence extends over what it cached; sequence 4 is
    # new in the same batch; sequence 1 adds one token outside a decode step.
    assert_matches(*h.step([4, 1, 9, 66, 3]))


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_decode_of_ragged_sequences_over_several_splits(heads, kv_heads, head_dim):
    h = Harness(heads, kv_heads, head_dim, max_kv_splits=4)
    # 200 tokens make 4 pieces of 64 keys, 65 make 2, short ones 1.
    h.fill([1, 2, 64, 199])
    for _ in range(2):
        assert_matches(*h.step([1, 1, 1, 1], decode=True))


def test_decode_with_one_split_and_with_more_splits_than_blocks():
    for splits in (1, 16):
        h = Harness(4, 2, 16, max_kv_splits=splits)
        h.fill([5, 150])
        assert_matches(*h.step([1, 1], decode=True))


def test_decode_ignores_what_slot_0_holds():
    h = Harness(4, 2, 32)
    h.fill([2, 20])
    h.pool.k_buffer[0][0] = 1e4  # the padding slot: never read for a real sequence
    h.pool.v_buffer[0][0] = 1e4
    assert_matches(*h.step([1, 1], decode=True))


@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="Triton's interpreter multiplies bfloat16 bit patterns as integers in tl.dot")),
])
def test_half_precision_close_to_reference(dtype):
    h = Harness(4, 2, 64, dtype=dtype)
    out, torch_out, expected = h.step([4, 11])
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    out, torch_out, expected = h.step([1, 1], decode=True)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def _latent_reference(q, keys, values, prefix, scale):
    """Causal attention of new queries [n, heads, kd] over one sequence's keys [len, kd] / values [len, vd]."""
    s = torch.einsum("thd,nd->thn", q.float(), keys.float()) * scale
    seen = torch.arange(keys.shape[0])[None, None, :] <= (prefix + torch.arange(q.shape[0]))[:, None, None]
    return torch.einsum("thn,nd->thd", s.masked_fill(~seen, float("-inf")).softmax(-1), values.float())


@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="Triton's interpreter multiplies bfloat16 bit patterns as integers in tl.dot")),
])
def test_half_precision_latent_cache(dtype):
    """A latent cache as DeepSeek's (one KV head of K 40 values, V a view of
    its first 32) in 16-bit, extend over a cached prefix and decode: the
    tile shapes that miscompiled on an H100 when the key block was wider
    than the V tile."""
    from pyserve.model.attention.triton_decode import decode_attention
    from pyserve.model.attention.triton_extend import extend_attention

    heads, kd, vd, prefix, new = 4, 40, 32, 30, 14
    g = torch.Generator().manual_seed(0)
    k_buffer = (torch.randn(128, 1, kd, generator=g) * 0.5).to(dtype).to(DEVICE)
    v_buffer = k_buffer[..., :vd]
    lens = [prefix + new, new]
    slots = [torch.randperm(127, generator=g)[:n] + 1 for n in lens]
    q = (torch.randn(2 * new, heads, kd, generator=g) * 0.5).to(dtype)
    kv_indptr = torch.tensor([0, lens[0], sum(lens)], device=DEVICE)
    kv_indices = torch.cat(slots).to(DEVICE)
    out = torch.zeros(2 * new, heads, vd, dtype=dtype, device=DEVICE)
    extend_attention(q.to(DEVICE), k_buffer, v_buffer, out, torch.tensor([0, new, 2 * new], device=DEVICE),
                     kv_indptr, kv_indices, new, kd**-0.5)
    cpu_k = k_buffer[:, 0].cpu()
    expected = torch.cat([_latent_reference(q[i * new:(i + 1) * new], cpu_k[s], cpu_k[s, :vd], n - new, kd**-0.5)
                          for i, (s, n) in enumerate(zip(slots, lens))])
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)
    last = q[[new - 1, 2 * new - 1]].contiguous()  # each sequence's last position, as a decode row
    out = torch.zeros(2, heads, vd, dtype=dtype, device=DEVICE)
    mid_o = torch.empty(2, heads, 4, vd, dtype=torch.float32, device=DEVICE)
    mid_lse = torch.empty(2, heads, 4, dtype=torch.float32, device=DEVICE)
    decode_attention(last.to(DEVICE), k_buffer, v_buffer, out, kv_indptr, kv_indices, mid_o, mid_lse, 4, kd**-0.5)
    expected = torch.cat([_latent_reference(last[i:i + 1], cpu_k[s], cpu_k[s, :vd], n - 1, kd**-0.5)
                          for i, (s, n) in enumerate(zip(slots, lens))])
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_kv_is_written_to_its_slots_and_layer_only():
    h = Harness(4, 2, 16)
    h.step([3, 5], layer_id=1)
    for slots, keys, values in zip(h.slots, h.keys, h.values):
        assert torch.equal(h.pool.k_buffer[1][slots].cpu(), keys)
        assert torch.equal(h.pool.v_buffer[1][slots].cpu(), values)
        assert not h.pool.k_buffer[0][slots].any()


def test_forward_without_prepare_is_an_error():
    h = Harness(4, 2, 16)
    batch, _ = h.batch([2], decode=False)
    qkv = torch.zeros(2, 4, 16, device=DEVICE)
    with pytest.raises(RuntimeError, match="prepare"):
        h.triton.forward(qkv, qkv[:, :2], qkv[:, :2], 0, batch, 1.0)


def test_split_count_depends_on_the_batch_size_only():
    h = Harness(4, 2, 16, max_kv_splits=8)
    h.triton._target_programs = 64  # as on a GPU with 32 SMs
    assert [h.triton.num_kv_splits(bs) for bs in (1, 4, 5, 32, 64)] == [8, 8, 7, 1, 1]


@pytest.mark.parametrize("options", [{}, dict(window=16, softcap=4.0, sinks=[0.5, -1.0, 2.0, 0.0])],
                         ids=["plain", "sliding-capped-sinks"])
def test_cuda_graph_tables_pad_a_decode_batch_with_slot_0(options):
    """A decode batch of 3 run through the static tables padded to 5 rows
    (what a CUDA-graph replay reads) gives the eager batch's outputs, with
    a layer's options too."""
    if "sinks" in options:
        options = {**options, "sinks": torch.tensor(options["sinks"], device=DEVICE)}
    h = Harness(4, 2, 32)
    h.fill([3, 40, 9])
    batch, _ = h.batch([1, 1, 1], decode=True)
    q = h.randn(3, 4, 32).to(DEVICE)
    kv = h.randn(3, 2, 32).to(DEVICE)
    h.triton.prepare(batch)
    eager = h.triton.forward(q, kv, kv, 0, batch, 0.2, **options)

    h.triton.init_cuda_graph_state(max_bs=8)
    indptr, indices, window_indices = h.triton.cuda_graph_kv_tables(5)
    assert window_indices is None  # one pool
    assert indptr.tolist() == [0, 1, 2, 3, 4, 5] and not indices[:5].any()
    indices[:100] = 7  # stale entries of an earlier, longer batch
    h.triton.fill_cuda_graph_kv_tables(batch, 5)
    total = batch.kv_indices.numel()
    assert indptr.tolist() == batch.kv_indptr.tolist() + [total + 1, total + 2]
    assert torch.equal(indices[:total], batch.kv_indices) and not indices[total : total + 2].any()

    padded = ForwardBatch(
        input_ids=torch.zeros(5, dtype=torch.long, device=DEVICE),
        positions=torch.zeros(5, dtype=torch.long, device=DEVICE),
        out_cache_loc=torch.cat([batch.out_cache_loc, torch.zeros(2, dtype=torch.long, device=DEVICE)]),
        extend_lens=[1] * 5, seq_lens=[1] * 5, kv_indptr=indptr, kv_indices=indices,
        logits_indices=torch.arange(5, device=DEVICE), is_decode=True,
    )
    pad = lambda x: torch.cat([x, torch.ones_like(x[:2])])  # noqa: E731
    h.triton.prepare(padded)
    out = h.triton.forward(pad(q), pad(kv), pad(kv), 0, padded, 0.2, **options)
    torch.testing.assert_close(out[:3], eager, atol=1e-5, rtol=1e-5)


def test_engine_on_triton_backend_matches_torch_backend(tiny_llama_dir):
    """The whole engine (paged pool with page size 4, prefix sharing, mixed
    prefill + decode steps, overlap) gives the same greedy tokens on both
    backends."""
    import asyncio

    from tests.test_engine import collect, started_engine

    system = list(range(200, 223))  # shared prefix: 5 whole pages and a bit
    prompts = [system + [5, 6], system + [7], [9, 10, 11]]

    async def greedy(backend: str) -> list[list[int]]:
        engine = await started_engine(tiny_llama_dir, attention_backend=backend, page_size=4, device=DEVICE,
                                      max_total_tokens=512, disable_overlap_schedule=False)
        first = await collect(engine, prompts[0], max_new_tokens=5, temperature=0, ignore_eos=True)
        rest = await asyncio.gather(*[collect(engine, p, max_new_tokens=5, temperature=0, ignore_eos=True)
                                      for p in prompts[1:]])
        assert engine.integrity_problem() is None
        await engine.shutdown()
        assert rest[0][2].cached_tokens == 20
        return [first[1]] + [r[1] for r in rest]

    assert asyncio.run(greedy("triton")) == asyncio.run(greedy("torch"))
