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
  tokens) are found here (Drafter.late_drafts), with their tree where they
  are one, and the row is cut to the drafts found (its unused slots are
  dropped with the rejected ones); a draft model's are proposed by the
  model as for any row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pyserve.engine.step import ScheduledStep
from pyserve.lora.batch import LoraBatch
from pyserve.model.forward_batch import ForwardBatch


@dataclass
class StepRuns:
    """What a step emitted per sampled sequence, kept by the forward thread
    for the step after it."""

    ids: torch.Tensor  # the token each logits row emits, on the device
    last_rows: torch.Tensor  # per sampled sequence, the row of the last token it emitted (device)
    first_rows: list[int]  # per sampled sequence, its first logits row
    counts: list[int]  # per sampled sequence, the tokens it emitted
    dropped: list[int]  # per sampled sequence, the draft slots it gives back (rejected or unused)

    @classmethod
    def of(cls, ids: torch.Tensor, drafts: list[list[int]], counts: list[int] | None,
           reserved: list[list[int]]) -> StepRuns:
        """`drafts` and `counts` as verification gave them (empty and None
        for a step without drafts: one token per sequence); `reserved`: the
        drafts the scheduler made room for (ScheduledStep.drafts)."""
        if counts is None:
            n = ids.numel()
            first, counts = list(range(n)), [1] * n
        else:
            first = first_rows(drafts)
        dropped = [len(r) - (c - 1) for r, c in zip(reserved, counts)] if reserved else [0] * len(counts)
        last = torch.tensor([f + c - 1 for f, c in zip(first, counts)], dtype=torch.long)
        return cls(ids, last.to(ids.device, non_blocking=True), first, counts, dropped)


def first_rows(drafts: list[list[int]]) -> list[int]:
    """Per sampled sequence of a step with drafts, its first logits row
    (each has one for its known token and one per draft)."""
    first, row = [], 0
    for draft in drafts:
        first.append(row)
        row += len(draft) + 1
    return first


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
    over the slots the previous step gave back, their late drafts found and
    each cut to what was found; the event loop's step is left as it is."""
    if runs is None:
        return step
    moves = {f.row: [runs.dropped[f.previous], 0] for f in step.following}
    drafts, trees = step.drafts, step.trees
    if step.late_drafts:
        emitted = runs.ids.tolist()
        drafts = [list(d) for d in drafts]
        trees = list(trees) or [None] * len(drafts)
        input_ids = step.batch.input_ids.clone()
        firsts = first_rows(step.drafts)
        for f in step.following:
            late = step.late_drafts.get(f.sampled)
            if late is None:
                continue
            first_row, p = firsts[f.sampled], f.previous
            found, trees[f.sampled] = late.find(emitted[runs.first_rows[p] : runs.first_rows[p] + runs.counts[p]])
            at = step.batch.logits_indices[first_row + 1 : first_row + 1 + len(found)]
            input_ids[at] = torch.tensor(found, dtype=input_ids.dtype)
            moves[f.row][1] = late.k - len(found)
            drafts[f.sampled] = found
        if not any(t is not None for t in trees):
            trees = []
        step = replace(step, batch=replace(step.batch, input_ids=input_ids))
    moves = {row: (shift, cut) for row, (shift, cut) in moves.items() if shift or cut}
    if not moves:
        return replace(step, drafts=drafts, trees=trees)
    batch = relaid(step.batch, moves)
    batch.is_decode = not step.num_prefill_seqs and len(batch.extend_lens) == batch.input_ids.numel()
    if batch.lora is not None:
        batch.lora = LoraBatch.of_rows([s.lora.slot if s.lora else -1 for s in step.seqs], batch.extend_lens)
    return replace(step, batch=batch, drafts=drafts, trees=trees)


def relaid(batch: ForwardBatch, moves: dict[int, tuple[int, int]]) -> ForwardBatch:
    """The host `batch` with sequence b's new tokens moved back by
    moves[b][0] positions and its last moves[b][1] new tokens left out: it
    reads its slots up to its new last token, and its new tokens take the
    slots at their new positions. Logits rows of tokens left out go too."""
    extend_lens, seq_lens = list(batch.extend_lens), list(batch.seq_lens)
    parts = list(batch.kv_indices.split(batch.seq_lens))
    window_parts = None if batch.window_kv_indices is None else list(batch.window_kv_indices.split(batch.seq_lens))
    keep = torch.ones(batch.input_ids.numel(), dtype=torch.bool)
    positions, out = batch.positions.clone(), batch.out_cache_loc.clone()
    window_out = None if batch.window_out_cache_loc is None else batch.window_out_cache_loc.clone()
    start = 0
    for b, n in enumerate(batch.extend_lens):
        if b in moves:
            shift, cut = moves[b]
            new_n, new_len = n - cut, seq_lens[b] - shift - cut
            keep[start + new_n : start + n] = False
            positions[start : start + n] -= shift
            out[start : start + new_n] = parts[b][new_len - new_n : new_len]
            parts[b] = parts[b][:new_len]
            if window_parts is not None:
                window_out[start : start + new_n] = window_parts[b][new_len - new_n : new_len]
                window_parts[b] = window_parts[b][:new_len]
            extend_lens[b], seq_lens[b] = new_n, new_len
        start += n
    new_index = keep.cumsum(0) - 1  # each kept token's index in the new batch
    logits = batch.logits_indices[keep[batch.logits_indices]]
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
    indptr[1:] = torch.tensor(seq_lens, dtype=torch.long).cumsum(0)
    return replace(
        batch, input_ids=batch.input_ids[keep], positions=positions[keep], out_cache_loc=out[keep],
        extend_lens=extend_lens, seq_lens=seq_lens, kv_indptr=indptr, kv_indices=torch.cat(parts),
        logits_indices=new_index[logits],
        window_out_cache_loc=None if window_out is None else window_out[keep],
        window_kv_indices=None if window_parts is None else torch.cat(window_parts),
    )
