"""The CUDA kernels of quantized checkpoints and LoRA, one linear layer at a
time, against the same layer dense in bfloat16 (in the same run):

- int4 groups (group 128, asymmetric; and act-order): torch's tinygemm
  (`_weight_int4pack_mm`) and the Triton W4A16 GEMM, through W4A16Linear;
- FP8 (compute capability 8.9+), through Fp8Linear: per-channel scales
  through `torch._scaled_mm` with per-token activation scales, 128x128
  block scales through the Triton block-scaled kernel;
- LoRA: the segmented Triton kernel against the torch path of the same
  projection (4 adapters of rank 16 and base rows mixed).

Rows (tokens) 1, 8, 64 and 512 over Llama-7B-like shapes; each figure is
the median of --iters CUDA-event timings after warm-up, printed as ms and
as a ratio to bf16 dense (for LoRA: to the torch path). Without CUDA it
says so and exits 0.

    python bench/gpu_quant.py [--iters 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (out, in)
ROWS = [1, 8, 64, 512]


def timed(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def int4_weight(out: int, cols: int, act_order: bool):
    from pyserve.model.quantized.weights import IntWeight

    group = 128
    g_idx = torch.randperm(cols) // group if act_order else None
    return IntWeight(torch.randint(0, 16, (out, cols)), torch.randint(0, 16, (out, cols // group)),
                     torch.rand(out, cols // group) * 0.01, group, 4, g_idx)


def layers(out: int, cols: int):
    from pyserve.model.quantized.fp8_linear import Fp8Linear, has_fp8_gemm
    from pyserve.model.quantized.int4_linear import W4A16Linear
    from pyserve.model.quantized.weights import FloatWeight

    dense = torch.randn(out, cols, dtype=torch.bfloat16, device="cuda") * 0.02
    yield "bf16 dense", lambda x: torch.nn.functional.linear(x, dense)
    for act_order in (False, True):
        w = int4_weight(out, cols, act_order)
        for backend in ("aten", "triton"):
            layer = W4A16Linear(w, torch.bfloat16, "cuda", backend)
            yield f"int4 {backend}{' act-order' if act_order else ''}", layer
    if has_fp8_gemm(torch.device("cuda")):
        scale = torch.rand(out, 1) * 0.001
        fp8 = FloatWeight(torch.randn(out, cols).to(torch.float8_e4m3fn), scale)
        yield "fp8 scaled_mm", Fp8Linear(fp8, torch.bfloat16, "cuda", "scaled_mm")
        blocks = torch.rand(-(-out // 128), -(-cols // 128)) * 0.001
        block_fp8 = FloatWeight(fp8.values, blocks, (128, 128))
        yield "fp8 128x128 triton", Fp8Linear(block_fp8, torch.bfloat16, "cuda", "triton_block")


def lora_cases():
    """(rows, the torch path, the kernel) for a q/k/v-like projection with 4 adapters and base rows."""
    from pyserve.lora.batch import LoraBatch
    from pyserve.lora.slots import _Projection

    p = _Projection(8, 16, 3, 4096, 6144, torch.bfloat16, "cuda")
    p.A.normal_(0, 0.02)
    p.B.normal_(0, 0.02)
    for rows in ROWS:
        slots = torch.tensor([i % 5 - 1 for i in range(rows)])
        slots[0] = 0
        batch = LoraBatch.of_tokens(slots).to(torch.device("cuda"), pin=False)
        x = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
        out = torch.zeros(rows, 6144, dtype=torch.bfloat16, device="cuda")
        yield rows, (lambda: p.add_delta_torch(x, out, batch)), (lambda: p.add_delta(x, out, batch))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_quant.py: no CUDA device here, nothing to measure")
        return 0
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for out, cols in SHAPES:
        built = list(layers(out, cols))
        for rows in ROWS:
            x = torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda")
            base = None
            for name, layer in built:
                ms = timed(lambda: layer(x), args.iters)
                base = base or ms
                print(f"{out}x{cols} rows {rows:4d}  {name:22s} {ms:8.3f} ms  x{ms / base:5.2f} of bf16")
    for rows, torch_path, kernel in lora_cases():
        ms_torch, ms_kernel = timed(torch_path, args.iters), timed(kernel, args.iters)
        print(f"lora qkv 4096->6144 rank 16 rows {rows:4d}  torch {ms_torch:.3f} ms  triton {ms_kernel:.3f} ms  "
              f"x{ms_kernel / ms_torch:.2f} of torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
