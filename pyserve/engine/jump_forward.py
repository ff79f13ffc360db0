"""Jump-forward on the event loop: the tokens each sequence takes from a
finished step.

A step gives each sampled sequence its sampled token, or with speculation
the accepted run of its drafts and the target's token; a constrained
sequence's grammar may have forced more tokens after it (engine/grammar.py
finds and encodes them on the forward thread). They all go to the request
as one output, in order, so a stream carries them in one delta; the output
processor ends the request at the first stop or limit among them and keeps
nothing after it. Forced tokens have no log-probabilities: requests that
ask for them never jump (sampler.jumps_forward).

Their KV is computed by the sequence's next decode row, which holds every
known token not yet computed (Scheduler._decode_length); a jumping request
is not overlapped (Scheduler.needs_known_tokens), so no step is launched
for it before its forced tokens are known.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from pyserve.engine.kv.manager import KVManager
from pyserve.engine.metrics import EngineMetrics
from pyserve.engine.request import TokenLogprob
from pyserve.engine.sequence import Sequence
from pyserve.engine.speculative.commit import accepted_runs
from pyserve.engine.speculative.drafter import Drafter
from pyserve.engine.step import ScheduledStep

if TYPE_CHECKING:
    from pyserve.engine.runner.model_runner import StepOutput


def emitted_tokens(step: ScheduledStep, output: StepOutput, ids: list[int], logprobs: list[TokenLogprob | None],
                   kv: KVManager, drafter: Drafter | None, metrics: EngineMetrics
                   ) -> Iterator[tuple[Sequence, list[int], list[TokenLogprob | None]]]:
    """Per live sampled sequence of the step: its tokens and their logprob
    entries (None where not asked for, and for forced tokens). `ids` and
    `logprobs` are the step's, per logits row."""
    if output.counts is None:
        runs = ((i, seq, range(i, i + 1)) for i, seq in enumerate(step.sampled))
    else:
        index = {seq: i for i, seq in enumerate(step.sampled)}
        accepted = accepted_runs(step, output.counts, output.drafted, kv, drafter, metrics)
        runs = ((index[seq], seq, rows) for seq, rows in accepted)
    for i, seq, rows in runs:
        if seq.finished:  # aborted, or finished by an earlier token, while this step ran
            continue
        tokens = [ids[j] for j in rows]
        entries = [logprobs[j] for j in rows]
        forced = output.forced[i] if output.forced else []
        yield seq, tokens + forced, entries + [None] * len(forced)
