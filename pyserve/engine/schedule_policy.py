"""--schedule-policy (SGLang's): the order in which waiting requests of
equal urgency (scheduler.Scheduler.rank) are admitted.

- fcfs: arrival order.
- lpm: the longest prefix in the radix cache first, so that requests
  sharing a cached prefix run while it is cached, rather than after
  requests that evict it; with more than LPM_QUEUE_LIMIT waiting, arrival
  order (matching every prompt each step would cost more than it saves).
- lof: the longest output first (max_new_tokens), so that long
  generations start early and the batch drains evenly.
- random: a random order, drawn anew each step.
"""

from __future__ import annotations

import random

from pyserve.engine.kv.manager import KVManager
from pyserve.engine.sequence import Sequence

POLICIES = ("fcfs", "lpm", "lof", "random")
LPM_QUEUE_LIMIT = 128  # SGLang's


class WaitingOrder:
    def __init__(self, policy: str, kv: KVManager, seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"--schedule-policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
        self.kv = kv
        self._random = random.Random(seed)

    def keys(self, ready: list[Sequence]) -> dict[Sequence, float]:
        """Each ready sequence's place (lower first; ties keep arrival order)."""
        if self.policy == "lpm" and len(ready) <= LPM_QUEUE_LIMIT and self.kv.cache is not None:
            return {s: -self.kv.cache.cached_length(s.all_ids[:-1], s.prefix_namespace) if self.kv.can_share(s)
                    else 0 for s in ready}
        if self.policy == "lof":
            return {s: -(s.params.max_new_tokens or 0) for s in ready}
        if self.policy == "random":
            return {s: self._random.random() for s in ready}
        return dict.fromkeys(ready, 0)
