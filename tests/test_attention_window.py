"""A layer's attention options in both backends: sliding window, soft-cap, sinks.

Each backend runs over scattered slots of one pool, with prompts longer
than the window, chunked prefill over cached prefixes and decode rows of
different lengths, against attention written out here by hand from
transformers' definitions (masking_utils' sliding_window_overlay, Gemma 2's
soft-cap, gpt-oss's eager attention with sinks). The Triton kernels run in
Triton's interpreter without CUDA (tests/conftest.py sets it up).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.model.step_plan import StepPlan
from tests.slow import slow
from tests.test_attention_torch import step_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS, DIM = 1024, 16


def reference(q, k, v, first_pos: int, scale: float, window=None, softcap=None, sinks=None) -> torch.Tensor:
    """q [n, H, D] at positions first_pos.. over k/v [L, KVH, D], in float64:
    the query at position i sees the keys at j with i - window < j <= i."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    sees = k_pos <= q_pos
    if window is not None:
        sees &= k_pos > q_pos - window
    scores = scores.masked_fill(~sees, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.double()[:, None, None].expand(*scores.shape[:2], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", probs, v)


def triton_backend(pool, heads):
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from pyserve.model.attention import triton_decode
    from pyserve.model.attention.triton_backend import TritonAttention

    if DEVICE == "cpu" and not isinstance(triton_decode._decode_split_kernel, InterpretedFunction):
        pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set")
    return TritonAttention(pool, heads, context_len=SLOTS, max_kv_splits=4)


BACKENDS = {"torch": lambda pool, heads: TorchAttention(pool), "triton": triton_backend}


class Harness:
    """One backend over a pool of scattered slots, and the true K/V of every sequence."""

    def __init__(self, backend: str, heads: int = 4, kv_heads: int = 2, seed: int = 0, q_gain: float = 1.0):
        self.heads, self.kv_heads = heads, kv_heads
        self.device = "cpu" if backend == "torch" else DEVICE
        shape = (SLOTS, kv_heads, DIM)
        self.pool = SimpleNamespace(
            dtype=torch.float32,
            k_buffer=[torch.zeros(shape, device=self.device)],
            v_buffer=[torch.zeros(shape, device=self.device)],
        )
        self.attn = BACKENDS[backend](self.pool, heads)
        self.gen = torch.Generator().manual_seed(seed)
        self.q_gain = q_gain  # larger scores, so that a soft-cap bites
        self.free = (torch.randperm(SLOTS - 1, generator=self.gen) + 1).tolist()  # slot 0 is reserved
        self.slots: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def new_tokens(self, new_lens: list[int], decode: bool = False) -> SimpleNamespace:
        """A batch adding `new_lens` tokens to sequences 0..B-1 (created on
        first use), with their q/k/v."""
        while len(self.slots) < len(new_lens):
            self.slots.append(torch.empty(0, dtype=torch.long))
            self.keys.append(self.randn(0, self.kv_heads, DIM))
            self.values.append(self.randn(0, self.kv_heads, DIM))
        T = sum(new_lens)
        q = self.randn(T, self.heads, DIM) * self.q_gain
        k, v = self.randn(T, self.kv_heads, DIM), self.randn(T, self.kv_heads, DIM)
        fresh, first_pos, starts = [], [], []
        for i, n in enumerate(new_lens):
            starts.append(sum(new_lens[:i]))
            first_pos.append(self.slots[i].numel())
            fresh.append(torch.tensor([self.free.pop() for _ in range(n)], dtype=torch.long))
            self.slots[i] = torch.cat([self.slots[i], fresh[-1]])
            self.keys[i] = torch.cat([self.keys[i], k[starts[i] : starts[i] + n]])
            self.values[i] = torch.cat([self.values[i], v[starts[i] : starts[i] + n]])
        batch = step_batch(self.slots[: len(new_lens)], fresh, first_pos, decode, self.device)
        return SimpleNamespace(batch=batch, q=q, k=k, v=v, new_lens=new_lens, first_pos=first_pos, starts=starts)

    def attend(self, new: SimpleNamespace, **options) -> torch.Tensor:
        """The backend's output for a prepared batch of `new_tokens`."""
        if options.get("sinks") is not None:
            options["sinks"] = options["sinks"].to(self.device)
        q, k, v = (t.to(self.device) for t in (new.q, new.k, new.v))
        return self.attn.forward(q, k, v, 0, new.batch, DIM**-0.5, **options).cpu()

    def expected(self, new: SimpleNamespace, **options) -> torch.Tensor:
        return torch.cat([
            reference(new.q[s : s + n], self.keys[i][: p + n], self.values[i][: p + n], p, DIM**-0.5, **options)
            for i, (s, n, p) in enumerate(zip(new.starts, new.new_lens, new.first_pos))
        ])

    def step(self, new_lens: list[int], decode: bool = False, plan: StepPlan | None = None, **options):
        """One forward with the layer options: (output, expected output)."""
        new = self.new_tokens(new_lens, decode)
        self.attn.prepare(new.batch, *([plan] if plan else []))
        return self.attend(new, **options), self.expected(new, **options)


def assert_close(out, expected):
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(params=list(BACKENDS))
def backend(request) -> str:
    return request.param


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_prompts_longer_than_the_window(backend, heads, kv_heads):
    """Prompts of 1.5 and 9 windows (the longer spanning many kernel key
    blocks) beside one shorter than the window."""
    h = Harness(backend, heads, kv_heads)
    out, expected = h.step([30, 5, 180], window=20)
    assert_close(out, expected)


def test_chunked_prefill_over_cached_prefixes(backend):
    """A prompt fed in chunks, each over the cached earlier ones; chunks
    shorter and longer than the window, and a new sequence beside them."""
    h = Harness(backend)
    window = 24
    for chunk in ([40, 7], [10, 30], [70, 1], [3, 2, 50]):
        out, expected = h.step(chunk, window=window)
        assert_close(out, expected)


# Triton's interpreter takes its time over these lengths: slow (its other window tests run by default).
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=slow)])
def test_decode_rows_of_different_lengths(backend):
    """Rows shorter than, equal to and far longer than the window; on
    Triton the windowed rows span several decode splits."""
    h = Harness(backend)
    h.step([3, 69, 150, 400])
    for _ in range(3):
        out, expected = h.step([1, 1, 1, 1], decode=True, window=70)
        assert_close(out, expected)


