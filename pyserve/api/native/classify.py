"""SGLang's POST /encode, POST /classify on a server of a sequence
classifier (a reward model: model/pooling.py), and vLLM's POST /pooling,
on an --is-embedding server.

/encode takes SGLang's body, `text` or `input_ids`, one prompt or a list,
and answers each prompt's vector as `embedding` with `meta_info`; a list
for a list. /classify takes that body too (a classifier's vector is its
label scores: a reward model's one score is `embedding[0]`), or vLLM's,
`input` (a text, texts, token ids or lists of them) or one conversation as
`messages` (rendered by the chat template), answered with `data` of
`{"index", "label", "probs", "num_classes"}`: the probabilities a sigmoid
(one label) or softmax of the scores, the label the likeliest. /pooling
takes vLLM's body (and `encoding_format`) and answers each prompt's
vector as /v1/embeddings computes it (a classifier's: its label scores)
as `data` of `{"index", "object": "pooling", "data"}`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import torch

from pyserve.api.generation.serving import ServingContext, new_id, now, prompt_id_lists
from pyserve.api.openai.embeddings import encode_vector, pooled_vectors, prompts_of, serves_embeddings
from pyserve.api.protocol.openai import ChatMessage
from pyserve.engine.embedding import embedding_mismatch
from pyserve.http.errors import bad_request
from pyserve.http.strict import convert_strict


class ClassifyRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's body (/encode's and /classify's)."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    model: str | None = None


class ClassificationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's body: `input`, or one conversation as `messages`."""

    input: str | list[str | int | list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None


class PoolingRequest(ClassificationRequest, kw_only=True, forbid_unknown_fields=True):
    encoding_format: Literal["float", "base64"] = "float"


def _check_server(ctx: ServingContext) -> None:
    if not serves_embeddings(ctx):
        raise bad_request(embedding_mismatch(True))


async def encode(ctx: ServingContext, req: ClassifyRequest) -> dict | list[dict]:
    _check_server(ctx)
    return await _sglang(ctx, req)


async def classify(ctx: ServingContext, body: dict) -> dict | list[dict]:
    _check_server(ctx)
    if ctx.engine.pooling.head is None:
        raise bad_request("this server's model embeds and classifies nothing: /classify serves sequence "
                          "classifiers (reward models); its vectors are at /v1/embeddings and /encode")
    if "input" in body or "messages" in body:
        return await _vllm(ctx, convert_strict(body, ClassificationRequest, "/classify"))
    return await _sglang(ctx, convert_strict(body, ClassifyRequest, "/classify"))


async def _sglang(ctx: ServingContext, req: ClassifyRequest) -> dict | list[dict]:
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", "text")
    param = "text" if req.text is not None else "input_ids"
    if req.text is not None and ctx.engine.tokenizer is None:
        raise bad_request("this server runs with --skip-tokenizer-init: send input_ids", "text")
    prompts, single = prompt_id_lists(ctx.engine.tokenizer, req.text if req.text is not None else req.input_ids,
                                      param, text=req.text is not None)
    answers = [{"embedding": vector.tolist(), "meta_info": {"prompt_tokens": len(ids)}}
               for ids, vector in zip(prompts, await pooled_vectors(ctx, prompts, param))]
    return answers[0] if single else answers


def _vllm_prompts(ctx: ServingContext, req: ClassificationRequest) -> list[list[int]]:
    texts = req.messages is not None or isinstance(req.input, str) or any(isinstance(p, str) for p in req.input or [])
    if ctx.engine.tokenizer is None and texts:
        raise bad_request("this server runs with --skip-tokenizer-init: send token ids", "input")
    return prompts_of(ctx, req)


def _vllm_response(ctx: ServingContext, req: ClassificationRequest, kind: str, data: list[dict],
                   prompts: list[list[int]]) -> dict:
    tokens = sum(len(ids) for ids in prompts)
    return {"id": new_id(kind + "-"), "object": "list", "created": now(), "model": req.model or ctx.served_model_name,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def _vllm(ctx: ServingContext, req: ClassificationRequest) -> dict:
    prompts = _vllm_prompts(ctx, req)
    labels = ctx.engine.pooling.labels
    data = []
    for i, scores in enumerate(await pooled_vectors(ctx, prompts, "input")):
        probs = torch.sigmoid(scores) if len(labels) == 1 else torch.softmax(scores, -1)
        data.append({"index": i, "label": labels[int(probs.argmax())], "probs": probs.tolist(),
                     "num_classes": len(labels)})
    return _vllm_response(ctx, req, "classify", data, prompts)


async def pooling(ctx: ServingContext, req: PoolingRequest) -> dict:
    _check_server(ctx)
    prompts = _vllm_prompts(ctx, req)
    data = [{"index": i, "object": "pooling", "data": encode_vector(vector.numpy(), req.encoding_format)}
            for i, vector in enumerate(await pooled_vectors(ctx, prompts, "input"))]
    return _vllm_response(ctx, req, "pool", data, prompts)
