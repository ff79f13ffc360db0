"""Decode time per token as the context grows, one request at a time.

A request's decode steps attend over every token before them, so past a
few hundred tokens attention, not the weights, sets a step's time. This
starts the engine once (the embedded model by default, its default
layout: 8da4w's native decode layer on an AVX2 CPU), then, in rounds,
generates --output-len tokens after a prompt of each --contexts length and
times the stream from its first token to its last (the prompt's prefill is
left out). The first context is the baseline the others are divided by.

    python bench/long_context.py                          # contexts 32, 1300, 3000
    python bench/long_context.py --contexts 32 4000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch


async def main(args) -> None:
    from pyserve.engine.engine import Engine
    from pyserve.engine.request import GenerateRequest, SamplingParams
    from pyserve.server_args import ServerArgs

    kwargs = {"model_path": args.model} if args.model else {}
    engine = Engine.from_args(ServerArgs(max_total_tokens=max(args.contexts) + args.output_len + 64, **kwargs))
    await engine.start()
    rng = random.Random(args.seed)
    vocab = engine.tokenizer.vocab_size

    async def ms_per_token(context: int) -> float:
        # New random tokens each time: nothing of the prompt is cached.
        ids = [rng.randrange(100, vocab) for _ in range(context)]
        params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
        stamps = []
        async for out in engine.generate(GenerateRequest(ids, params)):
            stamps += [time.perf_counter()] * len(out.token_ids)
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000

    await ms_per_token(args.contexts[0])  # warm-up
    times = {c: [] for c in args.contexts}
    for _ in range(args.rounds):  # rounds interleave the contexts: a slow spell hits all
        for context in args.contexts:
            times[context].append(await ms_per_token(context))
    await engine.shutdown()
    base = statistics.median(times[args.contexts[0]])
    print(f"decode ms per token after a prompt, {args.output_len} tokens, one request, median of "
          f"{args.rounds} interleaved rounds; {torch.get_num_threads()} torch threads")
    print(f"{'context':>8}{'ms/token':>10}{'vs first':>10}")
    for context in args.contexts:
        median = statistics.median(times[context])
        print(f"{context:>8}{median:>10.2f}{median / base:>9.2f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a model directory (default: the embedded model)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32, 1300, 3000], help="prompt lengths in tokens")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(main(ap.parse_args()))
