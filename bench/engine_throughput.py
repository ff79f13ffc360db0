"""Offline generation throughput: pyserve's engine vs transformers `generate`.

Both run the same weights on the same device in this one process, on the
same random prompts (random input/output lengths, EOS ignored), so the
ratio holds on a noisy shared machine even when the absolute numbers move.

    python bench/engine_throughput.py                      # embedded model
    python bench/engine_throughput.py --model DIR --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import time

import torch


def make_workload(vocab: int, n: int, in_range: tuple[int, int], out_range: tuple[int, int], seed: int):
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(*in_range))], rng.randint(*out_range))
        for _ in range(n)
    ]


class StepCounter:
    """Counts the forward steps an engine's scheduler hands out until `stop`."""

    def __init__(self, engine):
        self.steps = 0
        self._scheduler = engine.scheduler
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._counting

    def _counting(self):
        step = self._schedule()
        self.steps += step is not None
        return step

    def stop(self) -> int:
        self._scheduler.schedule = self._schedule
        return self.steps


async def run_engine(model_dir: str, workload, device: str, **server_args) -> tuple[float, int]:
    """(seconds, forward steps) for the whole workload through pyserve's engine."""
    from pyserve.engine.engine import Engine
    from pyserve.engine.request import GenerateRequest, SamplingParams
    from pyserve.server_args import ServerArgs

    engine = Engine.from_args(ServerArgs(model_path=model_dir, device=device, max_total_tokens=65536, **server_args))
    await engine.start()

    async def one(ids, out_len):
        n = 0
        params = SamplingParams(max_new_tokens=out_len, temperature=0, ignore_eos=True)
        async for out in engine.generate(GenerateRequest(ids, params)):
            n += len(out.token_ids)
        return n

    await one(workload[0][0], 4)  # warm-up
    counter = StepCounter(engine)
    start = time.perf_counter()
    produced = sum(await asyncio.gather(*[one(ids, n) for ids, n in workload]))
    elapsed = time.perf_counter() - start
    steps = counter.stop()
    await engine.shutdown()
    assert produced == sum(n for _, n in workload)
    return elapsed, steps


def run_transformers(model_dir: str, workload, device: str, dtype: str, batch_size: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    model.generation_config.eos_token_id = None  # like ignore_eos
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(workload), batch_size):
            chunk = workload[i : i + batch_size]
            width = max(len(ids) for ids, _ in chunk)
            # left padding, so every row's last prompt token lines up
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
            # one generate per batch runs to the longest requested output
            model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in chunk),
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def workload_parser(description: str) -> argparse.ArgumentParser:
    """The model and workload options the engine benchmarks share."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 128))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 64))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def workload_from_args(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """Fills in args.model when it was not given; returns the workload."""
    if args.model is None:
        from pyserve.model.default_model import default_model_path

        args.model = str(default_model_path())
    from pyserve.model.families import read_config

    vocab = read_config(args.model).vocab_size
    return make_workload(vocab, args.num_prompts, tuple(args.input_len), tuple(args.output_len), args.seed)


def main() -> None:
    ap = workload_parser(__doc__.split("\n")[0])
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu (both sides)")
    args = ap.parse_args()
    workload = workload_from_args(args)
    out_tokens = sum(n for _, n in workload)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    ours, _ = asyncio.run(run_engine(args.model, workload, args.device, dtype=dtype))
    hf = run_transformers(args.model, workload, args.device, dtype, args.hf_batch_size)
    print(f"machine: {platform.machine()} {torch.get_num_threads()} threads, device {args.device}, {dtype}, "
          f"torch {torch.__version__}")
    print(f"workload: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
          f"{out_tokens} output tokens, EOS ignored")
    print(f"{'':<28}{'seconds':>10}{'output tok/s':>15}")
    print(f"{'pyserve engine':<28}{ours:>10.2f}{out_tokens / ours:>15.1f}")
    print(f"{'transformers generate':<28}{hf:>10.2f}{out_tokens / hf:>15.1f}")
    print(f"ratio (pyserve / transformers throughput): {hf / ours:.2f}x")


if __name__ == "__main__":
    main()
