"""Decode speed at --tp-size 2 against --tp-size 1, in one script run.

Each round starts an engine of each size in turn (its ranks as the server
starts them: spawned processes, gloo on CPU, NCCL on CUDA), times batch-1
and batch-8 decoding (32-token prompts, 64 output tokens, EOS ignored:
one prefill, then decode steps) and stops it; the best round counts. The
ratio is TP=2 over TP=1 tokens/s. On CPU the ranks of one machine share
its cores (each gets cores / ranks torch threads), so expect no speed-up
there: the all-reduces are pure cost. On GPUs each rank has its own.

    python bench/tensor_parallel.py                       # embedded model, CPU, float32
    python bench/tensor_parallel.py --torchao-config auto # the 4-bit default
    python bench/tensor_parallel.py --device cuda --shape 1b   # random Llama-1B-shaped weights, 2 GPUs
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import StepCounter, make_workload  # noqa: E402

BATCHES = (1, 8)


async def decode_rates(model_dir: str, tp_size: int, device: str, **options) -> dict[int, float]:
    """Output tokens/s at each batch size on an engine of `tp_size` ranks."""
    from pyserve.engine.engine import Engine
    from pyserve.engine.request import GenerateRequest, SamplingParams
    from pyserve.model.families import read_config
    from pyserve.server_args import ServerArgs

    vocab = read_config(model_dir).vocab_size
    engine = Engine.from_args(ServerArgs(model_path=model_dir, device=device, tp_size=tp_size, max_total_tokens=4096,
                               **options))
    await engine.start()

    async def one(ids, n):
        params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        async for _ in engine.generate(GenerateRequest(ids, params)):
            pass

    try:
        await one([100] * 8, 4)  # warm-up
        rates = {}
        for batch in BATCHES:
            workload = make_workload(vocab, batch, (32, 32), (64, 64), seed=batch)
            counter = StepCounter(engine)
            start = time.perf_counter()
            await asyncio.gather(*[one(ids, n) for ids, n in workload])
            rates[batch] = sum(n for _, n in workload) / (time.perf_counter() - start)
            counter.stop()
    finally:
        await engine.shutdown()
    return rates


def compare(model_dir: str, device: str, rounds: int, **options) -> dict[int, dict[int, float]]:
    """{tp size: {batch: best tokens/s}} for TP 1 and 2, rounds interleaved."""
    best: dict[int, dict[int, float]] = {1: {}, 2: {}}
    for _ in range(rounds):
        for tp_size in (1, 2):
            for batch, rate in asyncio.run(decode_rates(model_dir, tp_size, device, **options)).items():
                best[tp_size][batch] = max(best[tp_size].get(batch, 0.0), rate)
    return best


def format_rows(best: dict[int, dict[int, float]]) -> str:
    lines = [f"{'batch':>6}{'TP=1 tok/s':>12}{'TP=2 tok/s':>12}{'TP=2 / TP=1':>13}"]
    for batch in BATCHES:
        one, two = best[1][batch], best[2][batch]
        lines.append(f"{batch:>6}{one:>12.1f}{two:>12.1f}{two / one:>12.2f}x")
    return "\n".join(lines)


def random_checkpoint(shape: dict, out_dir: Path) -> Path:
    """A Llama checkpoint of `shape` with random weights and the embedded model's tokenizer."""
    from pyserve.model.default_model import default_model_path
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(out_dir, "llama", tokenizer_dir=default_model_path(), max_position_embeddings=4096,
                            **shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--shape", choices=("1b", "8b"), default=None,
                    help="instead of --model: random weights in a Llama shape (bench/gpu.py's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--torchao-config", default="none", help="CPU weight quantization, as the server's option")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    options = {"torchao_config": args.torchao_config} if args.device == "cpu" else {}
    with tempfile.TemporaryDirectory() as scratch:
        if args.shape:
            from gpu import SHAPES

            model_dir = str(random_checkpoint(SHAPES[args.shape], Path(scratch)))
        elif args.model:
            model_dir = args.model
        else:
            from pyserve.model.default_model import default_model_path

            model_dir = str(default_model_path())
        best = compare(model_dir, args.device, args.rounds, **options)
    print(f"machine: {platform.machine()}, device {args.device}, torch {torch.__version__}, model {model_dir}, "
          f"{options or 'bf16'}; decode of 32-token prompts, 64 output tokens, best of {args.rounds} rounds")
    print(format_rows(best))


if __name__ == "__main__":
    main()
