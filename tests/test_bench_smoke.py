"""Smoke tests of the benchmarks: bench/serving.py against the session's
live server, bench/baseline_hf.py and bench/compare.py on a tiny model."""

from __future__ import annotations

import asyncio

from bench import baseline_hf, compare, serving
from tests.slow import slow_test

# 2 prompts of exactly 8 words (8 tokens with the embedded model's tokenizer,
# which adds no BOS) and 4 output tokens each
TINY = ["--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
        "--random-range-ratio", "1"]


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


def test_baseline_hf_generates_the_asked_tokens(tiny_llama_dir, tmp_path):
    out = tmp_path / "hf.json"
    report = baseline_hf.main(["--model", str(tiny_llama_dir), "--device", "cpu", "--batch-size", "2",
                               "--output-json", str(out), *TINY])

    assert report["completed"] == 2
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in report["requests"]] == [(8, 4), (8, 4)]
    assert report["total_output_tokens"] == 8
    assert report["output_throughput"] > 0 and report["request_throughput"] > 0
    assert report["e2e_latency_ms"]["mean"] > 0
    assert out.read_text().count('"prompt_tokens"') == 2


@slow_test  # four runs; one pair: the test below
def test_compare_rounds_alternate_on_new_prompts(tiny_llama_dir, capsys):
    """--rounds 2: two pairs of runs, each round's ratio and the medians'."""
    result = compare.main(["--model", str(tiny_llama_dir), "--device", "cpu", "--max-concurrency", "2",
                           "--disable-tqdm", "--rounds", "2", *TINY])
    assert len(result["ratios"]) == 2 and all(r > 0 for r in result["ratios"])
    printed = capsys.readouterr()
    assert "2 rounds (the table is round 1's)" in printed.out and f"{result['median_ratio']:.2f}x" in printed.out
    assert printed.err.count("out tok/s,") == 2


def test_compare_prints_both_rows_and_ratios(tiny_llama_dir, tmp_path, capsys):
    result = compare.main(["--model", str(tiny_llama_dir), "--device", "cpu", "--max-concurrency", "2",
                           "--disable-tqdm", "--output-json", str(tmp_path / "cmp.json"), *TINY])

    ours, hf = result["pyserve"], result["transformers"]
    assert ours["errors"] == [] and ours["completed"] == 2
    assert hf["batch_size"] == 2  # follows --max-concurrency
    # the same prompts on both sides, and exactly the asked output tokens
    assert ours["total_input_tokens"] == hf["total_input_tokens"] == 16
    assert ours["total_output_tokens"] == hf["total_output_tokens"] == 8
    printed = capsys.readouterr().out
    assert result["table"] in printed
    header, pyserve_row, hf_row, ratio_row = result["table"].splitlines()
    assert "out tok/s" in header and "median TTFT ms" in header
    assert pyserve_row.split()[:3] == ["pyserve", "16", "8"]
    assert hf_row.split()[:3] == ["transformers", "16", "8"]
    assert ratio_row.startswith("pyserve/transformers") and ratio_row.count("x") == 3
