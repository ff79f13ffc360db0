"""POST /v1/chat/completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import msgspec
from msgspec import UNSET

from pyserve._rust import ReasoningSplitter, content_text
from pyserve.api.errors import bad_request
from pyserve.api.logprobs import ChatLogprobs, chat_logprobs
from pyserve.api.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatStreamChoice, Delta,
)
from pyserve.api.sampling import build_params, check_context
from pyserve.api.serving import (
    REASONING_PARSERS, ServingContext, UsageCounter, check_requests, choice_requests, merged_outputs, new_id, now,
)
from pyserve.chat_template import ChatTemplateError
from pyserve.engine.request import GenerateOutput, TokenLogprob

_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _template_messages(req: ChatCompletionRequest) -> list[dict]:
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise bad_request(f"unknown role {m.role!r}", f"messages[{i}].role")
        try:
            # None stays None: templates tell "no content" (a tool call) from "".
            text = None if m.content is None else content_text(msgspec.to_builtins(m.content))
        except ValueError as e:  # e.g. image parts: this server serves text models
            raise bad_request(str(e), f"messages[{i}].content") from None
        msg = {"role": m.role, "content": text}
        for key in ("name", "tool_call_id", "reasoning_content"):
            value = getattr(m, key)
            if value is not None:
                msg[key] = value
        if m.tool_calls is not None:
            msg["tool_calls"] = [_template_tool_call(call) for call in m.tool_calls]
        messages.append(msg)
    return messages


def _template_tool_call(call: dict) -> dict:
    """OpenAI sends a call's arguments as a JSON string; chat templates
    (Llama 3.1, Qwen...) iterate them as a mapping, so decode them when we can."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


def prepare(ctx: ServingContext, req: ChatCompletionRequest):
    """Validate, render the chat template and tokenize: (prompt ids, SamplingParams)."""
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.logprobs is not None and not isinstance(req.logprobs, bool):
        raise bad_request("logprobs must be true or false", "logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.tool_choice not in (None, "none", "auto"):
        # Tools reach the template, but calls are not parsed out of the output yet.
        raise bad_request("tool_choice other than 'auto' or 'none' is not supported yet", "tool_choice")
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
        logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0,
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
    check_requests(ctx.engine, requests, "messages")
    if req.stream:
        return _stream(ctx, req, requests, rid)
    texts = [""] * req.n
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
    finals: list[GenerateOutput | None] = [None] * req.n
    counter = UsageCounter()
    async for i, out in merged_outputs(ctx.engine, requests):
        texts[i] += out.text
        logprobs[i] += out.logprobs or []
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
        choices.append(ChatChoice(
            index=i,
            message=AssistantMessage(content=text, reasoning_content=reasoning),
            logprobs=chat_logprobs(ctx.token_texts, logprobs[i]) if req.logprobs else None,
            finish_reason=out.finish_reason,
            matched_stop=out.matched_stop,
        ))
    return ChatCompletionResponse(
        id=rid, created=now(), model=ctx.served_model_name, choices=choices, usage=counter.body()
    )


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, requests, rid: str) -> AsyncIterator:
    """OpenAI's chunk order: a role chunk per choice, content deltas, a
    finish chunk per choice, then (if asked) one usage chunk with no choices."""
    created = now()

    def chunk(choices: list[ChatStreamChoice], usage=UNSET) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, created=created, model=ctx.served_model_name, choices=choices,
                                   usage=usage)

    splitters = [_splitter(ctx, req) for _ in requests]
    # Logprobs of tokens whose text is not out yet ride with the next chunk.
    pending: list[list[TokenLogprob]] = [[] for _ in requests]

    def take_logprobs(i: int) -> ChatLogprobs | None:
        if not req.logprobs or not pending[i]:
            return None
        entries, pending[i] = pending[i], []
        return chat_logprobs(ctx.token_texts, entries)

    counter = UsageCounter()
    for i in range(len(requests)):
        yield chunk([ChatStreamChoice(index=i, delta=Delta(role="assistant", content=""))])
    async for i, out in merged_outputs(ctx.engine, requests):
        pending[i] += out.logprobs or []
        reasoning, content = "", out.text
        if splitters[i] is not None:
            reasoning, content = splitters[i].feed(out.text)
            if out.finished:
                r, c = splitters[i].flush()
                reasoning, content = reasoning + r, content + c
        if reasoning or content:
            delta = Delta(content=content or UNSET, reasoning_content=reasoning or UNSET)
            yield chunk([ChatStreamChoice(index=i, delta=delta, logprobs=take_logprobs(i))])
        if out.finished:
            counter.add(0, out)
            yield chunk([ChatStreamChoice(index=i, delta=Delta(), logprobs=take_logprobs(i),
                                          finish_reason=out.finish_reason, matched_stop=out.matched_stop)])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], counter.body())
