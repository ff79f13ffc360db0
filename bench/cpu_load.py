"""Decode speed on a CPU busier than its cores, against the same machine quiet.

A server rarely has its cores to itself: other processes, a tokenizer
pool, the next job's prefill. The CPU kernels split each product in parts
over one thread per core (rust/kernels/spin_pool.rs); a part whose thread
the OS has not scheduled must not hold the step up.

One engine (the embedded model in the default 4-bit mode, batch 1, greedy,
a chat prompt) decodes --tokens tokens per round; rounds alternate quiet
and loaded (quiet, loaded, loaded, quiet, ...). Loaded rounds run beside
--others processes, each (--load engine) another engine decoding the same
model without end, as a second server or a tensor-parallel rank on the
same cores would, or (--load spin) a loop spinning on a core. They start
once, are stopped (SIGSTOP) through the quiet rounds and go on (SIGCONT)
through the loaded ones. The figure is the median decode tok/s (after the
first token) of each side and their ratio: loaded / quiet.

    python bench/cpu_load.py --rounds 3 --load engine --others 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.speculative import CHAT, decode_speed  # noqa: E402


def _spin() -> None:
    while True:
        pass


def _decode_forever(model: str | None) -> None:
    async def main():
        from pyserve.engine.engine import Engine
        from pyserve.server_args import ServerArgs

        engine = Engine.from_args(ServerArgs(model_path=model, max_total_tokens=4096, disable_radix_cache=True))
        await engine.start()
        ids = engine.tokenizer.encode(CHAT)
        while True:
            await decode_speed(engine, ids, 64, 0.7, 0)

    asyncio.run(main())


def _others(args) -> list[multiprocessing.Process]:
    """The loaded rounds' processes, started and stopped."""
    target, targs = (_decode_forever, (args.model,)) if args.load == "engine" else (_spin, ())
    # Spawned, not forked: a fork would inherit this process's kernel thread pool without its threads.
    spawn = multiprocessing.get_context("spawn")
    others = [spawn.Process(target=target, args=targs, daemon=True) for _ in range(args.others)]
    for other in others:
        other.start()
    time.sleep(args.warmup)  # an engine's start (model load, first steps)
    for other in others:
        os.kill(other.pid, signal.SIGSTOP)
    return others


async def run(args) -> dict:
    from pyserve.chat_template import ChatTemplate
    from pyserve.engine.engine import Engine
    from pyserve.server_args import ServerArgs

    engine = Engine.from_args(ServerArgs(model_path=args.model, max_total_tokens=4096, disable_radix_cache=True))
    await engine.start()
    template = ChatTemplate.for_model(engine.model_dir)
    ids = engine.tokenizer.encode(template.render([{"role": "user", "content": CHAT}], add_generation_prompt=True))
    await decode_speed(engine, ids, 8, 0.0, 0)  # warm-up
    others = _others(args)
    speeds = {"quiet": [], "loaded": []}
    try:
        for r in range(args.rounds):
            for side in (("quiet", "loaded") if r % 2 == 0 else ("loaded", "quiet")):
                signal_others = signal.SIGCONT if side == "loaded" else None
                for other in others if signal_others else []:
                    os.kill(other.pid, signal_others)
                if signal_others:
                    time.sleep(0.5)
                speed, tokens = await decode_speed(engine, ids, args.tokens, 0.0, 0)
                for other in others if signal_others else []:
                    os.kill(other.pid, signal.SIGSTOP)
                speeds[side].append(speed)
                print(side, round(speed, 1), "tok/s", len(tokens), "tokens", flush=True)
    finally:
        for other in others:
            other.kill()
            other.join()
        await engine.shutdown()
    quiet, loaded = statistics.median(speeds["quiet"]), statistics.median(speeds["loaded"])
    return {"cores": os.cpu_count(), "load": args.load, "others": args.others, "quiet_tok_s": round(quiet, 1),
            "loaded_tok_s": round(loaded, 1), "loaded_over_quiet": round(loaded / quiet, 2),
            "rounds": {k: [round(v, 1) for v in vs] for k, vs in speeds.items()}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--load", choices=["engine", "spin"], default="engine", help="what the other processes run")
    p.add_argument("--others", type=int, default=1, help="processes beside the loaded rounds")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds the other processes get to start")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