def test_decode_rows_beside_a_prefill_chunk():
    """A mixed step: single-token rows attend in the batched path, the
    chunk in its own, each within the window."""
    h = Harness("torch")
    h.step([50, 9])
    out, expected = h.step([1, 1, 33], window=12)
    assert_close(out, expected)


def test_softcap(backend):
    h = Harness(backend, q_gain=8.0)  # scores of several units, well into tanh's bend
    out, expected = h.step([20, 70], softcap=2.0)
    assert_close(out, expected)
    new = h.new_tokens([1, 1], decode=True)
    h.attn.prepare(new.batch)
    assert_close(h.attend(new, softcap=2.0), h.expected(new, softcap=2.0))
    # The cap changes the result, so the comparisons mean something.
    assert not torch.allclose(h.expected(new, softcap=2.0), h.expected(new), atol=1e-2)


def test_sinks(backend):
    h = Harness(backend, heads=4, kv_heads=2)
    sinks = torch.tensor([-1.0, 0.5, 3.0, 8.0])  # from negligible to most of the mass
    out, expected = h.step([20, 90], sinks=sinks)
    assert_close(out, expected)
    out, expected = h.step([1, 1], decode=True, sinks=sinks)
    assert_close(out, expected)


def test_all_options_at_once(backend):
    h = Harness(backend, q_gain=4.0)
    options = dict(window=16, softcap=3.0, sinks=torch.tensor([0.0, 1.0, -2.0, 2.0]))
    for chunk, decode in (([40, 9], False), ([25, 30], False), ([1, 1], True)):
        out, expected = h.step(chunk, decode=decode, **options)
        assert_close(out, expected)


def test_decode_inputs_carry_the_window_to_the_compiled_decode():
    """The tensor-only decode attention (what torch.compile takes into the
    compiled layer) with a sliding layer's inputs is that layer's forward."""
    h = Harness("torch")
    h.step([5, 40])
    options = dict(window=8, softcap=5.0, sinks=torch.tensor([0.5, -0.5, 1.0, 2.0]))
    new = h.new_tokens([1, 1], decode=True)
    h.attn.prepare(new.batch)
    inputs = h.attn.decode_inputs(0, window=8)
    assert inputs[3].shape == (2, 8)  # the 41-token row reads its last 8 slots only
    direct = h.attn.attend_decode(new.q, new.k, new.v, *inputs, DIM**-0.5, options["softcap"], options["sinks"])
    assert torch.equal(direct, h.attend(new, **options))
    assert_close(direct, h.expected(new, **options))


@pytest.mark.parametrize("decode", [False, True])
def test_without_options_nothing_changes(backend, decode):
    """No option, or a window no sequence reaches, is the plain causal path
    bit for bit (extends with and without a cached prefix, decode rows);
    a window one token shorter is not."""
    h = Harness(backend)
    h.step([12, 30])
    new = h.new_tokens([1, 1] if decode else [9, 20, 25], decode=decode)
    h.attn.prepare(new.batch)
    longest = max(new.batch.seq_lens)
    plain = h.attend(new)
    assert torch.equal(plain, h.attend(new, window=longest))
    narrower = h.attend(new, window=longest - 1)
    assert not torch.equal(plain, narrower)
    assert_close(narrower, h.expected(new, window=longest - 1))
    assert_close(plain, h.expected(new))


def test_the_native_extend_kernel_refuses_options():
    """Native extends have no window, cap or sinks: the step's owner must
    plan such layers on SDPA, and the backend refuses rather than ignore them."""
    h = Harness("torch")
    with pytest.raises(ValueError, match="native extend"):
        h.step([20], plan=StepPlan(native_extend_attention=True), window=8)


@pytest.mark.parametrize("options,match", [
    (dict(window=0), "window"), (dict(softcap=0.0), "soft-cap"), (dict(sinks=torch.zeros(3)), "sinks"),
])
def test_meaningless_options_are_refused(backend, options, match):
    with pytest.raises(ValueError, match=match):
        Harness(backend).step([4], **options)
