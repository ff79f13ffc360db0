"""Baseline: bench/serving.py's prompts through transformers `generate`.

The dataset comes from serving.py's own code (same options, same seed, so
the same prompts and output lengths), and each prompt is encoded into the
token ids pyserve's /v1/completions would compute for it. The model is
loaded from the same directory onto the same device and dtype. Greedy, EOS
ignored (min_new_tokens = max_new_tokens), batches of --batch-size prompts
with left padding, one batch after another; every request of a batch runs
to the batch's longest output, but only its own output length is counted.

    python bench/baseline_hf.py --num-prompts 16 --random-input-len 128 \\
        --random-output-len 32 --random-range-ratio 1 --batch-size 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import serving  # noqa: E402


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model and placement, as pyserve's own --model/--device/--dtype."""
    p.add_argument("--model", dest="model_dir", default=None,
                   help="Hugging Face model directory (default: pyserve's embedded model)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when available, else cpu (as pyserve)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: float32 on CPU, bfloat16 on CUDA (as pyserve)")


def model_dir(args) -> Path:
    if args.model_dir:
        return Path(args.model_dir)
    from pyserve.model.default_model import default_model_path

    return default_model_path()


def prompt_ids(directory: Path, requests: list[serving.Request]) -> list[list[int]]:
    """The ids pyserve runs for these text prompts: its own tokenizer, with
    special tokens, as /v1/completions encodes a text prompt."""
    from pyserve._rust import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return tok.encode_batch([r.prompt for r in requests], add_special_tokens=True)


def left_padded(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    # left padding puts every row's last prompt token in the last column,
    # where generate appends the next one
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def run(args) -> dict:
    """Generate the whole dataset; returns the metrics plus one record per
    request under "requests". A request's latency is the time of the
    `generate` call of its batch."""
    import transformers
    from pyserve.engine.runner.rank_model import usable_cpus
    from pyserve.server_args import ServerArgs

    # text prompts, as serving.py sends them to /v1/completions (no chat template)
    requests = serving.build_dataset(argparse.Namespace(**vars(args) | {"backend": "completions"}))
    directory = model_dir(args)
    ids = prompt_ids(directory, requests)
    resolved = ServerArgs(device=args.device, dtype=args.dtype).resolved()  # "auto" as the server reads it
    device, dtype = torch.device(resolved.device), getattr(torch, resolved.dtype)
    if device.type == "cpu":
        torch.set_num_threads(usable_cpus())  # the thread count pyserve's server uses
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device)
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else pad  # masked out anyway

    def generate(rows: list[list[int]], new_tokens: int) -> int:
        """Generates for one batch; returns how many tokens it added per row."""
        input_ids, mask = left_padded(rows, pad, device)
        out = model.generate(input_ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        return out.shape[1] - input_ids.shape[1]

    records = []
    with torch.inference_mode():
        generate(ids[:1], 2)  # warm-up, not counted, as serving.py's
        t0 = time.perf_counter()
        for i in range(0, len(requests), args.batch_size):
            batch = range(i, min(i + args.batch_size, len(requests)))
            start = time.perf_counter()
            added = generate([ids[j] for j in batch], max(requests[j].output_len for j in batch))
            latency = time.perf_counter() - start
            records += [{"index": j, "max_tokens": requests[j].output_len, "prompt_tokens": len(ids[j]),
                         "output_tokens": min(added, requests[j].output_len), "e2e": latency}
                        for j in batch]
        duration = time.perf_counter() - t0

    output_tokens = sum(r["output_tokens"] for r in records)
    return {
        "backend": "transformers",
        "model": str(directory),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "batch_size": args.batch_size,
        "completed": len(records),
        "duration": duration,
        "total_input_tokens": sum(r["prompt_tokens"] for r in records),
        "total_output_tokens": output_tokens,
        "request_throughput": len(records) / duration,
        "output_throughput": output_tokens / duration,
        "e2e_latency_ms": serving.percentiles([r["e2e"] for r in records]),
        "requests": records,
    }


def format_report(m: dict) -> str:
    row = serving.row
    return "\n".join([
        f"{' transformers generate Baseline ':=^50}",
        row("Device, dtype:", f"{m['device']}, {m['dtype']}"),
        row("Batch size:", m["batch_size"]),
        row("Successful requests:", m["completed"]),
        row("Benchmark duration (s):", m["duration"]),
        row("Total input tokens:", m["total_input_tokens"]),
        row("Total generated tokens:", m["total_output_tokens"]),
        row("Request throughput (req/s):", m["request_throughput"]),
        row("Output token throughput (tok/s):", m["output_throughput"]),
        row("Mean E2E Latency (ms):", m["e2e_latency_ms"]["mean"]),
        "=" * 50,
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    serving.add_dataset_args(p)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    p.add_argument("--output-json", help="write metrics and per-request records here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    print(format_report(report))
    serving.save_json(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
