"""Structured outputs: decode throughput with a JSON-schema constraint vs
the same requests unconstrained, with jump-forward on and off, and grammar
compile times.

Two engines live in this process, one with jump-forward (the default) and
one with --disable-jump-forward. A constrained round runs its requests to
the grammar's end; an unconstrained round runs the same prompts on the
jump-forward engine for as many tokens each as its last constrained round
gave them (EOS ignored), so both sides decode the same number of tokens.
The three sides run in turn, the order reversed every other round (ABC
CBA), and each ratio of throughputs is the median over rounds, so it holds
on a noisy machine. Jump-forward writes the same JSON in fewer tokens (the
tokenizer's own encoding of the keys), so on vs off is also given in
output characters per second. Schemas: "people" (three records of four
keys) and "wide" (one record of twelve keys: mostly forced text). Compile
times: each test schema compiled on a fresh backend (cold) and again
(cached).

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
WIDE = {"type": "object", "properties": {
    **{key: {"type": "string", "maxLength": 16} for key in (
        "first_name", "last_name", "email_address", "phone_number", "street_address", "city", "postal_code",
        "country", "occupation", "employer")},
    "years_of_experience": {"type": "integer", "minimum": 0, "maximum": 60},
    "preferred_contact_method": {"enum": ["email", "phone", "post"]},
}, "additionalProperties": False}
WIDE["required"] = list(WIDE["properties"])
# The schemas decoded, with the prompt each is asked with.
DECODED = {"people": (PEOPLE, "List three members of {} as JSON."),
           "wide": (WIDE, "Give me the contact record of a member of {} as JSON.")}
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


async def timed_round(engine, prompts: list[list[int]], concurrency: int, params_for
                      ) -> tuple[float, list[int], int]:
    """(seconds, completion tokens per prompt, characters in all) with
    `concurrency` requests in flight."""
    from pyserve.engine.request import GenerateRequest

    tokens = [0] * len(prompts)
    chars = 0
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        nonlocal chars
        async with gate:
            async for out in engine.generate(GenerateRequest(prompts[i], params_for(i))):
                tokens[i] = out.completion_tokens
                chars += len(out.text)

    start = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(len(prompts))])
    return time.perf_counter() - start, tokens, chars


async def decode_ratios(jumping, plain, schema: dict, prompts, concurrency: int, temperature: float,
                        rounds: int) -> dict:
    """Constrained rounds on `jumping` (jump-forward on) and `plain` (off)
    and free rounds on `jumping`, in turn, ABC then CBA, so a drift in the
    machine's speed weighs on every side alike."""
    from pyserve.engine.request import Constraint, SamplingParams

    constraint = Constraint("json_schema", json.dumps(schema))
    lengths: list[int] = []

    def constrained(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=600, temperature=temperature, seed=i, constraint=constraint)

    async def on() -> tuple[float, float]:
        nonlocal lengths
        seconds, lengths, chars = await timed_round(jumping, prompts, concurrency, constrained)
        return sum(lengths) / seconds, chars / seconds

    async def off() -> tuple[float, float]:
        seconds, tokens, chars = await timed_round(plain, prompts, concurrency, constrained)
        return sum(tokens) / seconds, chars / seconds

    async def free() -> tuple[float, float]:
        seconds, tokens, chars = await timed_round(jumping, prompts, concurrency, lambda i: SamplingParams(
            max_new_tokens=lengths[i], temperature=temperature, seed=i, ignore_eos=True))
        return sum(tokens) / seconds, chars / seconds

    sides = {"on": on, "off": off, "free": free}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in ("on", "off", "free") if r % 2 == 0 else ("free", "off", "on"):
            runs[name].append(await sides[name]())
    tok_s = {name: [t for t, _ in r] for name, r in runs.items()}
    chars_s = {name: [c for _, c in r] for name, r in runs.items()}
    return {
        "ratio": statistics.median(a / b for a, b in zip(tok_s["on"], tok_s["free"])),
        "ratios": [a / b for a, b in zip(tok_s["on"], tok_s["free"])],
        "off_ratio": statistics.median(a / b for a, b in zip(tok_s["off"], tok_s["free"])),
        "on_vs_off_chars": statistics.median(a / b for a, b in zip(chars_s["on"], chars_s["off"])),
        "constrained_tok_s": statistics.median(tok_s["on"]),
        "off_tok_s": statistics.median(tok_s["off"]),
        "unconstrained_tok_s": statistics.median(tok_s["free"]),
        "tokens_per_round": sum(lengths),
    }


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

    engines = [Engine.from_args(ServerArgs(
        model_path=args.model, device=args.device, max_total_tokens=16384, disable_jump_forward=off,
        disable_overlap_schedule=None if args.overlap is None else not args.overlap)) for off in (False, True)]
    for engine in engines:
        await engine.start()
    jumping, plain = engines
    template = ChatTemplate.for_model(jumping.model_dir)
    result = {"compile_ms": await compile_times(jumping)}
    hello = [jumping.tokenizer.encode("Hello")] * 2
    for engine in engines:  # warm-up
        await timed_round(engine, hello, 2, lambda i: SamplingParams(max_new_tokens=8))
    for name in args.schemas:
        schema, ask = DECODED[name]
        prompts = [jumping.tokenizer.encode(template.render([{"role": "user", "content": ask.format(topic)}]))
                   for topic in TOPICS]
        for concurrency in args.concurrency:
            batch = (prompts * 4)[: max(concurrency, 2)]
            for temperature in args.temperatures:
                key = f"{name}-c{concurrency}-t{temperature:g}"
                result[key] = await decode_ratios(jumping, plain, schema, batch, concurrency, temperature,
                                                  args.rounds)
    for engine in engines:
        await engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--schemas", nargs="+", choices=list(DECODED), default=list(DECODED))
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="overlap scheduling (default: the server's, on for CUDA only)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    print(f"machine: {platform.machine()} {torch.get_num_threads()} threads, device {args.device}, "
          f"torch {torch.__version__}")
    print("constrained: jump-forward on; off: --disable-jump-forward; ratios are medians of per-round ratios")
    print(f"{'run':<18}{'constrained tok/s':>19}{'off tok/s':>11}{'free tok/s':>12}{'on/free':>9}{'off/free':>10}"
          f"{'on/off chars/s':>16}   on/free per round")
    for key, r in result.items():
        if key != "compile_ms":
            print(f"{key:<18}{r['constrained_tok_s']:>19.1f}{r['off_tok_s']:>11.1f}{r['unconstrained_tok_s']:>12.1f}"
                  f"{r['ratio']:>9.2f}{r['off_ratio']:>10.2f}{r['on_vs_off_chars']:>16.2f}"
                  f"   {' '.join(f'{x:.2f}' for x in r['ratios'])}")
    for name, (cold, cached) in result["compile_ms"].items():
        print(f"compile {name:<10} cold {cold:8.1f} ms   cached {cached:6.3f} ms   cold/cached {cold / cached:8.0f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
