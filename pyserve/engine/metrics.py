"""Serving metrics in Prometheus' text format, for GET /metrics.

The names follow SGLang's (`sglang:prompt_tokens_total`, ...) under a
`pyserve:` prefix, so an SGLang dashboard needs only the prefix changed.
Counters and histograms are updated by the engine as requests arrive,
produce their first token and finish; gauges are read from the engine when
scraped.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter

PREFIX = "pyserve:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self) -> list[str]:
        out = [f"# HELP {PREFIX}{self.name} {self.help}", f"# TYPE {PREFIX}{self.name} histogram"]
        running = 0
        for bound, n in zip(list(self.buckets) + [math.inf], self.counts):
            running += n
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append(f'{PREFIX}{self.name}_bucket{{le="{le}"}} {running}')
        out += [f"{PREFIX}{self.name}_sum {self.sum}", f"{PREFIX}{self.name}_count {running}"]
        return out


class EngineMetrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.finished = Counter()  # finish reason -> requests
        # Speculative decoding: verify steps of drafted rows, and the tokens they emitted.
        self.spec_verify_steps = 0
        self.spec_emitted_tokens = 0
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "Mean time per output token after the first.",
                              _TOKEN_LATENCY_BUCKETS)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_verify(self, emitted: int) -> None:
        self.spec_verify_steps += 1
        self.spec_emitted_tokens += emitted

    def on_finish(self, reason: str, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                  seconds: float, ttft: float | None) -> None:
        self.finished[reason] += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.generation_tokens += output_tokens
        self.e2e.observe(seconds)
        if ttft is not None and output_tokens > 1:
            self.tpot.observe((seconds - ttft) / (output_tokens - 1))

    def render(self, gauges: dict[str, tuple[float, str]]) -> str:
        """The exposition text; `gauges`: name -> (value, help)."""
        lines = []
        for name, (value, help_text) in gauges.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} gauge", f"{PREFIX}{name} {value}"]
        counters = {
            "prompt_tokens_total": (self.prompt_tokens, "Prompt tokens of finished requests."),
            "generation_tokens_total": (self.generation_tokens, "Generated tokens of finished requests."),
            "cached_tokens_total": (self.cached_tokens, "Prompt tokens served from the prefix cache."),
            "spec_verify_steps_total": (self.spec_verify_steps, "Decode rows that verified draft tokens."),
            "spec_accepted_tokens_total": (self.spec_emitted_tokens,
                                           "Tokens those rows emitted (accepted drafts + the target's own)."),
        }
        for name, (value, help_text) in counters.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} counter", f"{PREFIX}{name} {value}"]
        lines += [f"# HELP {PREFIX}num_requests_total Finished requests, by finish reason.",
                  f"# TYPE {PREFIX}num_requests_total counter"]
        for reason in sorted(self.finished):
            lines.append(f'{PREFIX}num_requests_total{{finish_reason="{reason}"}} {self.finished[reason]}')
        accept_len = self.spec_emitted_tokens / self.spec_verify_steps if self.spec_verify_steps else 0.0
        lines += [f"# HELP {PREFIX}spec_accept_length Mean tokens emitted per verify step (SGLang's accept len).",
                  f"# TYPE {PREFIX}spec_accept_length gauge", f"{PREFIX}spec_accept_length {accept_len}"]
        for histogram in (self.ttft, self.e2e, self.tpot):
            lines += histogram.lines()
        return "\n".join(lines) + "\n"
