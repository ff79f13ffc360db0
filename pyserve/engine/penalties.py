"""The logit adjustments before sampling, for a whole batch at once:
repetition, frequency and presence penalties, logit bias, and the stop
tokens a request may not end with yet (min_new_tokens).

Only the entries of tokens a row has seen change, so each adjustment is
one gather or scatter over those entries, never a pass over [batch,
vocab] and never a loop over rows in torch. What a sequence has seen is
kept on it (`TokenHistory`), grown by its new tokens at each step, so a
step's Python work does not grow with the length of the sequences.

Runs on the forward thread. Penalties make the scheduler wait for each
step's tokens (Scheduler.needs_known_tokens), so `output_ids` is complete
when they are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyserve.engine.request import SamplingParams
from pyserve.engine.sequence import Sequence


def reads_history(p: SamplingParams) -> bool:
    """Penalties depend on every token generated so far."""
    return bool(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty)


def ends_too_soon(seq: Sequence) -> bool:
    """The request may not stop yet: its stop tokens are masked. A grammar's
    own end (only EOS allowed) still ends a constrained request."""
    return seq.sampled < seq.params.min_new_tokens and seq.grammar is None


def adjusts_logits(seq: Sequence) -> bool:
    return reads_history(seq.params) or bool(seq.params.logit_bias) or ends_too_soon(seq)


@dataclass(eq=False)
class TokenHistory:
    """A sequence's tokens as the penalties read them, as int64 tensors:
    the distinct tokens of prompt and output, every output token, and the
    distinct output tokens."""

    seen: set[int]
    seen_ids: torch.Tensor
    outputs: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    output_seen: set[int] = field(default_factory=set)
    distinct_outputs: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    @classmethod
    def of(cls, seq: Sequence) -> TokenHistory:
        """The sequence's history, brought up to its latest output token."""
        history = seq.token_history
        if history is None:
            seen = set(seq.prompt_ids)
            history = seq.token_history = cls(seen, torch.tensor(sorted(seen), dtype=torch.long))
        new = seq.output_ids[len(history.outputs):]
        if new:
            history.outputs = torch.cat([history.outputs, torch.tensor(new, dtype=torch.long)])
            history.seen_ids = _grow(history.seen_ids, history.seen, new)
            history.distinct_outputs = _grow(history.distinct_outputs, history.output_seen, new)
        return history


def _grow(ids: torch.Tensor, members: set[int], new: list[int]) -> torch.Tensor:
    """`ids` (the tensor of `members`) with the tokens of `new` not in it yet."""
    added = [t for t in dict.fromkeys(new) if t not in members]
    if not added:
        return ids
    members.update(added)
    return torch.cat([ids, torch.tensor(added, dtype=torch.long)])


def _entries(parts: list[torch.Tensor], rows: list[int], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token ids of several rows as flat tensors on `device`: (index of
    the part each came from, its batch row, the token id)."""
    which = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor([len(p) for p in parts]))
    return which.to(device), torch.tensor(rows)[which].to(device), torch.cat(parts).to(device)


def _per_entry(values: list[float], which: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=which.device)[which]


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Penalties, logit bias and masked stops of a batch's rows, in place."""
    device = logits.device
    repeat = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if repeat:
        which, rows, ids = _entries([TokenHistory.of(seqs[i]).seen_ids for i in repeat], repeat, device)
        penalty = _per_entry([seqs[i].params.repetition_penalty for i in repeat], which)
        values = logits[rows, ids]
        # Shrink toward "less likely" whatever the sign (CTRL / HF semantics).
        logits[rows, ids] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [i for i, s in enumerate(seqs)
               if (s.params.frequency_penalty or s.params.presence_penalty) and s.output_ids]
    if counted:
        histories = [TokenHistory.of(seqs[i]) for i in counted]
        # Once per occurrence, then once per distinct token.
        which, rows, ids = _entries([h.outputs for h in histories], counted, device)
        logits.index_put_((rows, ids), _per_entry([-seqs[i].params.frequency_penalty for i in counted], which),
                          accumulate=True)
        which, rows, ids = _entries([h.distinct_outputs for h in histories], counted, device)
        logits.index_put_((rows, ids), _per_entry([-seqs[i].params.presence_penalty for i in counted], which),
                          accumulate=True)
    vocab = logits.shape[-1]
    _add_at(logits, [(i, token, bias) for i, s in enumerate(seqs) for token, bias in s.params.logit_bias.items()])
    _add_at(logits, [(i, token, float("-inf")) for i, s in enumerate(seqs) if ends_too_soon(s)
                     for token in s.output.stop_ids if token < vocab])


def _add_at(logits: torch.Tensor, entries: list[tuple[int, int, float]]) -> None:
    """logits[row, token] += value for each entry, at once."""
    if entries:
        rows, tokens, values = zip(*entries)
        device = logits.device
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                          torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
