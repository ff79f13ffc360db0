"""Greedy tokens through the whole Engine (scheduler, KV pool, batched decode
of different lengths, sampler) equal transformers' greedy tokens, float32."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pyserve.engine.engine import Engine
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.server_args import ServerArgs
from tests.tiny_models import build_tiny_model

NEW_TOKENS = 12
PROMPTS = [[5, 17, 99], list(range(100, 141)), [7], [300, 301, 302, 303, 304, 305, 306], [42] * 20]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own decode loop with its KV cache, argmax each step."""
    out, ids = None, torch.tensor([prompt])
    tokens = []
    with torch.inference_mode():
        for _ in range(n):
            out = model(ids, past_key_values=out.past_key_values if out else None, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


async def engine_greedy(model_dir, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = Engine.from_args(ServerArgs(model_path=str(model_dir), max_total_tokens=2048))
    await engine.start()

    async def one(prompt):
        params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        return [t async for out in engine.generate(GenerateRequest(prompt, params)) for t in out.token_ids]

    try:
        return await asyncio.gather(*[one(p) for p in prompts])  # all in one batch
    finally:
        assert engine.integrity_problem() is None
        await engine.shutdown()


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory, default_model_dir):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", tokenizer_dir=default_model_dir)


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_engine_greedy_matches_transformers(model, request):
    model_dir = request.getfixturevalue(model)
    import transformers

    got = asyncio.run(engine_greedy(model_dir, PROMPTS, NEW_TOKENS))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert got == expected
