"""TorchAttention against a naive float64 attention, and the KV memory.

Sequences get scattered, non-contiguous slots (as a long-running pool hands
out), ragged lengths, cached prefixes and grouped kv heads.
"""

from __future__ import annotations

import pytest
import torch

from pyserve.model.cpu import extend_attention
from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.engine.kv.page_allocator import PageAllocator
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.step_plan import StepPlan, TorchThreads

LAYERS, SLOTS, DIM = 2, 512, 16


def reference_attention(q, k, v, first_pos: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions first_pos.., over k/v [L, KVH, D], causal."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def step_batch(slots: list[torch.Tensor], fresh: list[torch.Tensor], first_pos: list[int], decode: bool,
               device="cpu") -> ForwardBatch:
    """The batch of a step that gives sequence i the slots `fresh[i]` from
    position `first_pos[i]` on; `slots[i]` are all of its slots after it."""
    new_lens = [f.numel() for f in fresh]
    return ForwardBatch.build(
        input_ids=[0] * sum(new_lens),
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(first_pos, new_lens)]),
        out_cache_loc=torch.cat(fresh),
        extend_lens=new_lens,
        slots=slots,
        logits_indices=(torch.tensor(new_lens).cumsum(0) - 1).tolist(),
        is_decode=decode,
        device=device,
    )


class Harness:
    """A pool, a backend, and the true K/V of every sequence so far."""

    def __init__(self, heads: int, kv_heads: int, dtype=torch.float32, seed: int = 0, native_extend: bool = False):
        self.heads, self.kv_heads, self.dtype = heads, kv_heads, dtype
        self.pool = KVBuffer(LAYERS, SLOTS, kv_heads, DIM, dtype, "cpu")
        self.pages = PageAllocator(SLOTS)
        # Scatter the slots: take them all, give them back shuffled.
        g = torch.Generator().manual_seed(seed)
        everything = self.pages.alloc(self.pages.capacity)
        self.pages.free(everything[torch.randperm(everything.numel(), generator=g)])
        self.attn = TorchAttention(self.pool)
        self.plan = StepPlan(native_extend_attention=native_extend)
        self.gen = g
        self.slots: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def step(self, new_lens: list[int], layer_id: int = 0, decode: bool = False):
        """One forward over sequences 0..B-1 (created on first use) adding
        `new_lens` tokens each; returns (output, expected output)."""
        while len(self.slots) < len(new_lens):
            self.slots.append(torch.empty(0, dtype=torch.long))
            self.keys.append(self.randn(0, self.kv_heads, DIM))
            self.values.append(self.randn(0, self.kv_heads, DIM))
        T = sum(new_lens)
        q, k, v = self.randn(T, self.heads, DIM), self.randn(T, self.kv_heads, DIM), self.randn(T, self.kv_heads, DIM)
        fresh, first_pos = [], []
        for i, n in enumerate(new_lens):
            first_pos.append(self.slots[i].numel())
            fresh.append(self.pages.alloc(n))
            self.slots[i] = torch.cat([self.slots[i], fresh[-1]])
        starts = [sum(new_lens[:i]) for i in range(len(new_lens))]
        for i, (s, n) in enumerate(zip(starts, new_lens)):
            self.keys[i] = torch.cat([self.keys[i], k[s : s + n]])
            self.values[i] = torch.cat([self.values[i], v[s : s + n]])
        batch = step_batch(self.slots[: len(new_lens)], fresh, first_pos, decode)
        scale = DIM**-0.5
        self.attn.prepare(batch, self.plan)
        out = self.attn.forward(q, k, v, layer_id, batch, scale)
        expected = torch.cat([
            reference_attention(q[s : s + n], self.keys[i], self.values[i], first_pos[i], scale)
            for i, (s, n) in enumerate(zip(starts, new_lens))
        ])
        return out, expected


# Extends through torch's SDPA, and through extend_attention.py's Rust kernel (8da4w steps).
NATIVE_FITS = extend_attention.fits(KVBuffer(1, 8, 1, DIM, torch.float32, "cpu"))
EXTEND_PATHS = [False, pytest.param(True, id="native", marks=pytest.mark.skipif(
    not NATIVE_FITS, reason="the native extend needs AVX2"))]


