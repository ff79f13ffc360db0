"""/metrics under the names SGLang's and vLLM's dashboards query
(--metrics-names), through the app in process, and aborted requests leave
no running or waiting count behind (vLLM's test_abort_metrics_reset), on
the shared real server, whose clients close their sockets."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from pyserve.asgi import create_app
from pyserve.engine.metrics import EngineMetrics
from tests.test_api_handlers import call
from tests.test_disconnect import wait_idle
from tests.test_tokenize_api import tiny_server_http

SERIES = re.compile(r"^([a-z_]+:[a-z_]+)(\{[^}]*\})? (\S+)$")


def scrape(http) -> dict[str, float]:
    """series name with its labels -> value."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if m := SERIES.match(line):
            out[m[1] + (m[2] or "")] = float(m[3])
    return out


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory):
    with tiny_server_http(tiny_llama_dir, tmp_path_factory.mktemp("metrics"), context_length=4096,
                          max_total_tokens=16384, served_model_name="tiny") as c:
        yield c


def test_every_family_by_default_with_the_same_values(http):
    r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    s = scrape(http)
    label = '{model_name="tiny"}'
    assert s["pyserve:generation_tokens_total"] == s[f"sglang:generation_tokens_total{label}"] \
        == s[f"vllm:generation_tokens_total{label}"] >= 3
    assert s["pyserve:prompt_tokens_total"] == s[f"vllm:prompt_tokens_total{label}"] \
        == s[f"vllm:prefix_cache_queries_total{label}"] > 0
    assert s["pyserve:cached_tokens_total"] == s[f"vllm:prefix_cache_hits_total{label}"]
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"vllm:{name}{label}" in s
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate"):
        assert f"sglang:{name}{label}" in s and f"pyserve:{name}" in s
    assert s['vllm:request_success_total{model_name="tiny",finished_reason="length"}'] >= 1
    assert s['sglang:num_requests_total{model_name="tiny",finish_reason="length"}'] >= 1
    assert s['vllm:time_to_first_token_seconds_bucket{model_name="tiny",le="+Inf"}'] \
        == s["pyserve:time_to_first_token_seconds_count"] >= 1
    # Every forward step: at least one per generated token of the requests above, each of >= 1 token.
    steps = s['vllm:iteration_tokens_total_count{model_name="tiny"}']
    assert steps == s["pyserve:iteration_tokens_total_count"] and steps >= 3
    assert s['vllm:iteration_tokens_total_sum{model_name="tiny"}'] >= steps


def test_aborted_requests_leave_no_running_or_waiting_count(server):
    # The shared server on the embedded model, which decodes slowly enough
    # on a CPU that the streams are still running when they are cut (the
    # tiny model would finish 4,000 tokens first on an idle machine).
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        wait_idle(http)  # nothing of an earlier test's still counted
        model = http.get("/v1/models").json()["data"][0]["id"]
        _abort_streams(server, http, f'{{model_name="{model}"}}')


def _abort_streams(metrics_server, http, label: str):
    body = {"prompt": "Count on and on:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    clients = [httpx.Client(base_url=metrics_server.base_url, timeout=60) for _ in range(4)]
    streams = [c.stream("POST", "/v1/completions", json=body) for c in clients]
    # Each line iterator is kept: dropping one closes its connection.
    lines = [s.__enter__().iter_lines() for s in streams]
    for it in lines:
        next(it)  # started
    started = scrape(http)
    in_engine = started[f"vllm:num_requests_running{label}"] + started[f"vllm:num_requests_waiting{label}"]
    for s, c in zip(streams, clients):
        s.__exit__(None, None, None)
        c.close()
    assert in_engine == len(streams)
    deadline = time.time() + 30
    while time.time() < deadline:
        s = scrape(http)
        if s[f"vllm:num_requests_running{label}"] == s[f"vllm:num_requests_waiting{label}"] == 0:
            break
        time.sleep(0.2)
    assert s[f"vllm:num_requests_running{label}"] == 0 and s[f"vllm:num_requests_waiting{label}"] == 0
    assert s["pyserve:num_running_reqs"] == s["pyserve:num_queue_reqs"] == 0
    assert s[f"vllm:kv_cache_usage_perc{label}"] == 0


def test_one_family_alone(tiny_llama_dir, tmp_path):
    async def scraped() -> str:
        app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path), max_total_tokens=4096,
                         metrics_names="vllm")
        await app.startup()
        try:
            return (await call(app, "GET", "/metrics"))[2].decode()
        finally:
            await app.shutdown()

    text = asyncio.run(scraped())
    names = {m[1].split(":")[0] for line in text.splitlines() if (m := SERIES.match(line))}
    assert names == {"vllm"}


def test_a_bad_family_is_refused_at_start_up():
    from pyserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="--metrics-names"):
        ServerArgs(metrics_names="pyserve,prometheus").validate()


def test_each_family_renders_every_histogram_bucket():
    m = EngineMetrics()
    m.on_first_token(0.03)
    m.on_finish("stop", 5, 0, 4, 0.2, 0.03)
    text = m.render({}, ("sglang", "vllm"), "x")
    for family in ("sglang", "vllm"):
        assert f'{family}:e2e_request_latency_seconds_bucket{{model_name="x",le="0.25"}} 1' in text
        assert f'{family}:e2e_request_latency_seconds_count{{model_name="x"}} 1' in text
