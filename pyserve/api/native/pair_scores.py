"""How relevant each second text is to its first, on an --is-embedding
server, as vLLM scores pairs: a cross-encoder (an encoder sequence
classifier, bge-reranker-v2-m3 or ms-marco-MiniLM) reads each pair encoded
together as one prompt (`[CLS] first [SEP] second [SEP]`), and its single
label's score through a sigmoid is the relevance; an embedding model's is
the cosine similarity of the two texts' embeddings. A reward model (a
decoder's classifier) scores no pairs: a 400 says so.

The rerank routes (rerank.py) score a query against documents here on such
a server, and vLLM's /score body (text_1 and text_2) is answered here.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
import torch.nn.functional as F

from pyserve.api.generation.serving import ServingContext, new_id, now
from pyserve.api.openai.embeddings import pooled_vectors
from pyserve.http.errors import bad_request
from pyserve.http.strict import convert_strict


async def relevance(ctx: ServingContext, pairs: list[tuple[str, str]], param: str) -> tuple[list[float], int]:
    """Each pair's relevance, and the tokens of the prompts computed;
    `param` names the texts in a refusal."""
    engine = ctx.engine
    pooling = engine.pooling
    if pooling.cross_encoder:
        if len(pooling.labels) != 1:
            raise bad_request(f"this cross-encoder has {len(pooling.labels)} labels; relevance is one label's "
                              "score: use /classify for the labels' probabilities", "model", "model_not_supported")
        prompts = engine.tokenizer.encode_pairs(pairs)
        vectors = await pooled_vectors(ctx, prompts, param)
        return [torch.sigmoid(v[0]).item() for v in vectors], sum(len(ids) for ids in prompts)
    if pooling.head is not None:
        raise bad_request("this model is a sequence classifier of one text at a time (a reward model), not a "
                          "cross-encoder or an embedding model: it scores no pairs; use /classify",
                          "model", "model_not_supported")
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))  # each text embedded once
    prompts = engine.tokenizer.encode_batch(texts, add_special_tokens=True)
    vectors = dict(zip(texts, await pooled_vectors(ctx, prompts, param)))
    scores = [F.cosine_similarity(vectors[a], vectors[b], dim=0).item() for a, b in pairs]
    return scores, sum(len(ids) for ids in prompts)


class PairScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /score body: a text and a list of texts, two lists paired
    item by item, or two texts (`queries` and `documents` are its newer
    names for text_1 and text_2)."""

    model: str | None = None
    text_1: Any = None
    text_2: Any = None
    queries: Any = None
    documents: Any = None


def _texts(value: Any, param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not (isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
        raise bad_request(f"{param} must be a text or a non-empty list of texts", param)
    return texts


async def score_pairs(ctx: ServingContext, body: dict) -> dict:
    """vLLM's /score: each pair's relevance, in order."""
    req = convert_strict(body, PairScoreRequest, "/score")
    first_name, second_name = ("queries", "documents") if req.text_1 is None and req.text_2 is None \
        else ("text_1", "text_2")
    firsts = _texts(getattr(req, first_name), first_name)
    seconds = _texts(getattr(req, second_name), second_name)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise bad_request(f"{first_name} has {len(firsts)} texts and {second_name} {len(seconds)}: give one "
                          f"{first_name} text, or as many as {second_name}", second_name)
    scores, tokens = await relevance(ctx, list(zip(firsts, seconds)), second_name)
    return {"id": new_id("score-"), "object": "list", "created": now(), "model": req.model or ctx.served_model_name,
            "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
