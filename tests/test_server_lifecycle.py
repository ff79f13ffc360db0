"""`pyserve` as a process: SIGTERM drains (streams in flight finish, or end
with an error event once --drain-timeout passes), batch state is saved for
the next start, and slow clients that never finish their headers starve
nobody and are closed after --header-read-timeout."""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.slow import slow_test

TINY = ("--max-total-tokens", "4096")


def tiny_server(tiny_llama_dir, *options: str) -> ServerProcess:
    return ServerProcess("--model", str(tiny_llama_dir), *TINY, *options)


def stream_and_sigterm(srv: ServerProcess, max_tokens: int) -> tuple[list[str], bool]:
    """Stream a chat answer, SIGTERM the server at its first chunk; the
    stream's data lines, and whether a new connection was served meanwhile."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    lines, served_new = [], False
    with httpx.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            if not lines:
                srv.proc.send_signal(signal.SIGTERM)
                try:
                    served_new = httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200
                except httpx.HTTPError:
                    pass
            lines.append(line[5:].strip())
    return lines, served_new


def drained_stream(tiny_llama_dir, drain_timeout: str, max_tokens: int) -> tuple[list[str], bool, str]:
    """stream_and_sigterm on a server with --drain-timeout, which must then
    exit with 0: the stream's data lines, whether a new connection was
    served meanwhile, and the server's log."""
    srv = tiny_server(tiny_llama_dir, "--drain-timeout", drain_timeout)
    try:
        lines, served_new = stream_and_sigterm(srv, max_tokens)
        assert srv.proc.wait(timeout=120) == 0
    finally:
        srv.stop()
    return lines, served_new, srv.log_path.read_text()


def test_sigterm_lets_a_stream_in_flight_finish(tiny_llama_dir):
    lines, served_new, log = drained_stream(tiny_llama_dir, "120", max_tokens=300)
    assert not served_new  # no new connection is accepted once draining
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["usage"]["completion_tokens"] == 300  # the whole answer, not cut
    assert "Draining: 1 requests in flight" in log
    # Its last words: nothing after them (a CPU server loads no Triton, whose bindings report leaks at exit).
    assert log.rstrip().splitlines()[-1].endswith("pyserve stopped")


def test_sigterm_ends_a_stream_with_an_error_event_after_the_drain_time(tiny_llama_dir):
    lines, _, log = drained_stream(tiny_llama_dir, "0", max_tokens=2000)
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["error"]["message"] == "the server is shutting down"
    assert "pyserve stopped" in log


@slow_test
def test_sigterm_saves_a_running_batch_and_the_next_start_finishes_it(tiny_llama_dir, tmp_path):
    storage = ("--file-storage-path", str(tmp_path))
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": f"story {i}"}],
                       "max_tokens": 200, "ignore_eos": True}} for i in range(24)]
    srv = tiny_server(tiny_llama_dir, *storage, "--drain-timeout", "0", "--batch-concurrency", "2")
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x")
        upload = client.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            time.sleep(0.1)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()
    saved = json.loads((tmp_path / "batches" / f"{batch.id}.json").read_text())
    written = (tmp_path / "batches" / f"{batch.id}.output.jsonl").read_text().splitlines()
    assert saved["status"] == "in_progress"
    assert saved["request_counts"]["completed"] == len(written) < len(lines)  # counts saved as they were

    srv = tiny_server(tiny_llama_dir, *storage)
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x")
        while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            time.sleep(0.2)
        output = client.files.content(done.output_file_id).text
    finally:
        srv.stop()
    assert done.status == "completed"
    assert sorted(json.loads(x)["custom_id"] for x in output.splitlines()) == sorted(x["custom_id"] for x in lines)


def still_open(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True  # nothing to read, not closed
    except OSError:
        return False


@pytest.fixture
def slow_clients():
    sockets: list[socket.socket] = []
    yield sockets
    for sock in sockets:
        sock.close()


@slow_test
def test_slow_clients_starve_nobody_and_are_closed_after_the_header_timeout(tiny_llama_dir, slow_clients):
    srv = tiny_server(tiny_llama_dir, "--header-read-timeout", "15")
    try:
        for _ in range(500):  # each sends the start of a request whose headers never end
            sock = socket.create_connection(("127.0.0.1", srv.port))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow_clients.append(sock)
        health = httpx.get(f"{srv.base_url}/health", timeout=60)
        chat = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60,
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        open_meanwhile = sum(still_open(s) for s in slow_clients)
        deadline = time.time() + 120
        while any(still_open(s) for s in slow_clients) and time.time() < deadline:
            time.sleep(0.5)
        open_at_the_end = sum(still_open(s) for s in slow_clients)
    finally:
        srv.stop()
    assert health.status_code == 200 and chat.status_code == 200
    assert open_meanwhile == 500  # answered while every slow client still held its connection
    assert open_at_the_end == 0  # then the header timeout closed them all
