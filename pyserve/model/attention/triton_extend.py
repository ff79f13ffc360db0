"""Extend (prefill) attention in Triton over the paged KV pool.

The new tokens of each sequence attend causally over the sequence's cached
prefix and themselves. The backend stores the new K/V in the pool before
calling this, so the whole sequence, prefix and new tokens alike, is read
through its stretch of `kv_indices`; a sequence with no prefix is just the
case prefix = 0.

One program per (sequence, query head, block of BLOCK_M new tokens), with
an online softmax over blocks of BLOCK_N keys. The new token i of a sequence
of `seq_len` tokens, `num_new` of them new, sits at position
seq_len - num_new + i and sees the keys at positions up to its own, and
under a sliding window only the last `window` of those: a block's loop
starts at its first query's window, so keys before it are never read.
Soft-capping applies to each score; a head's sink joins the denominator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyserve.model.attention.triton_decode import NO_WINDOW, capped, dot_precision


@triton.jit
def _extend_kernel(
    Q, K, V, O, qo_indptr, kv_indptr, kv_indices, Sinks, scale, window, softcap,
    stride_q_tok, stride_q_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)

    q_start = tl.load(qo_indptr + seq)
    num_new = tl.load(qo_indptr + seq + 1) - q_start
    # The grid is sized for the longest sequence; shorter ones have spare blocks.
    if block * BLOCK_M < num_new:
        kv_start = tl.load(kv_indptr + seq)
        seq_len = tl.load(kv_indptr + seq + 1) - kv_start
        prefix = seq_len - num_new
        kv_head = head // GROUP

        i = block * BLOCK_M + tl.arange(0, BLOCK_M)
        i_ok = i < num_new
        # Spare rows past num_new (never stored) take the last row's keys, so
        # none of them is left without a key to see.
        q_pos = prefix + tl.minimum(i, num_new - 1)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM  # head_dim need not be a power of two
        dv = tl.arange(0, BLOCK_DV)
        dv_ok = dv < V_DIM  # V may be narrower than K (a latent cache)
        q_rows = (q_start + i)[:, None]
        q = tl.load(Q + q_rows * stride_q_tok + head * stride_q_head + d[None, :],
                    mask=i_ok[:, None] & d_ok[None, :], other=0.0)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max score
        l = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        # Keys past the block's last query, or before its first query's
        # window, are never seen. A row's first key is within BLOCK_M of
        # the block's first (BLOCK_N == BLOCK_M), so after the first block
        # each row's max is finite.
        end = tl.minimum(prefix + (block + 1) * BLOCK_M, seq_len)
        first = tl.maximum(prefix + block * BLOCK_M - window + 1, 0)
        for start in range(first, end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < end
            slot = tl.load(kv_indices + kv_start + n, mask=n_ok, other=0)
            k = tl.load(K + slot[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # from an FP8 cache too
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            if SOFTCAP:
                s = capped(s, softcap)
            sees = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(n_ok[None, :] & sees, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_v_slot + kv_head * stride_v_head + dv[None, :],
                        mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        if SINKS:
            sink = tl.load(Sinks + head).to(tl.float32)
            m_sink = tl.maximum(m, sink)
            alpha = tl.exp(m - m_sink)
            l = l * alpha + tl.exp(sink - m_sink)
            acc = acc * alpha[:, None]
        out = acc / l[:, None]
        tl.store(O + q_rows * stride_o_tok + head * stride_o_head + dv[None, :], out.to(O.dtype.element_ty),
                 mask=i_ok[:, None] & dv_ok[None, :])


def extend_attention(
    q: torch.Tensor,  # [T, heads, head_dim]: the new tokens of all sequences
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim], new K already stored
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, v_dim], v_dim <= head_dim
    out: torch.Tensor,  # [T, heads, v_dim], written
    qo_indptr: torch.Tensor,  # [B + 1]: sequence i's new tokens are rows qo_indptr[i]:qo_indptr[i + 1]
    kv_indptr: torch.Tensor,  # [B + 1]
    kv_indices: torch.Tensor,
    max_new: int,  # the most new tokens of any sequence
    scale: float,
    window: int | None = None,  # see AttentionBackend.forward for the three options
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [heads]
) -> None:
    assert q.stride(-1) == k_buffer.stride(-1) == v_buffer.stride(-1) == out.stride(-1) == 1
    batch = qo_indptr.numel() - 1
    _, num_heads, head_dim = q.shape
    block_d, block_dv = triton.next_power_of_2(head_dim), triton.next_power_of_2(v_buffer.shape[2])
    # Tiles of q, k and v must fit in shared memory together (a latent
    # cache's K head of 576 values takes a block of 1024). A key block wider
    # than the V tile miscompiles in 16-bit on an H100 (Triton 3.6: wrong
    # outputs or an illegal address for K 40 / V 32 at block 64), so the
    # block never exceeds the V tile.
    block = max(16, min(64 if block_d <= 128 else 32 if block_d <= 256 else 16, block_dv))
    grid = (batch, num_heads, triton.cdiv(max_new, block))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, qo_indptr, kv_indptr, kv_indices, q if sinks is None else sinks, scale,
        NO_WINDOW if window is None else window, softcap or 1.0,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1),
        GROUP=num_heads // k_buffer.shape[1],
        HEAD_DIM=head_dim,
        V_DIM=v_buffer.shape[2],
        BLOCK_M=block,
        BLOCK_N=block,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        num_warps=4,
        num_stages=2,
    )
