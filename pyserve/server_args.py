"""Command-line options, named as SGLang names them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass
class ServerArgs:
    model_path: str | None = None  # None: the embedded default model
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    log_level: str = "info"
    chat_template: str | None = None  # a file, or a name from templates/
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None  # qwen25/hermes, llama3 or mistral
    api_key: str | None = None
    context_length: int | None = None  # default: the model's max_position_embeddings
    max_total_tokens: int | None = None  # KV cache size in tokens
    mem_fraction_static: float | None = None  # share of device memory for weights + KV (GPU)
    page_size: int = 1  # tokens per KV page
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 128
    # None: overlap on CUDA only. On CPU the forward pass and the loop's own
    # work share the same cores, so overlap buys nothing and delays tokens.
    disable_overlap_schedule: bool | None = None
    tp_size: int = 1  # tensor parallelism: one GPU only
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192  # token budget of one prefill step
    chunked_prefill_size: int = 2048  # longer prompts are computed in chunks; -1: never
    disable_radix_cache: bool = False
    default_max_tokens: int | None = None  # when a request sets none: up to the context length
    random_seed: int = 0
    decode_log_interval: int = 40  # decode steps between "Decode batch." log lines
    file_storage_path: str = "pyserve_storage"
    max_upload_size: int = 512 << 20  # bytes
    batch_concurrency: int = 8  # requests of all batches in flight at once

    @staticmethod
    def parser() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="pyserve", description="OpenAI-compatible LLM inference server"
        )
        p.add_argument("--model", "--model-path", dest="model_path", default=None,
                       help="Hugging Face model directory (default: the embedded model)")
        p.add_argument("--served-model-name", default=None,
                       help="model name reported by the API (default: the model path)")
        p.add_argument("--host", default=ServerArgs.host)
        p.add_argument("--port", type=int, default=ServerArgs.port)
        p.add_argument("--dtype", default=ServerArgs.dtype,
                       choices=["auto", "float32", "bfloat16", "float16"])
        p.add_argument("--device", default=ServerArgs.device, choices=["auto", "cpu", "cuda"])
        p.add_argument("--log-level", default=ServerArgs.log_level,
                       choices=["debug", "info", "warning", "error"])
        p.add_argument("--chat-template", default=None,
                       help="jinja2 chat template file, or a name from templates/ (chatml, llama3, ...)")
        p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek-r1"],
                       help="split <think>...</think> into reasoning_content")
        # SGLang's names; qwen25 and hermes are one format.
        p.add_argument("--tool-call-parser", default=None, choices=["qwen25", "hermes", "llama3", "mistral"],
                       help="read tool calls in chat output into message.tool_calls")
        p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
        p.add_argument("--context-length", type=int, default=None)
        p.add_argument("--max-total-tokens", type=int, default=None,
                       help="KV cache capacity in tokens")
        p.add_argument("--mem-fraction-static", type=float, default=None,
                       help="share of GPU memory for weights and KV cache (default 0.85)")
        p.add_argument("--page-size", type=int, default=ServerArgs.page_size,
                       help="tokens per KV cache page; the prefix cache shares whole pages")
        p.add_argument("--attention-backend", default=ServerArgs.attention_backend,
                       choices=["auto", "torch", "triton"],
                       help="auto: triton on CUDA, torch on CPU")
        p.add_argument("--disable-cuda-graph", action="store_true",
                       help="run decode steps eagerly instead of replaying CUDA graphs")
        p.add_argument("--cuda-graph-max-bs", type=int, default=ServerArgs.cuda_graph_max_bs,
                       help="largest decode batch captured as a CUDA graph")
        p.add_argument("--disable-overlap-schedule", action="store_const", const=True, default=None,
                       help="schedule the next step only after the current one finished")
        p.add_argument("--enable-overlap-schedule", dest="disable_overlap_schedule", action="store_const",
                       const=False, help="overlap scheduling on CPU too (by default only on CUDA)")
        p.add_argument("--tp-size", "--tp", type=int, default=ServerArgs.tp_size,
                       help="tensor-parallel size; pyserve runs on one GPU, so only 1")
        p.add_argument("--max-running-requests", type=int, default=ServerArgs.max_running_requests)
        p.add_argument("--max-prefill-tokens", type=int, default=ServerArgs.max_prefill_tokens)
        p.add_argument("--chunked-prefill-size", type=int, default=ServerArgs.chunked_prefill_size,
                       help="compute longer prompts a chunk per step, letting decode steps in between; -1 disables")
        p.add_argument("--disable-radix-cache", action="store_true",
                       help="do not reuse the KV of shared prompt prefixes")
        p.add_argument("--default-max-tokens", type=int, default=None,
                       help="max_tokens for requests that set none (default: up to the context length)")
        p.add_argument("--decode-log-interval", type=int, default=ServerArgs.decode_log_interval,
                       help="decode steps between 'Decode batch.' log lines")
        p.add_argument("--random-seed", type=int, default=ServerArgs.random_seed)
        p.add_argument("--file-storage-path", default=ServerArgs.file_storage_path,
                       help="where /v1/files and /v1/batches keep their data")
        p.add_argument("--max-upload-size", type=int, default=ServerArgs.max_upload_size,
                       help="largest accepted upload, in bytes")
        p.add_argument("--batch-concurrency", type=int, default=ServerArgs.batch_concurrency,
                       help="batch requests in flight at once (they run below interactive ones)")
        return p

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> "ServerArgs":
        parser = cls.parser()
        ns = parser.parse_args(argv)
        if ns.tp_size != 1:
            parser.error(f"--tp-size {ns.tp_size}: pyserve runs a model on one GPU (tensor parallelism is not built)")
        if ns.page_size < 1:
            parser.error("--page-size must be at least 1")
        if ns.mem_fraction_static is not None and not 0 < ns.mem_fraction_static <= 1:
            parser.error("--mem-fraction-static must be in (0, 1]")
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})
