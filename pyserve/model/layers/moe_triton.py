"""The experts of an MoE block as two fused Triton kernels (CUDA).

The design of vLLM's and SGLang's fused_moe: the (token, expert)
assignments are sorted by expert and each expert's run is padded to a whole
number of BLOCK_M rows (align_blocks, in torch), so every row block of the
grouped GEMM belongs to one expert. Then
  _w13_kernel  gathers each block's token rows of x, multiplies them by the
               block's expert's gate and up rows (two accumulators over the
               same columns) and writes the activation, one row per assignment;
  _w2_kernel   multiplies those rows by the expert's down projection, adds
               its bias, scales by the routing weight and writes one float32
               row per assignment;
and the k rows of each token are summed in torch. Routing is torch
(moe.route), so every family's numerics come from one place.

The padded length is bounded by N + min(E, N) * (BLOCK_M - 1) rows (each
expert that received assignments pads at most BLOCK_M - 1), so the grid has
a size known from the token count alone and blocks past the real padded
length return at once: no host sync, so that a CUDA graph can capture it
(not yet tried on a GPU).

Under TRITON_INTERPRET=1 the kernels run on CPU; the tests compare them with
the torch path there on small shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU, CLAMPED_SWIGLU = 0, 1


@triton.jit
def _activate(gate, up, ACTIVATION: tl.constexpr, alpha, limit):
    if ACTIVATION == 0:
        return gate * tl.sigmoid(gate) * up
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1) * (gate * tl.sigmoid(gate * alpha))


@triton.jit
def _block_rows(SortedIds, BlockExpert, n_assign, BLOCK_M: tl.constexpr):
    """This row block's expert, its rows' assignment indices, and which rows are real (not padding)."""
    block = tl.program_id(0)
    rows = tl.load(SortedIds + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.load(BlockExpert + block).to(tl.int64), rows, rows < n_assign


@triton.jit
def _w13_kernel(
    X, W13, B13, Out, SortedIds, BlockExpert, PaddedTotal,
    n_assign, top_k, hidden, inter, alpha, limit,
    stride_x, stride_we, stride_wn, stride_be, stride_o,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(PaddedTotal):
        return
    expert, rows, real = _block_rows(SortedIds, BlockExpert, n_assign, BLOCK_M)
    token = (rows // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_rows = W13 + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    up_rows = gate_rows + inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(X + token[:, None] * stride_x + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate += tl.dot(a, tl.load(gate_rows + ks[:, None], mask=w_mask, other=0.0), input_precision=PRECISION)
        up += tl.dot(a, tl.load(up_rows + ks[:, None], mask=w_mask, other=0.0), input_precision=PRECISION)
    if HAS_BIAS:
        bias = B13 + expert * stride_be + cols
        gate += tl.load(bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias + inter, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    h = _activate(gate, up, ACTIVATION, alpha, limit)
    out = Out + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out, h.to(Out.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


@triton.jit
def _w2_kernel(
    H, W2, B2, Weights, Out, SortedIds, BlockExpert, PaddedTotal,
    n_assign, hidden, inter,
    stride_h, stride_we, stride_wn, stride_be, stride_o,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(PaddedTotal):
        return
    expert, rows, real = _block_rows(SortedIds, BlockExpert, n_assign, BLOCK_M)
    rows64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_rows = W2 + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(H + rows64[:, None] * stride_h + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B2 + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(Weights + rows64, mask=real, other=0.0).to(tl.float32)
    out = Out + rows64[:, None] * stride_o + cols[None, :]
    tl.store(out, acc * weight[:, None], mask=real[:, None] & col_ok[None, :])


def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int):
    """Assignments sorted by expert, each expert's run padded to block_m rows.

    Returns (sorted_ids [capacity]: assignment index t*k+j, or N for padding;
    block_expert [capacity / block_m]: the expert of each row block;
    padded_total [1]: the rows in use)."""
    flat = ids.flatten()
    n = flat.numel()
    # scatter_add_, not bincount: bincount reads its maximum back to the host.
    counts = torch.zeros(num_experts, dtype=flat.dtype, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    capacity = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


def fused_experts(spec, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None) -> torch.Tensor:
    """What moe.grouped_experts computes, in two kernels. x [T, H]; w13 [E, 2L, H]; w2 [E, H, L]."""
    T, hidden = x.shape
    num_experts, two_l, _ = w13.shape
    inter = two_l // 2
    n = ids.numel()
    x = x.contiguous()
    block_m = 16 if n <= 256 else 64
    block_n, block_k = 64, 64 if x.dtype != torch.float32 else 32
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    sorted_ids, block_expert, padded_total = align_blocks(ids, num_experts, block_m)
    blocks = block_expert.numel()
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _w13_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, w13, b13 if b13 is not None else w13, h, sorted_ids, block_expert, padded_total,
        n, ids.shape[1], hidden, inter, spec.swiglu_alpha, spec.swiglu_limit,
        x.stride(0), w13.stride(0), w13.stride(1), b13.stride(0) if b13 is not None else 0, h.stride(0),
        HAS_BIAS=b13 is not None, ACTIVATION=SILU if spec.activation == "silu" else CLAMPED_SWIGLU,
        PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    out = torch.empty(n, hidden, dtype=torch.float32, device=x.device)
    _w2_kernel[(blocks, triton.cdiv(hidden, block_n))](
        h, w2, b2 if b2 is not None else w2, weights.contiguous(), out, sorted_ids, block_expert, padded_total,
        n, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), b2.stride(0) if b2 is not None else 0, out.stride(0),
        HAS_BIAS=b2 is not None, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out.view(T, ids.shape[1], hidden).sum(dim=1).to(x.dtype)
