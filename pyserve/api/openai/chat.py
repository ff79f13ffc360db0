"""POST /v1/chat/completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace

import msgspec
from msgspec import UNSET
from msgspec.structs import replace as replace_struct

from pyserve._rust import ReasoningSplitter, content_text
from pyserve.api.generation.harmony import FINAL_MESSAGE, HarmonyOutput, reads_harmony
from pyserve.api.generation.constraints import RequestConstraint, only_one, request_constraint
from pyserve.http.errors import bad_request
from pyserve.api.generation.logprobs import PendingLogprobs, chat_logprobs, prompt_logprobs
from pyserve.api.protocol.openai import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
    ChatStreamChoice, CompletionTokensDetails, Delta, FunctionCallDelta, ToolCallDelta, Usage,
)
from pyserve.api.generation.sampling import sampling_params, vllm_prompt_logprobs, with_logit_processor
from pyserve.api.generation.truncation import keep_last_tokens
from pyserve.api.generation.serving import (
    ChoiceResult, ChunkFactory, ServingContext, StreamUsage, adapter_name, answering_model, collect, fan_out,
    last_hidden_state, merged_outputs, new_id, now, usage,
)
from pyserve.api.generation.tool_grammar import CallDelta, new_call_id, with_strict_calls
from pyserve.api.generation.tools import HARMONY, ToolCalling, plan, whole_calls
from pyserve.chat_template import ChatTemplateError
from pyserve.engine.request import GenerateRequest, SamplingParams

# SGLang's --reasoning-parser names: (start marker, end marker, whether the
# chat template opens the block, so that the output starts inside it).
REASONING_PARSERS = {
    "qwen3": ("<think>", "</think>", False),
    "glm45": ("<think>", "</think>", False),  # GLM-4.5, 4.6: the model opens its block
    "deepseek-r1": ("<think>", "</think>", True),
    "qwen3-thinking": ("<think>", "</think>", True),  # Qwen3's -Thinking-2507 models
    "minimax": ("<think>", "</think>", True),  # MiniMax-M2
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
        if m.reasoning is not None and m.reasoning_content is None:
            msg["reasoning_content"] = m.reasoning
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


_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _template_kwargs(req: ChatCompletionRequest) -> dict:
    """chat_template_kwargs, with reasoning_effort mapped onto the template's
    thinking switch: "none" turns thinking off (Qwen3's `enable_thinking`,
    DeepSeek's `thinking`); another effort turns it on and reaches the
    template as `reasoning_effort` (gpt-oss reads it). What the request's
    own chat_template_kwargs say wins."""
    kwargs = dict(req.chat_template_kwargs or {})
    effort = req.reasoning_effort
    if effort is None:
        return kwargs
    if effort not in _EFFORTS:
        raise bad_request(f"reasoning_effort must be one of {', '.join(_EFFORTS)}", "reasoning_effort")
    thinking = effort != "none"
    return {"enable_thinking": thinking, "thinking": thinking, "reasoning_effort": effort, **kwargs}


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
    kwargs = _template_kwargs(req)
    if kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False:
        return asked
    end = FINAL_MESSAGE if ctx.reasoning_parser == HARMONY else REASONING_PARSERS[ctx.reasoning_parser][1]
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
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=tools,
            template_kwargs=_template_kwargs(req),
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    prompt_ids = ctx.engine.tokenizer.encode(prompt)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt_k = vllm_prompt_logprobs(req)
    params = sampling_params(req, max_tokens, ctx.engine.vocab_size,
                             top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             prompt_logprobs=prompt_k is not None, prompt_top_logprobs=prompt_k,
                             constraint=constrained and constrained.constraint, defaults=ctx.sampling_defaults,
                             tokenizer=ctx.engine.tokenizer)
    params = with_logit_processor(params, req.custom_logit_processor, req.custom_params,
                                  ctx.engine.served.custom_logit_processor)
    if reads_harmony(ctx.reasoning_parser, ctx.tool_call_parser):
        params = replace(params, skip_special_tokens=False)  # Harmony's markers are special tokens
    return prompt_ids, params, calling, constrained and constrained.param


def conversation_ids(ctx: ServingContext, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
                     continue_final_message: bool = False, tools: list[dict] | None = None,
                     chat_template_kwargs: dict | None = None) -> list[int]:
    """The prompt ids a chat request with these messages would run: for
    /tokenize, and for embedding or classifying a conversation."""
    ids, _, _, _ = prepare(ctx, ChatCompletionRequest(
        messages=messages, tools=tools, chat_template_kwargs=chat_template_kwargs,
        continue_final_message=continue_final_message, add_generation_prompt=add_generation_prompt))
    return ids


def _echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the answer starts with the final message when
    that is the assistant's own (a continued message)."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant" or last.content is None:
        return ""
    return content_text(msgspec.to_builtins(last.content))


class _ChoiceOutput:
    """One choice's output text, split into reasoning, content and tool calls."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, calling: ToolCalling | None):
        self.splitter = self.harmony = None
        if reads_harmony(ctx.reasoning_parser, ctx.tool_call_parser):
            self.harmony = HarmonyOutput(ctx.reasoning_parser == HARMONY and req.separate_reasoning, calling)
        elif ctx.reasoning_parser is not None and req.separate_reasoning:
            start, end, opened = REASONING_PARSERS[ctx.reasoning_parser]
            self.splitter = ReasoningSplitter(start, end, opened)
        self.tools = None if calling is None else calling.reader()
        self.reasoning = ""  # all of it so far, for usage's reasoning_tokens

    def feed(self, text: str, final: bool) -> tuple[str, str, list[CallDelta]]:
        """(reasoning, content, tool call deltas) that `text` completes."""
        reasoning, content, calls = "", text, []
        if self.harmony is not None:
            reasoning, content, calls = self.harmony.feed(text, final)
            self.reasoning += reasoning
        elif self.splitter is not None:
            reasoning, content = self.splitter.feed(text)
            if final:
                r, c = self.splitter.flush()
                reasoning, content = reasoning + r, content + c
            self.reasoning += reasoning
        if self.tools is not None:
            content, calls = self.tools.feed(content, final, calls)
        return reasoning, content, calls

    @property
    def splits_reasoning(self) -> bool:
        return self.splitter is not None or (self.harmony is not None and self.harmony.separate_reasoning)

    @property
    def calls(self) -> int:
        """Tool calls so far."""
        return 0 if self.tools is None else self.tools.count

    def finish_reason(self, reason: str | None) -> str | None:
        # As SGLang: a length cut stays "length" even after a complete call.
        return "tool_calls" if self.calls and reason == "stop" else reason


def _with_reasoning_tokens(ctx: ServingContext, total: Usage, outputs: list[_ChoiceOutput]) -> Usage:
    """usage.completion_tokens_details.reasoning_tokens when reasoning is
    split: the reasoning text's tokens as the tokenizer encodes it (the
    markers excluded), summed over the choices."""
    if not any(o.splits_reasoning for o in outputs):
        return total
    count = sum(len(ctx.engine.tokenizer.encode(o.reasoning)) for o in outputs if o.reasoning)
    return replace_struct(total, completion_tokens_details=CompletionTokensDetails(reasoning_tokens=count))


async def create(ctx: ServingContext, req: ChatCompletionRequest, batch: bool = False):
    prompt_ids, params, calling, constraint_param = prepare(ctx, req)
    rid = req.rid or new_id("chatcmpl-")
    limit = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    prompts = keep_last_tokens([prompt_ids], req.truncate_prompt_tokens, ctx.engine.context_len)
    requests = await fan_out(ctx, prompts, params, req.n, rid,
                             {"prompt": "messages", "max_new_tokens": limit, "constraint": constraint_param},
                             batch=batch, priority=req.priority, cache_salt=req.cache_salt,
                             lora=adapter_name(ctx, req.model, req.lora_path))
    if req.stream:
        return _stream(ctx, req, requests, rid, calling)
    results = await collect(ctx.engine, requests)
    outputs = [_ChoiceOutput(ctx, req, calling) for _ in results]
    choices = [_choice(ctx, req, output, i, result) for i, (output, result) in enumerate(zip(outputs, results))]
    response = ChatCompletionResponse(id=rid, created=now(), model=answering_model(ctx, req.model, req.lora_path),
                                      choices=choices,
                                      usage=_with_reasoning_tokens(ctx, usage([r.final for r in results], req.n),
                                                                   outputs))
    if req.prompt_logprobs is not None:
        response.prompt_logprobs = prompt_logprobs(ctx.texts_for(req), results[0].prompt_logprobs)
    if req.return_token_ids:
        response.prompt_token_ids = prompt_ids
    return response


def _choice(ctx: ServingContext, req: ChatCompletionRequest, output: _ChoiceOutput, index: int,
            result: ChoiceResult) -> ChatChoice:
    reasoning, content, deltas = output.feed(result.text, final=True)
    calls = whole_calls(deltas)
    if output.splitter is not None:
        content = content.lstrip()
    content = _echo(req) + content
    message = AssistantMessage(
        content=None if calls and not content.strip() else content,
        reasoning_content=reasoning.strip() or None,
        tool_calls=calls or None,
    )
    return ChatChoice(
        index=index,
        message=message,
        logprobs=chat_logprobs(ctx.texts_for(req), result.logprobs) if req.logprobs else None,
        finish_reason=output.finish_reason(result.final.finish_reason),
        matched_stop=result.final.matched_stop,
        token_ids=result.token_ids if req.return_token_ids else UNSET,
        hidden_states=last_hidden_state(result.hidden_states, result.final.prompt_tokens)
        if req.return_hidden_states else UNSET,
    )


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, requests: list[GenerateRequest], rid: str,
                  calling: ToolCalling | None) -> AsyncIterator:
    """OpenAI's chunk order: a role chunk per choice, content and tool call
    deltas, a finish chunk per choice, then (if asked) one usage chunk with
    no choices."""
    chunk = ChunkFactory(ChatCompletionChunk, rid, answering_model(ctx, req.model, req.lora_path))
    outputs = [_ChoiceOutput(ctx, req, calling) for _ in requests]
    pending = PendingLogprobs(len(requests))
    stream_usage = StreamUsage(req.stream_options, requests, req.n)
    held_ids: list[list[int]] = [[] for _ in requests]  # tokens whose text is not out yet
    states: list[list] = [[] for _ in requests]  # return_hidden_states: each choice's rows so far

    def choice(i: int, delta: Delta, **fields) -> ChatStreamChoice:
        entries = pending.take(i)
        logprobs = chat_logprobs(ctx.texts_for(req), entries) if req.logprobs and entries else None
        token_ids = UNSET
        if req.return_token_ids:
            token_ids, held_ids[i] = held_ids[i], []
        return ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, token_ids=token_ids, **fields)

    prompt_ids = {"prompt_token_ids": requests[0].input_ids} if req.return_token_ids else {}
    for i in range(len(requests)):
        yield chunk([ChatStreamChoice(index=i, delta=Delta(role="assistant", content=""))], stream_usage.on_chunk(),
                    **(prompt_ids if i == 0 else {}))
        if echo := _echo(req):
            yield chunk([ChatStreamChoice(index=i, delta=Delta(content=echo))], stream_usage.on_chunk())
    async for i, out in merged_outputs(ctx.engine, requests):
        stream_usage.note(i, out)
        pending.add(i, out.logprobs or [])
        held_ids[i] += out.token_ids
        if out.hidden_states is not None:
            states[i].append(out.hidden_states)
        reasoning, content, calls = outputs[i].feed(out.text, out.finished)
        if reasoning or content or calls:
            deltas = [_call_delta(*call) for call in calls]
            delta = Delta(content=content or UNSET, reasoning_content=reasoning or None, tool_calls=deltas or UNSET)
            yield chunk([choice(i, delta)], stream_usage.on_chunk())
        if out.finished:
            last = last_hidden_state(states[i], out.prompt_tokens) if req.return_hidden_states else UNSET
            yield chunk([choice(i, Delta(hidden_states=last), finish_reason=outputs[i].finish_reason(out.finish_reason),
                                matched_stop=out.matched_stop)], stream_usage.on_chunk())
    if stream_usage.at_end:
        yield chunk([], _with_reasoning_tokens(ctx, stream_usage.so_far(), outputs))


def _call_delta(index: int, name: str | None, arguments: str) -> ToolCallDelta:
    if name is None:
        return ToolCallDelta(index=index, function=FunctionCallDelta(arguments=arguments))
    return ToolCallDelta(index=index, id=new_call_id(), type="function",
                         function=FunctionCallDelta(name=name, arguments=arguments))
