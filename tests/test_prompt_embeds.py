"""Prompts given as embeddings (--enable-prompt-embeds): vLLM's
`prompt_embeds` on /v1/completions, through the openai client, and
SGLang's `input_embeds` on /generate (and over tensor-parallel ranks). The model reads the vectors in place
of its embedding table's rows (scaled as looked-up ones are), so its greedy
tokens and logprobs are transformers' given the same `inputs_embeds`, for
vectors no token has, across prefill chunks; prompts given as embeddings
come before text prompts; their KV never reaches the prefix cache, where
the placeholder ids it would be filed under would answer a prompt of
those ids. What cannot be served is a 400 naming the field."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import pickle

import pytest
import torch

from pyserve.asgi import create_app
from tests.conftest import ServerProcess
from tests.slow import slow_test
from tests.test_api_handlers import call
from tests.tiny_models import build_tiny_model

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

OPTIONS = {"dtype": "float32", "torchao_config": "none", "max_total_tokens": 4096, "chunked_prefill_size": 4}


def b64(value) -> str:
    """What vLLM's clients send: torch.save's bytes, in base64."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def reference(model, embeds: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after `inputs_embeds`, and each one's logprob."""
    tokens, logprobs, out = [], [], None
    with torch.inference_mode():
        for _ in range(n):
            out = model(inputs_embeds=embeds[None]) if out is None else \
                model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values)
            scores = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            tokens.append(int(scores.argmax()))
            logprobs.append(float(scores.max()))
    return tokens, logprobs


@pytest.fixture(scope="module", params=["llama", "granite"])  # granite scales its embeddings by 12
def model_dir(request, tmp_path_factory, default_model_dir):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, tokenizer_dir=default_model_dir,
                            seed=3)


