"""Continuous batching: which sequences run in the next forward pass.

Each step is either a prefill of newly admitted sequences or one decode
step for every running sequence. New requests are admitted first-come
first-served within their priority (interactive before batch jobs) while
there is room (running-request cap, prefill token budget,
KV slots). When decode runs out of KV slots, the newest running sequence of the
lowest priority is retracted: its slots are freed and it goes back to the head of the queue,
to be recomputed (prompt + tokens so far) when room returns.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from pyserve.engine.kv_pool import KVPool
from pyserve.engine.sequence import Sequence
from pyserve.model.forward_batch import ForwardBatch

logger = logging.getLogger("pyserve.engine")


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    batch: ForwardBatch
    is_prefill: bool
    num_new_tokens: int


class Scheduler:
    def __init__(self, kv_pool: KVPool, max_running: int, max_prefill_tokens: int, device: torch.device):
        self.kv_pool = kv_pool
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
        """Return every slot `seq` holds and forget it."""
        self.kv_pool.free(seq.slots)
        seq.slots = seq.slots[:0]
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

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
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            seq = self._next_waiting()
            need = len(seq.uncached_ids)
            if admitted and need > budget:
                break
            # Keep one slot per running sequence free so the next decode
            # step does not have to retract what was just admitted.
            headroom = len(self.running) + len(admitted)
            if self.kv_pool.num_free - need < headroom:
                break
            slots = self.kv_pool.alloc(need)
            if slots is None:
                break
            self.waiting.remove(seq)
            admitted.append(seq)
            admitted_slots.append(slots)
            budget -= need
        if not admitted:
            return None
        step = self._build(admitted, admitted_slots, is_prefill=True)
        self.running.extend(admitted)
        return step

    def _schedule_decode(self) -> ScheduledStep | None:
        while self.kv_pool.num_free < len(self.running):
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
        self.kv_pool.free(seq.slots)
        seq.slots = seq.slots[:0]
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
        return sum(s.num_cached for s in self.running)
