"""One MoE block's experts on a GPU: the fused Triton kernels against the
torch path, in one run.

The shape is one layer of Qwen3-30B-A3B (hidden 2048, 128 experts, top 8,
768 per expert) in bfloat16, routed by a random softmax router. Timed for
each token count:

  triton   moe_triton.fused_experts: assignments sorted into per-expert
           blocks, gate/up + activation in one kernel, down + the routing
           weight in a second, one launch each
  torch    moe.grouped_experts on the GPU: the same sort, one matmul pair
           per expert that received tokens (the path pyserve runs on CPU)

Each figure is the median of --iters CUDA-event timings after warm-up. The
roofline is the bytes of the distinct experts the batch touches (each read
once) over the HBM bandwidth measured here with a large device-to-device
copy. Both paths' outputs are compared (max |difference| over max |value|).
Without CUDA it says so and exits 0.

    python bench/gpu_moe.py [--tokens 1,8,64,512,2048] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_quant import timed  # noqa: E402  median CUDA-event ms after warm-up
from pyserve.model.layers.moe import MoESpec, grouped_experts, route  # noqa: E402

SPEC = MoESpec(num_experts=128, top_k=8, hidden=2048, intermediate=768, weights_float32=False)


def hbm_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * src.element_size() / (ms / 1000)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,8,64,512,2048")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_moe.py: no CUDA device here, nothing to measure")
        return {}
    from pyserve.model.layers import moe_triton

    torch.manual_seed(0)
    E, H, L = SPEC.num_experts, SPEC.hidden, SPEC.intermediate
    w13 = torch.randn(E, 2 * L, H, dtype=torch.bfloat16, device="cuda") * 0.02
    w2 = torch.randn(E, H, L, dtype=torch.bfloat16, device="cuda") * 0.02
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    bandwidth = hbm_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; HBM copy {bandwidth / 1e9:.0f} GB/s; "
          f"experts {E} x {expert_bytes / 1e6:.1f} MB, top {SPEC.top_k}, bfloat16")
    rows = {}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, H, dtype=torch.bfloat16, device="cuda")
        weights, ids = route(SPEC, torch.randn(tokens, E, dtype=torch.bfloat16, device="cuda"))
        fused = moe_triton.fused_experts(SPEC, x, weights, ids, w13, w2)
        grouped = grouped_experts(SPEC, x, weights, ids, w13, w2)
        error = ((fused.float() - grouped.float()).abs().max() / grouped.float().abs().max()).item()
        ms_triton = timed(lambda: moe_triton.fused_experts(SPEC, x, weights, ids, w13, w2), args.iters)
        ms_torch = timed(lambda: grouped_experts(SPEC, x, weights, ids, w13, w2), args.iters)
        roofline_ms = ids.unique().numel() * expert_bytes / bandwidth * 1000
        row = {"triton_ms": round(ms_triton, 4), "torch_ms": round(ms_torch, 4),
               "speedup": round(ms_torch / ms_triton, 2), "roofline_ms": round(roofline_ms, 4),
               "triton_of_roofline": round(roofline_ms / ms_triton, 2), "rel_error": round(error, 5)}
        rows[tokens] = row
        print(f"tokens {tokens:5d}  " + json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
