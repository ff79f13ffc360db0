"""What one long request keeps in the KV cache on Gemma 3's layouts, with the
sliding layers' pages given back as their window moves on.

No model runs: the engine's own scheduler and KV manager drive one request
(a 32,768-token prompt, chunked, then decode steps) over both pools, and
the KV manager's figures after each step give the largest footprint of
the prefill and of the decode. Bytes per token are KVBuffer's, bf16.

    python bench/sliding_memory.py [--tokens 32768] [--chunk 2048 8192] [--page-size 16]
"""

from __future__ import annotations

import argparse

import torch

from pyserve.engine.kv.manager import KVManager
from pyserve.engine.kv.window_pages import WindowPageAllocator
from pyserve.engine.request import SamplingParams
from pyserve.engine.scheduler import Scheduler
from pyserve.engine.sequence import Sequence
from pyserve.model.kv_buffer import KVBuffer

# name: (layers, global layers, kv heads, head dim, window)
LAYOUTS = {
    "Gemma 3 1B": (26, 4, 1, 256, 512),
    "Gemma 3 4B": (34, 5, 4, 256, 1024),
    "Gemma 3 12B": (48, 8, 8, 256, 1024),
    "Gemma 3 27B": (62, 10, 16, 128, 1024),
}
DECODE_STEPS = 64


def peak_tokens(tokens: int, chunk: int, page_size: int, window: int) -> tuple[int, int, int]:
    """(full pool tokens held at the end, most sliding tokens held during
    the prefill, most during the decode), as the allocators count them
    right after each step is scheduled (its new tokens' pages included).
    The prefix cache is off so that every page in use is the request's."""
    pages = -(-(tokens + DECODE_STEPS) // page_size) + 2
    kv = KVManager(WindowPageAllocator(pages, pages, page_size, window), use_radix_cache=False)
    sched = Scheduler(kv, max_running=1, max_prefill_tokens=chunk, chunk_size=chunk)
    seq = Sequence(rid="long", prompt_ids=[3 + i % 1000 for i in range(tokens)],
                   params=SamplingParams(max_new_tokens=DECODE_STEPS))
    sched.add(seq)
    prefill = decode = 0
    while sched.requests:
        step = sched.schedule()
        usage = kv.usage(sched.holders())
        held = usage["window_total"] - usage["window_free"]
        if step.is_prefill:
            prefill = max(prefill, held)
        else:
            decode = max(decode, held)
        full = usage["total"] - usage["free"]
        for s in step.sampled:
            s.output_ids.append(5)
            if len(s.output_ids) >= DECODE_STEPS:
                sched.remove(s)
    return full, prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    gib = float(1 << 30)
    print(f"one request of {args.tokens} prompt tokens, pages of {args.page_size}, bf16")
    print("| model | one pool | chunk | held while prefilling | held while decoding |")
    print("|---|---|---|---|---|")
    for name, (layers, global_layers, heads, head_dim, window) in LAYOUTS.items():
        per_layer = KVBuffer.bytes_per_token(1, heads, head_dim, torch.bfloat16)
        one_pool = (args.tokens + DECODE_STEPS) * layers * per_layer
        for chunk in args.chunk:
            full, prefill, decode = peak_tokens(args.tokens, chunk, args.page_size, window)
            sliding = layers - global_layers
            held = [(full * global_layers + s * sliding) * per_layer for s in (prefill, decode)]
            print(f"| {name} (window {window}) | {one_pool / gib:.2f} GiB | {chunk} | "
                  f"{held[0] / gib:.2f} GiB ({100 * held[0] / one_pool:.1f}%, {prefill} sliding tokens) | "
                  f"{held[1] / gib:.2f} GiB ({100 * held[1] / one_pool:.1f}%, {decode} sliding tokens) |")


if __name__ == "__main__":
    main()
