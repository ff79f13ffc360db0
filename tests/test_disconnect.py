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


def test_disconnect_mid_stream_frees_the_request(server):
    body = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 5:
                    break
        # the stream is closed here, long before 2000 tokens
        busy = http.get("/get_server_info").json()
        wait_idle(http)
    assert busy["num_running_reqs"] <= 1


def test_disconnect_during_non_streamed_request(server):
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        try:
            httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=1.5)
        except httpx.TimeoutException:
            pass  # the client gives up and closes the connection
        wait_idle(http)