@pytest.fixture
def native_calls(monkeypatch) -> list:
    """Records each call of the native extend kernel."""
    calls, attend = [], extend_attention.attend
    monkeypatch.setattr(extend_attention, "attend", lambda *args: calls.append(1) or attend(*args))
    return calls


@pytest.mark.parametrize("native_extend", EXTEND_PATHS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_ragged_prefill(heads, kv_heads, native_extend, native_calls):
    h = Harness(heads, kv_heads, native_extend=native_extend)
    out, expected = h.step([1, 7, 33, 4])
    assert len(native_calls) == (4 if native_extend else 0)
    assert out.shape == (45, heads, DIM)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native_extend", EXTEND_PATHS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_extend_over_cached_prefix(heads, kv_heads, native_extend, native_calls):
    h = Harness(heads, kv_heads, native_extend=native_extend)
    h.step([5, 1, 12, 3])
    # Sequence 4 is new (no prefix) in the same batch as extends over prefixes;
    # sequence 1 extends by a single token outside a decode step.
    out, expected = h.step([4, 1, 9, 6, 3])
    assert len(native_calls) == (4 + 4 if native_extend else 0)  # sequence 1 takes the one-token path
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not NATIVE_FITS, reason="the native extend needs AVX2")
def test_native_extend_spans_many_key_tiles_and_tasks(native_calls):
    """A long prefix (tiles of 64 keys, the last one partial) under a chunk
    of several 16-token tasks, a KV head's group of 3 query heads."""
    h = Harness(9, 3, native_extend=True)
    h.step([300, 2])
    out, expected = h.step([37, 2])
    assert len(native_calls) == 4
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_native_extend_refuses_what_does_not_fit_its_cache():
    k = torch.zeros(8, 2, DIM)
    with pytest.raises(ValueError, match="does not fit"):
        extend_attention.attend(torch.zeros(3, 3, DIM), k, k.clone(), torch.arange(4), 1.0)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="does not fit"):
        extend_attention.attend(torch.zeros(5, 2, DIM), k, k.clone(), torch.arange(4), 1.0)  # more tokens than slots


@pytest.fixture
def sdpa_threads(monkeypatch) -> list:
    """(queries, torch's thread count) of each extend's SDPA call."""
    from pyserve.model.attention import torch_backend

    seen, sdpa = [], torch_backend.F.scaled_dot_product_attention

    def recording(q, k, *args, **kwargs):
        seen.append((q.shape[-2], torch.get_num_threads()))
        return sdpa(q, k, *args, **kwargs)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", recording)
    return seen


def test_a_long_extend_takes_the_plans_threads_in_a_one_thread_step(sdpa_threads):
    """A step planned on one thread with long-attention threads: new tokens
    over a long cached prefix get those for their SDPA (a short extend does
    not), stay right, and leave the step's count as it was."""
    before = torch.get_num_threads()
    threads = TorchThreads(2)
    try:
        h = Harness(8, 2)
        h.attn = TorchAttention(h.pool, threads)
        h.plan = StepPlan(torch_threads=1, long_attention_threads=2)
        with threads.using(1):  # as the step's owner runs it
            h.step([400, 5])
            out, expected = h.step([48, 3])  # 48 x 448 keys: long; 3 x 8: short
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert sdpa_threads[-2:] == [(48, 2), (3, 1)]


