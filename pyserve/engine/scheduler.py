"""Continuous batching: which sequences run in the next forward pass.

Every step gives each running sequence its next token (decode rows) and
spends what is left of the step's token budget on prompts (prefill rows):
first the sequences in the middle of a chunked prefill, then new requests,
first-come first-served within their priority (interactive before batch
jobs) while there is room (running-request cap, token budget, KV pages). A
step with no prefill rows is a pure decode step, which the attention
backends and CUDA graphs run on their fast path.

An admitted request reuses the longest prefix of its prompt that the radix
cache holds and computes only the rest. A prompt longer than the chunk size
is computed a chunk per step, with the running streams decoding alongside,
so one long prompt does not freeze every stream.

When KV pages run short, unused cached prefixes are evicted first; if that
is not enough for the decode rows, the newest running sequence of the least
urgent priority is retracted: what it computed goes to the cache, and it
waits at the head of the queue to be resumed (prompt + tokens so far) when
room returns.

Overlap: the engine schedules step N+1 while step N still runs, so a
sequence's newest token may not be known yet (`Sequence.pending`). Its
decode row then carries a placeholder, -(row + 1), that the model runner
replaces with row `row` of step N's sampled ids before the forward pass.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from pyserve.engine.kv_pool import PagePool
from pyserve.engine.radix_cache import RadixCache
from pyserve.engine.sequence import Sequence
from pyserve.model.forward_batch import ForwardBatch

logger = logging.getLogger("pyserve.engine")
_SHARED_HEAD = 32  # prompt tokens two prompts must share before one waits for the other's KV


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    batch: ForwardBatch
    # The sequences whose next token this step samples, in the order of the
    # sampled ids; a sequence in the middle of a chunked prefill is
    # computed but not sampled.
    sampled: list[Sequence]
    num_prefill_seqs: int = 0
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens newly admitted requests took from the radix cache
    # Decode rows whose input is a placeholder for the previous step's output.
    has_placeholders: bool = False
    # Prompt log-probabilities: the token each extra logits row (after the
    # sampled ones) is scored on, and how many rows each sequence has.
    prompt_targets: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        return self.num_prefill_seqs > 0


@dataclass
class _Rows:
    """The rows of a step being assembled."""

    seqs: list[Sequence] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    new_slots: list[torch.Tensor] = field(default_factory=list)


class Scheduler:
    def __init__(self, pool: PagePool, cache: RadixCache | None, max_running: int, max_prefill_tokens: int,
                 chunk_size: int | None):
        self.pool = pool
        self.page_size = pool.page_size
        self.cache = cache
        self.max_running = max_running
        # Tokens one step may compute: a chunk, or a whole prefill batch.
        self.token_budget = chunk_size if chunk_size else max_prefill_tokens
        self.chunked = bool(chunk_size)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt partly computed
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def release(self, seq: Sequence) -> None:
        """Give back what `seq` holds and forget it."""
        self._return_pages(seq)
        for queue in (self.running, self.prefilling, self.waiting):
            if seq in queue:
                queue.remove(seq)
                return

    # -- KV pages ------------------------------------------------------------

    def _return_pages(self, seq: Sequence) -> None:
        """The KV that `seq` computed goes into the cache in whole pages (it
        stays valid for any request with the same prefix); pages the cache
        already had, the partial last page, and slots of tokens not known
        yet (pending) are freed."""
        own = seq.slots[seq.num_shared :]
        if self.cache is None or not seq.kv_valid:
            self.pool.free_slots(own)
        else:
            known = min(seq.num_cached, seq.num_tokens)
            whole = known - known % self.page_size
            already = self.cache.insert(seq.all_ids[:whole], seq.slots[:whole])
            self.pool.free_slots(seq.slots[seq.num_shared : max(already, seq.num_shared)])
            self.pool.free_slots(seq.slots[whole:])
        if seq.prefix_node is not None:
            self.cache.unlock(seq.prefix_node)
        seq.slots = seq.slots[:0]
        seq.num_shared = 0
        seq.prefix_node = None

    def _share_prompt(self, seq: Sequence) -> None:
        """Put the prompt computed so far (whole pages) into the cache now,
        not when the request ends, so requests arriving meanwhile with the
        same prefix reuse it. Whoever reads it runs in a later step, after
        this one wrote it. Where the cache already had some of it, the
        sequence switches to the cache's pages and frees its own copies."""
        known = min(seq.num_cached, len(seq.prompt_ids))
        whole = known - known % self.page_size
        if whole <= seq.num_shared:
            return
        ids = seq.prompt_ids[:whole]
        already = self.cache.insert(ids, seq.slots[:whole])
        shared, node = self.cache.match_prefix(ids)
        self.cache.lock(node)
        if seq.prefix_node is not None:
            self.cache.unlock(seq.prefix_node)
        self.pool.free_slots(seq.slots[seq.num_shared : max(already, seq.num_shared)])
        seq.slots = torch.cat([shared, seq.slots[whole:]])
        seq.num_shared, seq.prefix_node = whole, node

    def _pages_needed(self, seq: Sequence, n: int) -> int:
        """New pages `seq` needs to store `n` more tokens."""
        room = -seq.num_cached % self.page_size  # free slots in its last page
        return max(0, -(-(n - room) // self.page_size))

    def _new_slots(self, seq: Sequence, n: int) -> torch.Tensor:
        """Slots for `n` more tokens of `seq`: the rest of its last page, then
        new pages. The caller made room first."""
        ps = self.page_size
        if ps == 1:
            return self.pool.alloc(n)
        room = min(-seq.num_cached % ps, n)
        parts = []
        if room:
            last = int(seq.slots[-1])
            parts.append(torch.arange(last + 1, last + 1 + room))
        pages = self._pages_needed(seq, n)
        if pages:
            fresh = self.pool.alloc(pages)
            parts.append((fresh[:, None] * ps + torch.arange(ps)).flatten()[: n - room])
        return torch.cat(parts)

    def _make_room(self, pages: int) -> bool:
        """Evict cached prefixes until `pages` pages are free, if possible."""
        short = pages - self.pool.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.pool.num_free >= pages

    def token_usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.capacity

    # -- scheduling ----------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        decode = self._decode_rows()
        prefill, cached_tokens = self._prefill_rows(self.token_budget - len(decode.seqs), len(decode.seqs))
        decode = self._without_less_urgent(decode, prefill)
        if not decode.seqs and not prefill.seqs:
            return None
        step = self._build(prefill, decode)
        step.num_cached_tokens = cached_tokens
        return step

    def _decode_rows(self) -> _Rows:
        """One token for every running sequence, retracting sequences while
        the pool cannot hold them all."""
        rows = _Rows()
        while self.running:
            needed = sum(self._pages_needed(s, 1) for s in self.running)
            if self._make_room(needed):
                break
            if not self.retract_one():
                return rows
        for seq in self.running:
            rows.seqs.append(seq)
            rows.lengths.append(1)
            rows.new_slots.append(self._new_slots(seq, 1))
        return rows

    def _without_less_urgent(self, decode: _Rows, prefill: _Rows) -> _Rows:
        """A step that computes a prompt leaves out the decode rows of less
        urgent streams (batch jobs behind an interactive request): they
        wait a step, and the prompt's first token comes sooner."""
        if not prefill.seqs:
            return decode
        urgent = min(s.priority for s in prefill.seqs)
        kept = _Rows()
        for seq, n, slots in zip(decode.seqs, decode.lengths, decode.new_slots):
            if seq.priority <= urgent:
                kept.seqs.append(seq)
                kept.lengths.append(n)
                kept.new_slots.append(slots)
            elif seq.num_cached % self.page_size == 0:  # its slot opened a new page: give it back
                self.pool.free_slots(slots)
        return kept

    def _prefill_rows(self, budget: int, num_decode: int) -> tuple[_Rows, int]:
        rows = _Rows()
        cached_tokens = 0
        # Keep a page per sequence free so the next decode step does not have
        # to retract what was just admitted.
        headroom = num_decode
        # Sequences in the middle of a chunked prefill go first: they hold pages.
        for seq in self.prefilling:
            take = min(seq.num_tokens - seq.num_cached, budget)
            if take <= 0 or not self._make_room(self._pages_needed(seq, take) + headroom + 1):
                break
            self._add_row(rows, seq, take)
            budget -= take
            headroom += 1
        # A prompt that starts like one being computed now waits for it to
        # land in the cache instead of computing the same prefix again (n
        # choices of one request, a burst of requests with one system prompt).
        computing = {self._head(s) for s in self.prefilling} - {None} if self.cache is not None else set()
        deferred: set[Sequence] = set()
        while budget > 0 and len(self.running) + len(self.prefilling) < self.max_running:
            seq = self._next_waiting(deferred)
            if seq is None:
                break
            # Leave at least the last token to compute: its logits are needed.
            # Prompt log-probabilities need the logits of every position.
            if self.cache is not None and not seq.params.prompt_logprobs:
                head = self._head(seq)
                if head is not None and head in computing:
                    deferred.add(seq)
                    continue
                prefix, node = self.cache.match_prefix(seq.all_ids[:-1])
                self.cache.lock(node)
                if head is not None:
                    computing.add(head)
            else:
                prefix, node = seq.slots[:0], None
            need = seq.num_tokens - prefix.numel()
            take = min(need, budget) if self.chunked else need
            pages = -(-take // self.page_size)  # the prefix ends on a page boundary
            if (rows.seqs and take > budget) or not self._make_room(pages + headroom + 1):
                if node is not None:
                    self.cache.unlock(node)
                break
            self.waiting.remove(seq)
            seq.slots, seq.num_shared, seq.prefix_node = prefix, prefix.numel(), node
            if seq.cached_tokens is None:  # report the hit of the first admission
                seq.cached_tokens = prefix.numel()
            cached_tokens += prefix.numel()
            self.prefilling.append(seq)
            self._add_row(rows, seq, take)
            budget -= take
            headroom += 1
        return rows, cached_tokens

    def _add_row(self, rows: _Rows, seq: Sequence, n: int) -> None:
        rows.seqs.append(seq)
        rows.lengths.append(n)
        rows.new_slots.append(self._new_slots(seq, n))

    def _next_waiting(self, deferred: set[Sequence]) -> Sequence | None:
        """The oldest waiting sequence of the most urgent priority, not
        deferred. One just retracted while its last token was still being
        sampled waits until that token is known."""
        ready = [s for s in self.waiting if not s.pending and s not in deferred]
        return min(ready, key=lambda s: s.priority) if ready else None

    @staticmethod
    def _head(seq: Sequence) -> tuple[int, ...] | None:
        """The first tokens of a prompt long enough to be worth sharing."""
        return tuple(seq.prompt_ids[:_SHARED_HEAD]) if len(seq.prompt_ids) > _SHARED_HEAD else None

    def retract_one(self) -> bool:
        """Retract the newest sequence of the least urgent priority, unless
        only one sequence holds pages (it has nothing to wait for)."""
        holders = self.running + self.prefilling
        if len(holders) < 2:
            return False
        # Admission order: the last of the max priority value is the newest
        # of the least urgent.
        self._retract(max(reversed(holders), key=lambda s: s.priority))
        return True

    def _retract(self, seq: Sequence) -> None:
        logger.info("KV cache full: retracting request %s (%d tokens)", seq.rid, seq.num_tokens)
        self._return_pages(seq)
        (self.running if seq in self.running else self.prefilling).remove(seq)
        self.waiting.appendleft(seq)

    def _build(self, prefill: _Rows, decode: _Rows) -> ScheduledStep:
        input_ids: list[int] = []
        positions: list[int] = []
        extend_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Sequence] = []
        has_placeholders = False
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_spans: list[tuple[Sequence, int]] = []
        for seq, n, slots in zip(prefill.seqs + decode.seqs, prefill.lengths + decode.lengths,
                                 prefill.new_slots + decode.new_slots):
            start = seq.num_cached
            if start < seq.num_tokens:
                new = seq.uncached_ids[:n]
            else:  # a decode row whose input is still being sampled
                new = [-(seq.pending_row + 1)]
                has_placeholders = True
            if seq.params.prompt_logprobs:
                scored = self._unscored_prompt_positions(seq, start, n)
                if scored:
                    prompt_rows += [len(input_ids) + p - start for p in scored]
                    prompt_targets += [seq.prompt_ids[p + 1] for p in scored]
                    prompt_spans.append((seq, len(scored)))
            input_ids.extend(new)
            positions.extend(range(start, start + n))
            seq.slots = torch.cat([seq.slots, slots])
            extend_lens.append(n)
            if seq.num_cached == seq.num_total:  # the whole sequence is in: sample
                logits_indices.append(len(input_ids) - 1)
                sampled.append(seq)
        for seq in prefill.seqs:
            if seq.num_cached == seq.num_tokens:
                self.prefilling.remove(seq)
                self.running.append(seq)
        seqs = prefill.seqs + decode.seqs
        batch = ForwardBatch.build(
            input_ids, positions, torch.cat(prefill.new_slots + decode.new_slots), extend_lens,
            [s.slots for s in seqs], logits_indices + prompt_rows, is_decode=not prefill.seqs, device="cpu",
        )
        if self.cache is not None:
            for seq in prefill.seqs:
                self._share_prompt(seq)
        return ScheduledStep(
            seqs=seqs, batch=batch, sampled=sampled, num_prefill_seqs=len(prefill.seqs),
            num_prefill_tokens=sum(prefill.lengths), has_placeholders=has_placeholders,
            prompt_targets=prompt_targets, prompt_spans=prompt_spans,
        )

    @staticmethod
    def _unscored_prompt_positions(seq: Sequence, start: int, n: int) -> range:
        """Positions among this step's start..start+n whose logits score a
        prompt token not scored yet: position p scores prompt token p + 1."""
        first = max(start, seq.next_prompt_logprob - 1)
        last = min(start + n, len(seq.prompt_ids) - 1)  # exclusive
        if first < last:
            seq.next_prompt_logprob = last + 1
        return range(first, max(first, last))

    # -- accounting ----------------------------------------------------------

    def holders(self) -> list[Sequence]:
        return self.running + self.prefilling

    def owned_pages(self) -> int:
        """Pages running sequences hold that the cache does not."""
        return sum(-(-(s.num_cached - s.num_shared) // self.page_size) for s in self.holders())

    def owned_tokens(self) -> int:
        return sum(s.num_cached - s.num_shared for s in self.holders())

    def cached_pages(self) -> int:
        return self.cache.total_pages if self.cache is not None else 0
