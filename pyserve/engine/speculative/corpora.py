"""Operators' corpora for NGRAM draft trees (SGLang's external corpora):
documents the requests will echo (a code base, a product's manuals, the
answers given last week), loaded at start from
--speculative-ngram-external-corpus-path or at run time through
/add_external_corpus, and dropped through /remove_external_corpus.

A corpus file is JSON Lines, one document a line as a JSON string; a
document is tokenized alone, without special tokens, and no match runs
from one into the next (rust/text/ngram_corpus.rs). Of each draft tree,
--speculative-ngram-external-sam-budget nodes are kept for the corpora's
drafts, shared evenly among them in the order of their ids; the request
trie drafts the rest, and any room one source leaves goes to the others.
All corpora together hold at most
--speculative-ngram-external-corpus-max-tokens tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from pyserve._rust import NgramCorpus, Tokenizer

_LINES_PER_BATCH = 512  # documents tokenized at a time, so that an oversized file stops early
# SGLang's mark between documents in /add_external_corpus's token_chunks.
DOCUMENT_SEPARATOR = -(2**31)


class ExternalCorpora:
    """The corpora by id, and the order drafts read them in."""

    def __init__(self, tokenizer: Tokenizer, reserved: int, max_tokens: int):
        self.tokenizer = tokenizer
        self.reserved = reserved  # draft tree nodes kept for the corpora's drafts
        self.max_tokens = max_tokens
        self._corpora: dict[str, NgramCorpus] = {}
        self._building: dict[str, int] = {}  # ids being built, and their tokens
        # What a draft reads: the corpora by id; a new tuple at each change,
        # so a draft the forward thread finds later keeps the one it was given.
        self.in_order: tuple[NgramCorpus, ...] = ()

    def token_counts(self) -> dict[str, int]:
        return {corpus_id: corpus.tokens for corpus_id, corpus in sorted(self._corpora.items())}

    def tokens_left(self) -> int:
        held = sum(c.tokens for c in self._corpora.values()) + sum(self._building.values())
        return self.max_tokens - held

    def load_file_now(self, corpus_id: str, path: str) -> int:
        """Add the corpus file at `path`, blocking (at start); its tokens."""
        documents = self.read_file(corpus_id, path, self.tokens_left())
        with self._claim(corpus_id, documents):
            corpus = NgramCorpus(documents)
        return self._publish(corpus_id, corpus)

    async def add_file(self, corpus_id: str, path: str) -> int:
        """Add the corpus file at `path` (read and tokenized off the event loop); its tokens."""
        self._check_id(corpus_id)
        documents = await asyncio.to_thread(self.read_file, corpus_id, path, self.tokens_left())
        return await self._build(corpus_id, documents)

    async def add_documents(self, corpus_id: str, texts: list[str]) -> int:
        """Add a corpus of `texts`; its tokens."""
        self._check_id(corpus_id)
        documents = await asyncio.to_thread(self._tokenize, texts, self.tokens_left(), "the documents")
        return await self._build(corpus_id, documents)

    async def add_token_chunks(self, corpus_id: str, chunks: list[list[int]]) -> int:
        """Add a corpus given as SGLang's token_chunks (a client's own
        tokenization); its tokens."""
        self._check_id(corpus_id)
        documents = await asyncio.to_thread(self._split_chunks, chunks, self.tokens_left())
        return await self._build(corpus_id, documents)

    def remove(self, corpus_id: str) -> None:
        """KeyError for an id no corpus has."""
        del self._corpora[corpus_id]
        self._reorder()

    def read_file(self, corpus_id: str, path: str, limit: int) -> list[list[int]]:
        """The documents of the JSON Lines file at `path`, tokenized;
        ValueError for a file that is missing, malformed or over `limit` tokens."""
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"corpus {corpus_id!r}: no file at {path}")
        texts = []
        try:
            with file.open(encoding="utf-8") as lines:
                for number, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        texts.append(msgspec.json.decode(line, type=str))
                    except msgspec.DecodeError as e:
                        raise ValueError(f"{path}, line {number}: a corpus line is a JSON string ({e})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"corpus {corpus_id!r}: cannot read {path} as UTF-8 text ({e})") from None
        return self._tokenize(texts, limit, path)

    def _tokenize(self, texts: list[str], limit: int, where: str) -> list[list[int]]:
        documents, tokens = [], 0
        for start in range(0, len(texts), _LINES_PER_BATCH):
            for ids in self.tokenizer.encode_batch(texts[start : start + _LINES_PER_BATCH], False):
                if ids:
                    documents.append(ids)
                    tokens += len(ids)
            if tokens > limit:
                break  # refused below, without tokenizing the rest
        return self._check_size(where, tokens, limit, documents)

    def _split_chunks(self, chunks: list[list[int]], limit: int) -> list[list[int]]:
        """The documents of token_chunks: one stream of token ids, cut
        anywhere into chunks, its documents separated by DOCUMENT_SEPARATOR."""
        vocab = self.tokenizer.vocab_size
        documents, document, tokens = [], [], 0
        for chunk in chunks:
            for token in chunk:
                if token == DOCUMENT_SEPARATOR:
                    if document:
                        documents.append(document)
                    document = []
                elif 0 <= token < vocab:
                    document.append(token)
                    tokens += 1
                else:
                    raise ValueError(f"token_chunks: {token} is neither a token id of this model (0 to {vocab - 1}) "
                                     f"nor the document separator {DOCUMENT_SEPARATOR}")
        if document:
            documents.append(document)
        return self._check_size("token_chunks", tokens, limit, documents)

    def _check_size(self, where: str, tokens: int, limit: int, documents: list[list[int]]) -> list[list[int]]:
        """`documents` (of `tokens` tokens) if they fit in `limit` and hold any token."""
        if tokens > limit:
            raise ValueError(f"{where} hold more tokens than the corpora have room for ({limit} of "
                             f"--speculative-ngram-external-corpus-max-tokens {self.max_tokens} left)")
        if not documents:
            raise ValueError(f"{where} hold no tokens")
        return documents

    def _check_id(self, corpus_id: str) -> None:
        if not corpus_id:
            raise ValueError("corpus_id must not be empty")
        if corpus_id in self._corpora or corpus_id in self._building:
            raise ValueError(f"a corpus {corpus_id!r} is loaded or loading: remove it first to load another under "
                             "its id")

    @contextmanager
    def _claim(self, corpus_id: str, documents: list[list[int]]) -> Iterator[None]:
        """Hold the documents' share of the token budget while they are built."""
        self._check_id(corpus_id)  # again: another load may have taken the id meanwhile
        tokens = sum(map(len, documents))
        if tokens > self.tokens_left():
            raise ValueError(f"corpus {corpus_id!r} has {tokens} tokens; the corpora have room for "
                             f"{self.tokens_left()} more (--speculative-ngram-external-corpus-max-tokens "
                             f"{self.max_tokens})")
        self._building[corpus_id] = tokens
        try:
            yield
        finally:
            del self._building[corpus_id]

    async def _build(self, corpus_id: str, documents: list[list[int]]) -> int:
        with self._claim(corpus_id, documents):
            corpus = await asyncio.to_thread(NgramCorpus, documents)
        return self._publish(corpus_id, corpus)

    def _publish(self, corpus_id: str, corpus: NgramCorpus) -> int:
        self._corpora[corpus_id] = corpus
        self._reorder()
        return corpus.tokens

    def _reorder(self) -> None:
        self.in_order = tuple(corpus for _, corpus in sorted(self._corpora.items()))
