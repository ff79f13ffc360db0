"""Decode speed on a CPU busier than its cores, against the same machine quiet.

A server rarely has its cores to itself: other processes, a tokenizer
pool, the next job's prefill. The CPU kernels split each product in parts
over one thread per core (rust/kernels/spin_pool.rs); a part whose thread
the OS has not scheduled must not hold the step up.

One engine (the embedded model in the default 4-bit mode, batch 1, greedy,
a chat prompt) decodes --tokens tokens per round; rounds alternate quiet
and loaded (quiet, loaded, loaded, quiet, ...), loaded rounds beside
--hogs processes that spin on a core each (started before the round,
stopped after it). The figure is the median decode tok/s (after the first
token) of each side and their ratio: loaded / quiet.

    python bench/cpu_load.py --rounds 4 --hogs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.speculative import CHAT, decode_speed  # noqa: E402


def _spin() -> None:
    while True:
        pass


async def run(args) -> dict:
    from pyserve.chat_template import ChatTemplate
    from pyserve.engine.engine import Engine
    from pyserve.server_args import ServerArgs

    engine = Engine.from_args(ServerArgs(model_path=args.model, max_total_tokens=4096, disable_radix_cache=True))
    await engine.start()
    template = ChatTemplate.for_model(engine.model_dir)
    ids = engine.tokenizer.encode(template.render([{"role": "user", "content": CHAT}], add_generation_prompt=True))
    await decode_speed(engine, ids, 8, 0.0, 0)  # warm-up
    speeds = {"quiet": [], "loaded": []}
    for r in range(args.rounds):
        for side in (("quiet", "loaded") if r % 2 == 0 else ("loaded", "quiet")):
            hogs = []
            if side == "loaded":
                hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
                for hog in hogs:
                    hog.start()
                time.sleep(0.5)
            try:
                speed, tokens = await decode_speed(engine, ids, args.tokens, 0.0, 0)
            finally:
                for hog in hogs:
                    hog.terminate()
                    hog.join()
            speeds[side].append(speed)
            print(side, round(speed, 1), "tok/s", len(tokens), "tokens", flush=True)
    await engine.shutdown()
    quiet, loaded = statistics.median(speeds["quiet"]), statistics.median(speeds["loaded"])
    return {"cores": os.cpu_count(), "hogs": args.hogs, "quiet_tok_s": round(quiet, 1),
            "loaded_tok_s": round(loaded, 1), "loaded_over_quiet": round(loaded / quiet, 2),
            "rounds": {k: [round(v, 1) for v in vs] for k, vs in speeds.items()}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hogs", type=int, default=2, help="busy processes beside the loaded rounds")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
