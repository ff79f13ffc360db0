"""Prompts longer than the context: refused by default; cut to their last
k tokens by vLLM's per-request truncate_prompt_tokens (completions, chat,
embeddings); cut to their first context - 1 tokens, with max_tokens
lowered to the room left, by SGLang's --allow-auto-truncate. A cut prompt
answers as the same tokens sent whole do."""

from __future__ import annotations

import asyncio
import json

import pytest

from pyserve.asgi import create_app
from tests.test_api_handlers import call
from tests.tiny_models import build_tiny_embedding_model

CONTEXT = 64
LONG = [(7 * i) % 400 + 20 for i in range(100)]  # 100 token ids, more than the context holds
GREEDY = {"model": "m", "max_tokens": 6, "temperature": 0, "return_token_ids": True}


def _run(model_dir, tmp_path, requests: list[tuple[str, dict]], **options) -> list[tuple[int, dict]]:
    async def go():
        app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path), context_length=CONTEXT,
                         max_total_tokens=1024, **options)
        await app.startup()
        try:
            out = []
            for path, body in requests:
                status, _, raw = await call(app, "POST", path, body)
                out.append((status, json.loads(raw)))
            return out
        finally:
            await app.shutdown()

    return asyncio.run(go())


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_llama_dir, tmp_path):
    messages = [{"role": "user", "content": "word " * 80}]
    (whole, refused), (s1, cut), (s2, same), (s3, chat), (s4, too_many), (s5, zero) = _run(
        tiny_llama_dir, tmp_path, [
            ("/v1/completions", {**GREEDY, "prompt": LONG}),
            ("/v1/completions", {**GREEDY, "prompt": LONG, "truncate_prompt_tokens": 20}),
            ("/v1/completions", {**GREEDY, "prompt": LONG[-20:]}),
            ("/v1/chat/completions", {**GREEDY, "messages": messages, "truncate_prompt_tokens": 30}),
            ("/v1/completions", {**GREEDY, "prompt": LONG, "truncate_prompt_tokens": CONTEXT + 1}),
            ("/v1/completions", {**GREEDY, "prompt": LONG, "truncate_prompt_tokens": 0}),
        ])
    assert (whole, refused["error"]["code"]) == (400, "context_length_exceeded")
    assert (s1, s2) == (200, 200)
    assert cut["choices"][0]["prompt_token_ids"] == LONG[-20:]
    assert cut["choices"][0]["token_ids"] == same["choices"][0]["token_ids"]
    assert cut["usage"]["prompt_tokens"] == 20
    assert (s3, chat["usage"]["prompt_tokens"]) == (200, 30)
    assert (s4, too_many["error"]["param"]) == (400, "truncate_prompt_tokens")
    assert "greater than max_model_len (64)" in too_many["error"]["message"]
    assert (s5, zero["error"]["param"]) == (400, "truncate_prompt_tokens")


def test_allow_auto_truncate_keeps_the_first_tokens_and_lowers_max_tokens(tiny_llama_dir, tmp_path):
    fifty = LONG[:50]
    (s1, cut), (s2, same), (s3, lowered) = _run(tiny_llama_dir, tmp_path, [
        ("/v1/completions", {**GREEDY, "prompt": LONG}),
        ("/v1/completions", {**GREEDY, "prompt": LONG[:CONTEXT - 1], "max_tokens": 1}),
        ("/v1/completions", {**GREEDY, "prompt": fifty, "max_tokens": 30, "ignore_eos": True, "min_tokens": 20}),
    ], allow_auto_truncate=True)
    assert (s1, s2, s3) == (200, 200, 200), cut
    choice = cut["choices"][0]
    assert choice["prompt_token_ids"] == LONG[:CONTEXT - 1]
    assert choice["token_ids"] == same["choices"][0]["token_ids"]  # room for one token
    assert choice["finish_reason"] == "length"
    assert len(lowered["choices"][0]["token_ids"]) == CONTEXT - 50  # max_tokens (and min_tokens) cut to the room


def test_embeddings_truncate_as_generation_does(default_model_dir, tmp_path):
    model_dir = build_tiny_embedding_model(tmp_path / "embedder", default_model_dir)
    body = {"model": "m", "input": [LONG]}
    (s0, refused), (s1, cut), (s2, same) = _run(model_dir, tmp_path, [
        ("/v1/embeddings", body),
        ("/v1/embeddings", {**body, "truncate_prompt_tokens": 10}),
        ("/v1/embeddings", {**body, "input": [LONG[-10:]]}),
    ], is_embedding=True)
    assert (s0, refused["error"]["param"]) == (400, "input")
    assert (s1, s2) == (200, 200)
    assert cut["data"][0]["embedding"] == pytest.approx(same["data"][0]["embedding"], abs=1e-5)
    assert cut["usage"]["prompt_tokens"] == 10
    (s3, auto), (s4, first) = _run(model_dir, tmp_path, [
        ("/v1/embeddings", body), ("/v1/embeddings", {**body, "input": [LONG[:CONTEXT - 1]]})],
        is_embedding=True, allow_auto_truncate=True)
    assert (s3, s4) == (200, 200)
    assert auto["data"][0]["embedding"] == pytest.approx(first["data"][0]["embedding"], abs=1e-5)
