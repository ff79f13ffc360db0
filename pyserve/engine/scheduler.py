"""Continuous batching: which sequences run in the next forward pass.

Each step is either a prefill of newly admitted sequences or one decode
step for every running sequence. New requests are admitted first-come
first-served within their priority (interactive before batch jobs) while
there is room (running-request cap, prefill token budget, KV slots). An
admitted request reuses the longest prefix of its prompt that the radix
cache holds and computes only the rest. When KV slots run short, unused
cached prefixes are evicted first; if that is not enough during decode,
the newest running sequence of the lowest priority is retracted: what it
computed goes to the cache, and it waits at the head of the queue to be
resumed (prompt + tokens so far) when room returns.

With chunked prefill, a prompt longer than the chunk size is computed a
chunk per step, and decode steps of the running sequences come in between,
so one long prompt does not freeze every stream.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from pyserve.engine.kv_pool import KVPool
from pyserve.engine.radix_cache import RadixCache
from pyserve.engine.sequence import Sequence
from pyserve.model.forward_batch import ForwardBatch

logger = logging.getLogger("pyserve.engine")


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    batch: ForwardBatch
    is_prefill: bool
    num_new_tokens: int
    num_cached_tokens: int = 0  # prompt tokens taken from the radix cache
    # The sequences whose next token this step samples; a sequence in the
    # middle of a chunked prefill is computed but not sampled.
    sampled: list[Sequence] | None = None


class Scheduler:
    def __init__(self, kv_pool: KVPool, cache: RadixCache | None, max_running: int, max_prefill_tokens: int,
                 chunk_size: int | None, device: torch.device):
        self.kv_pool = kv_pool
        self.cache = cache
        self.max_running = max_running
        # Prefill tokens one step may compute.
        self.prefill_budget = chunk_size if chunk_size else max_prefill_tokens
        self.chunked = bool(chunk_size)
        self.prefilling: list[Sequence] = []  # admitted, prompt partly computed
        self._last_was_prefill = False
        self.device = device
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def release(self, seq: Sequence) -> None:
        """Give back what `seq` holds and forget it."""
        self._return_slots(seq)
        for queue in (self.running, self.prefilling, self.waiting):
            if seq in queue:
                queue.remove(seq)
                return

    def _return_slots(self, seq: Sequence) -> None:
        """The KV that `seq` computed goes into the cache (it stays valid for
        any request with the same prefix); slots the cache already had are
        freed."""
        if self.cache is None:
            self.kv_pool.free(seq.slots)
        else:
            already = self.cache.insert(seq.all_ids[: seq.num_cached], seq.slots)
            if already > seq.num_shared:
                self.kv_pool.free(seq.slots[seq.num_shared : already])
            if seq.prefix_node is not None:
                self.cache.unlock(seq.prefix_node)
        seq.slots = seq.slots[:0]
        seq.num_shared = 0
        seq.prefix_node = None

    def _make_room(self, needed: int) -> bool:
        """Evict cached prefixes until `needed` slots are free, if possible."""
        short = needed - self.kv_pool.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.kv_pool.num_free >= needed

    def token_usage(self) -> float:
        return 1.0 - self.kv_pool.num_free / self.kv_pool.capacity

    def schedule(self) -> ScheduledStep | None:
        # Between two chunks of a long prompt, let the running streams move.
        if self.prefilling and self.running and self._last_was_prefill:
            step = self._schedule_decode()
            if step is not None:
                self._last_was_prefill = False
                return step
        step = self._schedule_prefill()
        if step is None and self.running:
            step = self._schedule_decode()
        self._last_was_prefill = step is not None and step.is_prefill
        return step

    def _schedule_prefill(self) -> ScheduledStep | None:
        seqs: list[Sequence] = []
        new_slots: list[torch.Tensor] = []
        lengths: list[int] = []
        budget = self.prefill_budget
        cached_tokens = 0
        # Sequences in the middle of a chunked prefill go first: they hold slots.
        for seq in list(self.prefilling):
            take = min(len(seq.uncached_ids), budget)
            if take == 0 or not self._make_room(take + len(self.running)):
                break
            seqs.append(seq)
            new_slots.append(self.kv_pool.alloc(take))
            lengths.append(take)
            budget -= take
        while (self.waiting and budget > 0
               and len(self.running) + len(self.prefilling) + len(seqs) < self.max_running):
            seq = self._next_waiting()
            if seq in seqs:
                break
            # Leave at least the last token to compute: its logits are needed.
            if self.cache is not None:
                prefix, node = self.cache.match_prefix(seq.all_ids[:-1])
                self.cache.lock(node)
            else:
                prefix, node = seq.slots[:0], None
            need = seq.num_tokens - prefix.numel()
            take = min(need, budget) if self.chunked else need
            # Keep one slot per running sequence free so the next decode
            # step does not have to retract what was just admitted.
            headroom = len(self.running) + len(seqs)
            if (seqs and take > budget) or not self._make_room(take + headroom):
                if node is not None:
                    self.cache.unlock(node)
                break
            self.waiting.remove(seq)
            seq.slots, seq.num_shared, seq.prefix_node = prefix, prefix.numel(), node
            if seq.cached_tokens is None:  # report the hit of the first admission
                seq.cached_tokens = prefix.numel()
            cached_tokens += prefix.numel()
            seqs.append(seq)
            new_slots.append(self.kv_pool.alloc(take))
            lengths.append(take)
            budget -= take
        if not seqs:
            return None
        step = self._build(seqs, new_slots, lengths, is_prefill=True)
        step.num_cached_tokens = cached_tokens
        for seq in seqs:
            done = seq.num_cached == seq.num_tokens
            if seq in self.prefilling and done:
                self.prefilling.remove(seq)
                self.running.append(seq)
            elif seq not in self.prefilling:
                (self.running if done else self.prefilling).append(seq)
        return step

    def _schedule_decode(self) -> ScheduledStep | None:
        while not self._make_room(len(self.running)):
            if not self.retract_one():
                return None
        if not self.running:
            return None
        slots = [self.kv_pool.alloc(1) for _ in self.running]
        return self._build(list(self.running), slots, [1] * len(self.running), is_prefill=False)

    def _next_waiting(self) -> Sequence:
        """The oldest waiting sequence of the most urgent priority."""
        return min(self.waiting, key=lambda s: s.priority)

    def retract_one(self) -> bool:
        """Retract the newest sequence of the least urgent priority, unless
        only one sequence holds slots (it has nothing to wait for)."""
        holders = self.running + self.prefilling
        if len(holders) < 2:
            return False
        # Admission order: the last of the max priority value is the newest
        # of the least urgent.
        self._retract(max(reversed(holders), key=lambda s: s.priority))
        return True

    def _retract(self, seq: Sequence) -> None:
        logger.info("KV cache full: retracting request %s (%d tokens)", seq.rid, seq.num_tokens)
        self._return_slots(seq)
        (self.running if seq in self.running else self.prefilling).remove(seq)
        self.waiting.appendleft(seq)

    def _build(self, seqs: list[Sequence], new_slots: list[torch.Tensor], lengths: list[int],
               is_prefill: bool) -> ScheduledStep:
        input_ids: list[int] = []
        positions: list[int] = []
        extend_lens, logits_indices, sampled = [], [], []
        for seq, slots, n in zip(seqs, new_slots, lengths):
            new = seq.uncached_ids[:n]
            start = seq.num_cached
            input_ids.extend(new)
            positions.extend(range(start, start + len(new)))
            seq.slots = torch.cat([seq.slots, slots])
            extend_lens.append(len(new))
            if seq.num_cached == seq.num_tokens:  # the whole sequence is in: sample
                logits_indices.append(len(input_ids) - 1)
                sampled.append(seq)
        batch = ForwardBatch.build(
            input_ids, positions, torch.cat(new_slots), extend_lens, [s.slots for s in seqs],
            logits_indices, is_decode=not is_prefill, device=self.device,
        )
        return ScheduledStep(seqs=seqs, batch=batch, is_prefill=is_prefill, num_new_tokens=len(input_ids),
                             sampled=sampled)

    def owned_slots(self) -> int:
        """Slots running sequences hold that the cache does not."""
        return sum(s.num_cached - s.num_shared for s in self.running + self.prefilling)

    def cached_slots(self) -> int:
        return self.cache.total_slots if self.cache is not None else 0
