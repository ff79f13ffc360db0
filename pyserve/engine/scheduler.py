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


class Scheduler:
    def __init__(self, kv_pool: KVPool, cache: RadixCache | None, max_running: int, max_prefill_tokens: int,
                 device: torch.device):
        self.kv_pool = kv_pool
        self.cache = cache
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.device = device
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, seq: Sequence) -> None:
        """Give back what `seq` holds and forget it."""
        self._return_slots(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

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
        step = self._schedule_prefill()
        if step is None and self.running:
            step = self._schedule_decode()
        return step

    def _schedule_prefill(self) -> ScheduledStep | None:
        admitted: list[Sequence] = []
        admitted_slots: list[torch.Tensor] = []
        budget = self.max_prefill_tokens
        cached_tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            seq = self._next_waiting()
            # Leave at least the last token to compute: its logits are needed.
            if self.cache is not None:
                prefix, node = self.cache.match_prefix(seq.all_ids[:-1])
                self.cache.lock(node)
            else:
                prefix, node = seq.slots[:0], None
            need = seq.num_tokens - prefix.numel()
            # Keep one slot per running sequence free so the next decode
            # step does not have to retract what was just admitted.
            headroom = len(self.running) + len(admitted)
            if (admitted and need > budget) or not self._make_room(need + headroom):
                if node is not None:
                    self.cache.unlock(node)
                break
            self.waiting.remove(seq)
            seq.slots, seq.num_shared, seq.prefix_node = prefix, prefix.numel(), node
            if seq.cached_tokens is None:  # report the hit of the first admission
                seq.cached_tokens = prefix.numel()
            cached_tokens += prefix.numel()
            admitted.append(seq)
            admitted_slots.append(self.kv_pool.alloc(need))
            budget -= need
        if not admitted:
            return None
        step = self._build(admitted, admitted_slots, is_prefill=True)
        step.num_cached_tokens = cached_tokens
        self.running.extend(admitted)
        return step

    def _schedule_decode(self) -> ScheduledStep | None:
        while not self._make_room(len(self.running)):
            if len(self.running) == 1:
                # A lone sequence that no longer fits the whole pool.
                return None
            # running is in admission order: the last of the max priority
            # value is the newest of the least urgent.
            self._retract(max(reversed(self.running), key=lambda s: s.priority))
        slots = [self.kv_pool.alloc(1) for _ in self.running]
        return self._build(list(self.running), slots, is_prefill=False)

    def _next_waiting(self) -> Sequence:
        """The oldest waiting sequence of the most urgent priority."""
        return min(self.waiting, key=lambda s: s.priority)

    def _retract(self, seq: Sequence) -> None:
        logger.info("KV cache full: retracting request %s (%d tokens)", seq.rid, seq.num_tokens)
        self._return_slots(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _build(self, seqs: list[Sequence], new_slots: list[torch.Tensor], is_prefill: bool) -> ScheduledStep:
        input_ids: list[int] = []
        positions: list[int] = []
        extend_lens, seq_lens, kv_indices, logits_indices = [], [], [], []
        for seq, slots in zip(seqs, new_slots):
            new = seq.uncached_ids
            start = seq.num_cached
            input_ids.extend(new)
            positions.extend(range(start, start + len(new)))
            seq.slots = torch.cat([seq.slots, slots])
            extend_lens.append(len(new))
            seq_lens.append(seq.num_cached)
            kv_indices.append(seq.slots.to(self.device))
            logits_indices.append(len(input_ids) - 1)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            out_cache_loc=torch.cat(new_slots).to(dev),
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            kv_indices=kv_indices,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            is_decode=not is_prefill,
        )
        return ScheduledStep(seqs=seqs, batch=batch, is_prefill=is_prefill, num_new_tokens=len(input_ids))

    def owned_slots(self) -> int:
        """Slots running sequences hold that the cache does not."""
        return sum(s.num_cached - s.num_shared for s in self.running)

    def cached_slots(self) -> int:
        return self.cache.total_slots if self.cache is not None else 0
