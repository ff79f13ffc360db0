"""SGLang's native routes (/generate, /get_model_info, /health_generate...) and /v1/models."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from pyserve import __version__
from pyserve.api.errors import APIError, bad_request
from pyserve.api.http import Response
from pyserve.api.logprobs import MAX_TOP_LOGPROBS
from pyserve.api.protocol import ModelCard, ModelList, NativeGenerateRequest
from pyserve.api.sampling import build_params, check_context
from pyserve.api.serving import (
    ServingContext, check_prompt_ids, check_requests, choice_requests, merged_outputs, new_id,
)
from pyserve.engine.request import GenerateOutput, GenerateRequest, SamplingParams

HEALTH_GENERATE_TIMEOUT = 20.0  # seconds

# SGLang's sampling_params names and defaults
_SAMPLING_KEYS = {
    "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "stop": None, "stop_token_ids": None, "ignore_eos": False, "skip_special_tokens": True,
    "n": 1, "seed": None, "logit_bias": None,
}


def _model_card(ctx: ServingContext) -> ModelCard:
    name = ctx.served_model_name
    return ModelCard(id=name, created=ctx.created, root=name, max_model_len=ctx.engine.context_len)


def models(ctx: ServingContext) -> ModelList:
    return ModelList(data=[_model_card(ctx)])


def retrieve_model(ctx: ServingContext, model: str) -> ModelCard:
    if model != ctx.served_model_name:
        raise APIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")
    return _model_card(ctx)


async def health_generate(ctx: ServingContext) -> None:
    """SGLang's deep health check: the engine generates one token in time."""
    ids = ctx.engine.tokenizer.encode("Hello", add_special_tokens=True)
    req = GenerateRequest(ids, SamplingParams(max_new_tokens=1, temperature=0.0), new_id("health-"))

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
    return {
        "model_path": str(ctx.engine.model_dir),
        "tokenizer_path": str(ctx.engine.model_dir),
        "served_model_name": ctx.served_model_name,
        "is_generation": True,
        "architecture": ctx.engine.model_config.architecture,
        "context_length": ctx.engine.context_len,
        "version": __version__,
    }


def metrics(ctx: ServingContext) -> Response:
    """Prometheus text: request counters and latency histograms, and the
    engine's state now."""
    engine = ctx.engine
    m = engine.metrics
    kv = engine.kv_usage()
    gauges = {
        "num_running_reqs": (engine.num_running, "Requests in the running batch."),
        "num_queue_reqs": (engine.num_waiting, "Requests waiting to be scheduled."),
        "token_usage": (round(1 - kv["free"] / kv["total"], 4), "Share of the KV cache in use."),
        "cache_hit_rate": (round(m.cached_tokens / m.prompt_tokens, 4) if m.prompt_tokens else 0.0,
                           "Share of prompt tokens served from the prefix cache."),
    }
    return Response(200, m.render(gauges).encode(), "text/plain; version=0.0.4; charset=utf-8")


def flush_cache(ctx: ServingContext) -> Response:
    """SGLang's POST /flush_cache: drop every cached prefix, when idle."""
    if not ctx.engine.flush_cache():
        raise bad_request("cannot flush the cache while requests are running")
    return Response(200, b"Cache flushed.\n", "text/plain; charset=utf-8")


def server_info(ctx: ServingContext) -> dict:
    """Live engine state, for operators and for tests that check nothing leaked."""
    engine = ctx.engine
    kv = engine.kv_usage()
    return {
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
    }


def _params(ctx: ServingContext, raw: dict | None):
    raw = dict(raw or {})
    unknown = sorted(set(raw) - set(_SAMPLING_KEYS))
    if unknown:
        raise bad_request(f"unknown sampling_params: {unknown}", "sampling_params")
    values = {**_SAMPLING_KEYS, **raw}
    n = values.pop("n")
    max_new = values.pop("max_new_tokens")
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not isinstance(values[key], (int, float)) or isinstance(values[key], bool):
            raise bad_request(f"sampling_params.{key} must be a number", f"sampling_params.{key}")
    if not isinstance(max_new, int) or not isinstance(n, int):
        raise bad_request("sampling_params.max_new_tokens and n must be integers", "sampling_params")
    params = build_params(max_tokens=max_new, n=n, vocab_size=ctx.engine.vocab_size,
                          max_tokens_param="sampling_params.max_new_tokens", **values)
    return params, n, max_new


