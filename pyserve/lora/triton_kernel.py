"""The LoRA delta of one (fused) projection in two Triton kernels (CUDA;
under TRITON_INTERPRET=1 on CPU for tests): a segmented low-rank product,
as Punica's SGMV and SGLang's LoRA backend run it.

The step's adapted tokens are listed grouped by slot (LoraBatch.tokens);
segment i is `lengths[i]` of them from `starts[i]`, all under slot
`slots[i]`. Each program takes BLOCK_M rows of one segment, so it reads
one adapter's weights:
  _shrink_kernel  low[j] = x[tokens[j]] @ A[slot]^T   (all R ranks at once, float32)
  _expand_kernel  out[tokens[j]] += low[j] @ B[slot]^T  (a BLOCK_N column block)
A token is in one segment only, so the read-add-write of its output row
races with no other program. The scaling (lora_alpha / r, or rsLoRA's) is
in B already (adapter.py); base-model tokens are in no segment and their
rows are left as they are. The grid is sized by the longest segment (the
batch's `width`, known on the host), and blocks past a segment's end return.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _segment_rows(Tokens, Starts, Lengths, Slots, BLOCK_M: tl.constexpr):
    seg, block = tl.program_id(0), tl.program_id(1)
    start, length = tl.load(Starts + seg), tl.load(Lengths + seg)
    offs = block * BLOCK_M + tl.arange(0, BLOCK_M)
    live = offs < length
    tokens = tl.load(Tokens + start + offs, mask=live, other=0).to(tl.int64)
    return (start + offs).to(tl.int64), tokens, live, tl.load(Slots + seg).to(tl.int64), block * BLOCK_M < length


@triton.jit
def _shrink_kernel(
    X, A, Low, Tokens, Starts, Lengths, Slots, in_size, rank,
    stride_x, stride_as, stride_ar, stride_low,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows, tokens, live, slot, any_live = _segment_rows(Tokens, Starts, Lengths, Slots, BLOCK_M)
    if any_live:
        rs = tl.arange(0, BLOCK_R)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, in_size, BLOCK_K):
            k_ok = k0 + ks < in_size
            x = tl.load(X + tokens[:, None] * stride_x + (k0 + ks)[None, :], mask=live[:, None] & k_ok[None, :],
                        other=0.0)
            a = tl.load(A + slot * stride_as + rs[None, :] * stride_ar + (k0 + ks)[:, None],
                        mask=(rs < rank)[None, :] & k_ok[:, None], other=0.0)
            acc += tl.dot(x, a, input_precision=PRECISION)
        tl.store(Low + rows[:, None] * stride_low + rs[None, :], acc, mask=live[:, None] & (rs < rank)[None, :])


@triton.jit
def _expand_kernel(
    Low, B, Out, Tokens, Starts, Lengths, Slots, out_size, rank,
    stride_low, stride_bs, stride_bn, stride_out,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, tokens, live, slot, any_live = _segment_rows(Tokens, Starts, Lengths, Slots, BLOCK_M)
    if any_live:
        rs = tl.arange(0, BLOCK_R)
        ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok, r_ok = ns < out_size, rs < rank
        b = tl.load(B + slot * stride_bs + ns[None, :] * stride_bn + rs[:, None], mask=r_ok[:, None] & n_ok[None, :],
                    other=0.0)
        low = tl.load(Low + rows[:, None] * stride_low + rs[None, :], mask=live[:, None] & r_ok[None, :], other=0.0)
        delta = tl.dot(low.to(b.dtype), b, input_precision=PRECISION)
        where = Out + tokens[:, None] * stride_out + ns[None, :]
        mask = live[:, None] & n_ok[None, :]
        base = tl.load(where, mask=mask, other=0.0)
        tl.store(where, (base.to(tl.float32) + delta).to(Out.dtype.element_ty), mask=mask)


def add_lora_delta(x: torch.Tensor, out: torch.Tensor, A: torch.Tensor, B: torch.Tensor, tokens: torch.Tensor,
                   segs: torch.Tensor, width: int) -> None:
    """out[t] += x[t] @ A[slot]^T @ B[slot]^T for each adapted token t, in place.
    x [T, in], out [T, out] (contiguous rows), A [slots, R, in], B [slots, out, R];
    `tokens` and `segs` (LoraBatch's) on x's device, `width` the longest segment."""
    rank, in_size, out_size = A.shape[1], A.shape[2], B.shape[1]
    if out.stride(1) != 1 or x.stride(1) != 1 or A.stride(2) != 1 or B.stride(2) != 1:
        raise ValueError("add_lora_delta needs rows with unit column stride")
    slots, starts, lengths = segs[0], segs[1], segs[2]
    low = torch.empty(tokens.numel(), rank, dtype=torch.float32, device=x.device)
    block_m, block_r = 16, max(16, triton.next_power_of_2(rank))
    block_n = 64 if out_size >= 64 else max(16, triton.next_power_of_2(out_size))
    precision = "ieee" if A.dtype == torch.float32 else "tf32"  # float32 models keep float32 products
    grid = (segs.shape[1], triton.cdiv(width, block_m))
    _shrink_kernel[grid](x, A, low, tokens, starts, lengths, slots, in_size, rank,
                         x.stride(0), A.stride(0), A.stride(1), low.stride(0),
                         PRECISION=precision, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=32)
    _expand_kernel[(*grid, triton.cdiv(out_size, block_n))](
        low, B, out, tokens, starts, lengths, slots, out_size, rank,
        low.stride(0), B.stride(0), B.stride(1), out.stride(0),
        PRECISION=precision, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n)
