"""The output side of an embedding request (GenerateRequest.embedding).

An embedding request is a prompt computed like any other, in the same
batches and over the same prefix cache, whose steps hand back the pooled
hidden states of its chosen positions (model/pooling.py) instead of a
sampled token. This object, the request's `Sequence.output`, adds them up
over the prompt's chunks and ends the request with the finished vector
once its whole prompt is in.
"""

from __future__ import annotations

import torch

from pyserve.engine.request import GenerateOutput
from pyserve.engine.sequence import Sequence
from pyserve.model.pooling import PoolingConfig


class EmbeddingOutput:
    def __init__(self, seq: Sequence, pooling: PoolingConfig):
        self.seq = seq
        self.pooling = pooling
        self.total: torch.Tensor | None = None  # float32 sum of the pooled hidden states so far
        self.count = 0  # how many positions it sums

    def add(self, start: int, count: int, total: torch.Tensor) -> None:
        """A step's pooled sum of `count` positions from `start` on. A chunk
        at position 0 starts over: a request retracted in the middle of its
        prompt computes it again from the beginning."""
        if start == 0 or self.total is None:
            self.total, self.count = total.clone(), count
        else:
            self.total += total
            self.count += count

    def _output(self, **fields) -> GenerateOutput:
        seq = self.seq
        return GenerateOutput(rid=seq.rid, text="", token_ids=[], finished=True, prompt_tokens=len(seq.prompt_ids),
                              cached_tokens=seq.cache_hit or 0, **fields)

    def finish(self) -> GenerateOutput:
        """The last output, with the embedding."""
        return self._output(finish_reason="stop", embedding=self.pooling.finish(self.total, self.count))

    def abort(self, reason: str) -> GenerateOutput:
        return self._output(finish_reason=reason)

    # Validation keeps a prompt within the KV cache; should it not fit
    # after all, the request ends without a vector.
    out_of_memory = abort


def embedding_mismatch(wants_embedding: bool) -> str:
    """Why a server refuses a request of the other kind, naming the flag."""
    if wants_embedding:
        return ("this server generates text; embeddings need a server started with --is-embedding "
                "on an embedding model")
    return ("this server serves a model that embeds or scores (--is-embedding): it answers /v1/embeddings, "
            "/classify, /rerank and /score, not generation")
