"""Rows scheduled while their sequence's previous step still ran (overlap
scheduling), made exact on the forward thread.

The scheduler placed such a row after every draft of the sequence's
previous row, since it could not know how many the target would keep, and
gave it placeholder tokens. The forward thread runs steps in order, so
when it takes this step the previous one's results are known to it:

- the row moves back over the drafts the target rejected: its positions,
  the slots it writes, and its sequence's slots read (the last `rejected`
  ones dropped, as the event loop drops them when it commits that step);
- its first token is the last token the previous step emitted for the
  sequence (resolve_placeholders);
- drafts the scheduler could not find (NGRAM's, which read the accepted
  tokens) are found here (Drafter.late_drafts); a draft model's are
  proposed by the model as for any row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pyserve.engine.step import ScheduledStep
from pyserve.model.forward_batch import ForwardBatch


@dataclass
class StepRuns:
    """What a step emitted per sampled sequence, kept by the forward thread
    for the step after it."""

    ids: torch.Tensor  # the token each logits row emits, on the device
    last_rows: torch.Tensor  # per sampled sequence, the row of the last token it emitted (device)
    first_rows: list[int]  # per sampled sequence, its first logits row
    counts: list[int]  # per sampled sequence, the tokens it emitted
    rejected: list[int]  # per sampled sequence, its drafts the target rejected

    @classmethod
    def of(cls, ids: torch.Tensor, drafts: list[list[int]], counts: list[int] | None) -> StepRuns:
        """`drafts` and `counts` as verification gave them (empty and None
        for a step without drafts: one token per sequence)."""
        if counts is None:
            n = ids.numel()
            first, counts, rejected = list(range(n)), [1] * n, [0] * n
        else:
            first, row = [], 0
            for draft in drafts:
                first.append(row)
                row += len(draft) + 1
            rejected = [len(d) - (c - 1) for d, c in zip(drafts, counts)]
        last = torch.tensor([f + c - 1 for f, c in zip(first, counts)], dtype=torch.long)
        return cls(ids, last.to(ids.device, non_blocking=True), first, counts, rejected)


def resolve_placeholders(ids: torch.Tensor, runs: StepRuns | None) -> torch.Tensor:
    """`ids` with each placeholder -(i + 1) replaced by the last token
    sampled sequence i of the previous step emitted (zeros when that step
    failed: its requests are ended anyway)."""
    if runs is None or runs.ids.numel() == 0:
        return torch.where(ids < 0, torch.zeros_like(ids), ids)
    index = (-ids - 1).clamp(0, runs.last_rows.numel() - 1)
    return torch.where(ids < 0, runs.ids[runs.last_rows[index]], ids)


def follow_previous(step: ScheduledStep, runs: StepRuns | None) -> ScheduledStep:
    """`step` (its host batch and drafts) with its following rows moved back
    over the previous step's rejected drafts and their late drafts found;
    the event loop's step is left as it is."""
    if runs is None:
        return step
    shifts = {f.row: runs.rejected[f.previous] for f in step.following if runs.rejected[f.previous]}
    batch = shifted(step.batch, shifts) if shifts else step.batch
    drafts = step.drafts
    if step.late_drafts:
        emitted = runs.ids.tolist()
        drafts = [list(d) for d in drafts]
        input_ids = batch.input_ids.clone()
        first_row = 0
        previous = {f.sampled: f.previous for f in step.following}
        for i, draft in enumerate(step.drafts):
            late = step.late_drafts.get(i)
            if late is not None:
                p = previous[i]
                found = late.find(emitted[runs.first_rows[p] : runs.first_rows[p] + runs.counts[p]])
                drafts[i] = found
                at = batch.logits_indices[first_row + 1 : first_row + 1 + len(found)]
                input_ids[at] = torch.tensor(found, dtype=input_ids.dtype)
            first_row += len(draft) + 1
        batch = replace(batch, input_ids=input_ids)
    return replace(step, batch=batch, drafts=drafts)


def shifted(batch: ForwardBatch, shifts: dict[int, int]) -> ForwardBatch:
    """The host `batch` with sequence b's new tokens moved back by
    shifts[b] positions: it reads its slots but the last shifts[b], and
    its new tokens take the slots at their new positions."""
    positions = batch.positions.clone()
    out = batch.out_cache_loc.clone()
    window_out = None if batch.window_out_cache_loc is None else batch.window_out_cache_loc.clone()
    parts = list(batch.kv_indices.split(batch.seq_lens))
    window_parts = None if batch.window_kv_indices is None else list(batch.window_kv_indices.split(batch.seq_lens))
    seq_lens = list(batch.seq_lens)
    starts = [0]
    for n in batch.extend_lens:
        starts.append(starts[-1] + n)
    for b, r in shifts.items():
        n, t = batch.extend_lens[b], starts[b]
        keep = seq_lens[b] - r
        positions[t : t + n] -= r
        out[t : t + n] = parts[b][keep - n : keep]
        parts[b] = parts[b][:keep]
        if window_parts is not None:
            window_out[t : t + n] = window_parts[b][keep - n : keep]
            window_parts[b] = window_parts[b][:keep]
        seq_lens[b] = keep
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
    indptr[1:] = torch.tensor(seq_lens, dtype=torch.long).cumsum(0)
    return replace(
        batch, positions=positions, out_cache_loc=out, seq_lens=seq_lens, kv_indptr=indptr,
        kv_indices=torch.cat(parts),
        window_out_cache_loc=window_out,
        window_kv_indices=None if window_parts is None else torch.cat(window_parts),
    )
