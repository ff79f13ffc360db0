"""pyserve.create_app under other ASGI servers and inside another app:
Starlette's Mount (in-process), uvicorn, hypercorn and Granian's own CLI
(subprocesses), each serving chat through the official openai client and
running the lifespan's startup and shutdown."""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest

from pyserve import create_app
from pyserve.server_args import ServerArgs
from tests.conftest import free_port
from tests.slow import slow


def chat_through(client: openai.OpenAI) -> tuple[str, list[str]]:
    """A whole and a streamed chat answer."""
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Say hi."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, stream=True) if c.choices]
    return whole.choices[0].message.content, pieces


def test_options_are_checked_when_the_app_is_made():
    with pytest.raises(TypeError):
        create_app(no_such_option=1)
    with pytest.raises(ValueError, match="--page-size"):
        create_app(page_size=0)
    with pytest.raises(ValueError, match="--allowed-origins"):
        create_app(ServerArgs(allowed_origins="not an origin"))
    assert create_app(ServerArgs(port=1), port=2).args.port == 2  # keywords win


def test_before_its_lifespan_the_app_answers_503():
    app = create_app()

    async def get():
        sent = []

        async def receive():
            return {"type": "http.request", "body": b""}

        async def send(message):
            sent.append(message)

        await app({"type": "http", "method": "GET", "path": "/health", "headers": []}, receive, send)
        return sent

    import asyncio

    start, body = asyncio.run(get())
    assert start["status"] == 503 and b"lifespan" in body["body"]


def test_mounted_in_starlette_under_a_prefix(tiny_llama_dir, tmp_path, caplog):
    from starlette.applications import Starlette
    from starlette.routing import Mount, Route
    from starlette.responses import PlainTextResponse
    from starlette.testclient import TestClient

    llm = create_app(model_path=str(tiny_llama_dir), max_total_tokens=2048, file_storage_path=str(tmp_path))

    @contextlib.asynccontextmanager
    async def lifespan(parent):
        async with llm.lifespan():  # Starlette does not pass the lifespan on to mounted apps
            yield

    parent = Starlette(routes=[Route("/", lambda request: PlainTextResponse("home")), Mount("/llm", app=llm)],
                       lifespan=lifespan)
    with caplog.at_level(logging.INFO), TestClient(parent) as http:
        assert http.get("/").text == "home"
        client = openai.OpenAI(base_url="http://testserver/llm/v1", api_key="x", http_client=http)
        whole, pieces = chat_through(client)
        assert http.get("/v1/models").status_code == 404  # only under the prefix
        assert http.get("/llm/health").status_code == 200
    assert isinstance(whole, str) and len(pieces) >= 1
    assert not llm.started and "pyserve stopped" in caplog.text
    assert '"GET /llm/health HTTP/1.1" 200' in caplog.text


def test_server_info_reports_the_resolved_options_but_never_the_api_key(tiny_llama_dir, tmp_path, caplog):
    from starlette.testclient import TestClient

    key = "sekrit-api-key"
    llm = create_app(model_path=str(tiny_llama_dir), max_total_tokens=2048, max_running_requests=7,
                     file_storage_path=str(tmp_path), api_key=key)
    with caplog.at_level(logging.INFO), TestClient(llm) as http:
        assert http.get("/get_server_info").status_code == 401
        response = http.get("/get_server_info", headers={"Authorization": f"Bearer {key}"})
    info = response.json()
    assert info["max_running_requests"] == 7 and info["max_total_tokens"] == 2048
    assert info["file_storage_path"] == str(tmp_path) and info["model_path"] == str(tiny_llama_dir)
    assert "auto" not in (info["device"], info["dtype"], info["attention_backend"])  # as resolved
    assert "api_key" not in info and key not in response.text
    assert "server_args=ServerArgs(" in caplog.text and key not in caplog.text


@contextlib.contextmanager
def served(command: list[str], port: int, cwd, timeout: float = 180):
    """A server started by `command`, ready when /health answers; stopped with SIGTERM."""
    log = open(cwd / "server.log", "w")
    proc = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, (cwd / "server.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            assert time.time() < deadline, (cwd / "server.log").read_text()
            time.sleep(0.3)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def app_module(tmp_path, tiny_llama_dir) -> None:
    (tmp_path / "llm_app.py").write_text(textwrap.dedent(f"""
        import logging
        from pyserve import create_app

        logging.basicConfig(level=logging.INFO)
        app = create_app(model_path={str(tiny_llama_dir)!r}, max_total_tokens=2048)
    """))


@pytest.mark.parametrize("asgi_server", ["uvicorn", pytest.param("hypercorn", marks=slow)])
def test_served_by_another_asgi_server(asgi_server, tiny_llama_dir, tmp_path):
    app_module(tmp_path, tiny_llama_dir)
    port = free_port()
    command = {
        "uvicorn": [sys.executable, "-m", "uvicorn", "llm_app:app", "--port", str(port)],
        "hypercorn": [sys.executable, "-m", "hypercorn", "llm_app:app", "--bind", f"127.0.0.1:{port}"],
    }[asgi_server]
    with served(command, port, tmp_path) as proc:
        whole, pieces = chat_through(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x"))
    assert isinstance(whole, str) and len(pieces) >= 1
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn ends by re-raising the signal it handled
    log = (tmp_path / "server.log").read_text()
    assert "pyserve stopped" in log  # the lifespan's shutdown ran
    assert (tmp_path / "pyserve_storage" / "batches").is_dir()  # the stores were made at startup


def test_granian_cli_with_the_factory(tmp_path):
    """`granian --interface asgi --factory pyserve:create_app`: the embedded model, default options."""
    port = free_port()
    command = [sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "--port", str(port),
               "pyserve:create_app"]
    with served(command, port, tmp_path) as proc:
        whole, pieces = chat_through(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x"))
    assert whole and "".join(pieces)
    assert proc.returncode == 0
