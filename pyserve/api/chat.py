"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from pyserve._rust import ReasoningSplitter, content_text
from pyserve.api.errors import bad_request
from pyserve.api.protocol import ChatCompletionRequest
from pyserve.api.sampling import build_params, check_context
from pyserve.api.serving import (
    REASONING_PARSERS, ServingContext, UsageCounter, choice_requests, merged_outputs, new_id, now,
)
from pyserve.chat_template import ChatTemplateError

_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _template_messages(req: ChatCompletionRequest) -> list[dict]:
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise bad_request(f"unknown role {m.role!r}", f"messages[{i}].role")
        try:
            text = content_text(msgspec.to_builtins(m.content))
        except ValueError as e:  # e.g. image parts: this server serves text models
            raise bad_request(str(e), f"messages[{i}].content") from None
        msg = {"role": m.role, "content": text}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            value = getattr(m, key)
            if value is not None:
                msg[key] = value
        messages.append(msg)
    return messages


def prepare(ctx: ServingContext, req: ChatCompletionRequest):
    """Validate and tokenize; returns (prompt ids, SamplingParams, max_tokens)."""
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.logprobs:
        raise bad_request("logprobs are not supported yet", "logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request(f"response_format {req.response_format.type!r} is not supported yet", "response_format")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if ctx.chat_template is None:
        raise bad_request("this model has no chat template; pass --chat-template or use /v1/completions")
    try:
        prompt = ctx.chat_template.render(
            _template_messages(req),
            add_generation_prompt=True,
            continue_final_message=req.continue_final_message,
            tools=req.tools,
            template_kwargs=req.chat_template_kwargs,
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    prompt_ids = ctx.engine.tokenizer.encode(prompt)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = build_params(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, n=req.n, stop=req.stop,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logit_bias=req.logit_bias, seed=req.seed, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        vocab_size=ctx.engine.vocab_size, default_max_tokens=ctx.default_max_tokens, max_tokens_param=param,
    )
    check_context(len(prompt_ids), max_tokens, ctx.engine.context_len)
    return prompt_ids, params


def _splitter(ctx: ServingContext, req: ChatCompletionRequest) -> ReasoningSplitter | None:
    if ctx.reasoning_parser is None or not req.separate_reasoning:
        return None
    start, end, opened = REASONING_PARSERS[ctx.reasoning_parser]
    return ReasoningSplitter(start, end, opened)


async def create(ctx: ServingContext, req: ChatCompletionRequest, priority: int = 0):
    prompt_ids, params = prepare(ctx, req)
    rid = req.rid or new_id("chatcmpl-")
    requests = choice_requests(prompt_ids, params, req.n, rid, priority)
    if req.stream:
        return _stream(ctx, req, requests, rid)
    texts = [""] * req.n
    finals = [None] * req.n
    counter = UsageCounter()
    async for i, out in merged_outputs(ctx.engine, requests):
        texts[i] += out.text
        if out.finished:
            finals[i] = out
            counter.add(0, out)
    choices = []
    for i, (text, out) in enumerate(zip(texts, finals)):
        reasoning = None
        splitter = _splitter(ctx, req)
        if splitter is not None:
            r1, c1 = splitter.feed(text)
            r2, c2 = splitter.flush()
            reasoning, text = (r1 + r2).strip() or None, (c1 + c2).lstrip()
        choices.append({
            "index": i,
            "message": {"role": "assistant", "content": text, "reasoning_content": reasoning, "tool_calls": None},
            "logprobs": None,
            "finish_reason": out.finish_reason,
            "matched_stop": out.matched_stop,
        })
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": ctx.served_model_name,
        "choices": choices,
        "usage": counter.body(),
    }


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, requests, rid: str) -> AsyncIterator[dict]:
    created = now()
    model = ctx.served_model_name

    def chunk(choices: list[dict], usage=None) -> dict:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def delta_choice(i: int, delta: dict, finish_reason=None, matched_stop=None) -> dict:
        c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            c["matched_stop"] = matched_stop
        return c

    splitters = [_splitter(ctx, req) for _ in requests]
    counter = UsageCounter()
    for i in range(len(requests)):
        yield chunk([delta_choice(i, {"role": "assistant", "content": ""})])
    async for i, out in merged_outputs(ctx.engine, requests):
        reasoning, content = "", out.text
        if splitters[i] is not None:
            reasoning, content = splitters[i].feed(out.text)
            if out.finished:
                r, c = splitters[i].flush()
                reasoning, content = reasoning + r, content + c
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if delta:
            yield chunk([delta_choice(i, delta)])
        if out.finished:
            counter.add(0, out)
            yield chunk([delta_choice(i, {}, out.finish_reason, out.matched_stop)])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], counter.body())
