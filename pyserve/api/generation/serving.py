"""What every generation route shares: its context, the prompt shapes,
fan-out of prompts x n into engine requests (validated once, by the
engine), merged outputs, the collector of whole responses, usage, and the
factory of streamed chunks.

Chat, completions and /generate only translate their own request and
response shapes around these.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch
from msgspec import UNSET, UnsetType

from pyserve._rust import Tokenizer
from pyserve.http.errors import APIError, bad_request
from pyserve.api.generation.logprobs import TokenIdTexts, TokenTexts
from pyserve.api.generation.truncation import fit_context
from pyserve.api.generation.admission_gate import AdmissionGate
from pyserve.api.generation.prompt_embeds import placeholder_ids
from pyserve.api.generation.sessions import Sessions
from pyserve.api.protocol.openai import PromptTokensDetails, Usage
from pyserve.chat_template import ChatTemplate
from pyserve.completion_template import CompletionTemplate
from pyserve.engine.engine import Engine
from pyserve.engine.request import GenerateOutput, GenerateRequest, RequestError, SamplingParams, TokenLogprob
from pyserve.options import ServerOptions


@dataclass(frozen=True)
class ServingContext:
    """The engine and how the API presents it: what the generation and
    model routes need, and batches run their requests with."""

    engine: Engine
    served_model_name: str  # the name responses report
    chat_template: ChatTemplate | None
    reasoning_parser: str | None = None  # a --reasoning-parser name
    tool_call_parser: str | None = None  # a --tool-call-parser name
    created: int = field(default_factory=lambda: int(time.time()))  # reported as the model's creation time
    # How many sequences (prompts x n) one request may ask for; unless given, the option's default.
    max_sequences_per_request: int = ServerOptions.max_sequences_per_request
    # The options the server runs with, as /get_server_info reports them (ServerArgs.reported).
    server_args: Mapping[str, Any] = field(default_factory=dict)
    # What requests that leave a sampling setting out take (--sampling-defaults):
    # the model's recommendation, else OpenAI's default.
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)
    # How /v1/completions asks for the text between a prompt and its suffix (None: it cannot).
    completion_template: CompletionTemplate | None = None
    # --allow-auto-truncate: prompts too long for the context are cut (api/generation/truncation.py).
    allow_auto_truncate: bool = False
    # Closed during a weight update and a pause: requests wait at it.
    gate: AdmissionGate = field(default_factory=AdmissionGate)
    # Other names the base model answers to (--served-model-name's after the first).
    other_model_names: tuple[str, ...] = ()
    sessions: Sessions = field(default_factory=Sessions)  # SGLang's /open_session and session_params

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_model_name, *self.other_model_names

    @cached_property
    def token_texts(self) -> TokenTexts:
        return TokenTexts(self.engine.tokenizer)

    def texts_for(self, fields) -> TokenTexts:
        """How a request's logprob tokens read: their text, or "token_id:N"
        (vLLM's return_tokens_as_token_ids)."""
        return TokenIdTexts() if fields.return_tokens_as_token_ids else self.token_texts


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# -- requests ----------------------------------------------------------------


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def prompt_id_lists(tokenizer: Tokenizer, prompt, param: str, text: bool = True) -> tuple[list[list[int]], bool]:
    """The prompt shapes OpenAI and SGLang accept: a text, a list of texts
    (unless `text` is False), token ids, or a list of token id lists.
    Returns (token id lists, whether it was a single prompt).

    Text gets the tokenizer's special tokens (a Llama BOS), as SGLang and
    vLLM encode completion prompts; token ids are taken as they are (their
    range is the engine's to check)."""
    if text and isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=True)], True
    if isinstance(prompt, list) and prompt:
        if text and all(isinstance(p, str) for p in prompt):
            return tokenizer.encode_batch(prompt, add_special_tokens=True), False
        if _is_token_ids(prompt):
            return [prompt], True
        if all(isinstance(p, list) for p in prompt):
            if not all(_is_token_ids(p) for p in prompt):
                raise bad_request("token ids must be integers", param)
            return prompt, False
    shapes = "a string, a list of strings, a list of token ids or a list of those lists" if text else \
        "a list of token ids or a list of such lists"
    raise bad_request(f"{param} must be {shapes}", param)


