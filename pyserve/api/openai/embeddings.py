"""POST /v1/embeddings, on a server started with --is-embedding.

Each input is one engine request (GenerateRequest.embedding): they run in
the engine's continuous batches like any prompt and come back as pooled,
normalised float32 vectors (model/pooling.py). `dimensions` cuts them
(Matryoshka) and normalises them again; `encoding_format: base64` sends
each vector as the base64 of its little-endian float32 bytes, which is
what the openai client asks for by default and decodes.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import msgspec
import numpy as np
import torch

from pyserve.http.errors import bad_request
from pyserve.api.generation.truncation import fit_context, keep_last_tokens
from pyserve.api.generation.serving import ServingContext, merged_outputs, new_id, prompt_id_lists, refusal
from pyserve.api.openai.chat import conversation_ids
from pyserve.api.protocol.openai import ChatMessage
from pyserve.engine.embedding import embedding_mismatch
from pyserve.engine.request import GenerateRequest, RequestError, SamplingParams


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: Any = None  # str | list[str] | list[int] | list[list[int]]
    # vLLM's: a conversation, rendered by the chat template, as the one input.
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's last k tokens (-1: the context's worth)


class Embedding(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def serves_embeddings(ctx: ServingContext) -> bool:
    """Whether the server was started with --is-embedding."""
    # getattr: stand-in engines in the API tests only generate.
    return getattr(ctx.engine, "pooling", None) is not None


def refuse_generation(ctx: ServingContext) -> None:
    """A generation route on an --is-embedding server: 400 naming the flag."""
    if serves_embeddings(ctx):
        raise bad_request(embedding_mismatch(False))


async def create(ctx: ServingContext, req: EmbeddingRequest) -> EmbeddingResponse:
    engine = ctx.engine
    if not serves_embeddings(ctx):
        raise bad_request(embedding_mismatch(True))
    if req.dimensions is not None:
        problem = engine.pooling.check_dimensions(req.dimensions)
        if problem is not None:
            raise bad_request(problem, "dimensions")
    prompts = prompts_of(ctx, req)
    prompts = keep_last_tokens(prompts, req.truncate_prompt_tokens, engine.context_len)
    data = []
    for i, vector in enumerate(await pooled_vectors(ctx, prompts, "input")):
        vector = vector if req.dimensions is None else engine.pooling.truncate(vector, req.dimensions)
        data.append(Embedding(index=i, embedding=encode_vector(vector.numpy(), req.encoding_format)))
    tokens = sum(len(ids) for ids in prompts)
    return EmbeddingResponse(data=data, model=ctx.served_model_name,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def prompts_of(ctx: ServingContext, req) -> list[list[int]]:
    """The prompts of a body with vLLM's `input` or `messages` (one
    conversation, rendered by the chat template)."""
    if (req.input is None) == (req.messages is None):
        raise bad_request("give exactly one of input and messages", "input")
    if req.messages is None:
        return prompt_id_lists(ctx.engine.tokenizer, req.input, "input")[0]
    return [conversation_ids(ctx, req.messages, add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message,
                             chat_template_kwargs=req.chat_template_kwargs)]


async def pooled_vectors(ctx: ServingContext, prompts: list[list[int]], param: str) -> list[torch.Tensor]:
    """Each prompt's pooled vector, from one embedding request each, the
    whole lot refused (naming `param`) before any runs."""
    engine = ctx.engine
    params = SamplingParams(max_new_tokens=None)
    if ctx.allow_auto_truncate:
        prompts = [fit_context(ids, params, engine.context_len)[0] for ids in prompts]
    await ctx.gate.passed()
    rid = new_id("embd-")
    requests = [GenerateRequest(ids, params, f"{rid}-{i}", embedding=True) for i, ids in enumerate(prompts)]
    try:
        engine.check_queue_room()
        for r in requests:
            engine.validate(r)
    except RequestError as e:
        raise refusal(e, {"prompt": param}) from None
    vectors: list[torch.Tensor | None] = [None] * len(requests)
    async for i, out in merged_outputs(engine, requests):  # an aborted request raises there
        vectors[i] = out.embedding
    return vectors


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
