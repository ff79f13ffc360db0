"""The logit adjustments before sampling, for a whole batch at once:
repetition, frequency and presence penalties, logit bias, the tokens a
request allows (allowed_token_ids) or bans after what it wrote (bad
words), the stop tokens a request may not end with yet
(min_new_tokens), and last a client's custom logit processor
(engine/logit_processors.py).

Only the entries of tokens a row has seen change, so each adjustment is
one gather or scatter over those entries, never a pass over [batch,
vocab] and never a loop over rows in torch. What a request has seen is
kept in its sampling state (engine/sampling_state.py's TokenHistory).

Runs on the forward thread, over the requests' SamplingStates. A
speculative verify step adjusts each of a drafted row's logits rows as if
the drafts before it were output already (`after`), which is what plain
decoding sees at that position.
"""

from __future__ import annotations

import torch

from pyserve.engine import logit_processors
from pyserve.engine.request import SamplingParams
from pyserve.engine.sampling_state import SamplingState, joined


def reads_history(p: SamplingParams) -> bool:
    """Penalties, and bad words of several tokens, depend on the tokens generated so far."""
    return bool(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
                or any(len(banned) > 1 for banned in p.banned_sequences))


def ends_too_soon(state: SamplingState, drafted: int = 0) -> bool:
    """The request may not stop yet (`drafted`: draft tokens before the
    logits row): its stop tokens are masked. A grammar's own end (only EOS
    allowed) still ends a constrained request."""
    return state.sampled + drafted < state.params.min_new_tokens and state.grammar is None


def adjusts_logits(state: SamplingState) -> bool:
    p = state.params
    return (reads_history(p) or bool(p.logit_bias) or p.allowed_token_ids is not None or bool(p.banned_sequences)
            or p.logit_processor is not None or ends_too_soon(state))


def _entries(parts: list[torch.Tensor], rows: list[int], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token ids of several rows as flat tensors on `device`: (index of
    the part each came from, its batch row, the token id)."""
    which = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor([len(p) for p in parts]))
    return which.to(device), torch.tensor(rows)[which].to(device), torch.cat(parts).to(device)


def _per_entry(values: list[float], which: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=which.device)[which]


def adjust_logits(logits: torch.Tensor, states: list[SamplingState], after: list[list[int]] | None = None) -> None:
    """Penalties, logit bias and masked stops of a batch's rows, in place;
    row i counts the tokens `after[i]` as output after its request's own."""
    device = logits.device
    seqs = [s.seq for s in states]
    after = after or [[] for _ in states]
    repeat = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if repeat:
        histories = [states[i].history() for i in repeat]
        which, rows, ids = _entries([joined(h.seen_ids, h.seen, after[i]) for i, h in zip(repeat, histories)],
                                    repeat, device)
        penalty = _per_entry([seqs[i].params.repetition_penalty for i in repeat], which)
        values = logits[rows, ids]
        # Shrink toward "less likely" whatever the sign (CTRL / HF semantics).
        logits[rows, ids] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [i for i, s in enumerate(seqs)
               if (s.params.frequency_penalty or s.params.presence_penalty) and (s.output_ids or after[i])]
    if counted:
        histories = [states[i].history() for i in counted]
        # Once per occurrence, then once per distinct token.
        outputs = [torch.cat([h.outputs, torch.tensor(after[i], dtype=torch.long)]) if after[i] else h.outputs
                   for i, h in zip(counted, histories)]
        which, rows, ids = _entries(outputs, counted, device)
        logits.index_put_((rows, ids), _per_entry([-seqs[i].params.frequency_penalty for i in counted], which),
                          accumulate=True)
        which, rows, ids = _entries([joined(h.distinct_outputs, h.output_seen, after[i])
                                     for i, h in zip(counted, histories)], counted, device)
        logits.index_put_((rows, ids), _per_entry([-seqs[i].params.presence_penalty for i in counted], which),
                          accumulate=True)
    vocab = logits.shape[-1]
    _keep_only(logits, [(i, s.params.allowed_token_ids) for i, s in enumerate(seqs)
                        if s.params.allowed_token_ids is not None])
    _add_at(logits, [(i, banned[-1], float("-inf")) for i, s in enumerate(seqs) for banned in s.params.banned_sequences
                     if _ends_with(s.output_ids, after[i], banned[:-1])])
    _add_at(logits, [(i, token, bias) for i, s in enumerate(seqs) for token, bias in s.params.logit_bias.items()])
    _add_at(logits, [(i, token, float("-inf")) for i, s in enumerate(states) if ends_too_soon(s, len(after[i]))
                     for token in s.stop_ids if token < vocab])
    if any(s.params.logit_processor is not None for s in states):
        logit_processors.apply(logits, states, after)


def _ends_with(output: list[int], after: list[int], ids: tuple[int, ...]) -> bool:
    """Whether the output, then `after`, ends with `ids` (always, for none)."""
    return not ids or tuple((output[-len(ids):] + after)[-len(ids):]) == ids


def _keep_only(logits: torch.Tensor, allowed: list[tuple[int, tuple[int, ...]]]) -> None:
    """Each listed row keeps the logits of its allowed ids; the rest are -inf."""
    if allowed:
        which, rows, ids = _entries([torch.tensor(a, dtype=torch.long) for _, a in allowed],
                                    [i for i, _ in allowed], logits.device)
        kept = logits[rows, ids]
        logits[torch.tensor([i for i, _ in allowed], device=logits.device)] = float("-inf")
        logits[rows, ids] = kept


def _add_at(logits: torch.Tensor, entries: list[tuple[int, int, float]]) -> None:
    """logits[row, token] += value for each entry, at once."""
    if entries:
        rows, tokens, values = zip(*entries)
        device = logits.device
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                          torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
