"""A W4A16 GEMM in Triton: y = x @ W^T with W's int4 codes unpacked and
scaled inside the kernel (CUDA; under TRITON_INTERPRET=1 on CPU for tests).

Layout (pack): codes q [N, K] (0..15) packed along K, eight per int32
word, first code in the lowest bits: `qweight` [K / 8, N], so a block of
BLOCK_K inputs for BLOCK_N outputs is one coalesced load of words along N.
`scales` and `zeros` [K / group, N] (zeros in code units, float), and
w[n, k] = (q[n, k] - z[g, n]) * s[g, n] with g = k // group. Without zero
points (symmetric checkpoints) the kernel subtracts 8 and reads no zeros.
A BLOCK_K divides the group, so each K block reads one row of scales.
Act-order checkpoints are reordered before packing (int4_linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SYMMETRIC_ZERO = 8


@triton.jit
def _w4a16_kernel(
    X, QW, S, Z, Y, M, N, K, group,
    stride_xm, stride_qk, stride_sg, stride_ym,
    HAS_ZEROS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    shifts = (ks % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
        words = tl.load(QW + ((k0 + ks) // 8)[:, None] * stride_qk + cols[None, :], mask=col_ok[None, :], other=0)
        q = ((words >> shifts[:, None]) & 0xF).to(tl.float32)
        g = k0 // group
        s = tl.load(S + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(Z + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        w = ((q - z[None, :]) * s[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)
    tl.store(Y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int codes [N, K] (0..15, K a multiple of 8) -> int32 [K / 8, N]."""
    n, k = codes.shape
    words = codes.to(torch.int32).T.reshape(k // 8, 8, n)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)[None, :, None]
    return (words << shifts).sum(dim=1, dtype=torch.int32)


def block_k(group: int, k: int) -> int:
    """The K block: the largest of 64, 32, 16 dividing both the group and K (None: no such block)."""
    return next((b for b in (64, 32, 16) if group % b == 0 and k % b == 0), None)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group: int) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or float32) @ the packed weight^T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    bk = block_k(group, k)
    if bk is None or qweight.shape[0] * 8 != k:
        raise ValueError(f"w4a16: K {k} and group {group} need a common multiple-of-16 block and K = 8 x words")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if n >= 64 else 32 if n >= 32 else 16
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        x, qweight, scales, scales if zeros is None else zeros, y, m, n, k, group,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        HAS_ZEROS=zeros is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
    )
    return y
