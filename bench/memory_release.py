"""What /release_memory_occupation gives a colocated trainer, and what
/resume_memory_occupation takes back: the server process's resident memory
(VmRSS) after a request, after each release, after each resume, as ratios
to the resident size before; and the time each call takes.

The embedded model in its CPU default (4-bit native layers), in process, a
greedy request before and after (the answers must match).

    python bench/memory_release.py [--max-total-tokens 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import httpx

from pyserve.asgi import create_app

PROMPT = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 16}}


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def call(http: httpx.AsyncClient, path: str, body: dict) -> dict | None:
    r = await http.post(path, json=body, timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"{path}: {r.status_code} {r.text}")
    return r.json() if r.content else None


async def run(max_total_tokens: int) -> None:
    app = create_app(file_storage_path=tempfile.mkdtemp(), max_total_tokens=max_total_tokens)
    await app.startup()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench")
    try:
        kv = app.http.ctx.engine.runner.rank_model.kv_buffer
        pool = sum(t.untyped_storage().nbytes() for t in kv.k_pages + kv.v_pages) / 2**20
        before = (await call(http, "/generate", PROMPT))["output_ids"]
        base = resident_mib()
        print(f"KV pool {pool:.0f} MiB; resident after a request {base:.0f} MiB")
        for tags in (["kv_cache"], ["weights"], None):
            for route in ("/release_memory_occupation", "/resume_memory_occupation"):
                started = time.perf_counter()
                await call(http, route, {"tags": tags})
                took = time.perf_counter() - started
                now = resident_mib()
                print(f"{route:28s} {str(tags or 'all'):14s} resident {now:7.0f} MiB ({now / base:.2f}x) "
                      f"in {took:.2f} s")
        after = (await call(http, "/generate", PROMPT))["output_ids"]
        print("answers match" if after == before else f"ANSWERS DIFFER: {before} vs {after}")
    finally:
        await http.aclose()
        await app.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-total-tokens", type=int, default=100_000)
    asyncio.run(run(parser.parse_args().max_total_tokens))


if __name__ == "__main__":
    main()
