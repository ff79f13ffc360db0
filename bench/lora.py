"""Decode throughput of a batch mixing 4 LoRA adapters against the same
batch on the base model alone.

Makes 4 random PEFT adapters (rank --rank on q/k/v/o/gate/up/down) over the
model (embedded unless --model), then runs the same --requests greedy
requests of --tokens tokens three ways, in this one process: on an engine
without --enable-lora (the base model alone), and on one with it, first all
on the base model, then spread over the 4 adapters (request i under
adapter i % 4, so every step mixes them). Both engines stay up and the
three runs take turns for --rounds rounds, so that a busy machine slows
each alike; figures are the median tokens per second, ratios against the
base model without --enable-lora.

    python bench/lora.py --requests 16 --tokens 64 --torchao-config none
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pyserve.engine.engine import Engine  # noqa: E402
from pyserve.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from pyserve.server_args import ServerArgs  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[str]:
    import peft
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                          init_lora_weights=False))
        model.save_pretrained(out / f"a{i}")
        paths.append(f"a{i}={out / f'a{i}'}")
    return paths


async def throughput(engine: Engine, prompts: list[list[int]], tokens: int, adapters: list[str | None]) -> float:
    async def one(ids, lora):
        req = GenerateRequest(ids, SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True), lora=lora)
        async for _ in engine.generate(req):
            pass

    start = time.perf_counter()
    await asyncio.gather(*(one(p, adapters[i % len(adapters)]) for i, p in enumerate(prompts)))
    return len(prompts) * tokens / (time.perf_counter() - start)


async def compare(plain_args: ServerArgs, lora_args: ServerArgs, names: list[str], prompts: list[list[int]],
                  tokens: int, rounds: int) -> list[float]:
    plain, lora = Engine.from_args(plain_args), Engine.from_args(lora_args)
    await plain.start()
    await lora.start()
    runs = [(plain, [None]), (lora, [None]), (lora, names)]
    try:
        for engine, adapters in runs:  # warm-up
            await throughput(engine, prompts[:4], 4, adapters)
        figures = [[] for _ in runs]
        for _ in range(rounds):
            for figure, (engine, adapters) in zip(figures, runs):
                figure.append(await throughput(engine, prompts, tokens, adapters))
        return [statistics.median(f) for f in figures]
    finally:
        await plain.shutdown()
        await lora.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--torchao-config", default="none")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    cli = ap.parse_args()
    if cli.model:
        model_dir = Path(cli.model)
    else:
        from pyserve.model.default_model import default_model_path
        model_dir = default_model_path()
    prompts = [[100 + i, 200 + 3 * i, 300, 400 + i, 17, 18, 19, 20] for i in range(cli.requests)]
    common = dict(model_path=str(model_dir), torchao_config=cli.torchao_config,
                  max_running_requests=cli.requests)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(model_dir, Path(tmp), 4, cli.rank)
        lora = ServerArgs(**common, enable_lora=True, lora_paths=",".join(paths), max_loras_per_batch=4,
                          max_lora_rank=cli.rank)
        names = [p.split("=")[0] for p in paths]
        plain, lora_base, mixed = asyncio.run(compare(ServerArgs(**common), lora, names, prompts, cli.tokens,
                                                      cli.rounds))
    print(f"{cli.requests} requests x {cli.tokens} tokens, rank {cli.rank}, --torchao-config {cli.torchao_config}, "
          f"median of {cli.rounds} rounds")
    print(f"base model, no --enable-lora: {plain:.1f} tok/s")
    print(f"base model, --enable-lora:    {lora_base:.1f} tok/s ({lora_base / plain:.2f}x)")
    print(f"4 adapters mixed:             {mixed:.1f} tok/s ({mixed / plain:.2f}x)")


if __name__ == "__main__":
    main()