def test_completions_read_the_vectors_as_transformers_does(model_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    hidden = hf.config.hidden_size
    # No token's row: the server must read the vectors, not ids.
    first, second = torch.randn(9, hidden) * 0.5, torch.randn(3, hidden) * 0.5

    from starlette.testclient import TestClient

    app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path), enable_prompt_embeds=True, **OPTIONS)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        greedy = dict(model="m", max_tokens=6, temperature=0, logprobs=0)
        extra = {"ignore_eos": True, "return_token_ids": True}
        one = client.completions.create(prompt="", **greedy, extra_body={"prompt_embeds": b64(first), **extra})
        mixed = client.completions.create(prompt="Hello there", **greedy,
                                          extra_body={"prompt_embeds": [b64(first), b64(second[None])], **extra})
        text = client.completions.create(prompt="Hello there", **greedy, extra_body=extra)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            prompt="", stream=True, **greedy, extra_body={"prompt_embeds": b64(first), **extra}))
        generated = http.post("/generate", json={
            "input_embeds": [first.tolist(), second.tolist()],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    tokens, logprobs = reference(hf, first, 6)
    assert one.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert one.choices[0].model_extra["token_ids"] == tokens
    assert "prompt_token_ids" not in one.choices[0].model_extra  # its ids are placeholders
    # Embedded prompts first, in order, then the text ones.
    assert [c.index for c in mixed.choices] == [0, 1, 2]
    assert mixed.choices[0].text == one.choices[0].text
    assert mixed.choices[1].model_extra["token_ids"] == reference(hf, second, 6)[0]
    assert mixed.choices[2].text == text.choices[0].text
    assert streamed == one.choices[0].text
    assert generated.status_code == 200, generated.text
    assert [r["output_ids"] for r in generated.json()] == [tokens, reference(hf, second, 6)[0]]


def test_their_kv_is_never_a_cached_prefix_of_placeholder_ids(tmp_path, default_model_dir):
    model_dir = build_tiny_model(tmp_path / "m", "llama", tokenizer_dir=default_model_dir, seed=4)
    embeds = torch.randn(8, 64)
    zeros = {"model": "m", "prompt": [0] * 8, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True}

    async def go():
        app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path), enable_prompt_embeds=True,
                         **{**OPTIONS, "chunked_prefill_size": 2048})
        await app.startup()
        try:
            before = json.loads((await call(app, "POST", "/v1/completions", zeros))[2])
            await call(app, "POST", "/flush_cache")
            answers = [json.loads((await call(app, "POST", "/v1/completions", {
                "model": "m", "prompt_embeds": b64(embeds), "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}))[2]) for _ in range(2)]
            after = json.loads((await call(app, "POST", "/v1/completions", zeros))[2])
            return before, answers, after
        finally:
            await app.shutdown()

    before, answers, after = asyncio.run(go())
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 0]
    assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_what_cannot_be_served_is_a_400_naming_the_field(tmp_path, tiny_llama_dir):
    good = b64(torch.randn(4, 64))
    cases = [  # (body, route, the param named, a phrase of the message)
        ({"prompt_embeds": b64(torch.randn(4, 32))}, "/v1/completions", "prompt_embeds", "hidden size"),
        ({"prompt_embeds": b64(torch.full((4, 64), float("nan")))}, "/v1/completions", "prompt_embeds", "finite"),
        ({"prompt_embeds": b64({"x": torch.zeros(2)})}, "/v1/completions", "prompt_embeds", "not a tensor"),
        ({"prompt_embeds": base64.b64encode(pickle.dumps(os.getcwd)).decode()}, "/v1/completions",
         "prompt_embeds", "torch.save"),
        ({"prompt_embeds": "not base64!"}, "/v1/completions", "prompt_embeds", "base64"),
        ({"prompt_embeds": good, "echo": True}, "/v1/completions", "echo", "embeddings"),
        ({"prompt_embeds": good, "prompt_logprobs": 1}, "/v1/completions", "prompt_embeds", "prompt logprobs"),
        ({}, "/v1/completions", "prompt", "required"),
        ({"text": "hi", "input_embeds": [[0.0] * 64]}, "/generate", "input_embeds", "exactly one"),
        ({"input_embeds": [[0.0] * 64, [0.0] * 3]}, "/generate", "input_embeds", "rows of floats"),
        ({"input_embeds": [[0.0] * 64], "return_logprob": True, "logprob_start_len": 0}, "/generate",
         "input_embeds", "prompt logprobs"),
    ]

    async def go():
        answers = []
        for enabled in (True, False):
            app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path),
                             enable_prompt_embeds=enabled, **OPTIONS)
            await app.startup()
            try:
                if enabled:
                    for body, route, _, _ in cases:
                        answers.append(await call(app, "POST", route, {"model": "m", **body}))
                else:
                    answers.append(await call(app, "POST", "/v1/completions", {"model": "m", "prompt_embeds": good}))
            finally:
                await app.shutdown()
        return answers

    answers = asyncio.run(go())
    for (status, _, raw), (_, route, param, phrase) in zip(answers, cases + [(None, None, "prompt_embeds",
                                                                              "--enable-prompt-embeds")]):
        assert status == 400, raw
        error = json.loads(raw)
        error = error.get("error", error)
        assert error.get("param") == param and phrase in error["message"], (route, param, error)


@slow_test
def test_every_tensor_parallel_rank_reads_the_vectors(tmp_path, default_model_dir):
    import httpx

    model_dir = build_tiny_model(tmp_path / "m", "llama", tokenizer_dir=default_model_dir, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    embeds = torch.randn(7, 64) * 0.5
    server = ServerProcess("--model", str(model_dir), "--tp-size", "2", "--dtype", "float32", "--torchao-config",
                           "none", "--max-total-tokens", "4096", "--enable-prompt-embeds")
    try:
        answer = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": "m", "prompt_embeds": b64(embeds), "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
    finally:
        server.stop()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == reference(hf, embeds, 6)[0]
