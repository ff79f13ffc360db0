"""The `pyserve` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from pyserve.server_args import ServerArgs


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyserve", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_the_sglang_style_options():
    out = run_cli("--help")
    assert out.returncode == 0
    for option in ("--model", "--model-path", "--served-model-name", "--dtype", "--device", "--port",
                   "--host", "--chat-template", "--api-key", "--log-level"):
        assert option in out.stdout


def test_model_path_is_an_alias_of_model():
    assert ServerArgs.from_cli(["--model-path", "/m"]).model_path == "/m"
    assert ServerArgs.from_cli(["--model", "/m", "--port", "1234"]).port == 1234


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
