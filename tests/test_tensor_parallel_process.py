"""`pyserve --tp-size 2` as a process on a tiny model: a rank that dies
takes the server down with a clear log line, SIGTERM and Ctrl-C (SIGINT,
slow: the same path) stop every rank."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.slow import slow, slow_test


def tp_server(model_dir) -> tuple[ServerProcess, int]:
    """A two-rank server, and the pid of its rank 1."""
    srv = ServerProcess("--model", str(model_dir), "--max-total-tokens", "4096", "--tp-size", "2", timeout=300)
    pid = re.search(r"Tensor-parallel ranks started: 1 \(pid (\d+)\)", srv.log())
    assert pid, srv.log_path.read_text()
    return srv, int(pid.group(1))


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie left for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def answer(srv: ServerProcess) -> str:
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


@slow_test
def test_a_killed_rank_stops_the_server_with_a_log_line(tiny_llama_dir):
    srv, rank1 = tp_server(tiny_llama_dir)
    try:
        assert answer(srv)
        os.kill(rank1, signal.SIGKILL)
        assert srv.proc.wait(timeout=120) != 0
    finally:
        srv.stop()
    assert f"tensor-parallel rank 1 (pid {rank1}) was killed by SIGKILL: stopping pyserve" in srv.log_path.read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=slow)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_server_stops_every_rank(tiny_llama_dir, sig):
    srv, rank1 = tp_server(tiny_llama_dir)
    try:
        assert answer(srv)
        srv.proc.send_signal(sig)
        assert srv.proc.wait(timeout=120) == 0
    finally:
        srv.stop()
    assert not running(rank1), srv.log_path.read_text()
