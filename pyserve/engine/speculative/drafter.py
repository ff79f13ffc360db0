"""What every drafter shares, on the event loop: how many tokens a request
is drafted at most, and when it stops being drafted. Every decoding request
is drafted: verification applies a request's grammar, penalties, logit
bias and min_tokens to each logits row as plain decoding would
(speculative/rejection.py).

A request whose drafts keep failing stops drafting: each verify step costs
more than a plain decode step, so free chat must not pay for drafts it
never accepts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from pyserve.engine.speculative.tree import DraftTree

# A request's drafting is judged over this many verify steps: below
# MIN_ACCEPT_RATE accepted tokens per drafted one, it decodes plainly. A
# verify step costs about a decode step plus 0.12 of one per draft (the
# 4-bit CPU mode, bench/README.md SV1 and SO1-SO4), so a request keeping
# more than that share of its drafts gains from them.
_JUDGED_AFTER = 8
_MIN_ACCEPT_RATE = 0.15
# Until then, the CPU batch rule (Drafter.pays) counts a request as if it had
# kept this many more drafts: a new request drafts, and one keeping too few
# for a large batch stops after two or three verify steps rather than eight.
_TRUSTED_DRAFTS = 8
# What a draft token costs on a CPU, as a share of a one-row decode step.
CPU_DRAFT_COST = 0.12


class Drafter:
    """The scheduler's side of a drafter: `propose` gives each decode row
    its draft tokens ([] for a plain row), `draft` with their tree where
    they are one; `reserve`, for a row scheduled
    while its sequence's previous step runs, placeholders that the forward
    thread fills (`late_drafts` says how, or None: the draft model does)."""

    # Whether the forward thread runs a draft model over every step's batch,
    # which a step where no sequence drafts can skip (STANDALONE).
    follows_steps = False

    def __init__(self, num_draft_tokens: int, draft_cost: float | None = None):
        """`draft_cost`: a draft token's cost as a share of a one-row decode
        step, where that share holds at any batch size (a CPU's); None where
        a draft costs next to nothing in a small batch (a GPU's)."""
        self.num_draft_tokens = num_draft_tokens
        self.draft_cost = draft_cost

    def pays(self, seq: Sequence, rows: int) -> bool:
        """Whether drafting `seq` pays in a step of `rows` decode rows, by
        the drafts it kept so far. A CPU step of n tokens costs about
        a + b*n: the weights read once, and each token's products. A draft
        adds b; a kept one saves its row a token's share of a plain step,
        (a + b*rows) / rows. So drafting pays while the share of drafts kept
        exceeds b*rows / (a + b*rows) = rows*c / (1 - c + rows*c), with
        c = b / (a + b) the draft's cost: for c = 0.12, 12% alone, 35%
        among four rows, 69% among sixteen (bench/README.md SB1-SB7). A
        request below it decodes plainly while the batch is that large.
        Before it is judged, its counts start at _TRUSTED_DRAFTS kept
        (SB12-SB15)."""
        if self.draft_cost is None:
            return True
        kept, drafted = seq.accepted, seq.drafted
        if seq.verify_steps < _JUDGED_AFTER:
            kept, drafted = kept + _TRUSTED_DRAFTS, drafted + _TRUSTED_DRAFTS
        c = self.draft_cost
        return kept * (1 - c + rows * c) >= drafted * rows * c

    def propose(self, seq: Sequence) -> list[int]:
        raise NotImplementedError

    def draft(self, seq: Sequence) -> tuple[list[int], DraftTree | None]:
        """propose's drafts and, for drafts verified as a tree, the tree
        (speculative/tree.py); None for a chain."""
        return self.propose(seq), None

    def observe(self, seq: Sequence) -> None:
        """Called at every step that decodes `seq`, drafted or not, before
        its drafts are asked for, and once it ends: a drafter that learns
        from every request's tokens reads its new ones."""

    def forget(self) -> None:
        """Drop what observe learned (SGLang's /flush_cache does, between
        benchmark phases); called only while no request runs."""

    def reserve(self, seq: Sequence) -> list[int]:
        return [0] * self.budget(seq)

    def late_drafts(self, seq: Sequence, k: int):
        """What finds `seq`'s `k` reserved drafts on the forward thread; None
        when the draft model there proposes them anyway."""
        return None

    def budget(self, seq: Sequence) -> int:
        """Draft tokens `seq` may have this step: none when it is not
        drafted, and never past its length limit (the target's own token
        after the drafts is the last), counting every token of its steps
        still running as kept."""
        if not seq.drafting:
            return 0
        in_flight = seq.pending + seq.pending_drafts
        return max(0, min(self.num_draft_tokens, seq.params.max_new_tokens - len(seq.output_ids) - in_flight - 1))

    @staticmethod
    def on_verified(seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verify step; turn drafting off for a request whose drafts fail."""
        seq.drafted += drafted
        seq.accepted += accepted
        seq.verify_steps += 1
        seq.last_accepted = accepted
        if seq.verify_steps >= _JUDGED_AFTER and seq.accepted < _MIN_ACCEPT_RATE * seq.drafted:
            seq.drafting = False


class PlaceholderDrafter(Drafter):
    """For a draft model run on the forward thread (STANDALONE, EAGLE3):
    the scheduler only reserves room, placeholder tokens that the forward
    thread replaces with the draft model's tokens before the target runs."""

    def __init__(self, num_draft_tokens: int, draft_cost: float | None = None,
                 drafts_from_computed_rows: bool = False, follows_steps: bool = False):
        """`drafts_from_computed_rows`: the drafter reads the target's
        states of every token before the drafts (EAGLE3's and EAGLE's heads), so a row
        whose known tokens are not all computed yet (the text a jump-forward
        appended) is not drafted; the next step computes them. A draft
        model computes them itself (DraftModel.propose).
        `follows_steps`: see Drafter.follows_steps."""
        super().__init__(num_draft_tokens, draft_cost)
        self.drafts_from_computed_rows = drafts_from_computed_rows
        self.follows_steps = follows_steps

    def propose(self, seq: Sequence) -> list[int]:
        return self.reserve(seq)

    def budget(self, seq: Sequence) -> int:
        if self.drafts_from_computed_rows and not seq.pending and seq.num_tokens - seq.kv_len > 1:
            return 0
        return super().budget(seq)
