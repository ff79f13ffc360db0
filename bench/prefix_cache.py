"""Time to first token with a shared prompt prefix, radix cache on vs off.

Requests share a long system prompt and differ in their question, as chat
traffic does. The same engine code runs both ways in this one process (the
cache on, then `--disable-radix-cache`), so the ratio holds on a noisy
machine.

    python bench/prefix_cache.py --system-words 600 --requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time


async def ttfts(model_dir: str | None, prompts: list[list[int]], disable_cache: bool) -> tuple[list[float], int]:
    from pyserve.engine.engine import Engine
    from pyserve.engine.request import GenerateRequest, SamplingParams
    from pyserve.server_args import ServerArgs

    engine = Engine.from_args(ServerArgs(model_path=model_dir, disable_radix_cache=disable_cache, max_total_tokens=32768))
    await engine.start()
    out, cached = [], 0
    for ids in prompts:  # one at a time: TTFT without queueing effects
        start = time.perf_counter()
        gen = engine.generate(GenerateRequest(ids, SamplingParams(max_new_tokens=1, temperature=0)))
        async for o in gen:
            if o.finished:
                cached += o.cached_tokens
        out.append(time.perf_counter() - start)
    await engine.shutdown()
    return out, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    from pyserve._rust import Tokenizer
    from pyserve.model.default_model import default_model_path

    model_dir = args.model or str(default_model_path())
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    system = " ".join(f"rule{i % 97} applies to case {i};" for i in range(args.system_words // 5))
    prompts = [tok.encode(f"{system}\nQuestion {i}: what is {i} plus {i}?") for i in range(args.requests)]
    on, cached = asyncio.run(ttfts(model_dir, prompts, disable_cache=False))
    off, _ = asyncio.run(ttfts(model_dir, prompts, disable_cache=True))
    # the first request fills the cache; the others are the hits
    hit_on, hit_off = statistics.median(on[1:]), statistics.median(off[1:])
    print(f"prompt ~{len(prompts[0])} tokens, {args.requests} requests sharing the prefix, "
          f"{cached} prompt tokens served from the cache")
    print(f"TTFT median (ms): radix cache {hit_on * 1e3:.1f}, no cache {hit_off * 1e3:.1f}, "
          f"speed-up {hit_off / hit_on:.2f}x")


if __name__ == "__main__":
    main()
