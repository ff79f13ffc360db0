"""What every generation route shares: the engine, fan-out of n choices,
usage accounting and ids."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

from pyserve.api.errors import APIError, bad_request
from pyserve.api.logprobs import TokenTexts
from pyserve.api.protocol import PromptTokensDetails, Usage
from pyserve.chat_template import ChatTemplate
from pyserve.engine.engine import Engine
from pyserve.engine.request import GenerateOutput, GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from pyserve.api.batch_runner import BatchManager
    from pyserve.storage.files import FileStore

# Reasoning parsers: (start marker, end marker, does the template open it?)
REASONING_PARSERS = {
    "qwen3": ("<think>", "</think>", False),
    "deepseek-r1": ("<think>", "</think>", True),
}


@dataclass
class ServingContext:
    engine: Engine
    served_model_name: str
    chat_template: ChatTemplate | None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None  # a --tool-call-parser name
    files: "FileStore | None" = None
    batches: "BatchManager | None" = None
    created: int = field(default_factory=lambda: int(time.time()))  # reported as the model's creation time

    @cached_property
    def token_texts(self) -> TokenTexts:
        return TokenTexts(self.engine.tokenizer)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def check_prompt_ids(ctx: ServingContext, ids: list[int], param: str) -> None:
    vocab = ctx.engine.vocab_size
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise bad_request("token ids must be integers", param)
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (size {vocab})", param)
    if not ids:
        raise bad_request("the prompt is empty", param)


def choice_requests(
    prompt_ids: list[int], params: SamplingParams, n: int, rid: str, priority: int = 0
) -> list[GenerateRequest]:
    """n independent requests; with a seed, choice i uses seed + i so the
    choices differ yet stay reproducible."""
    out = []
    for i in range(n):
        p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
        out.append(GenerateRequest(prompt_ids, p, f"{rid}-{i}" if n > 1 else rid, priority))
    return out


def check_requests(engine: Engine, requests: list[GenerateRequest], param: str) -> None:
    """What only the engine knows (its KV capacity...), asked before a
    streamed response starts so that a refusal is still a plain 400."""
    for r in requests:
        try:
            engine.validate(r)
        except ValueError as e:
            raise bad_request(str(e), param) from None


async def merged_outputs(engine: Engine, requests: list[GenerateRequest]) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """Outputs of several requests as they come: (request index, output).

    Leaving early (client gone) cancels every request's generator, which
    aborts it in the engine."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest):
        started = False
        try:
            async for out in engine.generate(req):
                started = True
                await queue.put((i, out))
        except ValueError as e:
            # Before the first output a ValueError is the engine refusing the
            # request (e.g. a client-chosen rid already running): the client's fault.
            await queue.put((i, e if started else bad_request(str(e), "rid")))
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
                if item.finish_reason == "abort":
                    raise APIError("the request was aborted by the server", 500, "server_error")
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class UsageCounter:
    """Sums usage over choices: the prompt counts once per distinct prompt."""

    def __init__(self):
        self.prompt: dict[int, int] = {}
        self.completion = 0
        self.cached = 0

    def add(self, prompt_index: int, out: GenerateOutput) -> None:
        self.prompt[prompt_index] = out.prompt_tokens
        self.completion += out.completion_tokens
        self.cached += out.cached_tokens

    def body(self) -> Usage:
        return usage(sum(self.prompt.values()), self.completion, self.cached)
