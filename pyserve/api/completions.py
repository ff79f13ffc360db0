"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pyserve.api.constraints import request_constraint
from pyserve.api.errors import bad_request
from pyserve.api.logprobs import MAX_TOP_LOGPROBS, PendingLogprobs, completion_logprobs
from pyserve.api.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from pyserve.api.sampling import sampling_params
from pyserve.api.serving import (
    ChunkFactory, ServingContext, collect, fan_out, merged_outputs, new_id, now, prompt_id_lists, usage,
)
from pyserve.engine.request import GenerateOutput, GenerateRequest


async def create(ctx: ServingContext, req: CompletionRequest, priority: int = 0):
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if isinstance(req.logprobs, bool) or req.top_logprobs is not None:
        raise bad_request("completions take logprobs as the number of alternatives, 0 to "
                          f"{MAX_TOP_LOGPROBS}", "logprobs")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    prompts, _ = prompt_id_lists(ctx.engine.tokenizer, req.prompt, "prompt")
    constrained = request_constraint(req)
    params = sampling_params(req, req.max_tokens, ctx.engine.vocab_size, top_logprobs=req.logprobs,
                             top_logprobs_param="logprobs", prompt_logprobs=req.echo and req.logprobs is not None,
                             constraint=constrained and constrained.constraint)
    rid = req.rid or new_id("cmpl-")
    names = {"prompt": "prompt", "max_new_tokens": "max_tokens", "constraint": constrained and constrained.param}
    requests = await fan_out(ctx.engine, prompts, params, req.n, rid, names, priority)
    echoes = _echoes(ctx, req.prompt, prompts) if req.echo else [""] * len(prompts)
    if req.stream:
        return _stream(ctx, req, requests, rid, echoes)
    results = await collect(ctx.engine, requests)
    choices = [
        CompletionChoice(
            index=i, text=echoes[i // req.n] + r.text,
            logprobs=(completion_logprobs(ctx.token_texts, r.prompt_logprobs + r.logprobs, 0,
                                          requests[i].input_ids[0])
                      if req.logprobs is not None else None),
            finish_reason=r.final.finish_reason, matched_stop=r.final.matched_stop,
        )
        for i, r in enumerate(results)
    ]
    return CompletionResponse(id=rid, created=now(), model=ctx.served_model_name, choices=choices,
                              usage=usage([r.final for r in results], req.n))


def _echoes(ctx: ServingContext, prompt, prompts: list[list[int]]) -> list[str]:
    """The prompt as sent when it was text, decoded when it was token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [ctx.engine.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


async def _stream(ctx: ServingContext, req: CompletionRequest, requests: list[GenerateRequest], rid: str,
                  echoes: list[str]) -> AsyncIterator:
    chunk = ChunkFactory(CompletionResponse, rid, ctx.served_model_name)
    if req.echo:
        for i in range(len(requests)):
            yield chunk([CompletionChoice(index=i, text=echoes[i // req.n])])
    # Text offsets of logprobs run on across chunks.
    pending = PendingLogprobs(len(requests))
    offsets = [0] * len(requests)
    finals: list[GenerateOutput | None] = [None] * len(requests)
    async for i, out in merged_outputs(ctx.engine, requests):
        pending.add(i, (out.prompt_logprobs or []) + (out.logprobs or []))
        if out.finished:
            finals[i] = out
        if out.text or out.finished:
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(ctx.token_texts, pending.take(i), offsets[i], requests[i].input_ids[0])
                offsets[i] += sum(len(t) for t in logprobs.tokens)
            yield chunk([CompletionChoice(index=i, text=out.text, logprobs=logprobs, finish_reason=out.finish_reason,
                                          matched_stop=out.matched_stop)])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], usage(finals, req.n))