async def fan_out(ctx: ServingContext, prompts: list[list[int] | torch.Tensor],
                  params: SamplingParams | list[SamplingParams],
                  n: int, rid: str | list[str], param_names: Mapping[str, str], *, batch: bool = False,
                  priority: int | None = None, cache_salt: str | None = None,
                  lora: str | list[str | None] | None = None) -> list[GenerateRequest]:
    """n requests per prompt: request p * n + i is prompt p's choice i, as
    OpenAI numbers choices (rid, then `-p` with several prompts, `-i` with
    n > 1). With a seed, choice i uses seed + i, so the choices differ yet
    stay reproducible. Each is a batch job or not (`batch`) and carries the
    body's `priority`, `cache_salt` and LoRA adapter (`lora`, see adapter_name).
    `params`, `rid` and `lora` are one for every prompt or a list of one
    each (SGLang's /generate batches); a listed rid is its prompt's own. A
    prompt may be a tensor: its embeddings (prompt_embeds.py).

    With --allow-auto-truncate a prompt too long for the context is cut
    first (truncation.fit_context). The engine validates each prompt once, and compiles each constraint
    once, here, before anything streams, so a refusal is still a plain
    400; `param_names` maps the engine's field ("prompt", "max_new_tokens",
    "constraint") and "n" to the route's parameter name.

    One request asks for at most --max-sequences-per-request sequences
    (prompts x n), so that it cannot fill the engine's queue alone."""
    _check_sequences(ctx.max_sequences_per_request, len(prompts), n, param_names)
    await ctx.gate.passed()
    engine = ctx.engine
    each_params = params if isinstance(params, list) else [params] * len(prompts)
    requests = []
    try:
        if not batch:
            engine.check_queue_room()
        for p, prompt in enumerate(prompts):
            embeds = prompt if isinstance(prompt, torch.Tensor) else None
            ids = prompt if embeds is None else placeholder_ids(embeds)
            ids, prompt_params = fit_context(ids, each_params[p], engine.context_len) \
                if ctx.allow_auto_truncate and embeds is None else (ids, each_params[p])
            base = rid[p] if isinstance(rid, list) else f"{rid}-{p}" if len(prompts) > 1 else rid
            for i in range(n):
                choice = prompt_params if prompt_params.seed is None or i == 0 else \
                    replace(prompt_params, seed=prompt_params.seed + i)
                requests.append(GenerateRequest(ids, choice, f"{base}-{i}" if n > 1 else base, batch=batch,
                                                priority=priority, cache_salt=cache_salt,
                                                lora=lora[p] if isinstance(lora, list) else lora,
                                                prompt_embeds=embeds))
            engine.validate(requests[p * n])
        for constraint in dict.fromkeys(c.constraint for c in each_params if c.constraint is not None):
            await engine.compile_grammar(constraint)
    except RequestError as e:
        raise refusal(e, param_names) from None
    return requests


def refusal(e: RequestError, param_names: Mapping[str, str]) -> APIError:
    """The API's answer to a request the engine refuses."""
    if e.code == "model_not_found":  # an unknown adapter: vLLM's 404
        return APIError(e.message, 404, param="model", code=e.code)
    if e.code == "queue_full":  # the client may retry: not its fault
        return APIError(e.message, 503, "server_error", code=e.code)
    # The engine's "lora" is the body's lora_path (a `model` naming no adapter is the 404 above).
    default = "lora_path" if e.field == "lora" else e.field
    return bad_request(e.message, param_names.get(e.field, default), e.code)


def adapter_name(ctx: ServingContext, model: str | None, lora_path: str | None) -> str | None:
    """The LoRA adapter a body picks: SGLang's `lora_path`, else, on a server
    with --enable-lora, a `model` other than the base model's names (vLLM's way)."""
    if lora_path is not None:
        return lora_path
    if ctx.engine.adapters is not None and model and model not in ctx.model_names:
        return model
    return None


def answering_model(ctx: ServingContext, model: str | None, lora_path: str | None) -> str:
    """The name a response reports: the adapter that answered, else the served model."""
    return adapter_name(ctx, model, lora_path) or ctx.served_model_name


