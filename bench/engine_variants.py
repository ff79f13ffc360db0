"""Engine layouts side by side: overlap scheduling on vs off, KV page size.

The same workload (random prompts, EOS ignored) runs through the engine once
per layout, in this one process, so the ratios hold on a noisy machine. The
overlap row shows what scheduling step N+1 while step N runs buys; the page
rows show what larger KV pages cost or save.

    python bench/engine_variants.py                          # embedded model, CPU
    python bench/engine_variants.py --device cuda --num-prompts 256 --model DIR
"""

from __future__ import annotations

import asyncio
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import run_engine, workload_from_args, workload_parser  # noqa: E402

LAYOUTS = {
    "overlap, page 1": {"disable_overlap_schedule": False},
    "no overlap, page 1": {"disable_overlap_schedule": True},
    "overlap, page 16": {"page_size": 16, "disable_overlap_schedule": False},
}
CUDA_LAYOUTS = {
    "no CUDA graph": {"disable_cuda_graph": True},
    "no CUDA graph, no overlap": {"disable_cuda_graph": True, "disable_overlap_schedule": True},
}


def main() -> None:
    ap = workload_parser(__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="runs per layout; the best is kept")
    args = ap.parse_args()
    workload = workload_from_args(args)
    out_tokens = sum(n for _, n in workload)
    layouts = dict(LAYOUTS, **(CUDA_LAYOUTS if args.device == "cuda" else {}))
    results = {}
    # Rounds interleave the layouts, so a slow spell of the machine hits all.
    for _ in range(args.rounds):
        for name, layout in layouts.items():
            elapsed, steps = asyncio.run(run_engine(args.model, workload, args.device, **layout))
            if name not in results or elapsed < results[name][0]:
                results[name] = (elapsed, steps)
    print(f"machine: {platform.machine()}, device {args.device}, torch {torch.__version__}")
    print(f"workload: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
          f"{out_tokens} output tokens, EOS ignored; best of {args.rounds}")
    base = results[next(iter(layouts))][0]
    print(f"{'layout':<28}{'seconds':>9}{'tok/s':>9}{'steps':>7}{'ms/step':>9}{'vs first':>12}")
    for name, (elapsed, steps) in results.items():
        print(f"{name:<28}{elapsed:>9.2f}{out_tokens / elapsed:>9.1f}{steps:>7}"
              f"{1000 * elapsed / steps:>9.2f}{base / elapsed:>11.2f}x")


if __name__ == "__main__":
    main()
