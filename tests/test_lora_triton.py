"""The segmented LoRA kernel (pyserve/lora/triton_kernel.py) against the
torch path of the same projection (slots.py's _Projection.add_delta, padded
for short steps and group by group for long ones) and a per-token
reference: several adapters of different ranks and base-model rows (slot
-1) in one batch, in Triton's interpreter on CPU (compiled on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # in case this file runs without conftest.py

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pyserve.lora import triton_kernel  # noqa: E402
from pyserve.lora.batch import LoraBatch  # noqa: E402
from pyserve.lora.slots import PAD_BELOW_TOKENS, _Projection  # noqa: E402

if not CUDA and not isinstance(triton_kernel._shrink_kernel, InterpretedFunction):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

SLOTS, MAX_RANK, TARGETS, IN, OUT = 4, 8, 3, 40, 72  # fused q/k/v-like: three blocks of rank 8


def projection(ranks: dict[int, int], dtype: torch.dtype) -> _Projection:
    """Slot s holds an adapter of rank ranks[s] in each target block (the rest zero, as slots.py pads)."""
    p = _Projection(SLOTS, MAX_RANK, TARGETS, IN, OUT, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    for slot, rank in ranks.items():
        for block in range(TARGETS):
            rows = slice(block * MAX_RANK, block * MAX_RANK + rank)
            p.A[slot, rows] = torch.randn(rank, IN, generator=g) * 0.3
            p.B[slot, :, rows] = torch.randn(OUT, rank, generator=g) * 0.3
    p.A, p.B = p.A.to(dtype), p.B.to(dtype)
    return p


def reference(p: _Projection, x: torch.Tensor, out: torch.Tensor, per_token: list[int]) -> torch.Tensor:
    want = out.double().clone()
    for t, slot in enumerate(per_token):
        if slot >= 0:
            want[t] += p.B[slot].double() @ (p.A[slot].double() @ x[t].double())
    return want


CASES = {
    "mixed": [2, -1, 0, 2, 3, -1, 0, 0, 3],
    "one-adapter": [1] * 5,
    "base-first-ragged": [-1, -1, 3] + [1] * 19 + [-1] + [3] * 2,
    "long-step": ([0, 2, -1, 2, 1] * 15)[:PAD_BELOW_TOKENS + 3],  # torch's group-by-group path
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_torch_path(case, dtype):
    per_token = CASES[case]
    p = projection({0: 8, 1: 1, 2: 4, 3: 6}, dtype)
    g = torch.Generator().manual_seed(len(per_token))
    x = torch.randn(len(per_token), IN, generator=g).to(dtype)
    out = torch.randn(len(per_token), OUT, generator=g).to(dtype)
    batch = LoraBatch.of_tokens(torch.tensor(per_token))

    torch_out = out.float().clone()
    p32 = _Projection(SLOTS, MAX_RANK, TARGETS, IN, OUT, torch.float32, "cpu")
    p32.A, p32.B = p.A.float(), p.B.float()
    p32.add_delta(x.float(), torch_out, batch)

    kernel_out = out.clone().to(DEVICE)  # .to on CPU would be `out` itself
    device_batch = batch.to(torch.device(DEVICE), pin=False)
    triton_kernel.add_lora_delta(x.to(DEVICE), kernel_out, p.A.to(DEVICE), p.B.to(DEVICE), device_batch.tokens,
                                 device_batch.segments, batch.width)
    kernel_out = kernel_out.cpu()
    base_rows = torch.tensor(per_token) < 0
    assert torch.equal(kernel_out[base_rows], out[base_rows])  # base-model rows untouched, bit for bit
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    want = reference(p, x, out, per_token)
    torch.testing.assert_close(kernel_out.double(), want, atol=tol * want.abs().max().item(), rtol=0)
    torch.testing.assert_close(kernel_out.float(), torch_out, atol=tol * want.abs().max().item(), rtol=0)


def test_segments_list_each_slots_run_of_tokens():
    batch = LoraBatch.of_tokens(torch.tensor([3, -1, 0, 3, 3, -1, 0]))
    assert batch.segments.tolist() == [[0, 3], [0, 2], [2, 3]]  # slots, starts, lengths
    assert batch.tokens.tolist() == [2, 6, 0, 3, 4] and batch.width == 3


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_projection_runs_the_kernel(dtype):
    """On CUDA, _Projection.add_delta is the kernel: it matches the CPU's torch path."""
    per_token = CASES["mixed"]
    p = projection({0: 8, 1: 1, 2: 4, 3: 6}, dtype)
    x = torch.randn(len(per_token), IN).to(dtype)
    out = torch.randn(len(per_token), OUT).to(dtype)
    batch = LoraBatch.of_tokens(torch.tensor(per_token))
    want = out.float().clone()
    p32 = _Projection(SLOTS, MAX_RANK, TARGETS, IN, OUT, torch.float32, "cpu")
    p32.A, p32.B = p.A.float(), p.B.float()
    p32.add_delta(x.float(), want, batch)
    gpu = _Projection(SLOTS, MAX_RANK, TARGETS, IN, OUT, dtype, "cuda")
    gpu.A.copy_(p.A)
    gpu.B.copy_(p.B)
    got = out.cuda()
    gpu.add_delta(x.cuda(), got, batch.to(torch.device("cuda"), pin=True))
    torch.testing.assert_close(got.float().cpu(), want, atol=3e-2 * want.abs().max().item(), rtol=0)
