"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pyserve.api.errors import bad_request
from pyserve.api.protocol import CompletionRequest
from pyserve.api.sampling import build_params, check_context
from pyserve.api.serving import (
    ServingContext, UsageCounter, check_prompt_ids, choice_requests, merged_outputs, new_id, now,
)


def prompt_id_lists(ctx: ServingContext, prompt) -> list[list[int]]:
    """The four prompt shapes OpenAI accepts: str, [str], [int], [[int]]."""
    tok = ctx.engine.tokenizer
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tok.encode_batch(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = prompt
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of those lists", "prompt")
    for ids in prompts:
        check_prompt_ids(ctx, ids, "prompt")
    return prompts


async def create(ctx: ServingContext, req: CompletionRequest, priority: int = 0):
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.logprobs:
        raise bad_request("logprobs are not supported yet", "logprobs")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    prompts = prompt_id_lists(ctx, req.prompt)
    params = build_params(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, n=req.n, stop=req.stop,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logit_bias=req.logit_bias, seed=req.seed, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        vocab_size=ctx.engine.vocab_size, default_max_tokens=ctx.default_max_tokens,
    )
    for ids in prompts:
        check_context(len(ids), req.max_tokens, ctx.engine.context_len, where="prompt")
    rid = req.rid or new_id("cmpl-")
    # Choice index = prompt index * n + sample index, as OpenAI numbers them.
    requests = []
    for p, ids in enumerate(prompts):
        requests += choice_requests(ids, params, req.n, f"{rid}-{p}" if len(prompts) > 1 else rid, priority)
    echoes = [ctx.engine.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
    if req.stream:
        return _stream(ctx, req, requests, rid, echoes)
    texts = [echoes[i // req.n] for i in range(len(requests))]
    finals = [None] * len(requests)
    counter = UsageCounter()
    async for i, out in merged_outputs(ctx.engine, requests):
        texts[i] += out.text
        if out.finished:
            finals[i] = out
            counter.add(i // req.n, out)
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": ctx.served_model_name,
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": out.finish_reason,
             "matched_stop": out.matched_stop}
            for i, (text, out) in enumerate(zip(texts, finals))
        ],
        "usage": counter.body(),
    }


async def _stream(ctx: ServingContext, req: CompletionRequest, requests, rid, echoes) -> AsyncIterator[dict]:
    created = now()

    def chunk(choices: list[dict], usage=None) -> dict:
        body = {"id": rid, "object": "text_completion", "created": created,
                "model": ctx.served_model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    counter = UsageCounter()
    if req.echo:
        for i in range(len(requests)):
            yield chunk([{"index": i, "text": echoes[i // req.n], "logprobs": None, "finish_reason": None}])
    async for i, out in merged_outputs(ctx.engine, requests):
        choice = {"index": i, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        if out.finished:
            choice["matched_stop"] = out.matched_stop
            counter.add(i // req.n, out)
        if out.text or out.finished:
            yield chunk([choice])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], counter.body())
