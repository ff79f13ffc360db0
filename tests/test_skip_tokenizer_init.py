"""--skip-tokenizer-init (SGLang's): no tokenizer is loaded, so a model
directory without one is served; /generate takes input_ids and answers
output_ids, transformers' greedy tokens; what needs text (the text routes,
text prompts, stop strings, constraints) is refused with a 400 that says
what to send instead."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from pyserve.asgi import create_app
from pyserve.server_args import ServerArgs
from tests.test_api_handlers import call
from tests.test_engine_vs_hf import hf_greedy
from tests.tiny_models import build_tiny_model

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 99, 300, 301]


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """A tiny Llama with no tokenizer files at all."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("bare"), "llama")
    assert not (model_dir / "tokenizer.json").exists()
    return model_dir


def _calls(model_dir, tmp_path, requests: list[tuple[str, str, dict | None]]) -> list[tuple[int, object]]:
    async def go():
        app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path), skip_tokenizer_init=True,
                         max_total_tokens=1024, dtype="float32")
        await app.startup()
        try:
            out = []
            for method, path, body in requests:
                status, _, raw = await call(app, method, path, body)
                text = raw.decode()
                events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
                out.append((status, events or json.loads(text or "null")))
            return out
        finally:
            await app.shutdown()

    return asyncio.run(go())


def test_token_ids_in_token_ids_out(bare_model, tmp_path):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    (s1, whole), (s2, events), (s3, batch), (s4, _) = _calls(bare_model, tmp_path, [
        ("POST", "/generate", body), ("POST", "/generate", {**body, "stream": True}),
        ("POST", "/generate", {**body, "input_ids": [PROMPT, PROMPT[:3]]}), ("GET", "/health_generate", None)])
    assert (s1, s2, s3, s4) == (200, 200, 200, 200)
    reference = transformers.AutoModelForCausalLM.from_pretrained(bare_model, torch_dtype=torch.float32)
    assert whole["output_ids"] == hf_greedy(reference, PROMPT, 8) and "text" not in whole
    assert whole["meta_info"]["completion_tokens"] == 8
    assert events[-1]["output_ids"] == whole["output_ids"] and "text" not in events[-1]
    assert [b["output_ids"] for b in batch] == [whole["output_ids"], hf_greedy(reference, PROMPT[:3], 8)]


def test_what_needs_text_is_refused(bare_model, tmp_path):
    ids = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
    results = _calls(bare_model, tmp_path, [
        ("POST", "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}}),
        ("POST", "/generate", {**ids, "sampling_params": {"max_new_tokens": 4, "stop": ["x"]}}),
        ("POST", "/generate", {**ids, "sampling_params": {"max_new_tokens": 4, "regex": "a+"}}),
        ("POST", "/generate", {**ids, "return_logprob": True, "return_text_in_logprobs": True}),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1/completions", {"model": "m", "prompt": PROMPT}),
        ("POST", "/tokenize", {"prompt": "hi"}),
    ])
    params = [body["error"]["param"] for _, body in results]
    assert [status for status, _ in results] == [400] * 7
    assert params[:4] == ["text", "sampling_params.stop", "sampling_params.regex", "return_text_in_logprobs"]
    assert all("--skip-tokenizer-init" in body["error"]["message"] for _, body in results)


def test_options_that_need_text_are_refused_at_start():
    with pytest.raises(ValueError, match="--tool-call-parser: needs the tokenizer"):
        ServerArgs(skip_tokenizer_init=True, tool_call_parser="qwen25").validate()