def _meta(rid: str, out: GenerateOutput, started: float, logprobs: "_Logprobs | None" = None) -> dict:
    if out.finish_reason == "stop":
        reason = {"type": "stop", "matched": out.matched_stop}
    elif out.finish_reason == "length":
        reason = {"type": "length", "length": out.completion_tokens}
    else:
        reason = None
    return {
        "id": rid,
        "finish_reason": reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "e2e_latency": time.perf_counter() - started,
        **(logprobs.meta() if logprobs else {}),
    }


async def generate(ctx: ServingContext, req: NativeGenerateRequest):
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", "text")
    tok = ctx.engine.tokenizer
    if req.text is not None:
        single = isinstance(req.text, str)
        prompts = tok.encode_batch([req.text] if single else req.text, add_special_tokens=True)
    else:
        ids = req.input_ids
        single = isinstance(ids, list) and all(isinstance(i, int) for i in ids)
        prompts = [ids] if single else ids
        if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
            raise bad_request("input_ids must be a list of token ids or a list of such lists", "input_ids")
    for ids in prompts:
        check_prompt_ids(ctx, ids, "input_ids" if req.input_ids is not None else "text")
    params, n, max_new = _params(ctx, req.sampling_params)
    if req.return_logprob:
        if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs_num must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs_num")
        params = replace(params, logprobs=True, top_logprobs=req.top_logprobs_num,
                         prompt_logprobs=req.logprob_start_len >= 0)
    for ids in prompts:
        check_context(len(ids), max_new, ctx.engine.context_len, where="prompt")
    base = req.rid or new_id("")
    requests = []
    for p, ids in enumerate(prompts):
        requests += choice_requests(ids, params, n, f"{base}-{p}" if len(prompts) > 1 else base)
    check_requests(ctx.engine, requests, "input_ids" if req.input_ids is not None else "text")
    started = time.perf_counter()
    logprobs = [_Logprobs(ctx, req, r.input_ids) for r in requests] if req.return_logprob else None
    if req.stream:
        return _stream(ctx, requests, started, logprobs)
    texts = [""] * len(requests)
    results: list[dict] = [{}] * len(requests)
    async for i, out in merged_outputs(ctx.engine, requests):
        texts[i] += out.text
        if logprobs:
            logprobs[i].add(out)
        if out.finished:
            results[i] = {"text": texts[i], "meta_info": _meta(requests[i].rid, out, started, logprobs and logprobs[i])}
    # As SGLang answers: one object for one text, a list for a batch or n > 1.
    return results[0] if single and n == 1 else results


async def _stream(ctx: ServingContext, requests, started: float, logprobs) -> AsyncIterator[dict]:
    texts = [""] * len(requests)
    async for i, out in merged_outputs(ctx.engine, requests):
        texts[i] += out.text
        if logprobs:
            logprobs[i].add(out)
        event = {"text": texts[i], "meta_info": _meta(requests[i].rid, out, started, logprobs and logprobs[i])}
        if len(requests) > 1:
            event["index"] = i
        yield event


class _Logprobs:
    """SGLang's meta_info logprob lists for one request, built up as its
    outputs arrive: entries are [logprob, token_id, text or None]."""

    def __init__(self, ctx: ServingContext, req: NativeGenerateRequest, prompt_ids: list[int]):
        self.texts = ctx.token_texts if req.return_text_in_logprobs else None
        self.start = req.logprob_start_len
        self.prompt_ids = prompt_ids
        self.input: list = []
        self.input_top: list = []
        self.output: list = []
        self.output_top: list = []

    def _entry(self, logprob: float | None, token_id: int) -> list:
        return [logprob, token_id, self.texts.text(token_id) if self.texts else None]

    def add(self, out: GenerateOutput) -> None:
        if out.prompt_logprobs is not None:
            for pos, e in enumerate(out.prompt_logprobs[self.start :], start=self.start):
                if e is None:  # the first prompt token: nothing scores it
                    self.input.append(self._entry(None, self.prompt_ids[pos]))
                    self.input_top.append(None)
                else:
                    self.input.append(self._entry(e.logprob, e.token_id))
                    self.input_top.append([self._entry(lp, i) for i, lp in e.top])
        for e in out.logprobs or []:
            self.output.append(self._entry(e.logprob, e.token_id))
            self.output_top.append([self._entry(lp, i) for i, lp in e.top])

    def meta(self) -> dict:
        return {"input_token_logprobs": self.input, "output_token_logprobs": self.output,
                "input_top_logprobs": self.input_top, "output_top_logprobs": self.output_top}


def version() -> dict:
    return {"version": __version__}