@pytest.mark.parametrize("native_extend", EXTEND_PATHS)
@pytest.mark.parametrize("torch_threads", [1, 2])
def test_extends_attend_as_planned_whatever_torchs_thread_count(native_extend, torch_threads, native_calls,
                                                                 sdpa_threads, monkeypatch):
    """The plan alone says whether extends run the native kernel or SDPA:
    torch's thread count, one or more, changes nothing; and the backend
    never sets that count itself."""
    before, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    set_num_threads(torch_threads)
    set_threads = []
    monkeypatch.setattr(torch, "set_num_threads", set_threads.append)
    try:
        h = Harness(8, 2, native_extend=native_extend)
        h.step([300, 7])
        out, expected = h.step([60, 5])  # over 300 and 7 cached keys: long and short
    finally:
        set_num_threads(before)
    assert set_threads == []
    assert len(native_calls) == (4 if native_extend else 0)
    assert len(sdpa_threads) == (0 if native_extend else 4)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_plan_with_attention_threads_needs_a_backend_that_can_set_them():
    h = Harness(4, 2)
    h.plan = StepPlan(long_attention_threads=2)
    with pytest.raises(ValueError, match="TorchThreads"):
        h.step([3])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_batched_decode_of_ragged_sequences(heads, kv_heads):
    h = Harness(heads, kv_heads)
    h.step([1, 5, 17, 9])
    for _ in range(3):
        out, expected = h.step([1, 1, 1, 1], decode=True)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_of_equal_lengths_and_single_sequence():
    h = Harness(8, 2)
    h.step([6, 6])
    out, expected = h.step([1, 1], decode=True)  # no padding, so no mask
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    single = Harness(8, 2)
    single.step([3])
    out, expected = single.step([1], decode=True)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_padding_reads_slot_0_harmlessly():
    h = Harness(8, 2)
    h.step([2, 20])
    h.pool.k_buffer[0][0] = 1e4  # padded entries point at slot 0
    h.pool.v_buffer[0][0] = 1e4
    out, expected = h.step([1, 1], decode=True)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_kv_is_written_to_its_slots_and_layer_only():
    h = Harness(8, 2)
    h.step([3, 5], layer_id=1)
    for slots, keys, values in zip(h.slots, h.keys, h.values):
        assert torch.equal(h.pool.k_buffer[1][slots], keys)
        assert torch.equal(h.pool.v_buffer[1][slots], values)
        assert not h.pool.k_buffer[0][slots].any()


def test_bfloat16_close_to_reference():
    h = Harness(8, 2, dtype=torch.bfloat16)
    h.step([4, 11])
    out, expected = h.step([3, 2])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_forward_without_prepare_is_an_error():
    pool = KVBuffer(1, 8, 4, DIM, torch.float32, "cpu")
    slots = PageAllocator(8).alloc(2)
    batch = ForwardBatch.build(
        input_ids=[0, 0], positions=[0, 1], out_cache_loc=slots,
        extend_lens=[2], slots=[slots], logits_indices=[1], is_decode=False, device="cpu",
    )
    qkv = torch.zeros(2, 4, DIM)
    with pytest.raises(RuntimeError, match="prepare"):
        TorchAttention(pool).forward(qkv, qkv, qkv, 0, batch, 1.0)


# The KV memory


def test_kv_buffer_layout_and_size():
    kv = KVBuffer(3, 10, 2, DIM, torch.bfloat16, "cpu")
    assert len(kv.k_buffer) == len(kv.v_buffer) == 3
    assert kv.k_buffer[2].shape == (10, 2, DIM) and kv.k_buffer[2].dtype == torch.bfloat16
    assert KVBuffer.bytes_per_token(3, 2, DIM, torch.bfloat16) == 2 * 3 * 2 * DIM * 2


def test_pages_are_addressed_as_token_slots():
    kv = KVBuffer(2, 5, 2, DIM, torch.float32, "cpu", page_size=4)
    pages = PageAllocator(5, page_size=4)
    assert kv.k_pages[1].shape == (5, 4, 2, DIM) and kv.k_buffer[1].shape == (20, 2, DIM)
    assert pages.capacity == 4 and pages.capacity_tokens == 16
    page = int(pages.alloc(1)[0])
    kv.k_buffer[1][page * 4 + 3] = 7.0  # slot = page * page_size + offset
    assert bool((kv.k_pages[1][page, 3] == 7.0).all())
    slots = torch.arange(page * 4, page * 4 + 3)  # a partly filled page
    assert pages.pages_of(slots).tolist() == [page]
    pages.free_slots(slots)
    assert pages.num_free == 4