def _check_sequences(cap: int, prompts: int, n: int, param_names: Mapping[str, str]) -> None:
    if prompts * n <= cap:
        return
    # Name what to cut: the prompts when they alone are too many, else n.
    param = param_names.get("prompt", "prompt") if prompts > cap else param_names.get("n", "n")
    raise bad_request(f"this request asks for {prompts} prompt{'s' if prompts > 1 else ''} x n={n} = "
                      f"{prompts * n} sequences, more than the {cap} one request may have "
                      "(--max-sequences-per-request): split it into smaller requests", param)


async def merged_outputs(engine: Engine, requests: list[GenerateRequest],
                         on_output: Callable[[int, GenerateOutput], None] | None = None,
                         ) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """Outputs of several requests as they come: (request index, output),
    each shown first to `on_output` (a session records its turns' tokens).

    Leaving early (client gone) cancels every request's generator, which
    aborts it in the engine."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest):
        started = False
        try:
            async for out in engine.generate(req):
                started = True
                await queue.put((i, out))
        except RequestError as e:
            # Before the first output this is the engine refusing the request
            # (e.g. a client-chosen rid already running): the client's fault.
            await queue.put((i, e if started else refusal(e, {})))
        except Exception as e:  # surfaced to the consumer below
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    remaining = len(requests)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                remaining -= 1
                if item.finish_reason == "error":
                    raise APIError("the request was aborted by the server", 500, "server_error")
            if on_output is not None:
                on_output(i, item)
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- responses ---------------------------------------------------------------


@dataclass
class ChoiceResult:
    """One choice's whole output, for a response that is not streamed."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    hidden_states: list[torch.Tensor] = field(default_factory=list)  # return_hidden_states: each output's rows
    final: GenerateOutput | None = None  # the last output: finish reason, matched stop, token counts


def last_hidden_state(rows: list[torch.Tensor], prompt_tokens: int) -> list[float]:
    """An OpenAI choice's `hidden_states`, as SGLang answers it: the final-norm
    hidden state of the last output token the model read, from the rows a
    request's outputs brought; [] when it read none (one token generated)."""
    return rows[-1][-1].tolist() if sum(len(r) for r in rows) > prompt_tokens else []


async def collect(engine: Engine, requests: list[GenerateRequest],
                  on_output: Callable[[int, GenerateOutput], None] | None = None) -> list[ChoiceResult]:
    """Every request run to its end, its outputs gathered (see merged_outputs)."""
    results = [ChoiceResult() for _ in requests]
    async for i, out in merged_outputs(engine, requests, on_output):
        result = results[i]
        result.text += out.text
        result.token_ids += out.token_ids
        result.logprobs += out.logprobs or []
        result.prompt_logprobs += out.prompt_logprobs or []
        if out.hidden_states is not None:
            result.hidden_states.append(out.hidden_states)
        if out.finished:
            result.final = out
    return results


def usage(finals: list[GenerateOutput], n: int) -> Usage:
    """Usage of the requests `fan_out` made: a prompt counts once, not once
    per choice."""
    prompt = sum(out.prompt_tokens for out in finals[::n])
    completion = sum(out.completion_tokens for out in finals)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(out.cached_tokens for out in finals)),
    )


class StreamUsage:
    """A streamed response's usage as it grows: on every chunk with
    stream_options.continuous_usage_stats (vLLM), and in a last chunk of
    its own with include_usage."""

    def __init__(self, stream_options, requests: list[GenerateRequest], n: int):
        self.continuous = bool(stream_options and stream_options.continuous_usage_stats)
        self.at_end = bool(stream_options and stream_options.include_usage)
        self.prompt_tokens = sum(len(r.input_ids) for r in requests[::n])
        self.latest: list[GenerateOutput | None] = [None] * len(requests)

    def note(self, i: int, out: GenerateOutput) -> None:
        self.latest[i] = out

    def so_far(self) -> Usage:
        seen = [out for out in self.latest if out is not None]
        completion = sum(out.completion_tokens for out in seen)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.cached_tokens for o in seen)))

    def on_chunk(self) -> Usage | UnsetType:
        return self.so_far() if self.continuous else UNSET


class ChunkFactory:
    """The chunks of one streamed response, which all repeat its id,
    creation time and model."""

    def __init__(self, chunk_type: type, rid: str, model: str):
        self.chunk_type = chunk_type
        self.rid = rid
        self.model = model
        self.created = now()

    def __call__(self, choices: list, usage: Usage | UnsetType = UNSET, **fields):
        return self.chunk_type(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage,
                               **fields)
