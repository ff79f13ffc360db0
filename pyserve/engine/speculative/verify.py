"""Greedy verification of draft tokens, and rejection sampling for drafts
drawn from a point mass.

A row with k drafts has k + 1 logits rows: row j predicts the token after
the j-th input (the last known token, then the drafts). Greedy decoding
would have produced the target's argmax at row 0; if that equals draft 0,
the argmax at row 1 next, and so on: the accepted run is the longest prefix
of the drafts that matches, plus the target's own token after it (the
bonus), identical to decoding one token a step.
"""

from __future__ import annotations

import torch


def accepted_counts(row_ids: list[int], drafts: list[list[int]]) -> list[int]:
    """Tokens each sequence emits (accepted drafts + 1), given the target's
    token at every logits row (len(drafts[i]) + 1 rows per sequence, in order)."""
    counts, row = [], 0
    for draft in drafts:
        accepted = 0
        while accepted < len(draft) and row_ids[row + accepted] == draft[accepted]:
            accepted += 1
        counts.append(accepted + 1)
        row += len(draft) + 1
    return counts


def first_rows(drafts: list[list[int]]) -> list[int]:
    """Index of each sequence's first logits row."""
    rows, row = [], 0
    for draft in drafts:
        rows.append(row)
        row += len(draft) + 1
    return rows


def rejection_sample(probs: torch.Tensor, draft: int, generator: torch.Generator | None = None) -> tuple[int, bool]:
    """One speculative step for a draft proposed with certainty (the n-gram
    drafter's point mass): keep `draft` with probability p(draft), else draw
    from p with the draft's mass removed, renormalised. The token comes out
    distributed exactly as p (Leviathan et al., 2023, with q = the point
    mass). Returns (token, accepted)."""
    p = probs.double() / probs.sum()
    if torch.rand(1, generator=generator).item() < p[draft].item():
        return draft, True
    residual = p.clone()
    residual[draft] = 0.0
    if residual.sum() <= 0:
        return draft, True
    return int(torch.multinomial(residual, 1, generator=generator).item()), False
