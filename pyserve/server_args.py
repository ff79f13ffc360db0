"""Command-line options, named as SGLang names them.

Each option is declared once, as a field of the one group of options that
reads it: ModelOptions (every tensor-parallel rank), EngineOptions (the
scheduler) or ServerOptions (HTTP and the API). Its default is the field's,
and its flags, help and choices are in the field's metadata
(option_fields.py). ServerArgs is the three groups side by side: the
command line, whose argparse parser is built from the fields, so a new
option is one line here. At start-up `resolved()` turns "auto" into what
this machine runs, once, and `split()` hands each layer its own group.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import typing
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

from pyserve.model.hub import check_revision, local_model_dir
from pyserve.model.quantized.scheme import CHOICES as CHECKPOINT_QUANTIZATIONS
from pyserve.option_fields import add_arguments, comma_list, option


@dataclass(frozen=True)
class ModelOptions:
    """What loads and runs the model, on every tensor-parallel rank: rank 0's
    ModelRunner and the worker processes receive these options and no others."""

    model_path: str | None = option(None, "--model", "--model-path",
                                    help="a Hugging Face model directory, or a Hub id (OWNER/NAME) found in or "
                                         "downloaded to the Hugging Face cache (default: the embedded model)")
    revision: str | None = option(None, help="with a Hub id: the branch, tag or commit to serve (default: main)")
    tokenizer_path: str | None = option(None, help="a directory or Hub id whose tokenizer and chat template are served")
    trust_remote_code: bool = option(False, help="accepted from SGLang's launch lines: pyserve runs no repository code")
    download_dir: str | None = option(None, help="the Hugging Face cache Hub ids are found in and downloaded to")
    is_embedding: bool = option(False, help="serve /v1/embeddings from an embedding model (pooling from its "
                                "sentence-transformers files) instead of generating text")
    dtype: str = option("auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: float32 on CPU, bfloat16 on CUDA")
    device: str = option("auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available, else cpu")
    context_length: int | None = option(None, help="longest prompt + completion (default: the model's)")
    max_total_tokens: int | None = option(None, help="KV cache capacity in tokens")
    mem_fraction_static: float | None = option(
        None, help="share of GPU memory for weights and KV cache (default 0.85)")
    page_size: int = option(1, help="tokens per KV cache page; the prefix cache shares whole pages")
    swa_full_tokens_ratio: float = option(
        0.8, help="models with sliding-window layers: the sliding layers' KV pool holds this share of the "
        "full pool's tokens")
    attention_backend: str = option("auto", choices=["auto", "torch", "triton"],
                                    help="auto: triton on CUDA, torch on CPU")
    disable_cuda_graph: bool = option(False, help="run decode steps eagerly instead of replaying CUDA graphs")
    cuda_graph_max_bs: int = option(
        128, help="largest decode batch captured as a CUDA graph (at most --max-running-requests)")
    # CPU speed: quantized weights and a compiled decode step.
    torchao_config: str = option("auto", help="CPU quantization: none, int8wo, int4wo-<group> (32/64/128/256), "
                                 "8da4w (4-bit weights in blocks of 32, 8-bit dynamic activations), or auto: "
                                 "the 4-bit weights the model ships (the embedded model's) as 8da4w with AVX2")
    quantization: str = option("auto", help="the checkpoint's own quantization: auto (config.json's "
                               "quantization_config), awq, gptq, fp8 or compressed-tensors to insist on it, "
                               "none to refuse a quantized checkpoint", choices=list(CHECKPOINT_QUANTIZATIONS))
    enable_torch_compile: bool = option(False, help="compile the decode forward with torch.compile")
    random_seed: int = option(0, help="seed of sampling for requests that set none")
    # Tensor parallelism (README "Tensor parallelism"), named as SGLang names it.
    tp_size: int = option(1, "--tp-size", "--tp",
                          help="tensor-parallel ranks the model is split over: one process (and on CUDA one GPU) each")
    nnodes: int = option(1, help="machines the tensor-parallel ranks run on, --tp-size / --nnodes on each")
    node_rank: int = option(0, help="this machine's place among --nnodes: 0 serves the API, the others run only "
                                    "their tensor-parallel ranks")
    dist_init_addr: str | None = option(
        None, help="HOST:PORT on node 0 where the tensor-parallel ranks meet (needed with --nnodes > 1; "
                   "default on one machine: a free local port)")
    # LoRA adapters (README "LoRA adapters"), named as SGLang names them.
    enable_lora: bool = option(False, help="serve LoRA adapters over the base model, picked per request by name")
    lora_paths: str | None = option(None, items=True,
                                    help="adapters loaded at start, NAME=PATH (a PEFT adapter directory) each, "
                                         "space- or comma-separated")
    max_loras_per_batch: int = option(8, help="adapter slots: the most adapters loaded at once, every one of "
                                              "which a batch may mix")
    max_lora_rank: int = option(64, help="the largest adapter rank the slots hold")


@dataclass(frozen=True)
class EngineOptions:
    """How the engine schedules requests over the model."""

    max_running_requests: int = option(64, help="running batch cap")
    max_queued_requests: int | None = option(None, help="refuse requests with a 503 while this many wait (batch jobs excepted)")
    max_prefill_tokens: int = option(8192, help="token budget of one prefill step when chunking is off")
    chunked_prefill_size: int = option(
        2048, help="compute longer prompts a chunk per step, letting decode steps in between; -1 disables")
    disable_radix_cache: bool = option(False, help="do not reuse the KV of shared prompt prefixes")
    # SGLang's flag; vLLM's --scheduling-policy priority means the same.
    enable_priority_scheduling: bool = option(
        False, help="order waiting requests by their `priority` field (larger first, as SGLang; aged so that none "
                    "starves) and retract the least urgent first; without it a `priority` field is refused",
        alias=("--scheduling-policy", {"fcfs": False, "priority": True},
               "vLLM's name: priority is --enable-priority-scheduling, fcfs (the default) is without it"))
    # None: overlap on CUDA without speculative decoding. On CPU the forward
    # pass and the loop's own work share the same cores, so overlap buys
    # nothing and delays tokens; with speculation the next row's drafts
    # wait for the verify step's tokens, and on an H100 NGRAM ran 1.35x
    # faster without overlap (bench/README.md G23-G26).
    disable_overlap_schedule: bool | None = option(
        None, help="schedule the next step only after the current one finished",
        inverse=("--enable-overlap-schedule",
                 "overlap scheduling on CPU or with speculative decoding too (by default only on CUDA without it)"))
    # Structured outputs (engine/grammar): JSON schema, regex, EBNF and required tool calls.
    grammar_backend: str = option("xgrammar", choices=["xgrammar", "none"],
                                  help="constrained decoding backend; none refuses constrained requests")
    disable_jump_forward: bool = option(
        False, help="sample every token of a constrained output, including the text its grammar forces "
                    "(by default that text is appended at once, as the tokenizer encodes it)")
    default_max_tokens: int | None = option(
        None, help="max_tokens for requests that set none (default: up to the context length)")
    decode_log_interval: int = option(40, help="decode steps between 'Decode batch.' log lines")
    # Speculative decoding (engine/speculative/): SGLang's flags.
    speculative_algorithm: str | None = option(
        None, choices=["NGRAM", "STANDALONE", "EAGLE3", "EAGLE", "NEXTN"],
        help="propose draft tokens and verify them in one forward pass: NGRAM (prompt lookup), STANDALONE "
             "(a smaller draft model), EAGLE3 or EAGLE (an EAGLE-3 or EAGLE-1/2 head over the target's hidden "
             "states), NEXTN (the checkpoint's own multi-token-prediction layer, as EAGLE finds without a draft path)")
    speculative_num_steps: int | None = option(
        None, help="all but NGRAM: tokens the draft model or head decodes per verify (default: "
                   "--speculative-num-draft-tokens); a draft tree's depth. With none of the three "
                   "given, a draft model or head takes SGLang's choice for the model (docs/speculative-decoding.md)")
    speculative_num_draft_tokens: int | None = option(
        None, help="draft tokens verified per step and request (default 4; but NGRAM, unless "
                   "--speculative-num-steps says); with --speculative-eagle-topk above 1, the tree's, root included")
    speculative_ngram_min_match_window_size: int = option(
        3, help="NGRAM: shortest suffix of the request's tokens that must recur for a draft")
    speculative_ngram_max_match_window_size: int = option(
        12, help="NGRAM: longest suffix matched against the request's earlier tokens")
    speculative_ngram_min_bfs_breadth: int = option(
        1, help="NGRAM trees: branches below the longest match (--speculative-ngram-max-match-window-size tokens)")
    speculative_ngram_max_bfs_breadth: int = option(
        1, help="NGRAM: 1 drafts a chain from the request's own tokens; above 1, a tree from every request's tokens "
                "(docs/speculative-decoding.md) with this many branches below the shortest match")
    speculative_ngram_match_type: str = option(
        "BFS", choices=["BFS", "PROB"], help="NGRAM trees: BFS takes the most recent continuations, level by "
                                             "level; PROB, the likeliest (and drafts a tree whatever the breadths)")
    speculative_ngram_branch_length: int | None = option(
        None, "--speculative-ngram-branch-length", "--speculative-ngram-max-trie-depth", help="NGRAM trees: tokens the trie keeps after each position (default 18; above "
                   "--speculative-ngram-max-match-window-size)")
    speculative_ngram_capacity: int | None = option(
        None, help="NGRAM trees: most trie nodes kept, the least recently used out first (default 10000000, 0.8 GB)")
    speculative_ngram_external_corpus_path: str | None = option(
        None, help="NGRAM trees: a corpus to draft from, loaded at start (JSON Lines, a document a line as a string)")
    speculative_ngram_external_sam_budget: int | None = option(
        None, help="NGRAM trees: draft nodes kept for the corpora (default 0: the room the request trie leaves)")
    speculative_ngram_external_corpus_max_tokens: int | None = option(
        None, help="NGRAM trees: most tokens all corpora hold together (default 10000000, about 0.55 GB)")
    speculative_draft_model_path: str | None = option(
        None, help="STANDALONE: the draft model's directory (a smaller model with the target's tokenizer); "
                   "EAGLE3, EAGLE: the draft head's directory (SGLang's checkpoint formats); EAGLE, NEXTN: "
                   "by default the model's own multi-token-prediction layer, where its checkpoint has one")
    speculative_draft_model_revision: str | None = option(
        None, help="with a Hub id as --speculative-draft-model-path: its branch, tag or commit (default: main)")
    speculative_eagle_topk: int | None = option(
        None, help="all but NGRAM: draft branches per step; 1 (default), a chain; more, a draft tree")
    speculative_accept_threshold_single: float = option(
        1.0, help="sampled requests: keep a draft the target gives at least this probability (below 1, output "
                  "leaves the target's distribution for more kept drafts; greedy ones verify exactly)")
    speculative_accept_threshold_acc: float = option(
        1.0, help="sampled requests: divide the other drafts' chance of being kept by this (below 1, more kept)")
    speculative_token_map: str | None = option(
        None, help="EAGLE: a torch.save'd list of the token ids the head may draft (FR-Spec's reduced vocabulary), "
                   "which its vocabulary projection is cut to")
    speculative_draft_model_quantization: str = option(
        "auto", choices=[*CHECKPOINT_QUANTIZATIONS, "unquant"],
        help="the draft model's (STANDALONE) or multi-token-prediction layer's (NEXTN) checkpoint quantization, "
             "as --quantization is the target's (unquant: none); EAGLE heads load unquantized")
    speculative_draft_attention_backend: str | None = option(
        None, choices=["torch", "triton"], help="the draft model's or head's attention backend (default: the "
                                                "target's --attention-backend)")
    speculative_attention_mode: str = option(
        "prefill", choices=["prefill", "decode"],
        help="SGLang's pick between its prefill and decode attention backends for verify and draft steps; pyserve "
             "attends with --attention-backend in both phases, so both modes run the same")


@dataclass(frozen=True)
class ServerOptions:
    """The HTTP server and the API over the engine: what the app, its
    routes and its stores read. The API key stays here, in the server."""

    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(30000, help="port to listen on")
    log_level: str = option("info", choices=["debug", "info", "warning", "error"], help="log level")
    served_model_name: str | None = option(None, help="model name reported by the API (default: the model path)")
    chat_template: str | None = option(
        None, help="jinja2 chat template file, or a name from templates/ (chatml, llama3, ...)")
    reasoning_parser: str | None = option(None, choices=["qwen3", "deepseek-r1", "gpt-oss"],
                                          help="split the reasoning (<think>...</think>; gpt-oss: the analysis "
                                               "channel) into reasoning_content")
    # SGLang's names; qwen25 and hermes are one format.
    tool_call_parser: str | None = option(None, choices=["qwen25", "hermes", "llama3", "mistral", "deepseekv3",
                                                         "pythonic", "qwen3_coder", "gpt-oss"],
                                          help="read tool calls in chat output into message.tool_calls")
    api_key: str | None = option(None, help="require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY')", secret=True)
    # Per request, unlike the engine-wide --max-running-requests: one request's prompts x n.
    max_sequences_per_request: int = option(
        256, help="most sequences (prompts x n) one request may ask for; more is a 400")
    file_storage_path: str = option("pyserve_storage", help="where /v1/files and /v1/batches keep their data")
    max_upload_size: int = option(512 << 20, help="largest accepted upload, in bytes")
    max_payload_size: int = option(64 << 20, help="largest accepted JSON request body, in bytes (larger: 413)")
    batch_concurrency: int = option(
        8, help="batch requests in flight at once (they run below interactive ones)")
    # The HTTP server (Granian, when `pyserve` serves): see README "HTTP server".
    backlog: int = option(2048, help="connections the kernel queues before pyserve accepts them "
                                     "(capped by net.core.somaxconn)")
    max_connections: int = option(
        4096, help="connections open at once; requests beyond what the engine runs wait in its queue, "
                   "so this only bounds memory and file descriptors")
    header_read_timeout: float = option(
        10.0, help="seconds a connection may take to send a request's headers, counted from when it "
                   "opens or its previous response ends: closes slow and idle keep-alive connections")
    drain_timeout: float = option(
        20.0, help="seconds that requests in flight get to finish at shutdown (SIGTERM) before they are stopped")
    root_path: str = option("", help="path prefix the app is served under when a proxy passes it on "
                                     "(e.g. /llm); requests are routed without it")
    forwarded_allow_ips: str = option(
        "", help="comma-separated proxy addresses or networks (or *) whose X-Forwarded-For names the client "
                 "in the access log")
    allowed_origins: str = option(
        "", help="comma-separated origins allowed by CORS (or * for any, without credentials); "
                 "default: none, CORS is off")
    # Last in ServerOptions: the peer-compatibility options.
    metrics_names: str = option(
        "pyserve,sglang,vllm",
        help="comma-separated families of /metrics names: pyserve (SGLang's names under pyserve:), sglang, "
             "vllm; all by default, so SGLang's and vLLM's dashboards read pyserve unchanged")
    enable_metrics: bool = option(False, help="accepted from SGLang's launch lines: /metrics is always served")
    enable_cache_report: bool = option(False, help="accepted from SGLang's launch lines: usage always reports "
                                                   "cached_tokens")


class Options(NamedTuple):
    """The options split by the layer that reads them (ServerArgs.split)."""

    server: ServerOptions
    engine: EngineOptions
    model: ModelOptions


@dataclass(frozen=True)
class ServerArgs(ServerOptions, EngineOptions, ModelOptions):
    """Every option, as the command line (or create_app's keywords) gives
    them; `split()` makes them each layer's."""

    GROUPS = (ModelOptions, EngineOptions, ServerOptions)  # in --help's order

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="pyserve", description="OpenAI-compatible LLM inference server")
        hints = typing.get_type_hints(cls)
        for group in cls.GROUPS:
            section = p.add_argument_group(group.__name__.removesuffix("Options").lower() + " options")
            add_arguments(section, fields(group), hints)
        return p

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> ServerArgs:
        parser = cls.parser()
        args = cls(**vars(parser.parse_args(argv)))
        try:
            args.validate()
        except ValueError as e:
            parser.error(str(e))
        return args

    def validate(self) -> None:
        """Raise ValueError, naming the option, for a value pyserve cannot run with."""
        self._validate_tensor_parallel()
        if self.page_size < 1:
            raise ValueError("--page-size must be at least 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError("--swa-full-tokens-ratio must be in (0, 1]")
        for name in ("backlog", "max_connections", "max_sequences_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.header_read_timeout <= 0:
            raise ValueError("--header-read-timeout must be positive")
        if self.drain_timeout < 0:
            raise ValueError("--drain-timeout must not be negative")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError("--root-path must start with / and not end with one, e.g. /llm")
        for item in comma_list(self.forwarded_allow_ips):
            try:
                if item != "*":
                    ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"--forwarded-allow-ips: {item!r} is not an address or network") from None
        if self.is_embedding:
            self._validate_embedding()
        check_revision(self.model_path, self.revision, "--model", "--revision")
        check_revision(self.speculative_draft_model_path, self.speculative_draft_model_revision,
                       "--speculative-draft-model-path", "--speculative-draft-model-revision")
        for origin in comma_list(self.allowed_origins):
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin such as https://app.example")
        names = comma_list(self.metrics_names)
        if not names or not set(names) <= {"pyserve", "sglang", "vllm"}:
            raise ValueError("--metrics-names takes one or more of pyserve, sglang, vllm, comma-separated")

    # Options about generated text, which an embedding server never makes.
    _GENERATION_ONLY = ("chat_template", "reasoning_parser", "tool_call_parser", "default_max_tokens",
                        "enable_torch_compile")

    def _validate_embedding(self) -> None:
        given = [name for name in self._GENERATION_ONLY if getattr(self, name) not in (None, False)]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"{flags}: generation options make no sense with --is-embedding")

    def _validate_tensor_parallel(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1:
            raise ValueError("--tp-size and --nnodes must be at least 1")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} "
                             "(each node runs as many ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be between 0 and --nnodes - 1 ({self.nnodes - 1})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT, an address of node 0 "
                             "that every node reaches")
        if self.dist_init_addr is not None and not re.fullmatch(r"[^\s:]+:\d{1,5}|\[[0-9a-fA-F:.]+\]:\d{1,5}",
                                                                self.dist_init_addr):
            raise ValueError(f"--dist-init-addr {self.dist_init_addr!r} is not HOST:PORT")
        if self.tp_size > 1 and self.enable_torch_compile:
            raise ValueError("--enable-torch-compile is not supported with --tp-size > 1 (the compiled layers "
                             "would hold the ranks' all-reduce); it buys little on the CPU anyway")

    def resolved(self) -> ServerArgs:
        """A copy with every "auto" made concrete for this machine: device
        ("cpu" or "cuda"), dtype, attention backend and overlap scheduling
        (a bool); the CUDA graphs' largest batch, which every rank
        captures alike, capped by the running batch; Hub ids as local directories; and the speculative
        draft's shape, which the model's architecture decides where left out. Resolving a resolved
        copy changes nothing. Start-up resolves once, then splits."""
        import torch  # here, so that `pyserve --help` answers without loading torch

        cuda_available = torch.cuda.is_available()
        if self.device == "cuda" and not cuda_available:
            raise ValueError("--device cuda was asked for, but CUDA is not available")
        device = self.device
        if device == "auto":
            device = "cuda" if cuda_available else "cpu"
        on_cuda = device == "cuda"
        located = self._located()
        return replace(
            located,
            device=device,
            dtype=("bfloat16" if on_cuda else "float32") if self.dtype == "auto" else self.dtype,
            attention_backend=(("triton" if on_cuda else "torch") if self.attention_backend == "auto"
                               else self.attention_backend),
            disable_overlap_schedule=(not on_cuda or self.speculative_algorithm is not None
                                      if self.disable_overlap_schedule is None else self.disable_overlap_schedule),
            cuda_graph_max_bs=min(self.cuda_graph_max_bs, self.max_running_requests),
            **located._draft_shape(on_cuda),
        )

    def _located(self) -> ServerArgs:
        """A copy whose paths are local: Hub ids as their snapshots (the API keeps the name given)."""
        model_path = self.model_path and local_model_dir(self.model_path, self.revision, self.download_dir, "--model")
        tokenizer_path = self.tokenizer_path and local_model_dir(self.tokenizer_path, None, self.download_dir,
                                                                 "--tokenizer-path")
        draft_path = self.speculative_draft_model_path
        if self.speculative_algorithm is not None and draft_path:  # without it, start-up refuses the option
            draft_path = local_model_dir(draft_path, self.speculative_draft_model_revision, self.download_dir,
                                         "--speculative-draft-model-path", "--speculative-draft-model-revision")
        return replace(self, model_path=model_path, tokenizer_path=tokenizer_path, speculative_draft_model_path=draft_path,
                       served_model_name=self.served_model_name or self.model_path)

    def _draft_shape(self, on_cuda: bool) -> dict[str, int | None]:
        """--speculative-num-steps, -eagle-topk and -num-draft-tokens, made
        concrete where speculation is on."""
        if self.speculative_algorithm is None:
            return {}
        from pyserve.engine.speculative.options import draft_shape

        steps, topk, tokens = draft_shape(self.speculative_algorithm, self.model_path, on_cuda,
                                          self.speculative_num_steps, self.speculative_eagle_topk,
                                          self.speculative_num_draft_tokens)
        return dict(speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)

    def split(self) -> Options:
        """Each layer's group of these options (resolved ones: see `resolved`)."""
        server, engine, model = (group(**{f.name: getattr(self, f.name) for f in fields(group)})
                                 for group in (ServerOptions, EngineOptions, ModelOptions))
        return Options(server, engine, model)

    def reported(self) -> dict[str, Any]:
        """Every option by name but the secret ones: what /get_server_info
        reports, as SGLang's does."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata["secret"]}
