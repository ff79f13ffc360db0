"""pyserve vs transformers `generate` on the same prompts, in one command.

Starts pyserve on a free port (the model directory, --device and --dtype
passed through), runs bench/serving.py's benchmark against it, stops it,
then runs bench/baseline_hf.py on the same dataset with the same model,
device and dtype, and prints one table with both and their ratio. The two
never run at the same time, so neither slows the other.

On a shared machine one pair of runs can meet it in different moods:
--rounds N alternates the pair N times, each round on new prompts (seed
--seed + round), and ends with each round's throughput ratio and the
ratio of the medians.

    python bench/compare.py --num-prompts 16 --random-input-len 128 \\
        --random-output-len 32 --random-range-ratio 1 --max-concurrency 8 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import baseline_hf, serving  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402  (the same launcher the tests use)

# (header, how to read it from a report, how to print it, whether to show a ratio)
COLUMNS = [
    ("in tokens", lambda m: m["total_input_tokens"], "{}", False),
    ("out tokens", lambda m: m["total_output_tokens"], "{}", False),
    ("out tok/s", lambda m: m["output_throughput"], "{:.2f}", True),
    ("req/s", lambda m: m["request_throughput"], "{:.3f}", True),
    ("mean E2E ms", lambda m: m["e2e_latency_ms"]["mean"], "{:.1f}", True),
    # generate hands back whole batches, so only pyserve has these
    ("median TTFT ms", lambda m: m.get("ttft_ms", {}).get("median"), "{:.1f}", False),
    ("median TPOT ms", lambda m: m.get("tpot_ms", {}).get("median"), "{:.1f}", False),
]


def format_table(ours: dict, hf: dict) -> str:
    def line(label: str, cells: list[str]) -> str:
        return f"{label:<20}" + "".join(f"{c:>{max(len(h), 9) + 3}}" for c, (h, *_) in zip(cells, COLUMNS))

    def cells(m: dict) -> list[str]:
        values = [get(m) for _, get, _, _ in COLUMNS]
        return ["-" if v is None else fmt.format(v) for v, (_, _, fmt, _) in zip(values, COLUMNS)]

    ratios = [f"{get(ours) / get(hf):.2f}x" if shown else "-" for _, get, _, shown in COLUMNS]
    return "\n".join([
        line("", [header for header, *_ in COLUMNS]),
        line("pyserve", cells(ours)),
        line("transformers", cells(hf)),
        line("pyserve/transformers", ratios),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    baseline_hf.add_model_args(p)
    serving.add_dataset_args(p)
    serving.add_load_args(p)
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="prompts per generate call (default: --max-concurrency, else all prompts)")
    p.add_argument("--torchao-config", default="auto",
                   help="pyserve's CPU weight quantization (auto: the embedded model's own 4-bit weights; "
                        "none: float32 like transformers)")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="pyserve compiles its decode steps (CPU; compiled at start-up, before timing)")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate pyserve and transformers this many times, new prompts each round")
    p.add_argument("--output-json", help="write both reports and the table here")
    return p.parse_args(argv)


def run_pyserve(args: argparse.Namespace, directory: Path) -> dict:
    """serving.py's benchmark against a pyserve started for it, then stopped."""
    with tempfile.TemporaryDirectory() as storage:  # the server's files/batches, thrown away
        server = ServerProcess("--model", str(directory), "--device", args.device, "--dtype", args.dtype,
                               "--file-storage-path", storage,
                               "--torchao-config", args.torchao_config,
                               *(["--enable-torch-compile"] if args.enable_torch_compile else []))
        try:
            # serving.py's options on top of ours: completions with text
            # prompts, the model name from /v1/models, no API key
            return asyncio.run(serving.benchmark(argparse.Namespace(**vars(args) | {
                "base_url": server.base_url, "backend": "completions", "model": None, "api_key": None})))
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    directory = baseline_hf.model_dir(args)  # resolved once, so both load the same files
    rounds = []
    for number in range(args.rounds):
        round_args = argparse.Namespace(**vars(args) | {"seed": args.seed + number})
        ours = run_pyserve(round_args, directory)
        hf = baseline_hf.run(argparse.Namespace(**vars(round_args) | {
            "model_dir": str(directory),
            "batch_size": args.hf_batch_size or args.max_concurrency or len(ours["requests"]),
        }))
        rounds.append((ours, hf))
        if args.rounds > 1:
            print(f"round {number + 1}: {ours['output_throughput']:.2f} vs {hf['output_throughput']:.2f} out tok/s, "
                  f"{ours['output_throughput'] / hf['output_throughput']:.2f}x", file=sys.stderr)
    ours, hf = rounds[0]

    table = format_table(ours, hf)
    print(f"model {directory.name}, device {hf['device']}, dtype {hf['dtype']}, "
          f"{platform.machine()} with {torch.get_num_threads()} torch threads; pyserve max concurrency "
          f"{args.max_concurrency or 'unlimited'}, transformers batch size {hf['batch_size']}; "
          f"pyserve --torchao-config {args.torchao_config}"
          f"{' --enable-torch-compile' if args.enable_torch_compile else ''}")
    print(table)
    print("ratio = pyserve / transformers: higher is better for tok/s and req/s, lower for E2E")
    result = {"pyserve": ours, "transformers": hf, "table": table,
              "ratios": [o["output_throughput"] / h["output_throughput"] for o, h in rounds]}
    if args.rounds > 1:
        medians = [statistics.median(side["output_throughput"] for side in sides) for sides in zip(*rounds)]
        result["median_ratio"] = medians[0] / medians[1]
        print(f"{args.rounds} rounds (the table is round 1's): out tok/s ratios "
              + ", ".join(f"{r:.2f}x" for r in result["ratios"])
              + f"; medians {medians[0]:.2f} vs {medians[1]:.2f}, {result['median_ratio']:.2f}x")
    for error in (e for o, _ in rounds for e in o["errors"]):
        print(f"pyserve error: {error}")
    serving.save_json(result, args.output_json)
    return result


if __name__ == "__main__":
    main()
