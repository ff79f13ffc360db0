"""POST /v1/score in SGLang's shape: for each item, the probabilities of
`label_token_ids` as the next token after query + item (item + query with
`item_first`); without label_token_ids, the probability of each item as
the continuation of the query (the product of its tokens' probabilities).

Computed with the engine's prompt logprobs: the prompt query + item +
label scores the label at its last position, exactly the next-token
distribution after query + item. Every (item, label) pair is one engine
request of one output token, all sent in one fan-out, so they are batched
together; a prompt with prompt logprobs is computed whole (no cached
prefix), so a request costs items x labels prefills of query + item. A
continuation score reads the item's own positions of the prompt query +
item: one request per item.

vLLM's /score body (`text_1`, `text_2`) is for a cross-encoder or an
embedding model: an --is-embedding server answers it (pair_scores.py); a
generation server refuses it with a 400 that says what to send instead,
as vLLM has no such score for a generation model either. SGLang's body
needs a generation model: an --is-embedding server refuses it.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from pyserve.api.native.pair_scores import score_pairs
from pyserve.api.openai.embeddings import refuse_generation, serves_embeddings
from pyserve.http.errors import bad_request
from pyserve.api.generation.serving import ServingContext, collect, fan_out, new_id, prompt_id_lists
from pyserve.http.strict import convert_strict
from pyserve.engine.request import SamplingParams

# One output token (the engine's least); greedy, so nothing is sampled at random.
_PARAMS = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True)
_VLLM_FIELDS = ("text_1", "text_2", "queries", "documents", "data_1", "data_2")


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    query: Any = None  # a text, or token ids
    items: Any = None  # a text, a list of texts, or a list of token id lists (as the query is)
    label_token_ids: Any = None
    apply_softmax: bool = False  # normalize over the labels (or items) instead of the whole vocabulary
    item_first: bool = False


async def score(ctx: ServingContext, body: dict) -> dict:
    vllm_fields = [name for name in _VLLM_FIELDS if name in body]
    if vllm_fields and serves_embeddings(ctx):
        return await score_pairs(ctx, body)
    if vllm_fields:
        raise bad_request(f"{vllm_fields[0]!r} is vLLM's score shape, which needs a cross-encoder or embedding "
                          "model served with --is-embedding; this server scores with a generation model: send "
                          "query, items and label_token_ids (SGLang's shape)", vllm_fields[0], "unsupported_parameter")
    refuse_generation(ctx)
    req = convert_strict(body, ScoreRequest, "/v1/score")
    if req.label_token_ids is None:
        return await _continuations(ctx, req)
    labels = _labels(req.label_token_ids, ctx.engine.vocab_size)
    prompts = _prompts(ctx, req)
    requests = await fan_out(ctx, [ids + [label] for ids in prompts for label in labels], _PARAMS, 1,
                             new_id("score-"), {"prompt": "items", "max_new_tokens": "items"})
    results = await collect(ctx.engine, requests)
    logprobs = [result.prompt_logprobs[-1].logprob for result in results]
    scores = [_probabilities(logprobs[i : i + len(labels)], req.apply_softmax)
              for i in range(0, len(logprobs), len(labels))]
    # What was scored: query + item once per item, whatever the number of labels.
    return _response(ctx, scores, prompts)


async def _continuations(ctx: ServingContext, req: ScoreRequest) -> dict:
    """Each item's probability as what follows the query: the sum of its
    tokens' prompt logprobs after query + item, exponentiated (softmax:
    normalized over the items instead)."""
    if req.item_first:
        raise bad_request("item_first needs label_token_ids: a continuation score reads the item after the query",
                          "item_first")
    prompts = _prompts(ctx, req)
    query = _query_ids(ctx, req)
    if not query:
        raise bad_request("the query is empty: without label_token_ids the item is scored as its continuation",
                          "query")
    requests = await fan_out(ctx, prompts, _PARAMS, 1, new_id("score-"),
                             {"prompt": "items", "max_new_tokens": "items"})
    logprobs = []
    for ids, result in zip(prompts, await collect(ctx.engine, requests)):
        start = _shared_prefix(query, ids)
        if start == len(ids):
            raise bad_request("an item adds no token to the query", "items")
        logprobs.append(sum(entry.logprob for entry in result.prompt_logprobs[start:]))
    return _response(ctx, _probabilities(logprobs, req.apply_softmax), prompts)


def _query_ids(ctx: ServingContext, req: ScoreRequest) -> list[int]:
    """The query's tokens as they begin query + item: a text query is
    tokenized alone, as prompt_id_lists tokenizes the joined texts."""
    if isinstance(req.query, str):
        return ctx.engine.tokenizer.encode(req.query, add_special_tokens=True)
    return req.query


def _shared_prefix(query: list[int], ids: list[int]) -> int:
    """Where the item's tokens begin in query + item. Joined texts may merge
    the query's last word with the item's first: that token then counts as
    the item's."""
    n = 0
    while n < min(len(query), len(ids)) and query[n] == ids[n]:
        n += 1
    return max(n, 1)  # the first token has no logprob: nothing predicts it


def _response(ctx: ServingContext, scores: list, prompts: list[list[int]]) -> dict:
    prompt_tokens = sum(len(ids) for ids in prompts)
    return {"scores": scores, "model": ctx.served_model_name, "object": "scoring",
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}}


def _labels(value: Any, vocab_size: int) -> list[int]:
    if not (isinstance(value, list) and value
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise bad_request("label_token_ids must be a non-empty list of token ids", "label_token_ids")
    bad = next((i for i in value if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise bad_request(f"label token id {bad} is outside the vocabulary (size {vocab_size})", "label_token_ids",
                          "invalid_value")
    return value


def _prompts(ctx: ServingContext, req: ScoreRequest) -> list[list[int]]:
    prompts = _joined(ctx, req)
    if not all(prompts):
        raise bad_request("query + item is empty for an item: there is nothing to predict the label after", "items")
    return prompts


def _joined(ctx: ServingContext, req: ScoreRequest) -> list[list[int]]:
    """query + item (or item + query) per item, as token ids. Texts are
    joined before they are tokenized (so a word split across them is one
    token, as in the text a model reads), with the special tokens a
    completion prompt gets; token ids are joined as they are."""
    if req.query is None or req.items is None:
        raise bad_request("query and items are both required", "query" if req.query is None else "items")
    if isinstance(req.items, list) and not req.items:
        raise bad_request("items must not be empty", "items")
    if isinstance(req.query, str):
        items = [req.items] if isinstance(req.items, str) else req.items
        if not (isinstance(items, list) and all(isinstance(item, str) for item in items)):
            raise bad_request("with a text query, items must be a text or a list of texts", "items")
        texts = [item + req.query if req.item_first else req.query + item for item in items]
        prompts, _ = prompt_id_lists(ctx.engine.tokenizer, texts, "items")
        return prompts
    query, _ = prompt_id_lists(ctx.engine.tokenizer, req.query, "query", text=False)
    if len(query) != 1:
        raise bad_request("query must be a text or a list of token ids", "query")
    items, _ = prompt_id_lists(ctx.engine.tokenizer, req.items, "items", text=False)
    return [item + query[0] if req.item_first else query[0] + item for item in items]


def _probabilities(logprobs: list[float], softmax: bool) -> list[float]:
    """Each label's (or item's) probability: under the whole vocabulary, or
    (softmax) among the labels (items) only."""
    if not softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]
