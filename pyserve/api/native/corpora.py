"""NGRAM trees' corpora at run time (engine/speculative/corpora.py):
SGLang's POST /add_external_corpus, POST /remove_external_corpus and
GET /list_external_corpora, with its bodies. They answer
`{"success": true, ...}`, and what cannot be done `{"success": false,
"message": ...}` with a 4xx status, as SGLang's clients read them."""

from __future__ import annotations

import uuid

from pyserve.api.generation.serving import ServingContext
from pyserve.api.protocol.native import AddExternalCorpusRequest, RemoveExternalCorpusRequest
from pyserve.engine.speculative.corpora import ExternalCorpora
from pyserve.http.errors import APIError, bad_request


def _corpora(ctx: ServingContext) -> ExternalCorpora:
    corpora = ctx.engine.external_corpora
    if corpora is None:
        raise bad_request("this server drafts no NGRAM trees, which read corpora: start it with "
                          "--speculative-algorithm NGRAM and --speculative-ngram-max-bfs-breadth above 1 (or "
                          "--speculative-ngram-match-type PROB)")
    return corpora


async def add(ctx: ServingContext, req: AddExternalCorpusRequest) -> dict:
    corpora = _corpora(ctx)
    given = [form for form in ("file_path", "documents", "token_chunks") if getattr(req, form) is not None]
    if len(given) != 1:
        raise bad_request("give the corpus as one of file_path, documents or token_chunks"
                          + (f", not {' and '.join(given)}" if given else ""))
    corpus_id = uuid.uuid4().hex if req.corpus_id is None else req.corpus_id
    try:
        if req.file_path is not None:
            tokens = await corpora.add_file(corpus_id, req.file_path)
        elif req.documents is not None:
            tokens = await corpora.add_documents(corpus_id, req.documents)
        else:
            tokens = await corpora.add_token_chunks(corpus_id, req.token_chunks)
    except ValueError as e:
        raise bad_request(str(e)) from None
    return {"success": True, "corpus_id": corpus_id, "loaded_token_count": tokens,
            "message": f"Loaded corpus '{corpus_id}' with {tokens} tokens."}


def remove(ctx: ServingContext, req: RemoveExternalCorpusRequest) -> dict:
    corpora = _corpora(ctx)
    try:
        corpora.remove(req.corpus_id)
    except KeyError:
        raise APIError(f"no corpus '{req.corpus_id}' is loaded (loaded: {sorted(corpora.token_counts())})",
                       404) from None
    return {"success": True, "message": f"Removed corpus '{req.corpus_id}'."}


def list_corpora(ctx: ServingContext) -> dict:
    counts = _corpora(ctx).token_counts()
    return {"success": True, "corpus_ids": list(counts), "corpus_token_counts": counts, "message": ""}
