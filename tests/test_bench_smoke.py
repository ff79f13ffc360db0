"""Smoke test of bench/serving.py against the session's live server."""

from __future__ import annotations

import asyncio

from bench import serving


def test_serving_benchmark_counts_tokens_and_latencies(server):
    args = serving.parse_args([
        "--base-url", server.base_url, "--num-prompts", "4", "--max-concurrency", "2",
        "--random-input-len", "16", "--random-output-len", "4", "--random-range-ratio", "1",
        "--disable-tqdm",
    ])
    report = asyncio.run(serving.benchmark(args))

    assert report["errors"] == []
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 4 * 4  # ignore_eos: exactly max_tokens each
    assert report["total_input_tokens"] > 0
    records = report["requests"]
    assert len(records) == 4
    assert all(r["ttft"] > 0 and r["e2e"] >= r["ttft"] for r in records)
    assert report["ttft_ms"]["mean"] > 0
    assert "Successful requests:" in serving.format_report(report)
