"""The sampler's time per step, this tree's against another revision's, in one run.

A decode step of the embedded model samples a [batch, 49,152] logits
tensor. This times `Sampler.sample` on such a batch, each row with its own
penalties, logit bias and temperature, and greedy rows with nothing to
adjust as the floor. The other revision's sampler.py is loaded from git
into this process (its imports resolve to this tree), and the two are
timed alternately, so both see the same machine.

    python bench/sampler.py --base main --batch 8
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from pyserve.engine import sampler as this_sampler  # noqa: E402
from pyserve.engine.request import SamplingParams  # noqa: E402
from pyserve.engine.sampling_state import SamplingState  # noqa: E402
from pyserve.engine.sequence import Sequence  # noqa: E402


def sampler_at(revision: str):
    """pyserve/engine/sampler.py as it is at `revision`, as a module."""
    source = subprocess.run(["git", "show", f"{revision}:pyserve/engine/sampler.py"], cwd=HERE, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampler_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch(size: int, prompt_len: int, output_len: int, penalties: bool) -> list[SamplingState]:
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(size):
        params = SamplingParams(temperature=0.7, seed=i) if penalties else SamplingParams(temperature=0)
        if penalties:
            params.repetition_penalty, params.frequency_penalty, params.presence_penalty = 1.1, 0.5, 0.3
            params.logit_bias = {17: 2.0, 4242: -5.0}
        seq = Sequence(rid=str(i), prompt_ids=torch.randint(0, 49152, (prompt_len,), generator=gen).tolist(),
                       params=params, output_ids=torch.randint(0, 49152, (output_len,), generator=gen).tolist())
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seqs.append(SamplingState(seq, generator))
    return seqs


def time_sample(module, logits: torch.Tensor, seqs: list[SamplingState], repeats: int) -> float:
    sampler = module.Sampler(0)
    sampler.sample(logits, seqs)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler.sample(logits, seqs)
        times.append(time.perf_counter() - start)
    # The fastest call: on a shared machine, the one least disturbed.
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="main", help="the git revision whose sampler is the baseline")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = sampler_at(args.base)
    logits = torch.randn(args.batch, 49152, generator=torch.Generator().manual_seed(1))
    cases = {"penalties + bias, drawn": batch(args.batch, args.prompt_len, args.output_len, True),
             "greedy, nothing to adjust": batch(args.batch, args.prompt_len, args.output_len, False)}
    print(f"batch {args.batch}, vocabulary 49,152, prompts {args.prompt_len} + outputs {args.output_len} tokens; "
          f"ms per sample(), the median over {args.rounds} alternating rounds of each round's fastest "
          f"of {args.repeats} calls")
    for name, seqs in cases.items():
        runs = {"base": [], "this tree": []}
        for _ in range(args.rounds):
            runs["base"].append(time_sample(base, logits, seqs, args.repeats))
            runs["this tree"].append(time_sample(this_sampler, logits, seqs, args.repeats))
        old, new = (statistics.median(runs[k]) for k in ("base", "this tree"))
        print(f"{name:<28} {args.base}: {old:8.2f} ms   this tree: {new:8.2f} ms   {old / new:6.1f}x")


if __name__ == "__main__":
    main()
