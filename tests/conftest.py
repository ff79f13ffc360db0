"""Shared fixtures: the embedded model, tiny random models, a live server."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.tiny_models import build_tiny_model

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter.
# Triton reads TRITON_INTERPRET when a kernel is decorated, that is when its
# module is first imported, so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pyserve.model.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama with the default model's real tokenizer files."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tokenizer_dir=default_model_dir)


@pytest.fixture(scope="session")
def eagle3_target(tmp_path_factory, default_model_dir) -> Path:
    """A tiny Llama of four layers with the default model's tokenizer: the
    EAGLE3 tests' target."""
    return build_tiny_model(tmp_path_factory.mktemp("eagle3-target"), "llama", tokenizer_dir=default_model_dir,
                            num_hidden_layers=4)


@pytest.fixture(scope="session")
def eagle3_heads(eagle3_target, tmp_path_factory) -> dict:
    """Its random and fitted heads (tests/eagle3_heads.py), fitted once for
    every EAGLE3 test file."""
    from tests.eagle3_heads import tiny_target_heads

    return tiny_target_heads(eagle3_target, tmp_path_factory.mktemp("eagle3-heads"))


SERVER_DEFAULT_MAX_TOKENS = 96


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999): a port the
    kernel handed out would be free again once this probe closes, and a
    tensor-parallel server's gloo connections, opened before it binds its
    HTTP port, could take it (seen once: "Address already in use")."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def crash_stacks_env() -> dict[str, str]:
    """This environment, in which a server killed by a fatal signal
    (SIGSEGV, SIGABRT) first writes every thread's Python stack to its log."""
    return {**os.environ, "PYTHONFAULTHANDLER": "1"}


class ServerProcess:
    """`python -m pyserve` in a subprocess, as a user would start it."""

    def __init__(self, *args: str, timeout: float = 120.0):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pyserve-test-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyserve", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=crash_stacks_env(),
        )
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pyserve exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"pyserve did not become ready:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@contextlib.contextmanager
def app_of_cli(*args: str):
    """The app `pyserve *args` serves (its options parsed by
    ServerArgs.from_cli, then pyserve.asgi.create_app, as the command
    does), started in process, and an HTTP client of it (starlette's
    TestClient, also an openai client's http_client): for tests of what
    the app answers, not of the server process or its sockets."""
    from starlette.testclient import TestClient

    from pyserve.asgi import create_app
    from pyserve.server_args import ServerArgs

    with TestClient(create_app(ServerArgs.from_cli(list(args)))) as http:
        yield http


@pytest.fixture(scope="session")
def server():
    """The real server on the embedded default model. Requests that set no
    max_tokens (as some seeds do) are capped so a rambling answer from the
    small model cannot stall the suite. The tool-call parser only acts on
    requests that send tools. Float32 (--torchao-config none), the
    reference path: tests compare greedy answers across requests, and under
    the CPU default (4-bit weights, bfloat16 matmul inputs) a prompt computed
    over a cached prefix can round a near tie the other way."""
    srv = ServerProcess("--default-max-tokens", str(SERVER_DEFAULT_MAX_TOKENS), "--tool-call-parser", "qwen25",
                        "--torchao-config", "none")
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def kv_integrity_after_test(request):
    """After every test that talked to the shared server: each KV page is
    free, cached, or held by exactly one running request."""
    yield
    if "server" not in request.fixturenames:
        return
    import httpx

    srv = request.getfixturevalue("server")
    info = httpx.get(f"{srv.base_url}/get_server_info", timeout=30).json()
    assert info["kv_integrity"] == "ok", info["kv_integrity"]


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(api_key="EMPTY", base_url=f"{server.base_url}/v1", timeout=120)


@pytest.fixture(scope="session")
def model_name(client) -> str:
    return client.models.list().data[0].id
