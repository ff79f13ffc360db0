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
from pyserve.engine.metrics import EngineMetrics
from pyserve.engine.scheduler import Scheduler
from pyserve.engine.step import ScheduledStep

logger = logging.getLogger("pyserve.engine")


class StepLog:
    def __init__(self, scheduler: Scheduler, kv: KVManager, interval: int, metrics: EngineMetrics | None = None):
        self.scheduler = scheduler
        self.metrics = metrics  # where the speculative figures are counted
        self.kv = kv
        self.interval = interval
        self._decode_steps = 0
        self._decode_tokens = 0
        self._since = time.perf_counter()
        self._verify_steps = self._emitted = 0  # the metrics' figures at the last decode line
        self._drafts_counted = 0  # accepted drafts already in the throughput
        self.last_gen_throughput = 0.0  # tokens/s, the last decode line's

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
            throughput = self.last_gen_throughput = self._decode_tokens / max(now - self._since, 1e-9)
            m = self.metrics
            spec = ""
            if m is not None and s.drafter is not None:
                steps, emitted = m.spec_verify_steps - self._verify_steps, m.spec_emitted_tokens - self._emitted
                spec = f", accept len: {emitted / steps if steps else 0.0:.2f}"
                self._verify_steps, self._emitted = m.spec_verify_steps, m.spec_emitted_tokens
            logger.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                "gen throughput (token/s): %.2f, #queue-req: %d%s",
                len(s.running), self.kv.owned_tokens(s.holders()), self.kv.token_usage(), throughput,
                len(s.waiting), spec,
            )
            self._decode_tokens = 0
            self._since = now

    def on_done(self, step: ScheduledStep) -> None:
        if not step.is_prefill:
            self._decode_steps += 1
            self._decode_tokens += len(step.seqs) + self._accepted_drafts()

    def _accepted_drafts(self) -> int:
        """Draft tokens accepted since the last call: generated tokens beyond one per row."""
        m = self.metrics
        if m is None:
            return 0
        total = m.accepted_drafts()
        new, self._drafts_counted = total - self._drafts_counted, total
        return new
