"""What the forward thread keeps of one request to sample its tokens.

The engine builds a request's `SamplingState` when it takes the request
and hands it to the forward thread (ModelRunner.admit); from then on that
thread alone reads and writes it, and it drops it (ModelRunner.release)
after the last step launched for the request. The event loop, which
prepares step N+1 while step N runs, never touches it: no lock is needed,
and a step never sees it change under it.

Of the request's Sequence, the forward thread reads `params` and
`prompt_ids`, which never change, and `output_ids` for the penalties,
whose requests make the scheduler wait for each step's tokens
(Scheduler.needs_known_tokens), so the list does not grow while read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyserve.engine.grammar import GrammarState
from pyserve.engine.ownership import ThreadOwned
from pyserve.engine.request import SamplingParams
from pyserve.engine.sequence import Sequence


@dataclass(eq=False)
class TokenHistory:
    """A request's tokens as the penalties read them, as int64 tensors:
    the distinct tokens of prompt and output, every output token, and the
    distinct output tokens. Grown by the new tokens at each step, so a
    step's Python work does not grow with the length of the sequence."""

    seen: set[int]
    seen_ids: torch.Tensor
    outputs: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    output_seen: set[int] = field(default_factory=set)
    distinct_outputs: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


@dataclass(eq=False)
class SamplingState(ThreadOwned):
    seq: Sequence
    generator: torch.Generator | None = None  # a request with a seed draws from its own
    grammar: GrammarState | None = None  # a constrained request's place in its grammar
    # Tokens masked until min_new_tokens are out: the request's stop ids.
    stop_ids: frozenset[int] = frozenset()
    sampled: int = 0  # tokens drawn so far, in flight or not
    processor_failed: bool = False  # its custom logit processor raised (engine/logit_processors.py)
    _history: TokenHistory | None = field(default=None, init=False)

    def claim(self) -> None:
        super().claim()
        if self.grammar is not None:
            self.grammar.claim()

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def refused(self) -> bool:
        """The grammar refused a token sampled under its mask (a bug), or
        its custom logit processor raised: the engine ends the request."""
        return self.processor_failed or (self.grammar is not None and self.grammar.failed)

    def history(self) -> TokenHistory:
        """The request's history, brought up to its latest output token."""
        seq, history = self.seq, self._history
        if history is None:
            seen = set(seq.prompt_ids) if seq.prompt_embeds is None else set()  # not placeholder ids
            history = self._history = TokenHistory(seen, torch.tensor(sorted(seen), dtype=torch.long))
        new = seq.output_ids[len(history.outputs):]
        if new:
            history.outputs = torch.cat([history.outputs, torch.tensor(new, dtype=torch.long)])
            history.seen_ids = joined(history.seen_ids, history.seen, new)
            history.distinct_outputs = joined(history.distinct_outputs, history.output_seen, new)
            history.seen.update(new)
            history.output_seen.update(new)
        return history


def joined(ids: torch.Tensor, members: set[int], new: list[int]) -> torch.Tensor:
    """`ids` (the tensor of the tokens `members`) with the tokens of `new`
    not in it yet, `members` left as it is."""
    added = [t for t in dict.fromkeys(new) if t not in members]
    return torch.cat([ids, torch.tensor(added, dtype=torch.long)]) if added else ids
