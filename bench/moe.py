"""One MoE block's forward time on CPU: pyserve's grouped path against the
alternatives, in one run.

The shape is Qwen3-30B-A3B's layer scaled down (hidden 2048, 128 experts,
top 8, 768 per expert; the real model has hidden 2048 too), float32 as
pyserve runs on CPU. Timed for each token count:

  grouped     MoEBlock: assignments sorted by expert, one matmul pair per
              expert that received tokens (pyserve's CPU path)
  token_loop  a Python loop over tokens and their k experts, one
              matrix-vector pair each
  gathered    each assignment's expert weights gathered, one batched matmul
              (a candidate for few tokens; it copies k experts per token, so
              it only runs up to --gathered-max tokens)
  hf_eager    transformers' Qwen3MoeSparseMoeBlock, its loop over the experts hit
  hf_grouped  the same with experts_implementation="grouped_mm", the
              default of models made by from_config / from_pretrained

transformers' module shares pyserve's weight tensors (same layout), and
every variant's output is checked against the grouped path's.

    python bench/moe.py --tokens 1,8,64,512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyserve.model.layers.moe import MoEBlock, MoESpec, activate, route  # noqa: E402


def token_loop(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    spec = block.spec
    weights, ids = route(spec, F.linear(x, block.router_weight))
    out = torch.zeros_like(x)
    half = block.w13.shape[1] // 2
    for t, (row_weights, row_ids) in enumerate(zip(weights.tolist(), ids.tolist())):
        for w, e in zip(row_weights, row_ids):
            h = F.linear(x[t], block.w13[e])
            out[t] += w * F.linear(activate(spec, h[:half], h[half:]), block.w2[e])
    return out


def gathered(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    spec = block.spec
    weights, ids = route(spec, F.linear(x, block.router_weight))
    flat = ids.flatten()
    rows = x.repeat_interleave(spec.top_k, dim=0)[:, :, None]
    h = torch.bmm(block.w13[flat], rows)[:, :, 0]
    half = h.shape[1] // 2
    y = torch.bmm(block.w2[flat], activate(spec, h[:, :half], h[:, half:])[:, :, None])[:, :, 0]
    return (y.view(*ids.shape, -1) * weights[:, :, None]).sum(dim=1)


def hf_block(block: MoEBlock, implementation: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    spec = block.spec
    config = Qwen3MoeConfig(hidden_size=spec.hidden, num_experts=spec.num_experts,
                            num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.intermediate,
                            norm_topk_prob=spec.norm_topk_prob)
    config._experts_implementation = implementation
    with torch.device("meta"):
        hf = Qwen3MoeSparseMoeBlock(config)
    hf.experts.gate_up_proj = torch.nn.Parameter(block.w13, requires_grad=False)
    hf.experts.down_proj = torch.nn.Parameter(block.w2, requires_grad=False)
    hf.gate.weight = torch.nn.Parameter(block.router_weight, requires_grad=False)
    return lambda x: hf(x[None])[0]


def median_seconds(variants: dict, x: torch.Tensor, min_time: float, max_rounds: int) -> dict[str, float]:
    """Median seconds per call of each variant, timed in alternating rounds
    (one call of each per round) so that all see the same load on a shared
    machine; one warm-up round first."""
    runs = {name: [] for name in variants}
    start, rounds = time.perf_counter(), 0
    while rounds <= max_rounds and (rounds < 2 or time.perf_counter() - start < min_time):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn(x)
            if rounds:
                runs[name].append(time.perf_counter() - t)
        rounds += 1
    return {name: statistics.median(r) for name, r in runs.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--gathered-max", type=int, default=8)
    parser.add_argument("--token-loop-max", type=int, default=64)
    parser.add_argument("--min-time", type=float, default=3.0, help="seconds of timed rounds per row, at least")
    parser.add_argument("--max-rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    spec = MoESpec(num_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                   intermediate=args.intermediate, weights_float32=False)
    block = MoEBlock(spec)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    variants = {"grouped": block, "token_loop": lambda x: token_loop(block, x),
                "gathered": lambda x: gathered(block, x)}
    try:
        variants["hf_eager"] = hf_block(block, "eager")
        variants["hf_grouped"] = hf_block(block, "grouped_mm")
    except ImportError:
        print("transformers is not installed: no hf_* columns")
    skip = {"gathered": args.gathered_max, "token_loop": args.token_loop_max}

    print(f"MoE block, hidden {args.hidden}, {args.experts} experts, top {args.top_k}, "
          f"intermediate {args.intermediate}, float32, {torch.get_num_threads()} threads; ms per forward")
    header = " ".join(f"{name:>11}" for name in variants)
    print(f"{'tokens':>6} {header}   x grouped faster than token_loop / hf_eager")
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden)
            reference = block(x)
            here = {name: fn for name, fn in variants.items() if tokens <= skip.get(name, tokens)}
            for fn in here.values():
                torch.testing.assert_close(fn(x), reference, atol=1e-4, rtol=1e-3)
            times = median_seconds(here, x, args.min_time, args.max_rounds)
            cells = " ".join(f"{times[n] * 1e3:>11.2f}" if n in times else f"{'-':>11}" for n in variants)
            ratios = " / ".join(f"{times[n] / times['grouped']:.2f}" if n in times else "-"
                                for n in ("token_loop", "hf_eager"))
            print(f"{tokens:>6} {cells}   {ratios}", flush=True)


if __name__ == "__main__":
    main()
