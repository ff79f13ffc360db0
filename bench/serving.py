"""Online serving benchmark against any OpenAI-compatible server.

Shaped like `python -m sglang.bench_serving`: streams requests to
/v1/completions or /v1/chat/completions at a chosen rate and concurrency,
then reports throughput and TTFT / TPOT / ITL / end-to-end latency. Token
counts come from the server's `usage`, so prompts are plain random words
and no tokenizer is needed on the client side.

    pyserve --port 30000 &
    python bench/serving.py --base-url http://127.0.0.1:30000 --num-prompts 16 \\
        --random-input-len 128 --random-output-len 32 --max-concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
from tqdm import tqdm

# Common English words: with a leading space each is one token in the usual
# BPE vocabularies, so N words make a prompt of about N tokens. The exact
# count is whatever the server reports in usage.prompt_tokens.
WORDS = """
the of and to in is was for on that with as by at from his her they this have
had are not but one all were which when there been their can would who more
will other time into some could what about then them these two may first only
new like over such after also most made many before must through back years
where much your way well down should because each just those people how too
little state good very make world still own see men work long here get both
between life being under never day same another know while last might great
old year off come since against go came right used take three house city open
water small light stone river music green paper table horse bread night garden
""".split()


@dataclass
class Request:
    prompt: str | list[dict]  # text for completions, messages for chat
    output_len: int


@dataclass
class RequestResult:
    index: int
    max_tokens: int
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first content chunk
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    start: float = 0.0  # seconds after the benchmark began

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# --- datasets -----------------------------------------------------------------


def random_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def sample_len(rng: random.Random, length: int, ratio: float) -> int:
    """Uniform in [length * ratio, length], as bench_serving samples lengths."""
    return rng.randint(max(1, int(length * ratio)), max(1, length))


def as_prompt(backend: str, system: str | None, text: str) -> str | list[dict]:
    if backend == "chat":
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": "user", "content": text}]
    return f"{system}\n\n{text}" if system else text


def random_dataset(args, rng: random.Random) -> list[Request]:
    requests = []
    for _ in range(args.num_prompts):
        text = random_text(rng, sample_len(rng, args.random_input_len, args.random_range_ratio))
        output_len = sample_len(rng, args.random_output_len, args.random_range_ratio)
        requests.append(Request(as_prompt(args.backend, None, text), output_len))
    return requests


def shared_prefix_dataset(args, rng: random.Random) -> list[Request]:
    """num_groups x prompts_per_group requests; the requests of a group share
    one long system prompt, so a prefix cache can reuse its KV. Shuffled so
    that groups interleave instead of arriving one after another."""
    requests = []
    for _ in range(args.gsp_num_groups):
        system = random_text(rng, args.gsp_system_prompt_len)
        for _ in range(args.gsp_prompts_per_group):
            question = random_text(rng, args.gsp_question_len)
            requests.append(Request(as_prompt(args.backend, system, question), args.gsp_output_len))
    rng.shuffle(requests)
    return requests


def build_dataset(args) -> list[Request]:
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        return random_dataset(args, rng)
    return shared_prefix_dataset(args, rng)


# --- one streamed request -----------------------------------------------------


def request_body(args, model: str, req: Request) -> tuple[str, dict]:
    body = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,  # every request generates exactly max_tokens
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.backend == "chat":
        return "/v1/chat/completions", body | {"messages": req.prompt}
    return "/v1/completions", body | {"prompt": req.prompt}


def chunk_text(chunk: dict) -> str:
    choice = (chunk.get("choices") or [{}])[0]
    if "delta" in choice:  # chat; reasoning text is generated output too
        delta = choice["delta"]
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send(client: httpx.AsyncClient, args, model: str, req: Request, index: int,
               t0: float) -> RequestResult:
    path, body = request_body(args, model, req)
    result = RequestResult(index=index, max_tokens=req.output_len)
    start = time.perf_counter()
    result.start = start - t0
    last = start
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                return result
            usage = None
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                now = time.perf_counter()
                if chunk_text(chunk):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                usage = chunk.get("usage") or usage
            result.e2e = time.perf_counter() - start
    except Exception as e:  # any failure is one failed request, not the end of the run
        result.error = f"{type(e).__name__}: {e}"
        return result
    if usage is None:
        if not getattr(args, "chunks_as_tokens", False):
            result.error = "stream ended without usage (stream_options.include_usage unsupported?)"
            return result
        # Servers that stream one token per chunk and send no usage (llama.cpp's).
        usage = {"completion_tokens": len(result.itl) + (result.ttft > 0)}
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    result.output_tokens = usage.get("completion_tokens", 0)
    result.success = True
    return result


# --- load generation ----------------------------------------------------------


async def arrivals(requests: list[Request], rate: float, rng: random.Random):
    """Yield requests with exponential gaps (a Poisson process of `rate`
    requests/s); with an infinite rate, all at once."""
    for i, req in enumerate(requests):
        yield i, req
        if rate != float("inf") and i < len(requests) - 1:
            await asyncio.sleep(rng.expovariate(rate))


def percentiles(values: list[float]) -> dict:
    """mean/median/p90/p99/std in milliseconds; zeros when there are none."""
    ms = np.array(values, dtype=float) * 1000
    if ms.size == 0:
        return {k: 0.0 for k in ("mean", "median", "std", "p90", "p99")}
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std()),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def summarize(args, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "backend": args.backend,
        "base_url": args.base_url,
        "model": model,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        # mean number of requests in flight, as bench_serving reports it
        "concurrency": sum(r.e2e for r in ok) / duration,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl]),
        "e2e_latency_ms": percentiles([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.success}),
    }


async def first_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def benchmark(args) -> dict:
    """Run the whole benchmark; returns the metrics plus per-request records
    under "requests". Failed requests are counted in the report, not raised."""
    requests = build_dataset(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # no timeouts but connect: long generations are the point; trust_env off
    # so proxy variables cannot divert the traffic; no connection cap so the
    # pool never queues requests the semaphore already let through
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, trust_env=False,
                                 timeout=httpx.Timeout(None, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = args.model or await first_model(client)
        # the first requests of a fresh server pay one-off costs; keep them out.
        # A prompt of its own, so that no measured request hits a cached prefix.
        warmup = Request(as_prompt(args.backend, None, random_text(random.Random(-1), 16)), 16)
        for _ in range(args.warmup_requests):
            warm = await send(client, args, model, warmup, -1, time.perf_counter())
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")

        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
        if args.profile:  # as SGLang's bench_serving --profile: the server traces the measured requests
            (await client.post("/start_profile", json={})).raise_for_status()
        bar = tqdm(total=len(requests), disable=args.disable_tqdm)
        t0 = time.perf_counter()

        async def one(i: int, req: Request) -> RequestResult:
            async with limit:
                result = await send(client, args, model, req, i, t0)
            bar.update(1)
            return result

        tasks = [asyncio.create_task(one(i, req))
                 async for i, req in arrivals(requests, args.request_rate, random.Random(args.seed))]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        if args.profile:
            stopped = await client.post("/stop_profile")
            stopped.raise_for_status()
            print(stopped.text.strip())

    report = summarize(args, model, results, duration)
    report["requests"] = [asdict(r) | {"tpot": r.tpot} for r in results]
    return report


# --- output -------------------------------------------------------------------


def row(label: str, value) -> str:
    """One line of a report: label, then the value (floats to 2 decimals)."""
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40}{value}"


def format_report(m: dict) -> str:
    def section(title: str, key: str, name: str) -> list[str]:
        stats = {"mean": "Mean", "median": "Median", "p90": "P90", "p99": "P99"}
        return [f"{title:-^50}"] + [row(f"{label} {name} (ms):", m[key][s]) for s, label in stats.items()]

    lines = [
        f"{' Serving Benchmark Result ':=^50}",
        row("Backend:", m["backend"]),
        row("Traffic request rate:", m["request_rate"]),
        row("Max request concurrency:", m["max_concurrency"] or "not set"),
        row("Successful requests:", m["completed"]),
        row("Failed requests:", m["failed"]),
        row("Benchmark duration (s):", m["duration"]),
        row("Total input tokens:", m["total_input_tokens"]),
        row("Total generated tokens:", m["total_output_tokens"]),
        row("Request throughput (req/s):", m["request_throughput"]),
        row("Input token throughput (tok/s):", m["input_throughput"]),
        row("Output token throughput (tok/s):", m["output_throughput"]),
        row("Total token throughput (tok/s):", m["total_throughput"]),
        row("Concurrency:", m["concurrency"]),
        *section("End-to-End Latency", "e2e_latency_ms", "E2E Latency"),
        *section("Time to First Token", "ttft_ms", "TTFT"),
        *section("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
        *section("Inter-Token Latency", "itl_ms", "ITL"),
        "=" * 50,
    ]
    lines += [f"error: {e}" for e in m["errors"]]
    return "\n".join(lines)


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """The options that pick the prompts; bench/baseline_hf.py and
    bench/compare.py take the same ones, so one seed gives one dataset."""
    p.add_argument("--dataset-name", choices=("random", "shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests of the random dataset")
    p.add_argument("--random-input-len", type=int, default=1024, help="words per prompt, at most")
    p.add_argument("--random-output-len", type=int, default=1024, help="max_tokens, at most")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len * ratio, len]")
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="words of the shared prefix")
    p.add_argument("--gsp-question-len", type=int, default=128, help="words of each question")
    p.add_argument("--gsp-output-len", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--seed", type=int, default=1, help="seeds the prompts, lengths and arrival times")


def add_load_args(p: argparse.ArgumentParser) -> None:
    """How the requests are sent (shared with bench/compare.py)."""
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--warmup-requests", type=int, default=1, help="short requests sent first, not counted")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="have the server trace the measured requests (POST /start_profile, /stop_profile)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root, without /v1")
    p.add_argument("--backend", choices=("completions", "chat"), default="completions",
                   help="completions: POST /v1/completions; chat: POST /v1/chat/completions")
    p.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a bearer token (default: $OPENAI_API_KEY)")
    add_dataset_args(p)
    add_load_args(p)
    p.add_argument("--output-json", help="write metrics and per-request records here")
    return p.parse_args(argv)


def save_json(report: dict, path: str | None) -> None:
    """Write the report to --output-json, when one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = asyncio.run(benchmark(args))
    print(format_report(report))
    save_json(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
