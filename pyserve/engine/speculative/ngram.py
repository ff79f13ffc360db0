"""NGRAM drafting (prompt lookup): the tokens that followed the latest
earlier occurrence of the request's own last tokens.

Copy-heavy work (edits, RAG answers, code rewrites) repeats long stretches
of its prompt, so where the request's newest tokens appeared before, what
came after them then is a good guess of what comes next. The drafter runs
on the event loop, at scheduling; verification is the target's
(speculative/rejection.py).

NgramTreeDrafter drafts trees instead, from a trie of every request's
tokens and the operators' corpora (speculative/corpora.py;
rust/text/ngram_draft.rs says how they match and branch). A request with
a cache_salt neither reads nor feeds that trie: it drafts a chain from its
own tokens, since drafts from other requests' text would make its speed
tell what they wrote, as a shared prefix cache would.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyserve._rust import NgramCorpus, NgramCursor, NgramTrie
from pyserve.engine.sequence import Sequence
from pyserve.engine.speculative.corpora import ExternalCorpora
from pyserve.engine.speculative.drafter import Drafter
from pyserve.engine.speculative.tree import DraftTree

_SEARCH_SPAN = 4096  # tokens back the suffix is looked for
# The latest occurrences of the suffix that vote on the drafts, at most: in
# a loop of one word it recurs at every position, and counting thousands
# of them each step would cost the event loop milliseconds a request.
_MAX_VOTERS = 32


def find_draft(ids: list[int], min_window: int, max_window: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the earlier occurrences of the longest
    suffix of `ids` (between min_window and max_window tokens) that occurs
    earlier; [] when none does. Where those occurrences went on differently,
    each draft token is the one most of them that agree with the drafts so
    far have next, the latest occurrence's on a tie. In a loop of repeated
    words the latest occurrence is the one just before the suffix, whose
    continuation runs into the suffix itself after a token or two; the
    earlier ones draft on."""
    n = len(ids)
    if n < min_window + 1 or k <= 0:
        return []
    last = ids[-1]
    lo = max(0, n - _SEARCH_SPAN)
    best_len, ends = 0, []
    for end in reversed(_positions(ids, last, lo, n - 1)):  # candidate ends, latest first
        length = 1
        while length < max_window and end - length >= 0 and ids[end - length] == ids[n - 1 - length]:
            length += 1
        if length > best_len:
            best_len, ends = length, [end]
        elif length == best_len and len(ends) < _MAX_VOTERS:
            ends.append(end)
        if best_len >= max_window and len(ends) >= _MAX_VOTERS:
            break  # no later candidate is longer, and enough have voted
    if best_len < min_window:
        return []
    return _majority_continuation(ids, ends, k)


def _majority_continuation(ids: list[int], ends: list[int], k: int) -> list[int]:
    """Up to k tokens after the positions `ends` (latest first), each the
    one most of the positions still agreeing with the tokens before it
    have next (dicts keep insertion order, so a tie goes to the latest)."""
    draft: list[int] = []
    for offset in range(1, k + 1):
        counts: dict[int, int] = {}
        for end in ends:
            if end + offset < len(ids):
                token = ids[end + offset]
                counts[token] = counts.get(token, 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)
        draft.append(token)
        ends = [end for end in ends if end + offset < len(ids) and ids[end + offset] == token]
    return draft


def _last_tokens(seq: Sequence, n: int) -> list[int]:
    """The last `n` of the sequence's known tokens, prompt and output,
    without copying the rest of a long prompt."""
    out = seq.output_ids
    return out[-n:] if len(out) >= n else seq.prompt_ids[len(out) - n :] + out


def _positions(ids: list[int], token: int, start: int, stop: int) -> list[int]:
    """Where `token` occurs in ids[start:stop] (list.index scans in C)."""
    found = []
    try:
        while True:
            start = ids.index(token, start, stop)
            found.append(start)
            start += 1
    except ValueError:
        return found


@dataclass
class LateNgramDraft:
    """NGRAM drafts for a row scheduled while its sequence's previous step
    runs: the forward thread finds them once that step's accepted tokens
    are known, after the tokens known at scheduling (`known`, the last
    stretch that a search can read)."""

    known: list[int]
    min_window: int
    max_window: int
    k: int

    def find(self, accepted: list[int]) -> tuple[list[int], DraftTree | None]:
        """Up to k drafts (the room the row was scheduled with), a chain."""
        return find_draft(self.known + accepted, self.min_window, self.max_window, self.k), None


