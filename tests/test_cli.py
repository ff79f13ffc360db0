"""The `pyserve` command as a user runs it."""

from __future__ import annotations

import pytest

import subprocess
import sys

from pyserve.server_args import ServerArgs


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyserve", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_the_sglang_style_options():
    out = run_cli("--help")
    assert out.returncode == 0
    for option in ("--model", "--model-path", "--served-model-name", "--dtype", "--device", "--port",
                   "--host", "--chat-template", "--api-key", "--log-level", "--page-size", "--mem-fraction-static",
                   "--attention-backend", "--disable-cuda-graph", "--cuda-graph-max-bs",
                   "--disable-overlap-schedule", "--enable-overlap-schedule", "--tp-size", "--chunked-prefill-size"):
        assert option in out.stdout


def test_overlap_schedule_is_automatic_unless_forced():
    assert ServerArgs.from_cli([]).disable_overlap_schedule is None  # on CUDA only
    assert ServerArgs.from_cli(["--disable-overlap-schedule"]).disable_overlap_schedule is True
    assert ServerArgs.from_cli(["--enable-overlap-schedule"]).disable_overlap_schedule is False


def test_model_path_is_an_alias_of_model():
    assert ServerArgs.from_cli(["--model-path", "/m"]).model_path == "/m"
    assert ServerArgs.from_cli(["--model", "/m", "--port", "1234"]).port == 1234


@pytest.mark.parametrize("option", [
    ["--tp-size", "2", "--enable-torch-compile"], ["--page-size", "0"], ["--mem-fraction-static", "1.5"],
    ["--max-connections", "0"], ["--header-read-timeout", "0"], ["--root-path", "llm/"], ["--forwarded-allow-ips", "proxy.example"],
    ["--allowed-origins", "app.example"], ["--json-model-override-args", "{rope"],
    ["--json-model-override-args", "[1]"], ["--stream-interval", "0"], ["--watchdog-timeout", "0"],
    ["--max-queued-requests", "0"],
])
def test_impossible_options_fail_clearly(option):
    out = run_cli(*option)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert option[0] in out.stderr


def test_every_tool_call_parser_choice_is_a_parser():
    from pyserve._rust import HarmonyParser, ToolCallParser

    choices = ServerArgs.parser()._option_string_actions["--tool-call-parser"].choices
    assert set(choices) == {"qwen25", "hermes", "llama3", "mistral", "deepseekv3", "deepseekv31", "pythonic",
                            "qwen3_coder", "minimax-m2", "glm45", "glm47", "gpt-oss"}
    for name in choices:
        assert ServerArgs.from_cli(["--tool-call-parser", name]).tool_call_parser == name
        HarmonyParser() if name == "gpt-oss" else ToolCallParser(name)


def test_missing_model_directory_fails_clearly(tmp_path):
    out = run_cli("--model", str(tmp_path / "nope"), "--port", "0")
    assert out.returncode != 0
    assert "Traceback" not in out.stdout + out.stderr
    assert "nope" in out.stdout + out.stderr


def test_unsupported_model_fails_clearly(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    (tmp_path / "tokenizer.json").write_text("{}")
    out = run_cli("--model", str(tmp_path))
    assert out.returncode != 0
    assert "Traceback" not in out.stdout + out.stderr


def test_serves_logs_and_stops_cleanly_on_sigterm(tiny_llama_dir):
    """What it loaded and where it listens, and each request with
    --log-requests, in SGLang's timestamped shape; a second server on the
    same port fails at once; SIGTERM ends it with 0."""
    import re
    import signal

    import httpx

    from tests.conftest import ServerProcess

    srv = ServerProcess("--model", str(tiny_llama_dir), "--max-total-tokens", "2048",
                        "--served-model-name", "tiny", "--log-requests", "--log-requests-level", "0")
    try:
        httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        log = srv.log()
        assert re.search(r"^\[[\d :-]+\] Receive: rid=cmpl-\w+, prompt_tokens=\d+$", log, re.M)
        assert re.search(r"^\[[\d :-]+\] Finish: rid=cmpl-\w+, finish_reason=\w+, .*completion_tokens=", log, re.M)
        assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] server_args=ServerArgs\(", log, re.M)
        assert "LlamaForCausalLM" in log and "parameters" in log and "on cpu" in log
        assert "KV cache" in log and "context length" in log
        assert f"pyserve is ready on http://127.0.0.1:{srv.port}" in log
        taken = run_cli("--model", str(tiny_llama_dir), "--port", str(srv.port))
        assert taken.returncode != 0
        assert "already in use" in taken.stdout + taken.stderr
        assert "Traceback" not in taken.stdout + taken.stderr
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0
        srv.stop()
    assert "pyserve stopped" in srv.log_path.read_text()


@pytest.mark.parametrize("line", [
    # The seeds' launch lines, as written there.
    "--model-path meta-llama/Meta-Llama-3.1-8B-Instruct --host 0.0.0.0",
    "--model-path qwen/qwen2.5-0.5b-instruct --host 0.0.0.0 --mem-fraction-static 0.8",
    "--model-path meta-llama/Meta-Llama-3.1-8B-Instruct --port 30000 --host 0.0.0.0 --log-level warning",
    "--model-path QwQ/Qwen3-32B-250415 --reasoning-parser qwen3",
    # Flags SGLang's docs put on many launch lines, for what pyserve always does.
    "--model-path deepseek-ai/DeepSeek-V3 --tp 8 --trust-remote-code --enable-metrics --enable-cache-report",
])
def test_sglangs_launch_lines_are_pyserves(line):
    args = ServerArgs.from_cli(line.split())
    assert args.model_path == line.split()[1]


def test_a_step_past_the_watchdog_timeout_ends_the_server_with_its_stacks(tiny_llama_dir):
    """Every step outlasts a tenth of a millisecond: the first request's
    ends the process, its stacks in the log, for a supervisor to restart it."""
    import httpx

    from pyserve.engine.watchdog import EXIT_STATUS
    from tests.conftest import ServerProcess

    srv = ServerProcess("--model", str(tiny_llama_dir), "--max-total-tokens", "2048", "--watchdog-timeout", "0.0001")
    try:
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert srv.proc.wait(timeout=30) == EXIT_STATUS
        log = srv.log()
        assert "a forward step ran past --watchdog-timeout 0.0001 s" in log
        assert "most recent call first" in log  # every thread's stack
    finally:
        srv.stop()
