"""Interactive latency while a large batch runs, against the same server idle.

Starts pyserve (embedded model unless --model), measures time to first
token of short streamed chat requests with the server idle, then submits a
large batch (the seeds' 5,000-line cancel scenario by default), measures
the same interactive requests while the batch runs, cancels the batch and
prints both and their ratio. Both phases run in this one script against
the same server, so the ratio holds on a noisy machine.

    python bench/batch_fairness.py --batch-lines 5000 --probes 8
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import ServerProcess  # noqa: E402  (the same launcher the tests use)


def ttft(client: openai.OpenAI, model: str) -> float:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say this is a test"}], max_tokens=8, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
            break
    for _ in stream:
        pass
    return first


def batch_file(lines: int) -> bytes:
    out = io.StringIO()
    for i in range(lines):
        out.write(json.dumps({
            "custom_id": f"request-{i}", "method": "POST", "url": "/chat/completions",
            "body": {"model": "m", "max_tokens": 128, "messages": [
                {"role": "system", "content": f"{i}: You are a helpful AI assistant"},
                {"role": "user", "content": "Write a detailed story about topic. Make it very long."}]},
        }) + "\n")
    return out.getvalue().encode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-lines", type=int, default=5000)
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--batch-concurrency", type=int, default=8)
    args = ap.parse_args()
    extra = ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory() as storage:
        server = ServerProcess("--file-storage-path", storage, "--batch-concurrency",
                               str(args.batch_concurrency), *extra)
        try:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", timeout=300)
            model = client.models.list().data[0].id
            ttft(client, model)  # warm-up
            idle = [ttft(client, model) for _ in range(args.probes)]
            file = client.files.create(file=("batch.jsonl", io.BytesIO(batch_file(args.batch_lines))),
                                       purpose="batch")
            batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            while client.batches.retrieve(batch.id).request_counts.completed < args.batch_concurrency:
                time.sleep(0.2)  # the batch is in full swing
            busy = [ttft(client, model) for _ in range(args.probes)]
            done = client.batches.retrieve(batch.id).request_counts.completed
            client.batches.cancel(batch.id)
        finally:
            server.stop()
    med_idle, med_busy = statistics.median(idle), statistics.median(busy)
    print(f"interactive TTFT, median of {args.probes} (ms): idle {med_idle * 1e3:.1f}, "
          f"during a {args.batch_lines}-line batch {med_busy * 1e3:.1f} "
          f"({done} batch requests done meanwhile, batch concurrency {args.batch_concurrency})")
    print(f"ratio busy/idle: {med_busy / med_idle:.2f}x")


if __name__ == "__main__":
    main()
