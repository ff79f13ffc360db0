"""Structured outputs: decode throughput with a JSON-schema constraint vs
the same requests unconstrained, and grammar compile times.

One engine in this process serves both sides. A constrained round runs
its requests to the grammar's end; an unconstrained round runs the same
prompts for as many tokens each as the last constrained round gave them
(EOS ignored), so both sides decode the same tokens in batches of the
same sizes. Rounds alternate (ABBA), and the ratio of throughputs is the
median over rounds, so it holds on a noisy machine. Compile times: each test schema compiled on a fresh backend
(cold) and again (cached).

    python bench/structured.py                  # embedded model, CPU
    python bench/structured.py --device cuda --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time

import torch

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 20},
    "role": {"enum": ["admin", "user", "guest"]},
}, "required": ["name", "age", "city", "role"], "additionalProperties": False}
PEOPLE = {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}
# The schemas whose compile time is reported.
SCHEMAS = {
    "person": PERSON,
    "people": PEOPLE,
    "nested": {"type": "object", "properties": {
        "team": {"type": "string", "maxLength": 30},
        "members": {"type": "array", "items": PERSON, "maxItems": 10},
        "meta": {"type": "object", "properties": {"created": {"type": "string", "format": "date"},
                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["created"]},
    }, "required": ["team", "members", "meta"]},
}
TOPICS = ["a chess club", "a bakery", "a rowing team", "a startup", "a library", "a choir", "a lab", "a farm"]


async def timed_round(engine, prompts: list[list[int]], concurrency: int, params_for) -> tuple[float, list[int]]:
    """(seconds, completion tokens per prompt) with `concurrency` requests in flight."""
    from pyserve.engine.request import GenerateRequest

    tokens = [0] * len(prompts)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            async for out in engine.generate(GenerateRequest(prompts[i], params_for(i))):
                tokens[i] = out.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(len(prompts))])
    return time.perf_counter() - start, tokens


async def decode_ratio(engine, prompts, concurrency: int, temperature: float, rounds: int) -> dict:
    """Constrained and free rounds alternate, ABBA, so a drift in the
    machine's speed weighs on both sides alike."""
    from pyserve.engine.request import Constraint, SamplingParams

    constraint = Constraint("json_schema", json.dumps(PEOPLE))
    lengths: list[int] = []

    async def constrained() -> float:
        nonlocal lengths
        seconds, lengths = await timed_round(engine, prompts, concurrency, lambda i: SamplingParams(
            max_new_tokens=400, temperature=temperature, seed=i, constraint=constraint))
        return sum(lengths) / seconds

    async def free() -> float:
        seconds, tokens = await timed_round(engine, prompts, concurrency, lambda i: SamplingParams(
            max_new_tokens=lengths[i], temperature=temperature, seed=i, ignore_eos=True))
        return sum(tokens) / seconds

    pairs = []
    for r in range(rounds):
        if r % 2 == 0 or not lengths:
            c = await constrained()
            pairs.append((c, await free()))
        else:
            f = await free()
            pairs.append((await constrained(), f))
    ratios = [c / f for c, f in pairs]
    return {"ratio": statistics.median(ratios), "ratios": ratios,
            "constrained_tok_s": statistics.median(c for c, _ in pairs),
            "unconstrained_tok_s": statistics.median(f for _, f in pairs),
            "tokens_per_round": sum(lengths)}


async def compile_times(engine) -> dict[str, tuple[float, float]]:
    """Per schema: (cold ms on a fresh backend, cached ms)."""
    from pyserve.engine.grammar import GrammarBackend
    from pyserve.engine.request import Constraint

    backend = GrammarBackend(engine.grammars.info)
    out = {}
    for name, schema in SCHEMAS.items():
        c = Constraint("json_schema", json.dumps(schema))
        start = time.perf_counter()
        compiled = await backend.compile(c)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        again = await backend.compile(c)
        out[name] = (cold * 1e3, (time.perf_counter() - start) * 1e3)
        if again is not compiled:  # the "cached" time would be another cold one
            raise RuntimeError(f"the second compile of {name} missed the cache")
    backend.shutdown()
    return out


async def run(args) -> dict:
    from pyserve.chat_template import ChatTemplate
    from pyserve.engine.engine import Engine
    from pyserve.engine.request import SamplingParams
    from pyserve.server_args import ServerArgs

    engine = Engine.from_args(ServerArgs(model_path=args.model, device=args.device, max_total_tokens=65536,
                               disable_overlap_schedule=None if args.overlap is None else not args.overlap))
    await engine.start()
    template = ChatTemplate.for_model(engine.model_dir)
    prompts = [engine.tokenizer.encode(template.render(
        [{"role": "user", "content": f"List three members of {topic} as JSON."}], add_generation_prompt=True))
        for topic in TOPICS]
    result = {"compile_ms": await compile_times(engine)}
    await timed_round(engine, prompts[:2], 2, lambda i: SamplingParams(max_new_tokens=8))  # warm-up
    for concurrency in args.concurrency:
        batch = (prompts * 4)[: max(concurrency, 2)]
        for temperature in args.temperatures:
            key = f"c{concurrency}-t{temperature:g}"
            result[key] = await decode_ratio(engine, batch, concurrency, temperature, args.rounds)
    await engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="overlap scheduling (default: the server's, on for CUDA only)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    print(f"machine: {platform.machine()} {torch.get_num_threads()} threads, device {args.device}, "
          f"torch {torch.__version__}")
    print(f"{'run':<12}{'constrained tok/s':>19}{'free tok/s':>12}{'ratio':>8}   per round")
    for key, r in result.items():
        if key != "compile_ms":
            print(f"{key:<12}{r['constrained_tok_s']:>19.1f}{r['unconstrained_tok_s']:>12.1f}{r['ratio']:>8.2f}"
                  f"   {' '.join(f'{x:.2f}' for x in r['ratios'])}")
    for name, (cold, cached) in result["compile_ms"].items():
        print(f"compile {name:<10} cold {cold:8.1f} ms   cached {cached:6.3f} ms   cold/cached {cold / cached:8.0f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
