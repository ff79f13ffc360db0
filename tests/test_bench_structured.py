"""Smoke test of bench/structured.py: one short round each way."""

from __future__ import annotations

from bench import structured


def test_structured_benchmark_reports_ratios_and_compile_times(capsys):
    result = structured.main(["--rounds", "1", "--concurrency", "2", "--temperatures", "0"])
    run = result["c2-t0"]
    assert run["tokens_per_round"] > 0 and run["ratio"] > 0 and len(run["ratios"]) == 1
    assert run["constrained_tok_s"] > 0 and run["unconstrained_tok_s"] > 0
    assert set(result["compile_ms"]) == set(structured.SCHEMAS)
    assert all(cold > cached for cold, cached in result["compile_ms"].values())
    printed = capsys.readouterr().out
    assert "c2-t0" in printed and "compile people" in printed
