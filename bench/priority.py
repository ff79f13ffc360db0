"""A high-priority request's time to first token under low-priority load,
against the same server idle.

Starts pyserve with --enable-priority-scheduling (embedded model unless
--model) and a small running cap, measures the time to first token of
short streamed chat requests of priority 10 with the server idle, then
keeps `--load` clients sending long low-priority (0) requests, so that the
running batch is full and the queue holds as many again, and measures the
same high-priority requests under that load, and requests of the load's
own priority beside them (what first-come first-served would give). Every
phase runs in this one script against the same server, so the ratios hold
on a noisy machine.

    python bench/priority.py --max-running-requests 4 --load 8 --probes 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import ServerProcess  # noqa: E402  (the same launcher the tests use)

HIGH, LOW = 10, 0


def ttft(client: openai.OpenAI, model: str, priority: int) -> float:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say this is a test"}], max_tokens=8, stream=True,
        extra_body={"priority": priority})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first


def keep_loading(client: openai.OpenAI, model: str, max_tokens: int, stop: threading.Event,
                 done: list[int]) -> None:
    """One client of the load: long low-priority requests, one after another."""
    while not stop.is_set():
        client.chat.completions.create(
            model=model, max_tokens=max_tokens,
            messages=[{"role": "user", "content": "Write a detailed story about a lighthouse. Make it very long."}],
            extra_body={"priority": LOW, "ignore_eos": True})
        done.append(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-running-requests", type=int, default=4)
    ap.add_argument("--load", type=int, default=8, help="low-priority clients sending requests back to back")
    ap.add_argument("--load-max-tokens", type=int, default=256)
    ap.add_argument("--probes", type=int, default=8)
    args = ap.parse_args()
    extra = ["--model", args.model] if args.model else []
    server = ServerProcess("--enable-priority-scheduling", "--max-running-requests",
                           str(args.max_running_requests), *extra)
    stop, done = threading.Event(), []
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", timeout=600)
        model = client.models.list().data[0].id
        ttft(client, model, HIGH)  # warm-up
        idle = [ttft(client, model, HIGH) for _ in range(args.probes)]
        load = [threading.Thread(target=keep_loading, args=(client, model, args.load_max_tokens, stop, done),
                                 daemon=True) for _ in range(args.load)]
        for thread in load:
            thread.start()
        time.sleep(2.0)  # the running batch is full and the queue holds the rest
        busy_high, busy_low = [], []
        for _ in range(args.probes):
            busy_high.append(ttft(client, model, HIGH))
            busy_low.append(ttft(client, model, LOW))
        stop.set()
    finally:
        server.stop()
    med_idle, med_high, med_low = (statistics.median(x) for x in (idle, busy_high, busy_low))
    print(f"TTFT, median of {args.probes} (ms): priority {HIGH} idle {med_idle * 1e3:.1f}, "
          f"priority {HIGH} under load {med_high * 1e3:.1f}, priority {LOW} under load {med_low * 1e3:.1f} "
          f"({args.load} low-priority clients of {args.load_max_tokens} tokens, --max-running-requests "
          f"{args.max_running_requests}; {len(done)} load requests done meanwhile)")
    print(f"ratio high under load / idle: {med_high / med_idle:.2f}x; low under load / idle: "
          f"{med_low / med_idle:.2f}x")


if __name__ == "__main__":
    main()
