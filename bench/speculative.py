"""NGRAM speculative decoding: batch-1 decode speed with it on vs off.

Two engines in this process, the same model, one with
--speculative-algorithm NGRAM. Two workloads, greedy: a copy-heavy one
(rewrite a ~300-token text with one change: most of the answer is in the
prompt) and free chat (nothing to copy; the drafter must switch itself
off). Rounds alternate off, on, on, off (ABBA) and each figure is the
median over rounds of decode tokens per second (after the first token),
so the ratio holds on a noisy machine. In float32 both engines give the
same tokens (the script checks it); in the 4-bit mode a verify row runs
the block kernels' extend path, whose rounding differs from the decode
path's, so a near-tie can go the other way: the script reports how many
leading tokens agree.

    python bench/speculative.py                 # embedded model, CPU
    python bench/speculative.py --rounds 6 --max-tokens 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time

TEXT = (
    "The harbour town of Kelmsford wakes early. Before dawn the fishing boats slip out past the breakwater, "
    "their lamps swinging in the swell, and by six the market hall is full of crates of mackerel, crab and "
    "hake. The baker on Quay Street opens at half past six; her rye loaves sell out by eight. Children walk "
    "to the school on the hill, where the bell in the old tower still rings the hours, although it has "
    "been a minute slow since the storm of last winter. In the afternoon the tide goes out and leaves the "
    "mud flats shining, and the wading birds arrive in their hundreds: curlews, redshanks and the odd "
    "heron standing perfectly still. Visitors come for the lighthouse, which is open on weekends from "
    "April to October, and for the museum, whose collection of ship models fills three rooms. In the "
    "evening the pubs along the harbour wall fill with people, the boats come back with the light fading, "
    "and the gulls fight over what the fishermen throw away. On Sundays the town is quiet, and the only "
    "sound is the bell."
)
COPY = f"Rewrite the following text exactly, but change the town's name from Kelmsford to Ashby.\n\n{TEXT}"
CHAT = "Write a short story about a robot who learns to paint."


async def decode_speed(engine, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(decode tokens per second after the first token, the tokens) of one greedy request."""
    from pyserve.engine.request import GenerateRequest, SamplingParams

    tokens, first = [], None
    async for out in engine.generate(GenerateRequest(ids, SamplingParams(max_new_tokens=max_tokens, temperature=0))):
        tokens += out.token_ids
        if first is None and tokens:
            first, first_count = time.perf_counter(), len(tokens)
    return (len(tokens) - first_count) / (time.perf_counter() - first), tokens


async def run(args) -> dict:
    from pyserve.chat_template import ChatTemplate
    from pyserve.engine.engine import Engine
    from pyserve.server_args import ServerArgs

    common = dict(model_path=args.model, device=args.device, max_total_tokens=16384, disable_radix_cache=True,
                  torchao_config=args.torchao_config)
    engines = {"off": Engine.from_args(ServerArgs(**common)),
               "on": Engine.from_args(ServerArgs(**common, speculative_algorithm="NGRAM",
                                                 speculative_num_draft_tokens=args.draft_tokens,
                                                 speculative_ngram_min_match_window_size=args.min_window))}
    for engine in engines.values():
        await engine.start()
    template = ChatTemplate.for_model(engines["off"].model_dir)

    def prompt(text: str) -> list[int]:
        return engines["off"].tokenizer.encode(template.render([{"role": "user", "content": text}],
                                                                add_generation_prompt=True))

    result = {}
    for name, text in (("copy", COPY), ("chat", CHAT)):
        ids = prompt(text)
        speeds = {"off": [], "on": []}
        outputs = {}
        await decode_speed(engines["on"], ids, 8)  # warm-up
        await decode_speed(engines["off"], ids, 8)
        for r in range(args.rounds):
            for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
                speed, tokens = await decode_speed(engines[side], ids, args.max_tokens)
                speeds[side].append(speed)
                outputs[side] = tokens
        same = next((i for i, (a, b) in enumerate(zip(outputs["on"], outputs["off"])) if a != b),
                    min(len(outputs["on"]), len(outputs["off"])))
        if args.torchao_config == "none":
            assert outputs["on"] == outputs["off"], f"{name}: speculation changed the greedy output"
        on, off = statistics.median(speeds["on"]), statistics.median(speeds["off"])
        m = engines["on"].metrics
        result[name] = {"prompt_tokens": len(ids), "output_tokens": len(outputs["on"]),
                        "off_tok_s": round(off, 1), "on_tok_s": round(on, 1), "ratio": round(on / off, 2),
                        "identical_leading_tokens": same}
        result[name]["accept_len_so_far"] = round(m.spec_emitted_tokens / max(m.spec_verify_steps, 1), 2)
    for engine in engines.values():
        await engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--torchao-config", default="auto", help="CPU quantization mode; none = float32")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--draft-tokens", type=int, default=6)
    p.add_argument("--min-window", type=int, default=3, help="--speculative-ngram-min-match-window-size")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    result["machine"] = platform.machine()
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
