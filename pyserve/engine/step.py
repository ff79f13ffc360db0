"""One scheduled step: the rows the scheduler picked, as a forward batch.

A row is a sequence and how many of its tokens this step computes: its
next token (decode), or a chunk of its prompt (prefill). `build_step`
turns the rows into the ForwardBatch the model reads and notes which
sequences get a token sampled and which prompt positions are scored.

Overlap: when step N+1 is built while step N still runs, a sequence's
newest token may not be known yet. Its decode row then carries a
placeholder, -(row + 1), that the model runner replaces with the last
token sampled sequence `row` of step N emitted, before the forward pass.
Such a row may carry drafts too, placeholders as well
(engine/speculative/overlap.py).

Speculative decoding: a decode row with k draft tokens (Sequence.draft_ids)
computes k + 1 tokens, its last known token and the drafts, with logits at
every one of them; the runner keeps the longest run the target agrees with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from pyserve.engine.kv.manager import KVManager
from pyserve.engine.request import prompt_alternatives
from pyserve.engine.sequence import Sequence
from pyserve.lora.batch import LoraBatch
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.pooling import pooled_positions

if TYPE_CHECKING:
    from pyserve.engine.speculative.tree import DraftTree


@dataclass
class Rows:
    """The rows of a step being assembled, with the KV slots for their new tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    new_slots: list[torch.Tensor] = field(default_factory=list)

    def add(self, seq: Sequence, n: int, slots: torch.Tensor) -> None:
        self.seqs.append(seq)
        self.lengths.append(n)
        self.new_slots.append(slots)


class Following(NamedTuple):
    """A decode row scheduled while its sequence's previous step runs."""

    row: int  # its index in the step's seqs
    sampled: int  # its index in the step's sampled
    previous: int  # its sequence's index in the previous step's sampled


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    batch: ForwardBatch
    # The sequences whose next token this step samples, in the order of the
    # sampled ids; a sequence in the middle of a chunked prefill is
    # computed but not sampled.
    sampled: list[Sequence]
    # Per sampled sequence, the draft tokens its row verifies ([] for none);
    # it has len(drafts) + 1 logits rows, in order. Empty when nothing is drafted.
    drafts: list[list[int]] = field(default_factory=list)
    # Per sampled sequence, its drafts' tree (speculative/tree.py; None: a
    # chain). Empty when no row verifies a tree.
    trees: list[DraftTree | None] = field(default_factory=list)
    num_prefill_seqs: int = 0
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens newly admitted requests took from the radix cache
    # Decode rows whose input is a placeholder for the previous step's output.
    following: list[Following] = field(default_factory=list)
    # Per sampled index, what finds the drafts of a following row on the
    # forward thread (a drafter's late_drafts) where the scheduler could not.
    late_drafts: dict = field(default_factory=dict)
    # Prompt log-probabilities: the token each extra logits row (after the
    # sampled ones) is scored on, and per sequence the positions it scores
    # (position p scores prompt token p + 1), in the order of the rows.
    prompt_targets: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Sequence, range]] = field(default_factory=list)
    # Embedding requests: the token rows whose hidden states are pooled,
    # (sequence, first position, rows) per sequence that has some, and the
    # sequences whose whole prompt is in after this step (they end with it).
    embed_rows: list[int] = field(default_factory=list)
    embed_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    embedded: list[Sequence] = field(default_factory=list)
    # return_hidden_states: the token rows whose hidden states go back to
    # their requests, and (sequence, rows) per sequence that has some.
    state_rows: list[int] = field(default_factory=list)
    state_spans: list[tuple[Sequence, range]] = field(default_factory=list)
    # The rows (indices into seqs) a draft model runs after the target, its
    # KV at every slot they write: those of drafting sequences; None, all.
    draft_rows: list[int] | None = None

    @property
    def is_prefill(self) -> bool:
        return self.num_prefill_seqs > 0

    @property
    def prompt_top_logprobs(self) -> int:
        """Alternatives to report per scored prompt position."""
        return max((prompt_alternatives(seq.params) for seq, _ in self.prompt_spans), default=0)


