"""NGRAM drafting (prompt lookup): the tokens that followed the latest
earlier occurrence of the request's own last tokens.

Copy-heavy work (edits, RAG answers, code rewrites) repeats long stretches
of its prompt, so where the request's newest tokens appeared before, what
came after them then is a good guess of what comes next. The drafter runs
on the event loop, at scheduling; verification is the target's (the
runner's `accepted_run`).

A request whose drafts keep failing stops drafting: each verify step costs
more than a plain decode step, so free chat must not pay for drafts it
never accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyserve.engine.penalties import reads_history
from pyserve.engine.request import SamplingParams
from pyserve.engine.sequence import Sequence

# A request's drafting is judged over this many verify steps: below
# MIN_ACCEPT_RATE accepted tokens per drafted one, it decodes plainly.
_JUDGED_AFTER = 8
_MIN_ACCEPT_RATE = 0.25
_SEARCH_SPAN = 4096  # tokens back the suffix is looked for


def find_draft(ids: list[int], min_window: int, max_window: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of
    the longest suffix of `ids` (between min_window and max_window tokens)
    that occurs earlier; [] when none does."""
    n = len(ids)
    if n < min_window + 1 or k <= 0:
        return []
    last = ids[-1]
    lo = max(0, n - _SEARCH_SPAN)
    best_len, best_end = 0, -1
    for end in reversed(_positions(ids, last, lo, n - 1)):  # candidate ends, latest first
        length = 1
        while length < max_window and end - length >= 0 and ids[end - length] == ids[n - 1 - length]:
            length += 1
        if length > best_len:
            best_len, best_end = length, end
            if length >= max_window:
                break
    if best_len < min_window:
        return []
    return ids[best_end + 1 : best_end + 1 + k]


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


def drafts_exactly(p: SamplingParams) -> bool:
    """Whether verification reproduces plain decoding for these params:
    greedy, with nothing that changes the logits from one token to the next
    (penalties, logit bias, min_tokens) and no grammar (its mask moves with
    every token)."""
    return (p.temperature == 0 and p.constraint is None and not reads_history(p) and not p.logit_bias
            and not p.min_new_tokens and not p.pooling)


@dataclass
class NgramDrafter:
    num_draft_tokens: int
    min_window: int
    max_window: int

    def propose(self, seq: Sequence) -> list[int]:
        """The drafts for `seq`'s next step ([] for a plain decode row)."""
        if not seq.drafting or not drafts_exactly(seq.params):
            return []
        # Never draft past the request's length limit: the bonus token is the last.
        room = seq.params.max_new_tokens - len(seq.output_ids) - 1
        return find_draft(seq.all_ids, self.min_window, self.max_window, min(self.num_draft_tokens, room))

    @staticmethod
    def on_verified(seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verify step; turn drafting off for a request whose drafts fail."""
        seq.drafted += drafted
        seq.accepted += accepted
        seq.verify_steps += 1
        if seq.verify_steps >= _JUDGED_AFTER and seq.accepted < _MIN_ACCEPT_RATE * seq.drafted:
            seq.drafting = False
