"""The engine benchmark on two revisions of pyserve, alternating, in one run.

A refactor must not slow the engine down; on a shared, noisy machine only
runs taken side by side say so. This checks REV out into a temporary git
worktree (its Rust extension is taken from this tree, so REV must have the
same `rust/`), then runs `bench/engine_throughput.py` in REV and in this
tree in turn, `--rounds` times each, and prints every run and the medians.

    python bench/ab_revisions.py --base e3687ba --rounds 3
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
_LINE = re.compile(r"^(pyserve engine|transformers generate)\s+([\d.]+)\s+([\d.]+)", re.M)


def run_in(tree: Path, extra: list[str]) -> dict[str, float]:
    """Output tok/s of the engine and of transformers, from one run in `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "bench/engine_throughput.py", *extra], cwd=tree, env=env,
                         capture_output=True, text=True, check=True).stdout
    return {name: float(tok_s) for name, _, tok_s in _LINE.findall(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    args, extra = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=HERE, check=True,
                       capture_output=True)
        try:
            for so in (HERE / "pyserve").glob("_rust*.so"):
                shutil.copy(so, base / "pyserve")
            runs = {"base": [], "this tree": []}
            for i in range(args.rounds):
                for label, tree in (("base", base), ("this tree", HERE)):
                    result = run_in(tree, extra)
                    runs[label].append(result)
                    print(f"round {i + 1} {label:<10} engine {result['pyserve engine']:8.1f} tok/s   "
                          f"transformers {result['transformers generate']:8.1f} tok/s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=HERE, check=True)
    for label, results in runs.items():
        engine = statistics.median(r["pyserve engine"] for r in results)
        ratio = statistics.median(r["pyserve engine"] / r["transformers generate"] for r in results)
        print(f"median {label:<10} engine {engine:8.1f} tok/s, {ratio:.2f}x transformers")


if __name__ == "__main__":
    main()
