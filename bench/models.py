"""Per model family: pyserve's engine against transformers `generate`, at batch 1.

For each family a random checkpoint of one realistic small shape is written
with transformers' own classes (hidden 512, 8 layers, 8 query and 4 KV heads
of 64, intermediate 1408, the embedded model's 49,152-token vocabulary; the
mixtures of experts 16 experts of 352, top 4), then the same prompt runs
through both, float32 on this machine's CPU, in one process:

  ttft     time to the first token of a 256-token prompt
  decode   tokens per second of the next 64 greedy tokens
  MB       the weights held (parameters and buffers), and for an MoE
           family the experts' share of them: what a quantized mode saves

transformers' figures come from `generate` with 1 and with 65 new tokens on
its KV cache (decode = the difference over 64). Each side runs --rounds
times, alternating, and the medians are reported with pyserve / transformers
ratios. The MoE block alone (grouped by expert against a loop) is
bench/moe.py's. In a quantized mode (--modes none,int8wo,8da4w) an MoE
family's experts are quantized too, each run by the mode's kernel.

    python bench/models.py                       # every family
    python bench/models.py --families llama,qwen3_moe --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.tiny_models import ARCHS, build_tiny_model  # noqa: E402

SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
# What differs per family from SHAPE: expert counts, windows wider than
# the tiny tests' (the prompt still crosses them).
FAMILY_SHAPE = {
    "mixtral": dict(num_local_experts=16, num_experts_per_tok=4, intermediate_size=352),
    "qwen2_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=352,
                      shared_expert_intermediate_size=1408, mlp_only_layers=[]),
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=352),
    "gemma2": dict(sliding_window=128),
    "gemma3": dict(sliding_window=128),
    "mistral": dict(sliding_window=128),
}
SKIPPED = {"gemma3-multimodal"}  # the same text model as gemma3


def build(family: str, root: Path) -> Path:
    from pyserve.model.default_model import default_model_path

    return build_tiny_model(root / family, family, tokenizer_dir=default_model_path(),
                            **{**SHAPE, **FAMILY_SHAPE.get(family, {})})


class PyserveSide:
    """The engine, started once; `once` times one request."""

    def __init__(self, model_dir: Path, torchao_config: str):
        from pyserve.engine.engine import Engine
        from pyserve.server_args import ServerArgs

        self.engine = Engine.from_args(ServerArgs(model_path=str(model_dir), device="cpu", dtype="float32",
                                                  torchao_config=torchao_config, max_total_tokens=8192))

    def weight_mb(self) -> tuple[float, float]:
        """(MB of weights the model holds, MB of them in its MoE blocks' experts)."""
        from pyserve.model.layers.moe import MoEBlock

        model = self.engine.runner.rank_model.model
        experts = [getattr(m, name) for m in model.modules() if isinstance(m, MoEBlock)
                   for name in ("w13", "w2", "shared_w13", "shared_w2")]
        return _mb(model), sum(_mb(w) for w in experts if w is not None)

    async def once(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        from pyserve.engine.request import GenerateRequest, SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens + 1, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        first = None
        async for out in self.engine.generate(GenerateRequest(list(prompt), params)):
            if first is None and out.token_ids:
                first = time.perf_counter()
        end = time.perf_counter()
        if out.finish_reason != "length":
            raise RuntimeError(f"the request ended early: {out.finish_reason}")
        return first - start, new_tokens / (end - first)


def _mb(held) -> float:
    if isinstance(held, torch.Tensor):
        return held.nbytes / 1e6
    return sum(t.nbytes for t in [*held.parameters(), *held.buffers()]) / 1e6


class TransformersSide:
    def __init__(self, model_dir: Path):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.generation_config.eos_token_id = None

    def _generate(self, ids: torch.Tensor, new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    def once(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        ids = torch.tensor([prompt])
        ttft = self._generate(ids, 1)
        whole = self._generate(ids, new_tokens + 1)
        return ttft, new_tokens / max(whole - ttft, 1e-9)


async def measure(model_dir: Path, modes: list[str], prompt_len: int, new_tokens: int,
                  rounds: int) -> dict[str, tuple[float, float]]:
    """{side: (median ttft seconds, median decode tok/s, weights MB, experts MB)}: pyserve in each
    --torchao-config mode that serves the model, and "hf"."""
    import random

    rng = random.Random(0)
    prompt = [rng.randrange(100, 49152) for _ in range(prompt_len)]
    ours = {}
    for mode in modes:
        try:
            ours[mode] = PyserveSide(model_dir, mode)
        except ValueError as e:  # a mode the family is refused in
            print(f"  --torchao-config {mode}: {e}".replace(str(model_dir) + ": ", ""), file=sys.stderr)
    runs = {side: [] for side in [*ours, "hf"]}
    theirs = TransformersSide(model_dir)
    for side in ours.values():
        await side.engine.start()
    try:
        for side in ours.values():
            await side.once(prompt[:16], 2)  # warm-up
        theirs.once(prompt[:16], 2)
        for i in range(rounds):
            # a fresh prompt each round, so pyserve's prefix cache serves none of it
            p = [(t + i) % 49152 for t in prompt]
            for mode, side in ours.items():
                runs[mode].append(await side.once(p, new_tokens))
            runs["hf"].append(theirs.once(p, new_tokens))
    finally:
        for side in ours.values():
            await side.engine.shutdown()
    medians = {side: tuple(statistics.median(r[k] for r in rs) for k in (0, 1)) for side, rs in runs.items()}
    return {side: (*m, *(ours[side].weight_mb() if side in ours else (_mb(theirs.model), 0.0)))
            for side, m in medians.items()}


def main(argv=None) -> None:
    transformers_logging.disable_progress_bar()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(a for a in ARCHS if a not in SKIPPED))
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="none,8da4w",
                    help="pyserve's --torchao-config values to run (none: float32 weights, as transformers)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    print(f"batch 1, {args.prompt_len}-token prompt, {args.new_tokens} greedy tokens, CPU, "
          f"{torch.get_num_threads()} threads; medians of {args.rounds} rounds; transformers (hf) in float32; "
          "x: how many times faster than hf; MB: weights held (of which the experts')")
    sides = [*modes, "hf"]
    print(f"{'family':<11}" + "".join(f"{'ttft ms ' + s:>18}" for s in sides)
          + "".join(f"{'tok/s ' + s:>16}" for s in sides) + "".join(f"{'MB ' + s:>16}" for s in modes))
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            model_dir = build(family, Path(tmp))
            m = asyncio.run(measure(model_dir, modes, args.prompt_len, args.new_tokens, args.rounds))
            ttft = "".join(f"{'refused':>18}" if s not in m else f"{m[s][0] * 1e3:>10.1f}"
                           + (f" {m['hf'][0] / m[s][0]:>5.2f}x " if s != "hf" else " " * 8) for s in sides)
            decode = "".join(f"{'refused':>16}" if s not in m else f"{m[s][1]:>8.1f}"
                             + (f" {m[s][1] / m['hf'][1]:>5.2f}x " if s != "hf" else " " * 8) for s in sides)
            memory = "".join(f"{'refused':>16}" if s not in m else f"{m[s][2]:>8.0f}"
                             + (f" ({m[s][3]:.0f})" if m[s][3] else "").rjust(8) for s in modes)
            print(f"{family:<11}{ttft}{decode}{memory}", flush=True)


if __name__ == "__main__":
    main()
