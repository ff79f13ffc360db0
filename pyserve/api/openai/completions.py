"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch
from msgspec import UNSET, UnsetType

from pyserve.api.generation.constraints import request_constraint
from pyserve.api.generation.prompt_embeds import embeds_from_base64
from pyserve.http.errors import bad_request
from pyserve.api.generation.logprobs import MAX_TOP_LOGPROBS, PendingLogprobs, completion_logprobs, prompt_logprobs
from pyserve.api.protocol.openai import CompletionChoice, CompletionRequest, CompletionResponse
from pyserve.api.generation.truncation import keep_last_tokens
from pyserve.api.generation.sampling import sampling_params, vllm_prompt_logprobs, with_logit_processor
from pyserve.api.generation.serving import (
    ChoiceResult, ChunkFactory, ServingContext, StreamUsage, adapter_name, answering_model, collect, fan_out,
    last_hidden_state, merged_outputs, new_id, now, prompt_id_lists, usage,
)
from pyserve.engine.request import GenerateRequest


async def create(ctx: ServingContext, req: CompletionRequest, batch: bool = False):
    if isinstance(req.logprobs, bool) or req.top_logprobs is not None:
        raise bad_request("completions take logprobs as the number of alternatives, 0 to "
                          f"{MAX_TOP_LOGPROBS}", "logprobs" if req.top_logprobs is None else "top_logprobs")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    prompts = keep_last_tokens(_prompts(ctx, req), req.truncate_prompt_tokens, ctx.engine.context_len)
    constrained = request_constraint(req)
    prompt_k = vllm_prompt_logprobs(req)
    params = sampling_params(req, req.max_tokens, ctx.engine.vocab_size, top_logprobs=req.logprobs,
                             top_logprobs_param="logprobs",
                             prompt_logprobs=(req.echo and req.logprobs is not None) or prompt_k is not None,
                             prompt_top_logprobs=prompt_k, constraint=constrained and constrained.constraint,
                             defaults=ctx.sampling_defaults, tokenizer=ctx.engine.tokenizer)
    params = with_logit_processor(params, req.custom_logit_processor, req.custom_params,
                                  ctx.engine.served.custom_logit_processor)
    rid = req.rid or new_id("cmpl-")
    names = {"prompt": "prompt", "max_new_tokens": "max_tokens", "constraint": constrained and constrained.param}
    requests = await fan_out(ctx, prompts, params, req.n, rid, names, batch=batch, priority=req.priority,
                             cache_salt=req.cache_salt, lora=adapter_name(ctx, req.model, req.lora_path))
    echoes = _echoes(ctx, req.prompt, prompts) if req.echo else [""] * len(prompts)
    if req.stream:
        return _stream(ctx, req, requests, rid, echoes)
    results = await collect(ctx.engine, requests)
    choices = [_choice(ctx, req, i, requests[i], r, echoes[i // req.n]) for i, r in enumerate(results)]
    return CompletionResponse(id=rid, created=now(), model=answering_model(ctx, req.model, req.lora_path),
                              choices=choices, usage=usage([r.final for r in results], req.n))


def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[list[int] | torch.Tensor]:
    """The prompts' token ids, after those given as embeddings (first, as vLLM orders them); with
    prompt_embeds, an empty `prompt` adds none."""
    embeds = [] if req.prompt_embeds is None else embeds_from_base64(req.prompt_embeds, "prompt_embeds")
    if embeds and (req.echo or req.suffix):
        raise bad_request(f"{'echo' if req.echo else 'suffix'} reads the prompt's text; a prompt given as embeddings "
                          "has none", "echo" if req.echo else "suffix")
    if embeds and req.prompt in (None, "", []):
        return embeds
    if req.prompt is None:
        raise bad_request("prompt is required (or prompt_embeds, with --enable-prompt-embeds)", "prompt")
    text = _fill_in_the_middle(ctx, req) if req.suffix else req.prompt
    return embeds + prompt_id_lists(ctx.engine.tokenizer, text, "prompt")[0]


def _fill_in_the_middle(ctx: ServingContext, req: CompletionRequest) -> str | list[str]:
    """The prompt text(s) that ask the model for what goes between each
    prompt and `suffix`."""
    template = ctx.completion_template
    if template is None:
        raise bad_request("suffix needs a fill-in-the-middle model: the tokenizer holds none of the markers "
                          "--completion-template knows", "suffix")
    if req.echo:
        raise bad_request("echo is not allowed with suffix", "echo")
    if isinstance(req.prompt, str):
        return template.prompt(req.prompt, req.suffix)
    if not all(isinstance(p, str) for p in req.prompt):
        raise bad_request("with suffix, the prompt must be text", "prompt")
    return [template.prompt(p, req.suffix) for p in req.prompt]


def _choice(ctx: ServingContext, req: CompletionRequest, index: int, request: GenerateRequest, result: ChoiceResult,
            echo: str) -> CompletionChoice:
    logprobs = None
    if req.logprobs is not None:
        entries = (result.prompt_logprobs if req.echo else []) + result.logprobs
        logprobs = completion_logprobs(ctx.texts_for(req), entries, 0, request.input_ids[0])
    choice = CompletionChoice(index=index, text=echo + result.text, logprobs=logprobs,
                              finish_reason=result.final.finish_reason, matched_stop=result.final.matched_stop)
    if req.prompt_logprobs is not None:
        choice.prompt_logprobs = prompt_logprobs(ctx.texts_for(req), result.prompt_logprobs)
    if req.return_token_ids:
        choice.prompt_token_ids, choice.token_ids = _prompt_ids(request), result.token_ids
    if req.return_hidden_states:
        choice.hidden_states = last_hidden_state(result.hidden_states, result.final.prompt_tokens)
    return choice


def _prompt_ids(request: GenerateRequest) -> list[int] | UnsetType:
    """return_token_ids' prompt_token_ids: none for a prompt given as embeddings (its ids are placeholders)."""
    return request.input_ids if request.prompt_embeds is None else UNSET


def _echoes(ctx: ServingContext, prompt, prompts: list[list[int]]) -> list[str]:
    """The prompt as sent when it was text, decoded when it was token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [ctx.engine.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


async def _stream(ctx: ServingContext, req: CompletionRequest, requests: list[GenerateRequest], rid: str,
                  echoes: list[str]) -> AsyncIterator:
    """An echoed prompt comes first, in a chunk of its own per choice: at
    once, or with logprobs once the engine has scored the prompt, so that
    chunk carries the prompt's logprobs."""
    chunk = ChunkFactory(CompletionResponse, rid, answering_model(ctx, req.model, req.lora_path))
    stream_usage = StreamUsage(req.stream_options, requests, req.n)
    echo_waits = [req.echo and req.logprobs is not None] * len(requests)
    if req.echo and req.logprobs is None:
        for i in range(len(requests)):
            yield chunk([CompletionChoice(index=i, text=echoes[i // req.n])], stream_usage.on_chunk())
    # Text offsets of logprobs run on across chunks.
    pending = PendingLogprobs(len(requests))
    offsets = [0] * len(requests)
    held_ids: list[list[int]] = [[] for _ in requests]  # tokens whose text is not out yet
    token_ids_sent = [False] * len(requests)
    states: list[list] = [[] for _ in requests]  # return_hidden_states: each choice's rows so far

    def logprobs_of(i: int):
        if req.logprobs is None:
            return None
        logprobs = completion_logprobs(ctx.texts_for(req), pending.take(i), offsets[i], requests[i].input_ids[0])
        offsets[i] += sum(len(t) for t in logprobs.tokens)
        return logprobs

    async for i, out in merged_outputs(ctx.engine, requests):
        stream_usage.note(i, out)
        if echo_waits[i]:
            echo_waits[i] = False
            pending.add(i, out.prompt_logprobs or [])
            yield chunk([CompletionChoice(index=i, text=echoes[i // req.n], logprobs=logprobs_of(i))],
                        stream_usage.on_chunk())
        pending.add(i, out.logprobs or [])
        held_ids[i] += out.token_ids
        if out.hidden_states is not None:
            states[i].append(out.hidden_states)
        if out.text or out.finished:
            choice = CompletionChoice(index=i, text=out.text, logprobs=logprobs_of(i),
                                      finish_reason=out.finish_reason, matched_stop=out.matched_stop)
            if req.return_token_ids:
                choice.token_ids, held_ids[i] = held_ids[i], []
                if not token_ids_sent[i]:
                    choice.prompt_token_ids, token_ids_sent[i] = _prompt_ids(requests[i]), True
            if out.finished and req.return_hidden_states:
                choice.hidden_states = last_hidden_state(states[i], out.prompt_tokens)
            yield chunk([choice], stream_usage.on_chunk())
    if stream_usage.at_end:
        yield chunk([], stream_usage.so_far())
