"""Smoke test of bench/structured.py: one short round each way."""

from __future__ import annotations

import re

from bench import structured
from tests.slow import slow_test


@slow_test  # three engines and every schema's compile
def test_structured_benchmark_reports_ratios_and_compile_times(capsys):
    result = structured.main(["--rounds", "1", "--concurrency", "2", "--temperatures", "0", "--schemas", "wide"])
    run = result["wide-c2-t0"]
    assert run["tokens_per_round"] > 0 and run["ratio"] > 0 and len(run["ratios"]) == 1
    assert run["constrained_tok_s"] > 0 and run["unconstrained_tok_s"] > 0 and run["off_tok_s"] > 0
    assert run["off_ratio"] > 0 and run["on_vs_off_chars"] > 0
    assert set(result["compile_ms"]) == set(structured.SCHEMAS)
    assert all(cold > 0 and cached > 0 for cold, cached in result["compile_ms"].values())
    # How much faster a cached compile is, a timing, is the benchmark's to print, not this test's to assert.
    printed = capsys.readouterr().out
    assert "wide-c2-t0" in printed
    assert all(re.search(rf"compile {name} +cold +[0-9.]+ ms +cached +[0-9.]+ ms +cold/cached +[0-9]+x", printed)
               for name in structured.SCHEMAS), printed
