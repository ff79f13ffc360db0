"""Paged decode attention in Triton, split-KV (flash-decoding).

In a decode step every sequence brings one new token, which attends over the
whole sequence, read from the KV pool through the sequence's stretch of
`kv_indices`. One program per (sequence, kv head) would leave most of the
GPU idle at small batch sizes, so each sequence is cut into up to
`num_splits` pieces:

  stage 1, one program per (sequence, kv head, piece): softmax-weighted V
           over the piece and the log-sum-exp of its scores, for every
           query head of the kv head's group;
  stage 2, one program per (sequence, query head): merge the pieces, each
           weighted by exp(its lse - the largest lse).

The query heads of one group are computed together as a [BLOCK_H, D] x
[D, BLOCK_N] dot, so each K/V row is loaded once per group (GQA). The grid
depends only on the batch size and the number of splits; sequence lengths
are read on the device, so a launch can be captured in a CUDA graph and
replayed with other lengths.

A sliding window cuts the sequence to its last `window` keys before the
split, so the pieces share only what is seen and nothing before is read.
Soft-capping applies to each score; sinks join the merge's denominator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys per inner iteration; a piece is a whole number of blocks. Heads
# wider than 256 values (a latent cache's 576) take fewer, so the key
# tiles still fit in shared memory.
_BLOCK_N = 64
_WIDE_BLOCK_N = 16
# tl.dot needs at least 16 rows on NVIDIA GPUs; unused head rows are masked.
_MIN_BLOCK_H = 16
# The window passed for a layer without one: longer than any sequence.
NO_WINDOW = 1 << 30


@triton.jit
def capped(s, softcap):
    """softcap * tanh(s / softcap); tanh as 1 - 2 / (exp(2x) + 1), which
    saturates to +-1 rather than overflowing (Triton has no tanh)."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))


@triton.jit
def _window_start(seq_len, window):
    """The first key position a sequence's newest token sees."""
    return tl.maximum(seq_len - window, 0)


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per piece: seq_len / num_splits rounded up to whole blocks.
    Pieces that start at or past seq_len are empty (short sequences use fewer)."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_split_kernel(
    Q, K, V, kv_indptr, kv_indices, Mid_O, Mid_LSE, scale, num_splits, window, softcap,
    stride_q_tok, stride_q_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_mo_tok, stride_mo_head, stride_mo_split,
    stride_ml_tok, stride_ml_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    kv_start = tl.load(kv_indptr + seq)
    seq_len = tl.load(kv_indptr + seq + 1) - kv_start
    first = _window_start(seq_len, window)
    split_len = _split_len(seq_len - first, num_splits, BLOCK_N)
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if lo < hi:
        h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + h
        head_ok = h < GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM  # head_dim need not be a power of two
        dv = tl.arange(0, BLOCK_DV)
        dv_ok = dv < V_DIM  # V may be narrower than K (a latent cache)
        q = tl.load(
            Q + seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
            mask=head_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max score
        l = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            slot = tl.load(kv_indices + kv_start + n, mask=n_ok, other=0)
            k = tl.load(K + slot[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # from an FP8 cache too
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            if SOFTCAP:
                s = capped(s, softcap)
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_v_slot + kv_head * stride_v_head + dv[None, :],
                        mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        mo = seq * stride_mo_tok + heads * stride_mo_head + split * stride_mo_split
        tl.store(Mid_O + mo[:, None] + dv[None, :], acc / l[:, None], mask=head_ok[:, None] & dv_ok[None, :])
        ml = seq * stride_ml_tok + heads * stride_ml_head + split
        tl.store(Mid_LSE + ml, m + tl.log(l), mask=head_ok)


@triton.jit
def _decode_merge_kernel(
    Mid_O, Mid_LSE, O, kv_indptr, Sinks, num_splits, window,
    stride_mo_tok, stride_mo_head, stride_mo_split,
    stride_ml_tok, stride_ml_head,
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)

    seq_len = tl.load(kv_indptr + seq + 1) - tl.load(kv_indptr + seq)
    seen = seq_len - _window_start(seq_len, window)
    split_len = _split_len(seen, num_splits, BLOCK_N)
    s = tl.arange(0, BLOCK_S)
    s_ok = (s < num_splits) & (s * split_len < seen)  # the pieces stage 1 wrote
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(Mid_LSE + seq * stride_ml_tok + head * stride_ml_head + s, mask=s_ok, other=float("-inf"))
    o = tl.load(
        Mid_O + seq * stride_mo_tok + head * stride_mo_head + s[:, None] * stride_mo_split + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    top = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(Sinks + head).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.exp(lse - top)  # 0 for the empty pieces
    denominator = tl.sum(w, 0)
    if SINKS:
        denominator += tl.exp(sink - top)
    out = tl.sum(w[:, None] * o, 0) / denominator
    tl.store(O + seq * stride_o_tok + head * stride_o_head + d, out.to(O.dtype.element_ty), mask=d_ok)


def decode_scratch(
    batch_size: int, num_heads: int, head_dim: int, max_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's float32 outputs: per piece, the partial output
    [B, heads, max_splits, head_dim] (V's head dim) and its log-sum-exp [B, heads, max_splits]."""
    mid_o = torch.empty(batch_size, num_heads, max_splits, head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.empty(batch_size, num_heads, max_splits, dtype=torch.float32, device=device)
    return mid_o, mid_lse


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise be rounded to TF32 on the GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(
    q: torch.Tensor,  # [B, heads, head_dim]
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, v_dim], v_dim <= head_dim
    out: torch.Tensor,  # [B, heads, v_dim], written
    kv_indptr: torch.Tensor,  # [B + 1]
    kv_indices: torch.Tensor,
    mid_o: torch.Tensor,  # from decode_scratch
    mid_lse: torch.Tensor,
    num_splits: int,  # at most mid_o.shape[2]; a runtime value, so changing it compiles nothing
    scale: float,
    window: int | None = None,  # see AttentionBackend.forward for the three options
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [heads]
) -> None:
    assert q.stride(-1) == k_buffer.stride(-1) == v_buffer.stride(-1) == out.stride(-1) == 1
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    assert 1 <= num_splits <= mid_o.shape[2]
    v_dim = v_buffer.shape[2]
    block_d, block_dv = triton.next_power_of_2(head_dim), triton.next_power_of_2(v_dim)
    block_n = _BLOCK_N if block_d <= 256 else _WIDE_BLOCK_N
    window = NO_WINDOW if window is None else window
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, mid_o, mid_lse, scale, num_splits, window, softcap or 1.0,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        V_DIM=v_dim,
        BLOCK_H=max(_MIN_BLOCK_H, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=softcap is not None,
        num_warps=4,
        num_stages=2,
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, kv_indptr, q if sinks is None else sinks, num_splits, window,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=v_dim,
        BLOCK_S=triton.next_power_of_2(mid_o.shape[2]),
        BLOCK_N=block_n,
        BLOCK_D=block_dv,
        SINKS=sinks is not None,
        num_warps=4,
    )
