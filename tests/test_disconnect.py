"""A client that goes away frees everything its request held."""

from __future__ import annotations

import time

import httpx


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> dict:
    deadline = time.time() + timeout
    while True:
        info = http.get("/get_server_info").json()
        if info["num_running_reqs"] == 0 and info["kv_tokens_in_use"] == 0:
            return info
        if time.time() > deadline:
            raise AssertionError(f"engine not idle after the client left: {info}")
        time.sleep(0.2)


def generated_tokens(http: httpx.Client) -> float:
    """The tokens finished requests generated, aborted ones included (/metrics)."""
    lines = http.get("/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("pyserve:generation_tokens_total"))


def leave_mid_stream(http: httpx.Client, path: str, body: dict, marker: str, count: int) -> float:
    """Stream `body` to `path` over a real socket and close it after `count`
    lines starting with `marker`; once the engine is idle, the tokens the
    request generated, which stop short of its end only if leaving aborted it."""
    before = generated_tokens(http)
    with http.stream("POST", path, json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith(marker)
            if seen >= count:
                break
    assert seen == count
    wait_idle(http)
    return generated_tokens(http) - before


def test_disconnect_mid_stream_frees_the_request(server):
    body = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        generated = leave_mid_stream(http, "/v1/chat/completions", body, "data: ", 5)
    assert 4 <= generated < 500  # stopped long before its 2000 tokens


def test_disconnect_during_non_streamed_request(server):
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        try:
            httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=1.5)
        except httpx.TimeoutException:
            pass  # the client gives up and closes the connection
        wait_idle(http)