@dataclass
class LateNgramTree:
    """LateNgramDraft for NgramTreeDrafter: the drafts and their tree, read
    from the trie and the corpora loaded at scheduling after `known` (the
    last tokens a match can read) and the accepted tokens."""

    trie: NgramTrie
    corpora: tuple[NgramCorpus, ...]
    reserved: int
    known: list[int]
    k: int

    def find(self, accepted: list[int]) -> tuple[list[int], DraftTree | None]:
        return tree_draft(self.trie, self.corpora, self.reserved, self.known + accepted, self.k)


def tree_draft(trie: NgramTrie, corpora: tuple[NgramCorpus, ...], reserved: int, ids: list[int],
               k: int) -> tuple[list[int], DraftTree | None]:
    """Up to k drafts after `ids` from `trie` and `corpora` (`reserved` of
    the nodes theirs), and their tree (None when they form a chain, each
    the child of the one before)."""
    tokens, parents = trie.draft(ids, k, corpora, reserved)
    if all(p == i - 1 for i, p in enumerate(parents)):
        return tokens, None
    return tokens, DraftTree(parents)


class NgramDrafter(Drafter):
    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int, draft_cost: float | None = None):
        super().__init__(num_draft_tokens, draft_cost)
        self.min_window = min_window
        self.max_window = max_window

    def budget(self, seq: Sequence) -> int:
        """Drafter.budget, and after a verify step at most twice the run it
        kept plus one (at least 2): a copy that goes on earns longer drafts
        step after step, one that broke off drafts little until it picks
        up again. Each draft makes the verify step dearer: a fixed long
        --speculative-num-draft-tokens pays for drafts past every
        divergence, and the switch-off then judges the request on the small
        share of them it keeps (bench/README.md SV6-SV11)."""
        k = super().budget(seq)
        if seq.last_accepted is None:
            return k
        return min(k, max(2, 2 * (seq.last_accepted + 1)))

    def propose(self, seq: Sequence) -> list[int]:
        """The drafts for `seq`'s next step ([] for a plain decode row)."""
        k = self.budget(seq)
        return find_draft(seq.all_ids, self.min_window, self.max_window, k) if k else []

    def late_drafts(self, seq: Sequence, k: int) -> LateNgramDraft:
        known = _last_tokens(seq, _SEARCH_SPAN + self.max_window)
        return LateNgramDraft(known, self.min_window, self.max_window, k)


class NgramTreeDrafter(NgramDrafter):
    """NGRAM drafts as trees, from every request's tokens in `trie` and the
    `corpora`; a request with a cache_salt drafts a chain from its own."""

    def __init__(self, num_draft_tokens: int, trie: NgramTrie, corpora: ExternalCorpora, min_window: int,
                 max_window: int, draft_cost: float | None = None):
        super().__init__(num_draft_tokens, min_window, max_window, draft_cost)
        self.trie = trie
        self.corpora = corpora

    def observe(self, seq: Sequence) -> None:
        """Add the request's tokens that came back since the last call to the trie."""
        if seq.cache_salt is not None:
            return
        if seq.ngram_cursor is None:
            seq.ngram_cursor = NgramCursor()
        cursor = seq.ngram_cursor
        prompt = len(seq.prompt_ids)
        new = (seq.prompt_ids[cursor.indexed :] + seq.output_ids if cursor.indexed < prompt
               else seq.output_ids[cursor.indexed - prompt :])
        if new:
            self.trie.extend(cursor, new)

    def forget(self) -> None:
        """Empty the trie; the corpora, an operator's, stay."""
        self.trie.clear()

    def draft(self, seq: Sequence) -> tuple[list[int], DraftTree | None]:
        if seq.cache_salt is not None:
            return super().propose(seq), None
        k = self.budget(seq)
        if not k:
            return [], None
        corpora = self.corpora
        return tree_draft(self.trie, corpora.in_order, corpora.reserved, _last_tokens(seq, self.max_window), k)

    def propose(self, seq: Sequence) -> list[int]:
        return self.draft(seq)[0]

    def late_drafts(self, seq: Sequence, k: int) -> LateNgramDraft | LateNgramTree:
        if seq.cache_salt is not None:
            return super().late_drafts(seq, k)
        corpora = self.corpora
        return LateNgramTree(self.trie, corpora.in_order, corpora.reserved, _last_tokens(seq, self.max_window), k)
