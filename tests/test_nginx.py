"""pyserve behind a real nginx with the shipped examples/nginx/pyserve.conf,
under the path /llm/: streams arrive event by event, a large upload
passes, the access log names the real client, and a client that leaves
at the proxy aborts its request in pyserve."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, free_port
from tests.slow import slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nginx" / "pyserve.conf"

pytestmark = [*slow, pytest.mark.skipif(shutil.which("nginx") is None,
                                        reason="nginx is not installed (.ci/run installs it with apt-get)")]


@pytest.fixture(scope="module")
def pyserve_behind(tmp_path_factory):
    storage = tmp_path_factory.mktemp("storage")
    srv = ServerProcess("--forwarded-allow-ips", "127.0.0.1", "--file-storage-path", str(storage))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def proxy(pyserve_behind, tmp_path_factory):
    """nginx running the example, pointed at the test's pyserve: the base URL of /llm."""
    root = tmp_path_factory.mktemp("nginx")
    port = free_port()
    site = EXAMPLE.read_text().replace("127.0.0.1:30000", f"127.0.0.1:{pyserve_behind.port}")
    (root / "pyserve.conf").write_text(site.replace("listen 8080;", f"listen 127.0.0.1:{port};"))
    (root / "nginx.conf").write_text(f"""
        daemon off;
        pid {root}/nginx.pid;
        error_log {root}/error.log;
        events {{}}
        http {{
            access_log {root}/access.log;
            client_body_temp_path {root}/client_body;
            proxy_temp_path {root}/proxy;
            fastcgi_temp_path {root}/fastcgi;
            uwsgi_temp_path {root}/uwsgi;
            scgi_temp_path {root}/scgi;
            include {root}/pyserve.conf;
        }}
    """)
    proc = subprocess.Popen(["nginx", "-p", str(root), "-c", str(root / "nginx.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/llm"
    deadline = time.time() + 30
    while True:
        assert proc.poll() is None, (root / "error.log").read_text()
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            assert time.time() < deadline
            time.sleep(0.2)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def test_a_stream_arrives_event_by_event_through_the_proxy(proxy):
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="x")
    start = time.perf_counter()
    arrivals = [time.perf_counter() - start for _ in client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=120,
        stream=True, extra_body={"ignore_eos": True})]
    assert len(arrivals) >= 60  # about one event a token
    first, last = arrivals[0], arrivals[-1]
    assert first < last / 4  # the first event long before the last
    # A buffering proxy hands events on a buffer (4-8 KiB, 20+ events) at a
    # time; here no more than a few ever arrive together.
    together, burst = 1, 1
    for before, now in zip(arrivals, arrivals[1:]):
        together = together + 1 if now - before < 0.002 else 1
        burst = max(burst, together)
    assert burst < 10, arrivals


def test_a_large_upload_passes(proxy, tmp_path):
    data = os.urandom(24 << 20)  # over nginx's default 1 MiB body limit
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="x")
    uploaded = client.files.create(file=("big.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data)
    back = client.files.content(uploaded.id).content
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()


def test_the_access_log_names_the_client_behind_the_proxy(proxy, pyserve_behind):
    # the client calls from 127.0.0.2 (loopback too); nginx, at 127.0.0.1, is the trusted proxy
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as client:
        assert client.get(f"{proxy}/v1/models?from=far").status_code == 200
    assert '127.0.0.2:0 - "GET /v1/models?from=far HTTP/1.1" 200 OK' in pyserve_behind.log()


def test_a_client_leaving_at_the_proxy_aborts_the_request(proxy, pyserve_behind):
    body = {"model": "m", "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{proxy}/v1/chat/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break  # the first event, then the client hangs up
    deadline = time.time() + 60
    while not re.search(r"(disconnected from|went away during) /v1/chat/completions", pyserve_behind.log()):
        assert time.time() < deadline, pyserve_behind.log()[-2000:]
        time.sleep(0.2)
    info = httpx.get(f"{pyserve_behind.base_url}/get_server_info", timeout=10).json()
    assert info["num_running_reqs"] == 0 and info["kv_integrity"] == "ok"
