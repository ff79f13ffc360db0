"""Connection load: N concurrent streams and M idle sockets against a server.

Every stream is a streaming chat request on a connection of its own, all
sent at once. Each ends as one of:

- completed: a 200 whose SSE stream ended with `data: [DONE]`;
- dropped: the connection failed or was closed before any HTTP response
  (refused, reset, or closed with nothing sent back);
- error: an HTTP error status, an error event, or a stream cut short.

Idle sockets open first and send the start of a request whose headers never
end (a slowloris client); the report says how many the server closed and
after how long. While the load runs, a probe asks `/health` and a one-token
chat request every half second and reports their worst latency: whether
the idle sockets and the streams starve other clients.

    pyserve --port 30000 &
    python bench/load.py --base-url http://127.0.0.1:30000 --streams 1000 --server-pid $!

`--launch` starts `python -m pyserve` itself (options after `--`), and
`--compare-granian-defaults` runs the same load a second time against a
server with Granian's own limits (backlog and connection cap 128), the
baseline of the report's ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.serving import percentiles  # noqa: E402


@dataclass
class StreamResult:
    outcome: str = "error"  # completed, dropped or error
    detail: str = ""
    ttft: float | None = None  # seconds from send to the first content chunk


@dataclass
class LoadReport:
    streams: int
    idle_sockets: int
    completed: int = 0
    dropped: int = 0
    errors: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # detail -> count
    ttft_ms: dict = field(default_factory=dict)
    duration_s: float = 0.0
    idle_closed: int = 0
    idle_closed_after_s: dict = field(default_factory=dict)
    probe_worst_ms: dict = field(default_factory=dict)  # health, chat
    rss_mib_before: float | None = None
    rss_mib_after: float | None = None


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def chat_body(model: str, max_tokens: int, i: int) -> dict:
    return {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Request {i}: name a colour."}]}


async def one_stream(client: httpx.AsyncClient, body: dict) -> StreamResult:
    result = StreamResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                result.detail = f"HTTP {resp.status_code}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    result.outcome = "completed"
                    return result
                chunk = json.loads(data)
                if "error" in chunk:
                    result.detail = "error event"
                    return result
                if result.ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    result.ttft = time.perf_counter() - start
            result.detail = "stream ended without [DONE]"
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as e:
        # No response at all: the server refused, reset or closed the connection.
        result.outcome, result.detail = "dropped", type(e).__name__
    except httpx.ReadError as e:
        result.outcome, result.detail = "dropped", f"ReadError {e}"[:60]
    except httpx.TimeoutException as e:
        result.detail = type(e).__name__
    return result


async def idle_socket(host: str, port: int, opened: asyncio.Event, closed_after: list[float]) -> None:
    """Open a connection, send half a request head, wait for the server to close it."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: load\r\nX-Slow: ")
    await writer.drain()
    start = time.perf_counter()
    opened.set()
    try:
        await reader.read()  # b"" (or a 408 and then b"") once the server closes it
        closed_after.append(time.perf_counter() - start)
    except (ConnectionError, OSError):
        closed_after.append(time.perf_counter() - start)
    finally:
        writer.close()