def build_step(kv: KVManager, prefill: Rows, decode: Rows, cached_tokens: int) -> ScheduledStep:
    """The step computing `prefill` then `decode` rows; hands each sequence
    its new slots and shares the prompts computed so far."""
    input_ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Sequence] = []
    drafts: list[list[int]] = []
    trees: list[DraftTree | None] = []
    following: list[Following] = []
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    prompt_spans: list[tuple[Sequence, range]] = []
    embed_rows: list[int] = []
    embed_spans: list[tuple[Sequence, int, int]] = []
    embedded: list[Sequence] = []
    state_rows: list[int] = []
    state_spans: list[tuple[Sequence, range]] = []
    embeds_rows: list[int] = []
    embeds: list[torch.Tensor] = []
    seqs = prefill.seqs + decode.seqs
    lengths = prefill.lengths + decode.lengths
    new_slots = prefill.new_slots + decode.new_slots
    for row, (seq, n, slots) in enumerate(zip(seqs, lengths, new_slots)):
        start = seq.kv_len
        if start < seq.num_tokens:
            # Only a decode row asks for more tokens than are known: its drafts.
            new = (seq.uncached_ids + seq.draft_ids)[:n]
        else:  # a decode row whose input is still being sampled
            new = [-(seq.pending_row + 1)] + seq.draft_ids
            following.append(Following(row, len(sampled), seq.pending_row))
        if seq.params.prompt_logprobs:
            scored = _unscored_prompt_positions(seq, start, n)
            if scored:
                prompt_rows += [len(input_ids) + p - start for p in scored]
                prompt_targets += [seq.prompt_ids[p + 1] for p in scored]
                prompt_spans.append((seq, scored))
        if seq.params.pooling:
            pooled = pooled_positions(seq.params.pooling, start, n, len(seq.prompt_ids))
            if pooled:
                embed_rows += [len(input_ids) + p - start for p in pooled]
                embed_spans.append((seq, start, len(pooled)))
        if seq.params.return_hidden_states:
            # Not a draft's: those the verify step rejects were never read.
            kept = range(max(start, seq.next_hidden_state), min(start + n, seq.num_total))
            if kept:
                state_rows += [len(input_ids) + p - start for p in kept]
                state_spans.append((seq, kept))
        if seq.prompt_embeds is not None and start < len(seq.prompt_ids):
            given = seq.prompt_embeds[start:start + n]
            embeds_rows += range(len(input_ids), len(input_ids) + len(given))
            embeds.append(given)
        input_ids.extend(new)
        positions.extend(range(start, start + n))
        kv.append_slots(seq, slots)
        if seq.params.pooling and seq.kv_len == seq.num_total:  # an embedding ends with its prompt
            embedded.append(seq)
        elif seq.kv_len >= seq.num_total:  # the whole sequence is in: sample
            drafted = seq.kv_len - seq.num_total
            logits_indices.extend(range(len(input_ids) - 1 - drafted, len(input_ids)))
            sampled.append(seq)
            drafts.append(new[len(new) - drafted :] if drafted else [])
            trees.append(seq.draft_tree if drafted else None)
    batch = ForwardBatch.build(
        input_ids, positions, torch.cat(new_slots), lengths, [s.slots for s in seqs],
        logits_indices + prompt_rows, is_decode=not prefill.seqs and len(input_ids) == len(seqs), device="cpu",
        lora=LoraBatch.of_rows([seq.lora.slot if seq.lora else -1 for seq in seqs], lengths),
        window_slots=kv.windowed.window_slots if kv.windowed is not None else None,
        embeds=(embeds_rows, torch.cat(embeds)) if embeds else None,
    )
    for seq in prefill.seqs:
        kv.share_prompt(seq)
    return ScheduledStep(
        seqs=seqs, batch=batch, sampled=sampled, drafts=drafts if any(drafts) else [],
        trees=trees if any(t is not None for t in trees) else [],
        num_prefill_seqs=len(prefill.seqs),
        num_prefill_tokens=sum(prefill.lengths), num_cached_tokens=cached_tokens,
        following=following, prompt_targets=prompt_targets, prompt_spans=prompt_spans,
        embed_rows=embed_rows, embed_spans=embed_spans, embedded=embedded,
        state_rows=state_rows, state_spans=state_spans,
    )


def _unscored_prompt_positions(seq: Sequence, start: int, n: int) -> range:
    """Positions among this step's start..start+n whose logits score a
    prompt token not scored yet (the scheduler moves the sequence's
    `next_prompt_logprob` past them once the step is built)."""
    first = max(start, seq.next_prompt_logprob - 1)
    last = min(start + n, len(seq.prompt_ids) - 1)  # exclusive
    return range(first, max(first, last))
