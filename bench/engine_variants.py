"""Engine layouts side by side: overlap scheduling on vs off, KV page size;
with --cpu-speed, CPU weight quantization and torch.compile instead.

The same workload (random prompts, EOS ignored) runs through the engine once
per layout, in this one process, so the ratios hold on a noisy machine. The
overlap row shows what scheduling step N+1 while step N runs buys; the page
rows show what larger KV pages cost or save.

--cpu-speed runs each --torchao-config mode, compile off and on (8da4w:
its native decode layer, and the torch layers compiled), at batch 1 and
batch 8 (that many prompts of 32 tokens, 64 output tokens each, so the
steps are decode steps but one prefill): ms/step is the decode step time.

    python bench/engine_variants.py                          # embedded model, CPU
    python bench/engine_variants.py --cpu-speed              # quantization x compile, batch 1 and 8
    python bench/engine_variants.py --device cuda --num-prompts 256 --model DIR
"""

from __future__ import annotations

import asyncio
import platform
import sys
import time
from contextlib import nullcontext
from unittest.mock import patch
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import (  # noqa: E402
    StepCounter, make_workload, run_engine, workload_from_args, workload_parser,
)

LAYOUTS = {
    "overlap, page 1": {"disable_overlap_schedule": False},
    "no overlap, page 1": {"disable_overlap_schedule": True},
    "overlap, page 16": {"page_size": 16, "disable_overlap_schedule": False},
}
CPU_SPEED_LAYOUTS = {
    "float32 (none)": {"torchao_config": "none"},
    "int8wo": {"torchao_config": "int8wo"},
    "int4wo-32": {"torchao_config": "int4wo-32"},
    "8da4w (auto, native)": {"torchao_config": "auto"},
    "float32 + compile": {"torchao_config": "none", "enable_torch_compile": True},
    "int4wo-32 + compile": {"torchao_config": "int4wo-32", "enable_torch_compile": True},
    "8da4w, torch + compile": {"torchao_config": "auto", "enable_torch_compile": True},
}
# Layouts whose decode steps keep the torch layers where the native decode
# layer (pyserve/model/cpu/native_layers.py) would run: what it replaces.
TORCH_LAYERS = {"8da4w, torch + compile"}
CUDA_LAYOUTS = {
    "no CUDA graph": {"disable_cuda_graph": True},
    "no CUDA graph, no overlap": {"disable_cuda_graph": True, "disable_overlap_schedule": True},
}


def main() -> None:
    ap = workload_parser(__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="runs per layout; the best is kept")
    ap.add_argument("--cpu-speed", action="store_true", help="quantization x compile at batch 1 and 8")
    args = ap.parse_args()
    workload = workload_from_args(args)
    print(f"machine: {platform.machine()}, device {args.device}, torch {torch.__version__}")
    if args.cpu_speed:
        asyncio.run(cpu_speed(args))
        return
    out_tokens = sum(n for _, n in workload)
    layouts = dict(LAYOUTS, **(CUDA_LAYOUTS if args.device == "cuda" else {}))
    results = {}
    # Rounds interleave the layouts, so a slow spell of the machine hits all.
    for _ in range(args.rounds):
        for name, layout in layouts.items():
            elapsed, steps = asyncio.run(run_engine(args.model, workload, args.device, **layout))
            if name not in results or elapsed < results[name][0]:
                results[name] = (elapsed, steps)
    print(f"workload: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
          f"{out_tokens} output tokens, EOS ignored; best of {args.rounds}")
    base = results[next(iter(layouts))][0]
    print(f"{'layout':<28}{'seconds':>9}{'tok/s':>9}{'steps':>7}{'ms/step':>9}{'vs first':>12}")
    for name, (elapsed, steps) in results.items():
        print(f"{name:<28}{elapsed:>9.2f}{out_tokens / elapsed:>9.1f}{steps:>7}"
              f"{1000 * elapsed / steps:>9.2f}{base / elapsed:>11.2f}x")


async def cpu_speed(args) -> None:
    """Every CPU_SPEED_LAYOUTS engine is started once (compiling, if asked,
    before timing starts), then rounds interleave them at batch 1 and 8."""
    from pyserve.engine.engine import Engine
    from pyserve.engine.runner.rank_model import RankModel
    from pyserve.engine.request import GenerateRequest, SamplingParams
    from pyserve.model.families import read_config
    from pyserve.server_args import ServerArgs

    vocab = read_config(args.model).vocab_size
    # Every compiled engine's layers share one compiled function (dynamo keys
    # its cache by code): three engines' shapes would pass the default limit
    # of 8 graphs, and the last engine would silently run eagerly.
    torch._dynamo.config.recompile_limit = 32
    workloads = {b: make_workload(vocab, b, (32, 32), (64, 64), args.seed) for b in (1, 8)}
    engines = {}
    for name, layout in CPU_SPEED_LAYOUTS.items():
        engines[name] = Engine.from_args(ServerArgs(model_path=args.model, device=args.device, max_total_tokens=4096,
                                          **layout))
        with patch.object(RankModel, "_native_layers", lambda self: None) if name in TORCH_LAYERS \
                else nullcontext():
            await engines[name].start()

    async def timed(engine, workload) -> float:
        """Seconds per forward step of the workload, EOS ignored."""

        async def one(ids, n):
            params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
            async for _ in engine.generate(GenerateRequest(ids, params)):
                pass

        counter = StepCounter(engine)
        start = time.perf_counter()
        await asyncio.gather(*[one(ids, n) for ids, n in workload])
        elapsed = time.perf_counter() - start
        return elapsed / counter.stop()

    for engine in engines.values():  # warm-up
        await timed(engine, workloads[1][:1])
    best = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            for b, workload in workloads.items():
                best[name, b] = min(best.get((name, b), float("inf")), await timed(engine, workload))
    for engine in engines.values():
        await engine.shutdown()
    print(f"decode ms/step at batch 1 and 8 (32-token prompts, 64 output tokens, EOS ignored; best of "
          f"{args.rounds} interleaved rounds; {torch.get_num_threads()} torch threads)")
    print(f"{'layout':<24}{'batch 1':>10}{'speed-up':>10}{'batch 8':>10}{'speed-up':>10}")
    first = next(iter(CPU_SPEED_LAYOUTS))
    for name in CPU_SPEED_LAYOUTS:
        cells = "".join(f"{1000 * best[name, b]:>10.2f}{best[first, b] / best[name, b]:>9.2f}x" for b in (1, 8))
        print(f"{name:<24}{cells}")


if __name__ == "__main__":
    main()
