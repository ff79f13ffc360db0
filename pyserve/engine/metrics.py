"""Serving metrics in Prometheus' text format, for GET /metrics.

Each series is written under the names of the families asked for
(--metrics-names): `pyserve:` (SGLang's names under pyserve's prefix),
`sglang:` (SGLang's own) and `vllm:` (vLLM's names for the same meaning),
so an SGLang or vLLM dashboard reads pyserve unchanged. The peers' series
carry their `model_name` label, as theirs do. A series a family has no
name for is left out of it. Counters and histograms are updated by the
engine as requests arrive, produce their first token and finish; gauges
are read from the engine when scraped.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter

FAMILIES = ("pyserve", "sglang", "vllm")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_TOKEN_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)

# A series' name in each family (pyserve's are SGLang's), None where the family has none.
_VLLM_NAMES = {
    "num_running_reqs": "num_requests_running",
    "num_queue_reqs": "num_requests_waiting",
    "token_usage": "kv_cache_usage_perc",
    "cache_hit_rate": None,  # vLLM has the two counters below instead
    "cached_tokens_total": "prefix_cache_hits_total",
    "prompt_tokens_cached_queries": "prefix_cache_queries_total",  # vLLM's only
    "num_requests_total": "request_success_total",
    "spec_verify_calls_total": "spec_decode_num_drafts_total",
    "spec_draft_tokens_total": "spec_decode_num_draft_tokens_total",
    "spec_accepted_drafts_total": "spec_decode_num_accepted_tokens_total",
    "spec_accepted_drafts_per_position_total": "spec_decode_num_accepted_tokens_per_pos_total",
    "spec_accept_length": None,  # vLLM has the counters above instead
    "spec_accept_rate": None,
}
# pyserve's own series, of no SGLang name: left out of the `sglang:` family.
_PYSERVE_ONLY = frozenset({"spec_draft_tokens_total", "spec_accepted_drafts_total",
                           "spec_accepted_drafts_per_position_total"})
# vLLM labels a finished request's reason `finished_reason`; SGLang and pyserve, `finish_reason`.
_REASON_LABEL = {"pyserve": "finish_reason", "sglang": "finish_reason", "vllm": "finished_reason"}


def series_name(family: str, name: str) -> str | None:
    if family == "vllm":
        name = _VLLM_NAMES.get(name, name)
    elif name == "prompt_tokens_cached_queries" or (family == "sglang" and name in _PYSERVE_ONLY):
        return None
    return None if name is None else f"{family}:{name}"


def _labels(pairs: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in pairs.items()) + "}" if pairs else ""


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(list(self.buckets) + [math.inf], self.counts):
            running += n
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append(f"{name}_bucket{_labels({**labels, 'le': le})} {running}")
        out += [f"{name}_sum{_labels(labels)} {self.sum}", f"{name}_count{_labels(labels)} {running}"]
        return out


class EngineMetrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.finished = Counter()  # finish reason -> requests
        # Speculative decoding: verify steps of drafted rows, the drafts they
        # verified, and the tokens they emitted (kept drafts + the target's own).
        self.spec_verify_steps = 0
        self.spec_draft_tokens = 0
        self.spec_emitted_tokens = 0
        self.spec_kept_at: list[int] = []  # per draft position (0: the first draft), the verify steps that kept it
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "Mean time per output token after the first.",
                              _TOKEN_LATENCY_BUCKETS)
        self.step_tokens = Histogram("iteration_tokens_total", "Tokens computed by each forward step.",
                                     _STEP_TOKEN_BUCKETS)

    def on_step(self, tokens: int) -> None:
        self.step_tokens.observe(tokens)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_verify(self, drafted: int, emitted: int) -> None:
        self.spec_verify_steps += 1
        self.spec_draft_tokens += drafted
        self.spec_emitted_tokens += emitted
        self.spec_kept_at += [0] * (drafted - len(self.spec_kept_at))
        for position in range(emitted - 1):  # the kept drafts, the target's own token after them
            self.spec_kept_at[position] += 1

    def accept_length(self) -> float:
        """Mean tokens a verify step emitted (0.0 before the first)."""
        return self.spec_emitted_tokens / self.spec_verify_steps if self.spec_verify_steps else 0.0

    def accepted_drafts(self) -> int:
        return self.spec_emitted_tokens - self.spec_verify_steps

    def accept_rate(self) -> float:
        """Kept drafts per verified draft (0.0 before the first)."""
        return self.accepted_drafts() / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    def on_finish(self, reason: str, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                  seconds: float, ttft: float | None) -> None:
        self.finished[reason] += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.generation_tokens += output_tokens
        self.e2e.observe(seconds)
        if ttft is not None and output_tokens > 1:
            self.tpot.observe((seconds - ttft) / (output_tokens - 1))

    def render(self, gauges: dict[str, tuple[float, str]], families: tuple[str, ...] = ("pyserve",),
               model_name: str = "") -> str:
        """The exposition text; `gauges`: name -> (value, help), named as
        pyserve names them; `families`: whose names to write them under."""
        return "".join(self._family(family, gauges, model_name) for family in families)

    def _family(self, family: str, gauges: dict[str, tuple[float, str]], model_name: str) -> str:
        labels = {} if family == "pyserve" else {"model_name": model_name}
        lines = []

        def scalar(kind: str, key: str, value: float, help_text: str) -> None:
            name = series_name(family, key)
            if name is not None:
                lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{_labels(labels)} {value}"])

        for key, (value, help_text) in gauges.items():
            scalar("gauge", key, value, help_text)
        scalar("counter", "prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests.")
        scalar("counter", "generation_tokens_total", self.generation_tokens, "Generated tokens of finished requests.")
        scalar("counter", "cached_tokens_total", self.cached_tokens, "Prompt tokens served from the prefix cache.")
        scalar("counter", "prompt_tokens_cached_queries", self.prompt_tokens,
               "Prompt tokens looked up in the prefix cache.")
        name = series_name(family, "num_requests_total")
        lines += [f"# HELP {name} Finished requests, by finish reason.", f"# TYPE {name} counter"]
        for reason in sorted(self.finished):
            lines.append(f"{name}{_labels({**labels, _REASON_LABEL[family]: reason})} {self.finished[reason]}")
        scalar("counter", "spec_verify_calls_total", self.spec_verify_steps, "Decode rows that verified draft tokens.")
        scalar("counter", "spec_draft_tokens_total", self.spec_draft_tokens, "Draft tokens those rows verified.")
        scalar("counter", "spec_accepted_drafts_total", self.accepted_drafts(), "Draft tokens the target kept.")
        scalar("gauge", "spec_accept_length", self.accept_length(),
               "Mean tokens emitted per verify step, the target's own included (SGLang's accept len).")
        scalar("gauge", "spec_accept_rate", self.accept_rate(), "Kept draft tokens per verified one.")
        name = series_name(family, "spec_accepted_drafts_per_position_total")
        if name is not None:
            lines += [f"# HELP {name} Draft tokens kept, by their position in the draft (0: the first).",
                      f"# TYPE {name} counter"]
            lines += [f"{name}{_labels({**labels, 'position': str(p)})} {n}" for p, n in enumerate(self.spec_kept_at)]
        for histogram in (self.ttft, self.e2e, self.tpot, self.step_tokens):
            lines += histogram.lines(series_name(family, histogram.name), labels)
        return "\n".join(lines) + "\n"
