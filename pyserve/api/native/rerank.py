"""POST /v1/rerank in SGLang's shape, and POST /rerank and /v2/rerank in
vLLM's (Jina's and Cohere's clients send it): a query and documents in,
the documents' relevance scores out, best first.

A causal LM reranks as SGLang's decoder-only path scores Qwen3-Reranker:
each document goes into the reranker's judging prompt (a system turn that
asks for "yes" or "no", then the instruction, the query and the document,
and an assistant turn with an empty think block), and its score is
P(yes) / (P(yes) + P(no)) for the next token. Both probabilities come from
the engine's prompt logprobs, the label appended to the prompt as /v1/score
reads them. A model whose tokenizer lacks the prompt's chat markers or
single "yes"/"no" tokens cannot be scored this way: a 400 says so.
On an --is-embedding server the documents are scored as vLLM scores
them (pair_scores.py): by a cross-encoder reranker (bge-reranker-v2-m3,
SGLang's --is-embedding rerank models), or by the cosine similarity of an
embedding model's vectors.
"""

from __future__ import annotations

import math

import msgspec

from pyserve.api.generation.serving import ServingContext, collect, fan_out, new_id
from pyserve.api.native.pair_scores import relevance
from pyserve.api.openai.embeddings import serves_embeddings
from pyserve.engine.request import SamplingParams
from pyserve.http.errors import bad_request
from pyserve.http.strict import convert_strict

_PARAMS = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True)
# Qwen3-Reranker's judging prompt, as its model card writes it.
_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
           'Note that the answer can only be "yes" or "no".')
_DEFAULT_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
_MARKERS = ("<|im_start|>", "<|im_end|>")


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    query: str
    documents: list[str]
    model: str | None = None
    instruct: str | None = None
    top_n: int | None = None
    return_documents: bool = True


def judging_prompt(instruct: str, query: str, document: str) -> str:
    return (f"<|im_start|>system\n{_SYSTEM}<|im_end|>\n<|im_start|>user\n"
            f"<Instruct>: {instruct}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _labels(ctx: ServingContext) -> tuple[int, int]:
    """The ids of "no" and "yes", or a 400 naming what the model lacks."""
    tokenizer = ctx.engine.tokenizer
    missing = [m for m in _MARKERS if tokenizer.token_to_id(m) is None]
    labels = [tokenizer.encode(word) for word in ("no", "yes")]
    if missing or any(len(ids) != 1 for ids in labels):
        lacks = f"the chat markers {' and '.join(missing)}" if missing else 'single "yes" and "no" tokens'
        raise bad_request(f"this model cannot rerank: its tokenizer has no {lacks}, which the Qwen3-Reranker "
                          "judging prompt needs; serve a reranker such as Qwen/Qwen3-Reranker-0.6B",
                          "model", "model_not_supported")
    return labels[0][0], labels[1][0]


class ScoredRerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's body (Jina's and Cohere's): top_n 0 keeps every document."""

    query: str
    documents: list[str]
    model: str | None = None
    top_n: int = 0
    return_documents: bool = True


async def _scores(ctx: ServingContext, query: str, documents: list[str], instruct: str) -> tuple[list[float], int]:
    """Each document's relevance, and the tokens of the prompts computed."""
    if not documents:
        raise bad_request("documents must not be empty", "documents")
    if serves_embeddings(ctx):
        return await relevance(ctx, [(query, document) for document in documents], "documents")
    no, yes = _labels(ctx)
    prompts = ctx.engine.tokenizer.encode_batch([judging_prompt(instruct, query, d) for d in documents])
    requests = await fan_out(ctx, [ids + [label] for ids in prompts for label in (no, yes)], _PARAMS, 1,
                             new_id("rerank-"), {"prompt": "documents", "max_new_tokens": "documents"})
    logprobs = [result.prompt_logprobs[-1].logprob for result in await collect(ctx.engine, requests)]
    scores = [1.0 / (1.0 + math.exp(logprobs[i] - logprobs[i + 1])) for i in range(0, len(logprobs), 2)]
    return scores, sum(len(ids) for ids in prompts)


def _best_first(scores: list[float], top_n: int | None) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]


async def rerank(ctx: ServingContext, body: dict) -> list[dict]:
    req = convert_strict(body, RerankRequest, "/v1/rerank")
    if req.top_n is not None and req.top_n < 1:
        raise bad_request("top_n must be at least 1", "top_n")
    if req.instruct is not None and serves_embeddings(ctx):
        raise bad_request("instruct goes into a generation model's judging prompt; this server scores with an "
                          "--is-embedding model, which takes the query and documents alone", "instruct")
    scores, _ = await _scores(ctx, req.query, req.documents, req.instruct or _DEFAULT_INSTRUCT)
    return [{"score": scores[i], **({"document": req.documents[i]} if req.return_documents else {}), "index": i}
            for i in _best_first(scores, req.top_n)]


async def scored_rerank(ctx: ServingContext, body: dict) -> dict:
    req = convert_strict(body, ScoredRerankRequest, "/rerank")
    if req.top_n < 0:
        raise bad_request("top_n must be 0 (every document) or more", "top_n")
    scores, tokens = await _scores(ctx, req.query, req.documents, _DEFAULT_INSTRUCT)
    results = [{"index": i, **({"document": {"text": req.documents[i]}} if req.return_documents else {}),
                "relevance_score": scores[i]} for i in _best_first(scores, req.top_n or None)]
    return {"id": new_id("rerank-"), "model": req.model or ctx.served_model_name, "usage": {"total_tokens": tokens},
            "results": results}
