"""The options, each declared once, as a field of the one group that reads
it: ModelOptions (every tensor-parallel rank), EngineOptions (the
scheduler) or ServerOptions (HTTP and the API). Its default is the
field's, and its flags, help and choices are in the field's metadata
(option_fields.py); they are named as SGLang names them. ServerArgs
(server_args.py) is the three groups side by side: the command line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import NamedTuple

from pyserve.completion_template import CHOICES as COMPLETION_TEMPLATES
from pyserve.model.quantized.scheme import CHOICES as CHECKPOINT_QUANTIZATIONS
from pyserve.option_fields import flags_of, option


@dataclass(frozen=True)
class ModelOptions:
    """What loads and runs the model, on every tensor-parallel rank: rank 0's
    ModelRunner and the worker processes receive these options and no others."""

    model_path: str | None = option(None, "--model", "--model-path",
                                    help="a Hugging Face model directory, or a Hub id (OWNER/NAME) found in or "
                                         "downloaded to the Hugging Face cache (default: the embedded model)")
    revision: str | None = option(None, help="with a Hub id: the branch, tag or commit to serve (default: main)")
    tokenizer_path: str | None = option(None, "--tokenizer-path", "--tokenizer", help="a directory or Hub id whose tokenizer and chat template are served")
    skip_tokenizer_init: bool = option(False, help="load no tokenizer: /generate takes input_ids and answers "
                                       "output_ids (no text, no stop strings, no constraints); the text routes are "
                                       "refused")
    trust_remote_code: bool = option(False, help="accepted from SGLang's launch lines: pyserve runs no repository code")
    download_dir: str | None = option(None, help="the Hugging Face cache Hub ids are found in and downloaded to")
    is_embedding: bool = option(False, help="serve /v1/embeddings from an embedding model (pooling from its "
                                "sentence-transformers files) instead of generating text; on by itself for a model "
                                "that cannot generate (an encoder, a sequence classifier)",
                                alias=("--runner", {"generate": False, "pooling": True},
                                       "vLLM's name: pooling is --is-embedding"))
    dtype: str = option("auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: float32 on CPU, bfloat16 on CUDA")
    device: str = option("auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available, else cpu")
    context_length: int | None = option(None, "--context-length", "--max-model-len", help="longest prompt + completion (default: the model's)")
    load_format: str = option("auto", choices=["auto", "safetensors", "dummy"],
                              help="auto, safetensors: the checkpoint's safetensors files; dummy: none read, weights "
                                   "drawn at random, to measure speed and memory without them (config.json and the "
                                   "tokenizer suffice)")
    json_model_override_args: str = option("{}", help="a JSON object whose keys replace config.json's (e.g. "
                                           "rope_scaling and max_position_embeddings for a longer context)")
    max_total_tokens: int | None = option(None, help="KV cache capacity in tokens")
    mem_fraction_static: float | None = option(
        None, "--mem-fraction-static", "--gpu-memory-utilization", help="share of GPU memory for weights and KV cache (default 0.85)")
    kv_cache_dtype: str = option("auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"], spellings={"fp8": "fp8_e4m3"},
                                 help="what the KV cache stores: auto, the model's dtype; fp8_e4m3 or fp8_e5m2, a "
                                      "byte a value (twice bfloat16's tokens in the same memory), rounded; vLLM's "
                                      "fp8 is fp8_e4m3")
    page_size: int = option(1, "--page-size", "--block-size", help="tokens per KV cache page; the prefix cache shares whole pages")
    swa_full_tokens_ratio: float = option(
        0.8, help="models with sliding-window layers: the sliding layers' KV pool holds this share of the "
        "full pool's tokens")
    attention_backend: str = option("auto", choices=["auto", "torch", "triton"],
                                    help="auto: triton on CUDA, torch on CPU")
    disable_cuda_graph: bool = option(False, "--disable-cuda-graph", "--enforce-eager", help="run decode steps eagerly instead of replaying CUDA graphs")
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
    random_seed: int = option(0, "--random-seed", "--seed", help="seed of sampling for requests that set none")
    # Tensor parallelism (README "Tensor parallelism"), named as SGLang names it.
    tp_size: int = option(1, "--tp-size", "--tp", "--tensor-parallel-size", "-tp",
                          help="tensor-parallel ranks the model is split over: one process (and on CUDA one GPU) each")
    nnodes: int = option(1, help="machines the tensor-parallel ranks run on, --tp-size / --nnodes on each")
    node_rank: int = option(0, help="this machine's place among --nnodes: 0 serves the API, the others run only "
                                    "their tensor-parallel ranks")
    dist_init_addr: str | None = option(
        None, help="HOST:PORT on node 0 where the tensor-parallel ranks meet (needed with --nnodes > 1; "
                   "default on one machine: a free local port)")
    # Other parallelisms SGLang's and vLLM's launch lines name: one of each (the defaults) runs.
    dp_size: int = option(1, "--dp-size", "--dp", "--data-parallel-size", "-dp",
                          help="data-parallel replicas: 1; more are refused (run replicas behind the smg gateway)")
    pp_size: int = option(1, "--pp-size", "--pipeline-parallel-size", "-pp",
                          help="pipeline stages: 1; more are refused (split the model with --tp-size)")
    # LoRA adapters (README "LoRA adapters"), named as SGLang names them.
    enable_lora: bool = option(False, help="serve LoRA adapters over the base model, picked per request by name")
    lora_paths: str | None = option(None, "--lora-paths", "--lora-modules", items=True,
                                    help="adapters loaded at start, NAME=PATH (a PEFT adapter directory or Hub id) each, "
                                         "space- or comma-separated")
    max_loras_per_batch: int = option(8, "--max-loras-per-batch", "--max-loras", help="adapter slots: the most adapters loaded at once, every one of "
                                              "which a batch may mix")
    max_lora_rank: int = option(64, help="the largest adapter rank the slots hold")

    @property
    def config_overrides(self) -> dict:
        """--json-model-override-args parsed: the config.json keys it replaces
        (ServerArgs.validate checks it is a JSON object)."""
        return json.loads(self.json_model_override_args)


@dataclass(frozen=True)
class EngineOptions:
    """How the engine schedules requests over the model."""

    max_running_requests: int = option(64, "--max-running-requests", "--max-num-seqs", help="running batch cap")
    max_queued_requests: int | None = option(None, help="refuse requests with a 503 while this many wait (batch jobs excepted)")
    max_prefill_tokens: int = option(8192, help="token budget of one prefill step when chunking is off")
    chunked_prefill_size: int = option(
        2048, "--chunked-prefill-size", "--max-num-batched-tokens", help="compute longer prompts a chunk per step, letting decode steps in between; -1 disables")
    schedule_policy: str = option(
        "fcfs", choices=["fcfs", "lpm", "lof", "random"],
        help="the order waiting requests of equal urgency start in: fcfs, arrival; lpm, the longest cached prompt "
             "prefix first; lof, the longest max_tokens first; random")
    disable_radix_cache: bool = option(False, "--disable-radix-cache", "--no-enable-prefix-caching",
                                       help="do not reuse the KV of shared prompt prefixes",
                                       inverse=("--enable-prefix-caching", "vLLM's: reuse them (the default)"))
    enable_prompt_embeds: bool = option(
        False, help="take prompts as embeddings: vLLM's prompt_embeds (/v1/completions), SGLang's input_embeds "
                    "(/generate); their KV is not shared through the prefix cache")
    enable_custom_logit_processor: bool = option(
        False, help="run the custom logit processors clients send (SGLang's custom_logit_processor on /generate): "
                    "unpickling one runs the client's code in the server, so only for clients you trust")
    enable_return_hidden_states: bool = option(
        False, help="serve requests' return_hidden_states (SGLang's): the final-norm hidden state of every token "
                    "the model reads, their prompts computed whole")
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
    stream_interval: int = option(1, help="tokens a request gathers before its next output is sent (the first "
                                          "at once): fewer, larger stream chunks")
    decode_log_interval: int = option(40, help="decode steps between 'Decode batch.' log lines")
    watchdog_timeout: float | None = option(
        None, help="seconds a forward step may run before the process ends with every thread's stack in the log, "
                   "for a supervisor to restart it (default: no limit)")
    log_requests: bool = option(False, "--log-requests", "--enable-log-requests",
                                help="log a line when each request arrives and one when it ends",
                                inverse=("--disable-log-requests", "vLLM's: no request lines (the default)"))
    log_requests_level: int = option(2, choices=[0, 1, 2, 3], help="how much of each: 0 ids and sizes, 1 and "
                                     "sampling parameters, 2 and text cut to 2048 characters, 3 the whole text")
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
        None, help="STANDALONE: the draft model's directory or Hub id (a smaller model with the target's tokenizer); "
                   "EAGLE3, EAGLE: the draft head's (SGLang's checkpoint formats); EAGLE, NEXTN: "
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
    speculative_draft_load_format: str | None = option(
        None, choices=["auto", "safetensors", "dummy"],
        help="the draft model's (STANDALONE) or multi-token-prediction layer's (NEXTN) --load-format (default: the "
             "target's); EAGLE heads load from their checkpoint")
    speculative_config: str | None = option(
        None, help="vLLM's: a JSON object (method ngram, draft_model, eagle3, eagle, deepseek_mtp or mtp; "
                   "num_speculative_tokens; model, revision, quantization; prompt_lookup_min and _max) read as "
                   "the --speculative-* options it means, which it may not be given beside")
    speculative_draft_attention_backend: str | None = option(
        None, choices=["torch", "triton"], help="the draft model's or head's attention backend (default: the "
                                                "target's --attention-backend)")
    speculative_attention_mode: str = option(
        "prefill", choices=["prefill", "decode"],
        help="SGLang's pick between its prefill and decode attention backends for verify and draft steps; pyserve "
             "attends with --attention-backend in both phases, so both modes run the same")

    def speculative_flags_given(self) -> list[str]:
        """The --speculative-* options set to other than their defaults."""
        return [flags_of(f)[0] for f in fields(EngineOptions)
                if f.name.startswith("speculative_") and getattr(self, f.name) != f.default]


@dataclass(frozen=True)
class ServerOptions:
    """The HTTP server and the API over the engine: what the app, its
    routes and its stores read. The API key stays here, in the server."""

    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(30000, help="port to listen on")
    log_level: str = option("info", choices=["debug", "info", "warning", "error"], help="log level")
    served_model_name: str | None = option(None, items=True,
                                           help="model name reported by the API (default: the model path); given "
                                                "several, space-separated, the server answers to each and reports "
                                                "the first")
    chat_template: str | None = option(
        None, help="jinja2 chat template file, or a name from templates/ (chatml, llama3, ...)")
    completion_template: str = option(
        "auto", choices=COMPLETION_TEMPLATES,
        help="the fill-in-the-middle markers /v1/completions' suffix is asked with: auto, those the tokenizer holds "
             "(qwen_coder's <|fim_prefix|>..., star_coder's <fim_prefix>..., deepseek_coder's); none refuses suffix")
    reasoning_parser: str | None = option(None, choices=["qwen3", "glm45", "deepseek-r1", "qwen3-thinking", "minimax",
                                                         "gpt-oss"],
                                          spellings={"deepseek_r1": "deepseek-r1", "openai_gptoss": "gpt-oss",
                                                     "minimax_m2": "minimax"},
                                          help="split the reasoning (<think>...</think>, which the template opens "
                                               "for deepseek-r1, qwen3-thinking and minimax; gpt-oss: the analysis "
                                               "channel) into reasoning_content (vLLM's names, such as deepseek_r1, "
                                               "name the same)")
    # SGLang's names (qwen25 and hermes are one format), vLLM's read as they are.
    tool_call_parser: str | None = option(None, choices=["qwen25", "hermes", "llama3", "mistral", "deepseekv3",
                                                         "deepseekv31", "pythonic", "qwen3_coder", "minimax-m2", "glm45",
                                                         "glm47", "gpt-oss"],
                                          spellings={"llama3_json": "llama3", "llama4_pythonic": "pythonic",
                                                     "deepseek_v3": "deepseekv3", "deepseek_v31": "deepseekv31",
                                                     "minimax_m2": "minimax-m2", "openai": "gpt-oss"},
                                          help="read tool calls in chat output into message.tool_calls (vLLM's "
                                               "names, such as llama3_json, name the same formats)")
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
    sampling_defaults: str = option(
        "model", choices=["model", "openai"], alias=("--generation-config", {"auto": "model", "vllm": "openai"},
                                                     "vLLM's name: auto is model, vllm is openai"), help="what a request that leaves temperature, top_p, top_k, min_p or "
        "repetition_penalty out samples with: model, generation_config.json's recommendation where it has one; "
        "openai, OpenAI's defaults (1, 1, none, 0, 1)")
    preferred_sampling_params: str | None = option(
        None, help="a JSON object of temperature, top_p, top_k, min_p and repetition_penalty values that requests "
                   "leaving them out sample with, over generation_config.json's (SGLang's; /get_model_info "
                   "reports it)")
    allow_auto_truncate: bool = option(
        False, help="a prompt longer than the context keeps its first context - 1 tokens instead of being refused, "
                    "and max_tokens is lowered to the room left (SGLang's; vLLM's per-request truncate_prompt_tokens "
                    "keeps the last tokens)")
    enable_auto_tool_choice: bool = option(False, help="accepted from vLLM's launch lines: with --tool-call-parser, "
                                                       "tool_choice auto is served")
    enable_metrics: bool = option(False, help="accepted from SGLang's launch lines: /metrics is always served")
    enable_cache_report: bool = option(False, help="accepted from SGLang's launch lines: usage always reports "
                                                   "cached_tokens")


    def preferred_sampling(self) -> dict[str, float]:
        """--preferred-sampling-params parsed and checked (ValueError naming
        the flag); {} when not given."""
        if self.preferred_sampling_params is None:
            return {}
        from pyserve.api.generation.sampling import preferred_defaults  # not loaded for `pyserve --help`

        try:
            values = json.loads(self.preferred_sampling_params)
        except json.JSONDecodeError as e:
            raise ValueError(f"--preferred-sampling-params is not JSON: {e}") from None
        return preferred_defaults(values)


class Options(NamedTuple):
    """The options split by the layer that reads them (ServerArgs.split)."""

    server: ServerOptions
    engine: EngineOptions
    model: ModelOptions
