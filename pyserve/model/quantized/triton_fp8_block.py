"""A block-scaled FP8 weight GEMM in Triton (W8A16): y = x @ (W * S)^T with
W float8_e4m3fn [N, K] and one scale per (b0 x b1) block of W (DeepSeek's
and Qwen's `weight_block_size`, `weight_scale_inv` [ceil(N / b0),
ceil(K / b1)]). The weight stays in FP8 (half the bytes of bfloat16, which
decode reads once per token); each K block of the kernel lies in one block
column, so it reads one scale per output row's block there. Activations
stay in the model's dtype. CUDA; under TRITON_INTERPRET=1 on CPU for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_block_kernel(
    X, W, S, Y, M, N, K, block_n, block_k,
    stride_xm, stride_wn, stride_sn, stride_ym,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    scale_rows = S + (cols // block_n) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(W + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None], mask=col_ok[None, :], other=0.0)
        s = tl.load(scale_rows + k0 // block_k, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.dot(x, (w.to(tl.float32) * s[None, :]).to(x.dtype), input_precision=PRECISION)
    tl.store(Y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def block_k(block: tuple[int, int], k: int) -> int | None:
    """The kernel's K block: the largest of 64, 32, 16 dividing the scale block's width and K."""
    return next((b for b in (64, 32, 16) if block[1] % b == 0 and k % b == 0), None)


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] float8 times its block scales)^T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    bk = block_k(block, k)
    if bk is None:
        raise ValueError(f"fp8 blocks {block} and K {k} need a common multiple-of-16 block")
    x, weight, scales = x.contiguous(), weight.contiguous(), scales.float().contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if n >= 64 else 32 if n >= 32 else 16
    _fp8_block_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, weight, scales, y, m, n, k, block[0], block[1],
        x.stride(0), weight.stride(0), scales.stride(0), y.stride(0),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
    )
    return y
