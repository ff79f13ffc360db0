"""SGLang's POST /classify, on an --is-embedding server of a sequence
classifier (a reward model: model/pooling.py): `text` or `input_ids`, one
prompt or a list, each answered as SGLang does, with its labels' scores
as `embedding` (a reward model's one score: `embedding[0]`) and
`meta_info`; a list for a list."""

from __future__ import annotations

import msgspec

from pyserve.api.generation.serving import ServingContext, prompt_id_lists
from pyserve.api.openai.embeddings import pooled_vectors, serves_embeddings
from pyserve.engine.embedding import embedding_mismatch
from pyserve.http.errors import bad_request


class ClassifyRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    model: str | None = None


async def classify(ctx: ServingContext, req: ClassifyRequest) -> dict | list[dict]:
    if not serves_embeddings(ctx):
        raise bad_request(embedding_mismatch(True))
    if ctx.engine.pooling.head is None:
        raise bad_request("this server's model embeds and classifies nothing: /classify serves sequence "
                          "classifiers (reward models); its vectors are at /v1/embeddings")
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
