"""Continuous batching: which sequences run in the next forward pass.

Every step gives each running sequence its next token (decode rows) and
spends what is left of the step's token budget on prompts (prefill rows):
first the sequences in the middle of a chunked prefill, then new requests
in order of urgency (`rank`), first-come first-served within a rank, while
there is room (running-request cap, token budget, KV pages). A step with no
prefill rows is a pure decode step, which the attention backends and CUDA
graphs run on their fast path.

Urgency: interactive requests before batch jobs; with priority scheduling
(--enable-priority-scheduling), then the larger client priority. A request
more urgent than a running one does not wait for it to end: when the
running cap or the KV pool leaves it no room, the least urgent running
request is retracted for it. Aging keeps that from starving anyone: a
request gains one priority level per AGING_STEPS steps it spends waiting
(and keeps what it gained once running), so a request of priority p that
waits is admitted at the latest once p + waited / AGING_STEPS passes the
priority of everything arriving after it. Batch jobs stay behind
interactive requests whatever they gained.

An admitted request reuses the longest prefix of its prompt that the radix
cache holds and computes only the rest. A prompt longer than the chunk size
is computed a chunk per step, with the running streams decoding alongside,
so one long prompt does not freeze every stream.

With sliding-window layers, each step first gives back the sliding pages
its sequences' windows have left (KVManager.slide), and room is made in
both pools.

When KV pages run short, unused cached prefixes are evicted first; if that
is not enough for the decode rows, the newest running sequence of the least
urgent priority is retracted: what it computed goes to the cache, and it
waits at the head of the queue to be resumed (prompt + tokens so far) when
room returns.

Overlap: the engine schedules step N+1 while step N still runs, so a
sequence's newest token may not be known yet (`Sequence.pending`, counted
by `on_launched` / `on_results`). Its decode row then carries a
placeholder (see step.py) that the model runner fills in.

Jump-forward (engine/grammar.py): a constrained request's step may
return, after its sampled token, tokens its grammar forced; they are known
tokens, and its next decode row computes them all. Such requests are not
overlapped: the row that follows a jump needs the forced tokens.

Speculative decoding: a drafter (engine/speculative/) proposes draft
tokens for each decode row, which then asks for room for all of them.
With overlap, a sequence whose verify step still runs does not know how
many of its drafts the target keeps: its next row is scheduled after all
of them (`Sequence.pending_drafts` keeps their slots), with placeholder
drafts, and the forward thread moves the row back over the rejected ones
and fills the drafts in (engine/speculative/overlap.py).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from pyserve.engine.kv.manager import KVManager
from pyserve.engine.penalties import reads_history
from pyserve.engine.sampler import jumps_forward
from pyserve.engine.schedule_policy import WaitingOrder
from pyserve.engine.sequence import Sequence
from pyserve.engine.speculative.drafter import Drafter
from pyserve.engine.step import Rows, ScheduledStep, build_step

if TYPE_CHECKING:
    from pyserve.engine.speculative.tree import DraftTree

logger = logging.getLogger("pyserve.engine")
_SHARED_HEAD = 32  # prompt tokens two prompts must share before one waits for the other's KV
# Priority scheduling: steps a request waits per priority level it gains. A
# step takes tens of milliseconds on a CPU, so a request passed over gains a
# level every few seconds.
AGING_STEPS = 64


class Scheduler:
    """Owns the requests the engine is serving and decides what each step
    computes; the KV manager finds room and slots for it."""

    def __init__(self, kv: KVManager, max_running: int, max_prefill_tokens: int, chunk_size: int | None,
                 priority_scheduling: bool = False, drafter: Drafter | None = None):
        self.kv = kv
        self.drafter = drafter
        self.max_running = max_running
        self.priority_scheduling = priority_scheduling
        # Tokens one step may compute: a chunk, or a whole prefill batch.
        self.token_budget = chunk_size if chunk_size else max_prefill_tokens
        self.chunked = bool(chunk_size)
        self.requests: dict[str, Sequence] = {}  # every sequence below, by request id
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt partly computed
        self.running: list[Sequence] = []
        self.jump_forward = False  # whether constrained requests jump forward (the engine sets it)
        self.order = WaitingOrder("fcfs", kv)  # --schedule-policy (the engine sets it)
        self.paused = False  # /pause_generation: no step is scheduled until resumed
        self._retract_on_pause = False

    def add(self, seq: Sequence) -> None:
        self.requests[seq.rid] = seq
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget `seq` (finished or aborted) and give back what it holds;
        a drafter learning from every request reads its last tokens."""
        if self.drafter is not None:
            self.drafter.observe(seq)
        self.kv.release(seq)
        del self.requests[seq.rid]
        for queue in (self.running, self.prefilling, self.waiting):
            if seq in queue:
                queue.remove(seq)
                return

    # -- overlap bookkeeping -------------------------------------------------

    def on_launched(self, step: ScheduledStep) -> None:
        """The step is running: each sampled sequence has one more token in
        flight, at its row of the step's output (read by placeholders), and
        its drafts' slots reserved."""
        for row, seq in enumerate(step.sampled):
            seq.pending += 1
            seq.pending_row = row
            seq.pending_drafts += len(step.drafts[row]) if step.drafts else 0

    def on_results(self, step: ScheduledStep) -> None:
        """The step's sampled ids are back: nothing of it is in flight."""
        for row, seq in enumerate(step.sampled):
            seq.pending -= 1
            seq.pending_drafts -= len(step.drafts[row]) if step.drafts else 0

    def needs_known_tokens(self) -> bool:
        """Penalties read every previous token when sampling, and a jump
        forward adds tokens after the pending one: such a sequence's next
        step waits for its pending token to come back."""
        return any(reads_history(s.params) or (self.jump_forward and jumps_forward(s.params)) for s in self.running)

    # -- scheduling ----------------------------------------------------------

    def rank(self, seq: Sequence) -> tuple[bool, int]:
        """How urgent `seq` is; lower runs first: interactive requests before
        batch jobs, then, with priority scheduling, the larger priority,
        aged by the steps it waited."""
        if not self.priority_scheduling:
            return seq.batch, 0
        return seq.batch, -(seq.priority + seq.waited_steps // AGING_STEPS)

    def schedule(self) -> ScheduledStep | None:
        if self.paused:
            return None
        for seq in self.holders():  # sliding pages their next steps no longer read
            self.kv.slide(seq)
        if self.priority_scheduling:
            self._make_way_for_urgent()
        decode = self._decode_rows()
        prefill, cached_tokens = self._prefill_rows(self.token_budget - sum(decode.lengths), len(decode.seqs))
        decode = self._without_less_urgent(decode, prefill)
        if not decode.seqs and not prefill.seqs:
            return None
        draft_rows = self._draft_rows(prefill.seqs + decode.seqs)
        step = build_step(self.kv, prefill, decode, cached_tokens)
        step.draft_rows = draft_rows
        if self.drafter is not None:
            for row in step.following:
                seq = step.sampled[row.sampled]
                late = self.drafter.late_drafts(seq, len(seq.draft_ids)) if seq.draft_ids else None
                if late is not None:
                    step.late_drafts[row.sampled] = late
        for seq, scored in step.prompt_spans:
            seq.next_prompt_logprob = scored.stop + 1
        for seq, kept in step.state_spans:
            seq.next_hidden_state = kept.stop
        for seq in prefill.seqs:
            if seq.kv_len == seq.num_tokens:  # its whole prompt is in: it decodes from now on
                self.prefilling.remove(seq)
                if seq.params.pooling:
                    # An embedding ends with this step and decodes nothing: its
                    # KV goes to the cache now, as a finished prompt's would.
                    self.kv.release(seq)
                else:
                    self.running.append(seq)
        if self.priority_scheduling:
            for seq in self.waiting:
                seq.waited_steps += 1
        return step

    def _draft_rows(self, seqs: list[Sequence]) -> list[int] | None:
        """The rows of a step of `seqs` that the draft model runs: those of
        drafting sequences (drafting, once off, stays off); None, all of
        them, also when a row may be moved back over rejected drafts on the
        forward thread (overlap). The other sequences' tokens from here on
        have no draft KV: the KV manager keeps them out of the prefix cache,
        whose prefixes a drafting request's draft model reads."""
        if self.drafter is None or not self.drafter.follows_steps or any(seq.pending for seq in seqs):
            return None
        rows = [i for i, seq in enumerate(seqs) if seq.drafting]
        if len(rows) == len(seqs):
            return None
        for seq in seqs:  # this step's tokens are without (a retracted one's computed again, too)
            if not seq.drafting:
                seq.draft_kv_len = seq.kv_len if seq.draft_kv_len is None else min(seq.draft_kv_len, seq.kv_len)
        return rows

    def _decode_rows(self) -> Rows:
        """One token for every running sequence, retracting sequences while
        the pool cannot hold them all."""
        rows = Rows()
        for seq in self.running:
            seq.draft_ids, seq.draft_tree = self._drafts(seq, len(self.running))
        while self.running:
            needed = sum(self.kv.pages_needed(s, self._decode_length(s)) for s in self.running)
            if self.kv.make_room(needed):
                break
            if not self.retract_one():
                return rows
        for seq in self.running:
            n = self._decode_length(seq)
            rows.add(seq, n, self.kv.new_slots(seq, n))
        return rows

    def _drafts(self, seq: Sequence, rows: int) -> tuple[list[int], DraftTree | None]:
        """The draft tokens of `seq`'s next decode row, one of `rows`, and
        their tree (None: a chain): the drafter's, or, while its previous
        step runs, placeholders that the forward thread fills once that
        step's accepted tokens are known."""
        if self.drafter is None:
            return [], None
        self.drafter.observe(seq)
        if not self.drafter.pays(seq, rows):
            return [], None
        return (self.drafter.reserve(seq), None) if seq.pending else self.drafter.draft(seq)

    @staticmethod
    def _decode_length(seq: Sequence) -> int:
        """A decode row's tokens: those whose KV is not computed yet (the
        newest, known or pending, and the forced ones of a jump) and the drafts."""
        return seq.num_total - seq.kv_len + len(seq.draft_ids)

    def _without_less_urgent(self, decode: Rows, prefill: Rows) -> Rows:
        """A step that computes a prompt leaves out the decode rows of less
        urgent streams (batch jobs behind an interactive request): they
        wait a step, and the prompt's first token comes sooner."""
        if not prefill.seqs:
            return decode
        urgent = min(self.rank(s) for s in prefill.seqs)
        kept = Rows()
        for seq, n, slots in zip(decode.seqs, decode.lengths, decode.new_slots):
            if self.rank(seq) <= urgent:
                kept.add(seq, n, slots)
            else:
                self.kv.unuse_slots(seq, slots)
        return kept

    def _prefill_rows(self, budget: int, num_decode: int) -> tuple[Rows, int]:
        rows = Rows()
        cached_tokens = 0
        # Keep a page per sequence free so the next decode step does not have
        # to retract what was just admitted.
        headroom = num_decode
        # Sequences in the middle of a chunked prefill go first (they hold
        # pages), unless less urgent than a waiting one: those take what
        # budget the waiting ones leave.
        urgent = self._next_waiting(set())
        behind = [s for s in self.prefilling if urgent is not None and self.rank(s) > self.rank(urgent)]
        budget, headroom = self._continue_prefills([s for s in self.prefilling if s not in behind], rows, budget,
                                                   headroom)
        # A prompt that starts like one being computed now waits for it to
        # land in the cache instead of computing the same prefix again (n
        # choices of one request, a burst of requests with one system prompt).
        computing = {self._head(s) for s in self.prefilling if self.kv.can_share(s)} - {None}
        deferred: set[Sequence] = set()
        while budget > 0 and len(self.running) + len(self.prefilling) < self.max_running:
            seq = self._next_waiting(deferred)
            if seq is None:
                break
            head = self._head(seq) if self.kv.can_share(seq) else None
            if head is not None and head in computing:
                deferred.add(seq)
                continue
            hit = self.kv.lookup(seq)
            need = seq.num_tokens - hit.length
            take = min(need, budget) if self.chunked else need
            pages = -(-take // self.kv.page_size)  # the prefix ends on a page boundary
            if (rows.seqs and take > budget) or not self.kv.make_room(pages + headroom + 1):
                self.kv.give_up(hit)
                break
            if head is not None:
                computing.add(head)
            self.waiting.remove(seq)
            self.kv.admit(seq, hit)
            cached_tokens += hit.length
            self.prefilling.append(seq)
            rows.add(seq, take, self.kv.new_slots(seq, take))
            budget -= take
            headroom += 1
        self._continue_prefills(behind, rows, budget, headroom)
        return rows, cached_tokens

    def _continue_prefills(self, seqs: list[Sequence], rows: Rows, budget: int, headroom: int) -> tuple[int, int]:
        """The next chunk of each of `seqs` (prompts partly computed) while
        budget and pages last; returns what budget and headroom are left."""
        for seq in seqs:
            take = min(seq.num_tokens - seq.kv_len, budget)
            if take <= 0 or not self.kv.make_room(self.kv.pages_needed(seq, take) + headroom + 1):
                break
            rows.add(seq, take, self.kv.new_slots(seq, take))
            budget -= take
            headroom += 1
        return budget, headroom

    def _next_waiting(self, deferred: set[Sequence]) -> Sequence | None:
        """The first waiting sequence of the most urgent rank, not deferred:
        first in --schedule-policy's order (schedule_policy.py), then in
        queue order. One just retracted while its last token was still
        being sampled waits until that token is known."""
        ready = [s for s in self.waiting if not s.pending and s not in deferred]
        if not ready:
            return None
        place = self.order.keys(ready)
        return min(ready, key=lambda s: (self.rank(s), place[s]))

    @staticmethod
    def _head(seq: Sequence) -> tuple[str | None, tuple[int, ...]] | None:
        """The first tokens of a prompt long enough to be worth sharing,
        with the salt it may share them under."""
        if len(seq.prompt_ids) <= _SHARED_HEAD or not seq.caches_kv:
            return None
        return seq.cache_salt, tuple(seq.prompt_ids[:_SHARED_HEAD])

    def _make_way_for_urgent(self) -> None:
        """The most urgent waiting request does not wait for less urgent
        running ones: while the running cap or the KV pool leaves no room
        for its first chunk, the least urgent holder is retracted (what it
        computed goes to the cache, so resuming it later is cheap)."""
        seq = self._next_waiting(set())
        if seq is None:
            return
        hit = self.kv.lookup(seq)
        self.kv.give_up(hit)
        chunk_pages = -(-min(seq.num_tokens - hit.length, self.token_budget) // self.kv.page_size)
        while holders := self.holders():
            victim = self._least_urgent(holders)
            if self.rank(victim) <= self.rank(seq):
                return
            # What the next step needs: the decode rows' pages, a page of
            # headroom each (as _prefill_rows keeps), and the chunk.
            pages = sum(self.kv.pages_needed(s, 1) for s in self.running) + len(self.running) + chunk_pages + 1
            if len(holders) < self.max_running and self.kv.make_room(pages):
                return
            logger.info("retracting request %s (priority %d) for the more urgent %s (priority %d)",
                        victim.rid, victim.priority, seq.rid, seq.priority)
            self._retract(victim)

    def _least_urgent(self, holders: list[Sequence]) -> Sequence:
        """The newest holder of the least urgent rank (holders are in
        admission order: the last of the max rank is the newest)."""
        return max(reversed(holders), key=self.rank)

    def retract_one(self) -> bool:
        """Retract the newest sequence of the least urgent rank, unless
        only one sequence holds pages (it has nothing to wait for)."""
        holders = self.holders()
        if len(holders) < 2:
            return False
        seq = self._least_urgent(holders)
        logger.info("KV cache full: retracting request %s (%d tokens)", seq.rid, seq.num_tokens)
        self._retract(seq)
        return True

    def _retract(self, seq: Sequence) -> None:
        """What `seq` computed goes to the cache, and it waits at the head
        of the queue to be resumed (prompt + tokens so far)."""
        self.kv.release(seq)
        (self.running if seq in self.running else self.prefilling).remove(seq)
        self.waiting.appendleft(seq)

    def pause(self, retract: bool) -> None:
        self.paused, self._retract_on_pause = True, retract

    def settle_pause(self) -> None:
        """Once no step is in flight: a retracting pause makes every holder
        wait, in admission order at the head of the queue."""
        if self._retract_on_pause:
            for seq in reversed(self.holders()):
                self._retract(seq)

    def holders(self) -> list[Sequence]:
        """Sequences holding KV: running, or in the middle of their prompt."""
        return self.running + self.prefilling
