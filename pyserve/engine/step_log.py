"""The engine's log lines, in SGLang's shape:

    Prefill batch. #new-seq: .., #new-token: .., #cached-token: .., token usage: .., ...
    Decode batch. #running-req: .., #token: .., token usage: .., gen throughput (token/s): .., ...

A prefill line for every step that computes prompts, a decode line every
`interval` decode steps with the throughput since the previous one.
"""

from __future__ import annotations

import logging
import time

from pyserve.engine.kv.manager import KVManager
from pyserve.engine.scheduler import Scheduler
from pyserve.engine.step import ScheduledStep

logger = logging.getLogger("pyserve.engine")


class StepLog:
    def __init__(self, scheduler: Scheduler, kv: KVManager, interval: int):
        self.scheduler = scheduler
        self.kv = kv
        self.interval = interval
        self._decode_steps = 0
        self._decode_tokens = 0
        self._since = time.perf_counter()

    def on_launch(self, step: ScheduledStep) -> None:
        s = self.scheduler
        if step.is_prefill:
            logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                "#running-req: %d, #queue-req: %d",
                step.num_prefill_seqs, step.num_prefill_tokens, step.num_cached_tokens, self.kv.token_usage(),
                len(step.seqs) - step.num_prefill_seqs, len(s.waiting),
            )
        elif self._decode_steps % self.interval == 0 and self._decode_steps:
            now = time.perf_counter()
            throughput = self._decode_tokens / max(now - self._since, 1e-9)
            logger.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                "gen throughput (token/s): %.2f, #queue-req: %d",
                len(s.running), self.kv.owned_tokens(s.holders()), self.kv.token_usage(), throughput,
                len(s.waiting),
            )
            self._decode_tokens = 0
            self._since = now

    def on_done(self, step: ScheduledStep) -> None:
        if not step.is_prefill:
            self._decode_steps += 1
            self._decode_tokens += len(step.seqs)
