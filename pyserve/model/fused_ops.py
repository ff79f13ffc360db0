"""Fused Triton kernels for a decoder layer's elementwise work on CUDA.

In torch each of these is a chain of small kernels (RMSNorm alone is eight:
cast, square, mean, add, rsqrt, multiply, cast, multiply), and a batch-1
decode step spends more time launching them than reading weights. Here each
is one kernel:

  rms_norm       RMSNorm of rows (hidden states, or per head for q/k norm)
  add_rms_norm   residual add + RMSNorm: the new residual stream and its norm
  silu_and_mul   SiLU(gate) * up on the fused gate_up projection
  rotary_        rotate-half RoPE on q and k, in place, in one launch

The torch code of the shared layers (layers/) is the reference: it matches transformers, and
these kernels round exactly where it rounds. Everything is computed in
float32 and cast to the model dtype at each point where torch's result is a
model-dtype tensor (a bf16 * bf16 product is exact in float32, so one
rounding after it gives torch's bf16 multiply). Launches disable FMA
contraction, which would otherwise skip a rounding torch makes in float32.
What remains different is the order of the sum of squares in RMSNorm. On
an H100 rotary, SiLU * up and the residual add give torch's bits in float32
and bfloat16; RMSNorm differs by about 1e-7 relative in float32, and in
bfloat16 gave torch's bits except for 3 in 100,000 outputs at hidden size
4096, by one ulp before the weight multiply and at most two after it.

Under TRITON_INTERPRET=1 (the CPU tests) the interpreter casts float32 to
bfloat16 by truncation where the GPU rounds to nearest, and has no libdevice
exp; float32 results are still torch's to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Elements of one silu_and_mul output row per program.
_SILU_BLOCK = 1024
_EXACT = {"enable_fp_fusion": False}


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 x rounded to dtype and back: where torch makes a dtype tensor."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    X, Residual, Out, ResidualOut, W, eps, inv_n, n,
    stride_x_row, stride_x_head,
    stride_r_row,
    stride_o_row, stride_o_head,
    stride_ro_row,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dtype = Out.dtype.element_ty
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(X + row * stride_x_row + head * stride_x_head + i, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # The stream is a model-dtype tensor: round the sum as `x + residual` does.
        x = _round(x + tl.load(Residual + row * stride_r_row + i, mask=ok, other=0.0).to(tl.float32), dtype)
        tl.store(ResidualOut + row * stride_ro_row + i, x.to(dtype), mask=ok)
    # torch's CUDA mean multiplies the sum by 1/n rather than dividing.
    variance = tl.sum(x * x, 0) * inv_n
    normed = _round(x * tl.math.rsqrt(variance + eps), dtype)
    w = tl.load(W + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o_row + head * stride_o_head + i, (w * normed).to(dtype), mask=ok)


def _norm_launch(x, residual, out, residual_out, weight, eps):
    n = x.shape[-1]
    assert x.stride(-1) == 1 and weight.shape == (n,), "RMSNorm rows must be contiguous and match the weight"
    assert weight.dtype == x.dtype, "the fused RMSNorm computes in the activations' dtype"
    rows, heads = x.shape[0], x.shape[1] if x.dim() == 3 else 1
    block = triton.next_power_of_2(n)
    with_residual = residual is not None
    _rms_norm_kernel[(rows, heads)](
        x, residual if with_residual else x, out, residual_out if with_residual else out, weight, eps, 1.0 / n, n,
        x.stride(0), x.stride(1) if x.dim() == 3 else 0,
        residual.stride(0) if with_residual else 0,
        out.stride(0), out.stride(1) if x.dim() == 3 else 0,
        residual_out.stride(0) if with_residual else 0,
        HAS_RESIDUAL=with_residual,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 8),
        **_EXACT,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, n], or [T, heads, n] (q/k norm);
    rows may be strided (views into a fused projection's output)."""
    assert x.dim() in (2, 3)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm_launch(x, None, out, None, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) for x, residual [T, n]."""
    assert x.dim() == 2 and residual.shape == x.shape and residual.stride(-1) == 1
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    _norm_launch(x, residual, out, new_residual, weight, eps)
    return out, new_residual


@triton.jit
def _silu_and_mul_kernel(
    GateUp, Out, n, stride_in_row, stride_out_row, PRECISE_EXP: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    dtype = Out.dtype.element_ty
    gate = tl.load(GateUp + row * stride_in_row + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_in_row + n + i, mask=ok, other=0.0).to(tl.float32)
    # torch's silu is x / (1 + expf(-x)) with IEEE division; tl.exp and `/`
    # are the GPU's approximate instructions.
    if PRECISE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = _round(tl.math.div_rn(gate, 1.0 + e), dtype)
    tl.store(Out + row * stride_out_row + i, (silu * up).to(dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2 * n] (gate first): [T, n]."""
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    _silu_and_mul_kernel[(rows, triton.cdiv(n, _SILU_BLOCK))](
        gate_up, out, n, gate_up.stride(0), out.stride(0),
        PRECISE_EXP=gate_up.is_cuda,  # the interpreter has no libdevice
        BLOCK=_SILU_BLOCK,
        num_warps=4,
        **_EXACT,
    )
    return out


@triton.jit
def _rotate_heads(
    X, stride_tok, stride_head, tok, num_heads, cos, sin, half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One token's heads of X rotated in place: (x1, x2) ->
    (x1 cos - x2 sin, x2 cos + x1 sin), each product and sum rounded to
    X's dtype as apply_rotary's tensor ops round them."""
    dtype = X.dtype.element_ty
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h < num_heads)[:, None] & (d < half)[None, :]
    first = X + tok * stride_tok + h[:, None] * stride_head + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    out1 = _round(x1 * cos, dtype) - _round(x2 * sin, dtype)
    out2 = _round(x2 * cos, dtype) + _round(x1 * sin, dtype)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + half, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, Cos, Sin, num_q_heads, num_k_heads, half,
    stride_q_tok, stride_q_head,
    stride_k_tok, stride_k_head,
    stride_cos_tok, stride_sin_tok,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(Cos + tok * stride_cos_tok + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + tok * stride_sin_tok + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(Q, stride_q_tok, stride_q_head, tok, num_q_heads, cos, sin, half, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(K, stride_k_tok, stride_k_head, tok, num_k_heads, cos, sin, half, BLOCK_KH, BLOCK_HALF)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE applied in place to q [T, heads, head_dim] and
    k [T, kv_heads, head_dim] (views into the qkv projection's output are
    fine), with cos/sin [T, 1, head_dim / 2] in their dtype, as
    RotaryEmbedding.cos_sin gives them."""
    tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    assert k.shape[0] == tokens and k.shape[2] == head_dim and cos.shape == sin.shape == (tokens, 1, half)
    assert q.dtype == k.dtype == cos.dtype == sin.dtype
    assert q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
    block_qh = triton.next_power_of_2(num_q_heads)
    block_half = triton.next_power_of_2(half)
    _rotary_kernel[(tokens,)](
        q, k, cos, sin, num_q_heads, k.shape[1], half,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0),
        BLOCK_QH=block_qh,
        BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=block_half,
        num_warps=min(max(block_qh * block_half // 512, 1), 8),
        **_EXACT,
    )
