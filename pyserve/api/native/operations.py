"""The operational routes: /v1/models, and SGLang's /health_generate,
/get_model_info, /get_server_info (also without `get_`, as SGLang now names
them), /v1/loads, /metrics, /flush_cache, /configure_logging, /freeze_gc
and /version: what operators, load balancers and the smg gateway read or set.

They read the engine's public figures (kv_usage, integrity_problem,
metrics...), never its scheduler or KV pool.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
from datetime import datetime, timezone
from typing import Literal

import msgspec

from pyserve import __version__
from pyserve.http.errors import APIError, bad_request
from pyserve.api.openai.embeddings import serves_embeddings
from pyserve.http.io import Request, Response
from pyserve.http.strict import read_strict
from pyserve.api.protocol.openai import ModelCard, ModelList
from pyserve.api.protocol.native import AbortRequest
from pyserve.api.generation.serving import ServingContext, merged_outputs, new_id
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.option_fields import comma_list
from pyserve.options import ServerOptions

HEALTH_GENERATE_TIMEOUT = 20.0  # seconds


def _model_cards(ctx: ServingContext) -> list[ModelCard]:
    """The base model, under each of its names (vLLM lists them so)."""
    return [ModelCard(id=name, created=ctx.created, root=name, max_model_len=ctx.engine.context_len)
            for name in ctx.model_names]


def _adapter_cards(ctx: ServingContext) -> list[ModelCard]:
    """The loaded LoRA adapters, each with the base model as its parent (as vLLM lists them)."""
    adapters = ctx.engine.adapters
    if adapters is None:
        return []
    return [ModelCard(id=name, created=ctx.created, root=adapters.registry.paths[name],
                      parent=ctx.served_model_name, max_model_len=ctx.engine.context_len) for name in adapters.names()]


def models(ctx: ServingContext) -> ModelList:
    return ModelList(data=[*_model_cards(ctx), *_adapter_cards(ctx)])


def retrieve_model(ctx: ServingContext, model: str) -> ModelCard:
    card = next((c for c in models(ctx).data if c.id == model), None)
    if card is None:
        raise APIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")
    return card


async def health_generate(ctx: ServingContext) -> None:
    """SGLang's deep health check: the engine generates one token in time."""
    if ctx.gate.pause_mode is not None:
        raise APIError("generation is paused: POST /continue_generation resumes it", 503, "server_error")
    if ctx.gate.memory_released:
        raise APIError("the server's memory is released: POST /resume_memory_occupation takes it back", 503,
                       "server_error")
    tokenizer = ctx.engine.tokenizer
    ids = tokenizer.encode("Hello", add_special_tokens=True) if tokenizer is not None else [0]  # 0: any token
    req = GenerateRequest(ids, SamplingParams(max_new_tokens=1, temperature=0.0), new_id("health-"),
                          embedding=serves_embeddings(ctx))  # an embedding server computes one embedding

    async def one_token():
        async for _ in merged_outputs(ctx.engine, [req]):
            pass

    try:
        await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT)
    except asyncio.TimeoutError:
        raise APIError("the engine did not generate a token in time", 503, "server_error") from None
    except APIError as e:
        raise APIError(f"the engine did not generate a token: {e.message}", 503, "server_error") from None


def model_info(ctx: ServingContext) -> dict:
    preferred = ctx.server_args.get("preferred_sampling_params")  # --preferred-sampling-params, as given
    return {
        "model_path": str(ctx.engine.model_dir),
        "tokenizer_path": str(ctx.engine.tokenizer_dir),
        "served_model_name": ctx.served_model_name,
        "is_generation": not serves_embeddings(ctx),
        "architecture": ctx.engine.model_config.architecture,
        "context_length": ctx.engine.context_len,
        "preferred_sampling_params": json.loads(preferred) if preferred else None,
        "weight_version": ctx.gate.version,
        "version": __version__,
    }


def metrics(ctx: ServingContext) -> Response:
    """Prometheus text: request counters and latency histograms, and the
    engine's state now."""
    engine = ctx.engine
    m = engine.metrics
    gauges = {
        "num_running_reqs": (engine.num_running, "Requests in the running batch."),
        "num_queue_reqs": (engine.num_waiting, "Requests waiting to be scheduled."),
        "token_usage": (round(engine.token_usage(), 4),
                        "Share of the KV cache running requests need (cached prefixes nobody uses excluded)."),
        "cache_hit_rate": (_cache_hit_rate(engine), "Share of prompt tokens served from the prefix cache."),
    }
    families = tuple(comma_list(ctx.server_args.get("metrics_names", ServerOptions.metrics_names)))
    return Response(200, m.render(gauges, families, ctx.served_model_name).encode(),
                    "text/plain; version=0.0.4; charset=utf-8")


def _cache_hit_rate(engine) -> float:
    m = engine.metrics
    return round(m.cached_tokens / m.prompt_tokens, 4) if m.prompt_tokens else 0.0


