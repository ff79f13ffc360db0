"""/v1/completions' `suffix`: a code model's fill-in-the-middle prompt
(--completion-template), found in the tokenizer's vocabulary, runs the
text before and after the gap through the model's markers and answers
with the middle, as transformers' greedy decoding of that prompt does."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from pyserve.asgi import create_app
from tests.test_api_handlers import call
from tests.test_engine_vs_hf import hf_greedy
from tests.tiny_models import build_tiny_model

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

QWEN_MARKERS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
BEFORE = "def add(a, b):\n    "
AFTER = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def coder_model(tmp_path_factory, default_model_dir):
    """A tiny Qwen2 whose tokenizer holds Qwen2.5-Coder's three markers."""
    tok_dir = tmp_path_factory.mktemp("coder-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, tok_dir / name)
    tok = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.add_special_tokens([tokenizers.AddedToken(m, special=True) for m in QWEN_MARKERS])
    tok.save(str(tok_dir / "tokenizer.json"))
    return build_tiny_model(tmp_path_factory.mktemp("coder"), "qwen2", tokenizer_dir=tok_dir)


def _run(model_dir, tmp_path, requests: list[dict], **options) -> list[tuple[int, dict]]:
    async def go():
        app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path), max_total_tokens=2048,
                         **options)
        await app.startup()
        try:
            out = []
            for body in requests:
                status, _, raw = await call(app, "POST", "/v1/completions", {"model": "m", **body})
                events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
                out.append((status, events if body.get("stream") else json.loads(raw)))
            return out
        finally:
            await app.shutdown()

    return asyncio.run(go())


def test_the_middle_is_the_models_greedy_answer_to_its_markers(coder_model, tmp_path):
    fim = {"prompt": BEFORE, "suffix": AFTER, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    (status, body), (_, listed), (_, plain), (_, streamed) = _run(coder_model, tmp_path, [
        fim, {**fim, "prompt": [BEFORE, "x = "]}, {**fim, "suffix": None}, {**fim, "stream": True}])
    assert status == 200, body
    choice = body["choices"][0]
    tok = tokenizers.Tokenizer.from_file(str(coder_model / "tokenizer.json"))
    expected_prompt = tok.encode(f"<|fim_prefix|>{BEFORE}<|fim_suffix|>{AFTER}<|fim_middle|>").ids
    assert choice["prompt_token_ids"] == expected_prompt
    assert [tok.token_to_id(m) in expected_prompt for m in QWEN_MARKERS] == [True] * 3
    model = transformers.AutoModelForCausalLM.from_pretrained(coder_model, torch_dtype=torch.float32)
    assert choice["token_ids"] == hf_greedy(model, expected_prompt, len(choice["token_ids"]))
    assert choice["text"] == tok.decode(choice["token_ids"])
    assert listed["choices"][0]["text"] == choice["text"]  # each prompt of a list gets the suffix
    assert listed["choices"][1]["prompt_token_ids"][-1] == tok.token_to_id("<|fim_middle|>")
    assert plain["choices"][0]["prompt_token_ids"] == tok.encode(BEFORE).ids  # no suffix: a plain completion
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == choice["text"]


def test_suffix_is_refused_where_it_cannot_be_honoured(coder_model, default_model_dir, tmp_path):
    fim = {"prompt": BEFORE, "suffix": AFTER, "max_tokens": 4}
    (s1, echoed), (s2, ids) = _run(coder_model, tmp_path, [{**fim, "echo": True}, {**fim, "prompt": [5, 6, 7]}])
    assert (s1, echoed["error"]["param"]) == (400, "echo")
    assert (s2, ids["error"]["param"]) == (400, "prompt")
    (s3, off), = _run(coder_model, tmp_path, [fim], completion_template="none")
    assert (s3, off["error"]["param"]) == (400, "suffix")
    # The embedded model's vocabulary holds no markers: auto finds none, and naming one stops the start.
    # (Its float32 weights: only its tokenizer matters here, and they load without the 4-bit quantization.)
    (s4, none), = _run(default_model_dir, tmp_path, [fim], torchao_config="none")
    assert s4 == 400 and "fill-in-the-middle" in none["error"]["message"]
    with pytest.raises(ValueError, match="no <fim_prefix>"):
        _run(default_model_dir, tmp_path, [fim], completion_template="star_coder", torchao_config="none")
