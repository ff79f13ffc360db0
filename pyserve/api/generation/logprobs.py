"""OpenAI `logprobs` bodies from the engine's per-token entries.

Chat (`logprobs: true`, `top_logprobs: 0..20`) answers
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`;
completions (`logprobs: 0..20`, the number of alternatives) answer the
legacy shape `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
with `echo` covering the prompt's tokens too (as evaluation harnesses use it).
A token's text is its own decode (special tokens included), so a token that
holds part of a UTF-8 character reads as U+FFFD, as in vLLM.
"""

from __future__ import annotations

from functools import lru_cache

from pyserve._rust import Tokenizer
from pyserve.api.protocol.openai import (
    ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob,
)
from pyserve.engine.request import TokenLogprob

MAX_TOP_LOGPROBS = 20


class TokenTexts:
    """Token id -> its text, cached: the same ids come back all the time."""

    def __init__(self, tokenizer: Tokenizer):
        self.text = lru_cache(maxsize=1 << 16)(lambda i: tokenizer.decode([i], skip_special_tokens=False))

    def top(self, entry: TokenLogprob) -> list[TopLogprob]:
        return [TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                for t, lp in ((self.text(i), lp) for i, lp in entry.top)]


class TokenIdTexts(TokenTexts):
    """vLLM's return_tokens_as_token_ids: each token reads "token_id:N",
    which names even a token whose own text is part of a UTF-8 character."""

    def __init__(self):
        self.text = lambda i: f"token_id:{i}"


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for e in entries:
        text = texts.text(e.token_id)
        content.append(ChatTokenLogprob(token=text, logprob=e.logprob, bytes=list(text.encode()),
                                        top_logprobs=texts.top(e)))
    return ChatLogprobs(content=content)


def completion_logprobs(texts: TokenTexts, entries: list[TokenLogprob | None], offset: int,
                        first_token: int | None = None) -> CompletionLogprobs:
    """`offset`: where the first token's text starts in the choice's text.
    An echoed prompt's entries come first, led by None for its first token,
    `first_token`, which nothing scores."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for e in entries:
        text = texts.text(first_token if e is None else e.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(None if e is None else e.logprob)
        # The sampled token always among them (OpenAI's "up to logprobs + 1";
        # with logprobs 0, it alone, as vLLM answers).
        out.top_logprobs.append(None if e is None else {texts.text(i): lp for i, lp in e.top} | {text: e.logprob})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def prompt_logprobs(texts: TokenTexts, entries: list[TokenLogprob | None]) -> PromptLogprobs:
    out: PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        tokens = {str(e.token_id): PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=texts.text(e.token_id))}
        for rank, (i, lp) in enumerate(e.top, 1):
            tokens.setdefault(str(i), PromptLogprob(logprob=lp, rank=rank, decoded_token=texts.text(i)))
        out.append(tokens)
    return out


class PendingLogprobs:
    """A stream's logprob entries of tokens whose text is not out yet, per
    choice: they ride with the choice's next chunk."""

    def __init__(self, choices: int):
        self._entries: list[list[TokenLogprob | None]] = [[] for _ in range(choices)]

    def add(self, choice: int, entries: list[TokenLogprob | None]) -> None:
        self._entries[choice] += entries

    def take(self, choice: int) -> list[TokenLogprob | None]:
        entries, self._entries[choice] = self._entries[choice], []
        return entries
