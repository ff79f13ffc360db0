"""--stream-interval N (SGLang's): a request's first output goes at once,
then one for every N tokens and the last at its end, with the same tokens,
text, logprobs and stop as one output per token."""

from __future__ import annotations

import asyncio

from pyserve.engine.request import GenerateRequest, SamplingParams
from tests.test_engine import started_engine

PROMPT = [5, 17, 99, 3, 42]


def outputs(model_dir, interval: int, **params) -> list:
    async def main():
        engine = await started_engine(model_dir, stream_interval=interval)
        try:
            req = GenerateRequest(PROMPT, SamplingParams(temperature=0, ignore_eos=True, logprobs=True, **params))
            return [out async for out in engine.generate(req)]
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def joined(outs: list) -> tuple:
    return ("".join(o.text for o in outs), [t for o in outs for t in o.token_ids],
            [lp.logprob for o in outs for lp in o.logprobs], outs[-1].finish_reason, outs[-1].matched_stop)


def test_outputs_come_every_n_tokens_with_the_same_content(tiny_llama_dir):
    every = outputs(tiny_llama_dir, 1, max_new_tokens=11)
    gathered = outputs(tiny_llama_dir, 4, max_new_tokens=11)
    assert [len(o.token_ids) for o in every] == [1] * 11
    assert [len(o.token_ids) for o in gathered] == [1, 4, 4, 2]
    assert joined(gathered) == joined(every)


def test_a_stop_string_inside_held_tokens_ends_the_text_where_it_would(tiny_llama_dir):
    text = joined(outputs(tiny_llama_dir, 1, max_new_tokens=12))[0]
    stop = text[len(text) // 2:][:3]
    assert stop.strip()
    every = outputs(tiny_llama_dir, 1, max_new_tokens=12, stop=[stop])
    gathered = outputs(tiny_llama_dir, 5, max_new_tokens=12, stop=[stop])
    assert joined(gathered) == joined(every) and every[-1].matched_stop == stop