def probe(base_url: str, headers: dict, model: str, stop, worst) -> None:
    """In a process of its own, so that the load's client work cannot delay
    it: /health and a one-token chat request, each on a fresh connection,
    each as soon as its previous answer came (at most twice a second)."""
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}

    async def keep_asking(name: str, method: str, path: str, payload) -> None:
        async with httpx.AsyncClient(base_url=base_url, headers=headers, trust_env=False, timeout=600,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    ok = (await client.request(method, path, json=payload)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                took = (time.perf_counter() - start) * 1000
                worst[name] = max(worst.get(name, 0.0), took)
                if not ok:
                    worst[f"{name}_failed"] = worst.get(f"{name}_failed", 0) + 1
                await asyncio.sleep(max(0.0, 0.5 - took / 1000))

    async def both() -> None:
        await asyncio.gather(keep_asking("health", "GET", "/health", None),
                             keep_asking("chat", "POST", "/v1/chat/completions", body))

    asyncio.run(both())


async def run_load(base_url: str, streams: int, idle_sockets: int, max_tokens: int = 4,
                   api_key: str | None = None, server_pid: int | None = None,
                   timeout: float = 600.0, idle_wait: float = 30.0) -> LoadReport:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, trust_env=False, timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    report = LoadReport(streams=streams, idle_sockets=idle_sockets, rss_mib_before=rss_mib(server_pid))
    url = urlsplit(base_url)
    closed_after: list[float] = []
    idle = []
    for _ in range(idle_sockets):
        opened = asyncio.Event()
        idle.append(asyncio.create_task(idle_socket(url.hostname, url.port, opened, closed_after)))
        await opened.wait()
    manager = multiprocessing.Manager()
    stop, worst = manager.Event(), manager.dict()
    prober = multiprocessing.Process(target=probe, args=(base_url, headers, model, stop, worst))
    prober.start()
    start = time.perf_counter()
    # One client, no connection reuse: every stream opens a connection of its
    # own, as 1,000 separate users do.
    async with httpx.AsyncClient(base_url=base_url, headers=headers, trust_env=False,
                                 timeout=httpx.Timeout(timeout),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=0)) as client:
        results = await asyncio.gather(*(one_stream(client, chat_body(model, max_tokens, i))
                                         for i in range(streams)))
    report.duration_s = round(time.perf_counter() - start, 2)
    # The probe goes on while the server has idle sockets to close.
    if idle:
        await asyncio.wait(idle, timeout=idle_wait)
    stop.set()
    await asyncio.to_thread(prober.join)
    worst = dict(worst)
    manager.shutdown()
    outcomes = [r.outcome for r in results]
    report.completed, report.dropped = outcomes.count("completed"), outcomes.count("dropped")
    report.errors = outcomes.count("error")
    for r in results:
        if r.outcome != "completed":
            report.failures[r.detail] = report.failures.get(r.detail, 0) + 1
    report.ttft_ms = percentiles([r.ttft for r in results if r.ttft is not None])
    report.probe_worst_ms = {k: round(v, 1) for k, v in worst.items()}
    report.rss_mib_after = rss_mib(server_pid)
    # Those the server has not closed within `idle_wait` s are closed by us.
    for task in idle:
        task.cancel()
    await asyncio.gather(*idle, return_exceptions=True)
    report.idle_closed = len(closed_after)
    if closed_after:
        report.idle_closed_after_s = {k: round(v / 1000, 1) for k, v in percentiles(closed_after).items()}
    return report


class LaunchedServer:
    """`python -m pyserve` on a free port, stopped on exit."""

    def __init__(self, extra: list[str]):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"pyserve-load-{self.port}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "pyserve", "--port", str(self.port), *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pyserve exited early, see {self.log.name}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("pyserve did not start")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def format_report(title: str, r: LoadReport) -> str:
    lines = [f"== {title}: {r.streams} streams, {r.idle_sockets} idle sockets ==",
             f"completed {r.completed}  dropped {r.dropped}  errors {r.errors}  in {r.duration_s} s"]
    if r.failures:
        lines.append(f"failures: {r.failures}")
    if r.ttft_ms:
        lines.append(f"TTFT ms: p50 {r.ttft_ms['median']:.0f}  p99 {r.ttft_ms['p99']:.0f}")
    lines.append(f"probe worst ms: {r.probe_worst_ms}")
    if r.idle_sockets:
        lines.append(f"idle sockets closed by the server: {r.idle_closed} after {r.idle_closed_after_s} s")
    if r.rss_mib_before is not None:
        lines.append(f"server RSS MiB: {r.rss_mib_before:.0f} before, {r.rss_mib_after:.0f} after")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="a running server (or --launch)")
    p.add_argument("--server-pid", type=int, help="the server's pid, for its RSS")
    p.add_argument("--launch", action="store_true", help="start python -m pyserve (options after --)")
    p.add_argument("--compare-granian-defaults", action="store_true",
                   help="with --launch: run again on a server with --backlog 128 --max-connections 128")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--idle-sockets", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--api-key")
    p.add_argument("--output-json")
    p.add_argument("server_args", nargs="*", help="pyserve options for --launch (after --)")
    args = p.parse_args(argv)
    if not args.launch and not args.base_url:
        p.error("give --base-url or --launch")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    runs: list[tuple[str, list[str]]] = [("pyserve defaults", [])]
    if args.compare_granian_defaults:
        runs.append(("Granian's limits (backlog 128, connection cap 128)",
                     ["--backlog", "128", "--max-connections", "128"]))
    reports = {}
    for title, extra in runs:
        if args.launch:
            with LaunchedServer([*args.server_args, *extra]) as srv:
                report = asyncio.run(run_load(srv.base_url, args.streams, args.idle_sockets, args.max_tokens,
                                              args.api_key, srv.proc.pid))
        else:
            report = asyncio.run(run_load(args.base_url, args.streams, args.idle_sockets, args.max_tokens,
                                          args.api_key, args.server_pid))
        print(format_report(title, report), flush=True)
        reports[title] = report.__dict__
    if len(reports) == 2:
        new, old = reports.values()
        print(f"completed: {new['completed']} vs {old['completed']} with Granian's limits")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(reports, indent=2))
    return reports


if __name__ == "__main__":
    main()
