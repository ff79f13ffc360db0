"""The fused Triton kernels (pyserve/model/fused_ops.py) against the shared layers' torch code.

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 before any kernel is imported), on small shapes with
sizes that are not powers of two (hidden 576, 80-dim heads) and q/k given as
strided views into a fused qkv output, the way the model passes them.

float32 results must be torch's to within rounding (the RMSNorm sum runs in
another order). In bfloat16 the GPU must give torch's bits, except that
RMSNorm may differ by two ulps (one in the normalized value, which the
weight multiply can make two); the interpreter truncates float32 to
bfloat16 where the GPU rounds, so on CPU bfloat16 only gets a tolerance.
On CUDA a small model's logits through the fused path are also compared
with the torch path.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # in case this file runs without conftest.py

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pyserve.model import fused_ops  # noqa: E402
from pyserve.model.config import ModelConfig  # noqa: E402
from pyserve.model.layers.causal_lm import CausalLM  # noqa: E402
from pyserve.model.layers.norms import RMSNorm  # noqa: E402
from pyserve.model.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

if DEVICE == "cpu" and not isinstance(fused_ops._rms_norm_kernel, InterpretedFunction):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
DTYPES = [torch.float32, torch.bfloat16]


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 steps between same-shape bfloat16 tensors."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def check(out: torch.Tensor, ref: torch.Tensor, max_ulps: int = 0) -> None:
    """float32: torch's to rounding. bfloat16: within max_ulps on the GPU, a
    tolerance under the interpreter."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    elif DEVICE == "cuda":
        assert ulps(out, ref).max().item() <= max_ulps
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=4e-2)


def randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def norm_module(n: int, dtype) -> RMSNorm:
    norm = RMSNorm(n, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(1)))
    return norm.to(DEVICE, dtype)


def qkv_views(tokens, heads, kv_heads, head_dim, dtype):
    """q [T, heads, D], k and v [T, kv_heads, D] as views into one qkv tensor."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return qkv, q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64])
def test_rms_norm(dtype, hidden):
    norm = norm_module(hidden, dtype)
    x = randn(5, hidden, dtype=dtype) * 3
    with torch.no_grad():
        check(fused_ops.rms_norm(x, norm.weight, norm.eps), norm._norm(x), max_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    norm = norm_module(576, dtype)
    x, residual = randn(5, 576, dtype=dtype), randn(5, 576, dtype=dtype, seed=1)
    with torch.no_grad():
        out, new_residual = fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        expected = x + residual
        check(new_residual, expected)  # one rounded add: exact on the GPU and, in float32, in the interpreter
        check(out, norm._norm(expected), max_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_strided_views(dtype):
    """Qwen3's q/k norm: one norm per head of an 80-dim view into qkv."""
    _, q, k, _ = qkv_views(3, 4, 2, 80, dtype)
    norm = norm_module(80, dtype)
    with torch.no_grad():
        for x in (q, k):
            check(fused_ops.rms_norm(x, norm.weight, norm.eps), norm._norm(x), max_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [1536, 40])
def test_silu_and_mul(dtype, intermediate):
    gate_up = randn(3, 2 * intermediate, dtype=dtype) * 4
    gate, up = gate_up.split(intermediate, dim=-1)
    check(fused_ops.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 80), (2, 2, 16)])
def test_rotary_in_place_on_qkv_views(dtype, heads, kv_heads, head_dim):
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=16, hidden_size=heads * head_dim, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
        attention_bias=False, o_proj_bias=False, mlp_bias=False, qk_norm=None, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    positions = torch.tensor([0, 7, 3, 31, 12], device=DEVICE)
    cos, sin = RotaryEmbedding(config).cos_sin(positions, 32, dtype)
    qkv, q, k, v = qkv_views(len(positions), heads, kv_heads, head_dim, dtype)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = v.clone()
    fused_ops.rotary_(q, k, cos, sin)
    check(q, expected_q)
    check(k, expected_k)
    assert torch.equal(v, v_before)


def small_model(dtype, hidden, heads, kv_heads, head_dim, qk_norm):
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=hidden, intermediate_size=1536,
        num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
        attention_bias=False, o_proj_bias=False, mlp_bias=False, qk_norm="head" if qk_norm else None, tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = CausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)
    return model.to(DEVICE, dtype).eval(), config


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 9, 3, 64, False), (640, 8, 2, 80, True)], ids=["576", "80dim-qknorm"])
def test_model_logits_fused_vs_torch(dtype, shape):
    """A prefill of two sequences then a decode step, fused and unfused
    (the same weights in a model built with fused_kernels=False)."""
    from pyserve.model.attention.torch_backend import TorchAttention
    from pyserve.model.kv_buffer import KVBuffer
    from pyserve.model.forward_batch import ForwardBatch

    model, config = small_model(dtype, *shape)
    unfused = CausalLM(config, fused_kernels=False).to(DEVICE, dtype).eval()
    unfused.load_state_dict(model.state_dict())
    pool = KVBuffer(config.num_hidden_layers, 256, config.num_key_value_heads, config.head_dim, dtype, DEVICE)
    attn = TorchAttention(pool)
    ids = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    lens = [27, 13]
    slots = [torch.arange(1, 28), torch.arange(28, 41)]
    prefill = ForwardBatch.build(
        ids, list(range(27)) + list(range(13)), torch.cat(slots), lens, slots, [26, 39],
        is_decode=False, device=DEVICE,
    )
    decode_slots = [torch.cat([slots[0], torch.tensor([41])]), torch.cat([slots[1], torch.tensor([42])])]
    decode = ForwardBatch.build(
        [5, 6], [27, 13], torch.tensor([41, 42]), [1, 1], decode_slots, [0, 1], is_decode=True, device=DEVICE,
    )

    def run(model):
        with torch.inference_mode():
            return torch.cat([model(prefill, attn), model(decode, attn)])

    fused, reference = run(model), run(unfused)
    scale = reference.abs().max().item()
    diff = (fused - reference).abs().max().item()
    if dtype == torch.float32:
        assert diff <= 1e-5 * scale
        assert torch.equal(fused.argmax(-1), reference.argmax(-1))
    else:
        # A rare one-ulp difference in a norm is carried through the layers,
        # and near-ties in bfloat16 logits may flip the argmax: bound the
        # difference at about four ulps of the largest logit.
        assert diff <= 2**-5 * scale
