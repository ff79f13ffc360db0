"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from msgspec import UNSET

from pyserve.api.errors import bad_request
from pyserve.api.logprobs import MAX_TOP_LOGPROBS, completion_logprobs
from pyserve.api.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from pyserve.api.sampling import build_params, check_context
from pyserve.api.serving import (
    ServingContext, UsageCounter, check_prompt_ids, check_requests, choice_requests, merged_outputs, new_id, now,
)
from pyserve.engine.request import GenerateOutput, TokenLogprob


def prompt_id_lists(ctx: ServingContext, prompt) -> list[list[int]]:
    """The four prompt shapes OpenAI accepts: str, [str], [int], [[int]].

    Text gets the tokenizer's special tokens (a Llama BOS), as SGLang and
    vLLM encode completion prompts; token ids are taken as they are."""
    tok = ctx.engine.tokenizer
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt, add_special_tokens=True)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tok.encode_batch(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = prompt
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of those lists", "prompt")
    for ids in prompts:
        check_prompt_ids(ctx, ids, "prompt")
    return prompts


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
    prompts = prompt_id_lists(ctx, req.prompt)
    params = build_params(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, n=req.n, stop=req.stop,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logit_bias=req.logit_bias, seed=req.seed, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        vocab_size=ctx.engine.vocab_size,
        logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0, top_logprobs_param="logprobs",
    )
    params.prompt_logprobs = req.echo and req.logprobs is not None
    for ids in prompts:
        check_context(len(ids), req.max_tokens, ctx.engine.context_len, where="prompt")
    rid = req.rid or new_id("cmpl-")
    # Choice index = prompt index * n + sample index, as OpenAI numbers them.
    requests = []
    for p, ids in enumerate(prompts):
        requests += choice_requests(ids, params, req.n, f"{rid}-{p}" if len(prompts) > 1 else rid, priority)
    check_requests(ctx.engine, requests, "prompt")
    echoes = _echoes(ctx, req.prompt, prompts) if req.echo else [""] * len(prompts)
    if req.stream:
        return _stream(ctx, req, requests, rid, echoes)
    texts = [echoes[i // req.n] for i in range(len(requests))]
    logprobs: list[list[TokenLogprob | None]] = [[] for _ in requests]
    finals: list[GenerateOutput | None] = [None] * len(requests)
    counter = UsageCounter()
    async for i, out in merged_outputs(ctx.engine, requests):
        texts[i] += out.text
        logprobs[i] += (out.prompt_logprobs or []) + (out.logprobs or [])
        if out.finished:
            finals[i] = out
            counter.add(i // req.n, out)
    choices = [
        CompletionChoice(
            index=i, text=text,
            logprobs=(completion_logprobs(ctx.token_texts, logprobs[i], 0, requests[i].input_ids[0])
                      if req.logprobs is not None else None),
            finish_reason=out.finish_reason, matched_stop=out.matched_stop,
        )
        for i, (text, out) in enumerate(zip(texts, finals))
    ]
    return CompletionResponse(id=rid, created=now(), model=ctx.served_model_name, choices=choices,
                              usage=counter.body())


def _echoes(ctx: ServingContext, prompt, prompts: list[list[int]]) -> list[str]:
    """The prompt as sent when it was text, decoded when it was token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [ctx.engine.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


async def _stream(ctx: ServingContext, req: CompletionRequest, requests, rid, echoes) -> AsyncIterator:
    created = now()

    def chunk(choices: list[CompletionChoice], usage=UNSET) -> CompletionResponse:
        return CompletionResponse(id=rid, created=created, model=ctx.served_model_name, choices=choices,
                                  usage=usage)

    counter = UsageCounter()
    if req.echo:
        for i in range(len(requests)):
            yield chunk([CompletionChoice(index=i, text=echoes[i // req.n])])
    # Logprobs of tokens whose text is not out yet ride with the next chunk;
    # text offsets run on across chunks.
    pending: list[list[TokenLogprob | None]] = [[] for _ in requests]
    offsets = [0] * len(requests)
    async for i, out in merged_outputs(ctx.engine, requests):
        pending[i] += (out.prompt_logprobs or []) + (out.logprobs or [])
        if out.finished:
            counter.add(i // req.n, out)
        if out.text or out.finished:
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(ctx.token_texts, pending[i], offsets[i], requests[i].input_ids[0])
                offsets[i] += sum(len(t) for t in logprobs.tokens)
                pending[i] = []
            yield chunk([CompletionChoice(index=i, text=out.text, logprobs=logprobs, finish_reason=out.finish_reason,
                                          matched_stop=out.matched_stop)])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], counter.body())