def loads(ctx: ServingContext) -> dict:
    """SGLang's /v1/loads: the load of each data-parallel rank (pyserve has
    one), which the smg gateway polls for its load-aware routing."""
    engine = ctx.engine
    kv = engine.kv_usage()
    load = {
        "dp_rank": 0,
        "num_running_reqs": engine.num_running,
        "num_waiting_reqs": engine.num_waiting,
        "num_total_reqs": engine.num_running + engine.num_waiting,
        "num_used_tokens": kv["in_use"],
        "max_total_num_tokens": kv["total"],
        "token_usage": round(engine.token_usage(), 4),
        "cache_hit_rate": _cache_hit_rate(engine),
        "max_running_requests": engine.max_running_requests,
    }
    return {"timestamp": datetime.now(timezone.utc).isoformat(), "dp_rank_count": 1, "loads": [load]}


def get_load(ctx: ServingContext) -> list[dict]:
    """SGLang's /get_load: each data-parallel rank's requests (running and
    waiting) and the KV tokens they hold."""
    engine = ctx.engine
    return [{"dp_rank": 0, "num_reqs": engine.num_running + engine.num_waiting,
             "num_waiting_reqs": engine.num_waiting, "num_tokens": engine.kv_usage()["in_use"]}]


class ConfigureLoggingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's body; a field left out (or null) keeps its setting."""

    log_requests: bool | None = None
    log_requests_level: Literal[0, 1, 2, 3] | None = None
    # SGLang's others, which pyserve has no counterpart of: refused when set.
    log_requests_format: str | None = None
    dump_requests_folder: str | None = None
    dump_requests_threshold: int | None = None
    crash_dump_folder: str | None = None
    dump_requests_exclude_meta_keys: list[str] | None = None


_NOT_CONFIGURED = ("log_requests_format", "dump_requests_folder", "dump_requests_threshold", "crash_dump_folder",
                   "dump_requests_exclude_meta_keys")


async def configure_logging(ctx: ServingContext, request: Request) -> Response:
    """SGLang's POST /configure_logging: --log-requests and
    --log-requests-level, changed while the server runs."""
    req = await read_strict(request, ConfigureLoggingRequest, "/configure_logging")
    refused = next((name for name in _NOT_CONFIGURED if getattr(req, name) is not None), None)
    if refused is not None:
        raise bad_request(f"{refused}: pyserve logs requests as lines of its log (--log-requests), and dumps none",
                          refused)
    ctx.engine.request_log.configure(req.log_requests, req.log_requests_level)
    return Response(200, b"")


def freeze_gc(ctx: ServingContext) -> Response:
    """SGLang's /freeze_gc: every object the server holds now (the model,
    the caches, what start-up made) leaves the garbage collector's scans,
    which then cost less (gc.freeze)."""
    gc.freeze()
    return Response(200, b"Garbage collection frozen.\n", "text/plain; charset=utf-8")


def flush_cache(ctx: ServingContext) -> Response:
    """SGLang's POST /flush_cache: drop every cached prefix, when idle."""
    if not ctx.engine.flush_cache():
        raise bad_request("cannot flush the cache while requests are running")
    return Response(200, b"Cache flushed.\n", "text/plain; charset=utf-8")


def abort_request(ctx: ServingContext, req: AbortRequest) -> Response:
    """SGLang's POST /abort_request: stop the request a client named by its
    `rid` (each of its prompts and choices: rid-P, rid-I, rid-P-I, as
    fan_out names them), or every request with `abort_all`. Its client
    gets what was generated so far, finish_reason "abort"; an id no
    request has is no error (it may have just ended)."""
    if not req.rid and not req.abort_all:
        raise bad_request("give the rid of the request to abort, or abort_all: true", "rid")
    if req.abort_all:
        ctx.engine.abort_all()
    else:
        of_rid = re.compile(re.escape(req.rid) + r"(-\d+){0,2}")
        for rid in ctx.engine.request_ids:
            if of_rid.fullmatch(rid):
                ctx.engine.abort(rid)
    return Response(200, b"", "text/plain; charset=utf-8")


def server_info(ctx: ServingContext) -> dict:
    """The options the server runs with, as SGLang reports its server args
    (the API key left out), then the engine's state now, for operators and
    for tests that check nothing leaked: where an option says "the
    default", the value the engine chose (KV capacity, context length);
    `internal_states` as SGLang's tools read it (one scheduler: one entry)."""
    engine = ctx.engine
    kv = engine.kv_usage()
    return {
        **ctx.server_args,
        "model_path": str(engine.model_dir),
        "served_model_name": ctx.served_model_name,
        "version": __version__,
        "max_total_tokens": kv["total"],
        "max_running_requests": engine.max_running_requests,
        "num_running_reqs": engine.num_running,
        "num_waiting_reqs": engine.num_waiting,
        "kv_tokens_total": kv["total"],
        "kv_tokens_free": kv["free"],
        "kv_tokens_in_use": kv["in_use"],
        "kv_tokens_cached": kv["cached"],
        "kv_tokens_cached_evictable": kv["cached_evictable"],
        "kv_page_size": kv["page_size"],
        "kv_integrity": engine.integrity_problem() or "ok",
        "context_length": engine.context_len,
        "internal_states": [engine.internal_state()],
    }


def version(ctx: ServingContext) -> dict:
    return {"version": __version__}


def health(ctx: ServingContext) -> None:
    """Liveness: the server answers (load balancers probe it without a key)."""
    return None
