"""POST /v1/chat/completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace

import msgspec
from msgspec import UNSET

from pyserve._rust import ReasoningSplitter, content_text
from pyserve.api.constraints import RequestConstraint, only_one, request_constraint
from pyserve.api.errors import bad_request
from pyserve.api.logprobs import ChatLogprobs, PendingLogprobs, chat_logprobs
from pyserve.api.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatStreamChoice, Delta, ToolCall, ToolCallDelta,
)
from pyserve.api.sampling import sampling_params
from pyserve.api.serving import (
    ChoiceResult, ChunkFactory, ServingContext, collect, fan_out, merged_outputs, new_id, now, usage,
)
from pyserve.api.tool_grammar import with_strict_calls
from pyserve.api.tools import ToolCalling, plan
from pyserve.chat_template import ChatTemplateError
from pyserve.engine.request import GenerateOutput, GenerateRequest, SamplingParams

# Reasoning parsers: (start marker, end marker, does the template open it?)
REASONING_PARSERS = {
    "qwen3": ("<think>", "</think>", False),
    "deepseek-r1": ("<think>", "</think>", True),
}
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
        if text is None and m.tool_calls:
            # A turn that only calls tools gets "", as SGLang and vLLM pass it:
            # templates that join content as a string (SmolLM2's, chatml) render
            # it too, and those that test `if message.content` read both alike.
            text = ""
        msg = {"role": m.role, "content": text}
        for key in ("name", "tool_call_id", "reasoning_content"):
            value = getattr(m, key)
            if value is not None:
                msg[key] = value
        if m.tool_calls is not None:
            msg["tool_calls"] = [_template_tool_call(msgspec.to_builtins(call)) for call in m.tool_calls]
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


def _constraint(ctx: ServingContext, req: ChatCompletionRequest,
                calling: ToolCalling | None) -> RequestConstraint | None:
    """The request's constraint: its own structured-output fields, or the
    grammar of its forced tool calls, or of its strict tools (alone or as
    the alternative to a JSON answer). With a reasoning parser, it starts
    after the reasoning block, unless the template was told not to think."""
    asked = request_constraint(req)
    if calling is not None and calling.forced is not None:
        asked = only_one([RequestConstraint(calling.forced, "tool_choice"), *([asked] if asked else [])])
    elif calling is not None and calling.strict is not None:
        asked = RequestConstraint(with_strict_calls(calling.strict, asked and asked.constraint,
                                                    asked and asked.param), "tools")
    if asked is None or ctx.reasoning_parser is None:
        return asked
    kwargs = req.chat_template_kwargs or {}
    if kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False:
        return asked
    _, end, _ = REASONING_PARSERS[ctx.reasoning_parser]
    return replace(asked, constraint=replace(asked.constraint, after=end))


def prepare(ctx: ServingContext, req: ChatCompletionRequest
            ) -> tuple[list[int], SamplingParams, ToolCalling | None, str | None]:
    """Check, render the chat template and tokenize: (prompt ids,
    SamplingParams, how to read tool calls in the output or None, the
    parameter that a constraint came from)."""
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.logprobs is not None and not isinstance(req.logprobs, bool):
        raise bad_request("logprobs must be true or false", "logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if ctx.chat_template is None:
        raise bad_request("this model has no chat template; pass --chat-template or use /v1/completions")
    tools, calling = plan(req, ctx.tool_call_parser)
    constrained = _constraint(ctx, req, calling)
    try:
        prompt = ctx.chat_template.render(
            _template_messages(req),
            add_generation_prompt=True,
            continue_final_message=req.continue_final_message,
            tools=tools,
            template_kwargs=req.chat_template_kwargs,
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    prompt_ids = ctx.engine.tokenizer.encode(prompt)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens, ctx.engine.vocab_size,
                             top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             constraint=constrained and constrained.constraint)
    return prompt_ids, params, calling, constrained and constrained.param


class _ChoiceOutput:
    """One choice's output text, split into reasoning, content and tool calls."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, calling: ToolCalling | None):
        self.splitter = None
        if ctx.reasoning_parser is not None and req.separate_reasoning:
            start, end, opened = REASONING_PARSERS[ctx.reasoning_parser]
            self.splitter = ReasoningSplitter(start, end, opened)
        self.tools = None if calling is None else calling.reader()

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, tool calls) that `text` completes."""
        reasoning, content, calls = "", text, []
        if self.splitter is not None:
            reasoning, content = self.splitter.feed(text)
            if final:
                r, c = self.splitter.flush()
                reasoning, content = reasoning + r, content + c
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        return reasoning, content, calls

    @property
    def calls(self) -> int:
        """Tool calls so far."""
        return 0 if self.tools is None else self.tools.count

    def finish_reason(self, reason: str | None) -> str | None:
        # As SGLang: a length cut stays "length" even after a complete call.
        return "tool_calls" if self.calls and reason == "stop" else reason


async def create(ctx: ServingContext, req: ChatCompletionRequest, priority: int = 0):
    prompt_ids, params, calling, constraint_param = prepare(ctx, req)
    rid = req.rid or new_id("chatcmpl-")
    limit = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requests = await fan_out(ctx.engine, [prompt_ids], params, req.n, rid,
                             {"prompt": "messages", "max_new_tokens": limit, "constraint": constraint_param}, priority)
    if req.stream:
        return _stream(ctx, req, requests, rid, calling)
    results = await collect(ctx.engine, requests)
    choices = [_choice(ctx, req, calling, i, result) for i, result in enumerate(results)]
    return ChatCompletionResponse(id=rid, created=now(), model=ctx.served_model_name, choices=choices,
                                  usage=usage([r.final for r in results], req.n))


def _choice(ctx: ServingContext, req: ChatCompletionRequest, calling: ToolCalling | None, index: int,
            result: ChoiceResult) -> ChatChoice:
    output = _ChoiceOutput(ctx, req, calling)
    reasoning, content, calls = output.feed(result.text, final=True)
    if output.splitter is not None:
        content = content.lstrip()
    message = AssistantMessage(
        content=None if calls and not content.strip() else content,
        reasoning_content=reasoning.strip() or None,
        tool_calls=calls or None,
    )
    return ChatChoice(
        index=index,
        message=message,
        logprobs=chat_logprobs(ctx.token_texts, result.logprobs) if req.logprobs else None,
        finish_reason=output.finish_reason(result.final.finish_reason),
        matched_stop=result.final.matched_stop,
    )


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, requests: list[GenerateRequest], rid: str,
                  calling: ToolCalling | None) -> AsyncIterator:
    """OpenAI's chunk order: a role chunk per choice, content and tool call
    deltas, a finish chunk per choice, then (if asked) one usage chunk with
    no choices."""
    chunk = ChunkFactory(ChatCompletionChunk, rid, ctx.served_model_name)
    outputs = [_ChoiceOutput(ctx, req, calling) for _ in requests]
    pending = PendingLogprobs(len(requests))
    finals: list[GenerateOutput | None] = [None] * len(requests)

    def take_logprobs(i: int) -> ChatLogprobs | None:
        entries = pending.take(i)
        return chat_logprobs(ctx.token_texts, entries) if req.logprobs and entries else None

    for i in range(len(requests)):
        yield chunk([ChatStreamChoice(index=i, delta=Delta(role="assistant", content=""))])
    async for i, out in merged_outputs(ctx.engine, requests):
        pending.add(i, out.logprobs or [])
        first_index = outputs[i].calls
        reasoning, content, calls = outputs[i].feed(out.text, out.finished)
        if reasoning or content or calls:
            deltas = [ToolCallDelta(index=first_index + k, id=c.id, function=c.function) for k, c in enumerate(calls)]
            delta = Delta(content=content or UNSET, reasoning_content=reasoning or UNSET, tool_calls=deltas or UNSET)
            yield chunk([ChatStreamChoice(index=i, delta=delta, logprobs=take_logprobs(i))])
        if out.finished:
            finals[i] = out
            yield chunk([ChatStreamChoice(index=i, delta=Delta(), logprobs=take_logprobs(i),
                                          finish_reason=outputs[i].finish_reason(out.finish_reason),
                                          matched_stop=out.matched_stop)])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], usage(finals, req.n))
