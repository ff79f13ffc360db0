"""Committing a speculative step's results on the event loop: each
sequence keeps the KV of its accepted run and frees its rejected drafts'
slots at once, before its tokens are handed out (a stop inside the run
then releases exactly the KV of known tokens)."""

from __future__ import annotations

from collections.abc import Iterator

from pyserve.engine.kv.manager import KVManager
from pyserve.engine.metrics import EngineMetrics
from pyserve.engine.sequence import Sequence
from pyserve.engine.speculative.drafter import Drafter
from pyserve.engine.step import ScheduledStep


def row_sequences(step: ScheduledStep, drafted: list[int] | None) -> list[Sequence]:
    """The sequence of every sampled logits row, in order (`drafted`: StepOutput's)."""
    if not step.drafts:
        return step.sampled
    return [seq for seq, n in zip(step.sampled, verified_drafts(step, drafted)) for _ in range(n + 1)]


def verified_drafts(step: ScheduledStep, drafted: list[int] | None) -> list[int]:
    """Per sampled sequence, the drafts its row verified: what the
    scheduler made room for, unless the forward thread cut the row."""
    return drafted if drafted is not None else [len(d) for d in step.drafts]


def accepted_runs(step: ScheduledStep, counts: list[int], drafted: list[int] | None, kv: KVManager,
                  drafter: Drafter, metrics: EngineMetrics) -> Iterator[tuple[Sequence, range]]:
    """Per live sampled sequence, the logits rows whose tokens it emits."""
    row = 0
    for seq, draft, verified, count in zip(step.sampled, step.drafts, verified_drafts(step, drafted), counts):
        if not seq.finished:  # else aborted while the step ran: its KV is already back
            if draft:
                # KV stays for the last known token and the accepted drafts;
                # the slots of the rejected drafts and of those the row was cut
                # to are the last ones (with overlap, a later row took their
                # place on the forward thread; retracted while the step ran,
                # the sequence holds none).
                kv.drop_tail(seq, seq.kv_len - (len(draft) - (count - 1)))
            if verified:
                drafter.on_verified(seq, verified, count - 1)
                metrics.on_verify(verified, count)
            yield seq, range(row, row + count)
        row += verified + 1
