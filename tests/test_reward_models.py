"""Sequence classifiers (reward models such as
Skywork-Reward-Llama-3.1-8B, LlamaForSequenceClassification) served with
--is-embedding, as SGLang serves them: SGLang's /classify and
/v1/embeddings answer each prompt's label scores, and vLLM's /classify
body their probabilities and likeliest label, checked against
transformers' own classifier on the same tiny weights."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from pyserve.asgi import create_app
from tests.test_api_handlers import call
from tests.tiny_models import build_tiny_model

transformers = pytest.importorskip("transformers")

TEXTS = ["The answer is 4.", "I think the capital of France is Paris.", "No."]


def hf_scores(model_dir) -> list[list[float]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(**tokenizer(text, return_tensors="pt")).logits[0].tolist() for text in TEXTS]


async def serve(model_dir, tmp_path, **options):
    app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path), max_total_tokens=4096,
                     dtype="float32", torchao_config="none", **options)
    await app.startup()
    return app


@pytest.mark.parametrize("arch, labels", [("llama-classifier", 1), ("qwen3-classifier", 3)])
def test_classify_and_embeddings_answer_transformers_scores(tmp_path, default_model_dir, arch, labels):
    model_dir = build_tiny_model(tmp_path / "model", arch, tokenizer_dir=default_model_dir, num_labels=labels)

    async def go():
        app = await serve(model_dir, tmp_path, is_embedding=True)
        try:
            batch = json.loads((await call(app, "POST", "/classify", {"text": TEXTS}))[2])
            one = json.loads((await call(app, "POST", "/classify", {"model": "rm", "text": TEXTS[1]}))[2])
            embedded = json.loads((await call(app, "POST", "/v1/embeddings", {"input": TEXTS}))[2])
            vllm = json.loads((await call(app, "POST", "/classify", {"model": "rm", "input": TEXTS}))[2])
            v1 = json.loads((await call(app, "POST", "/v1/classify", {"model": "rm", "input": TEXTS}))[2])
            # A conversation (a reward model's usual input), rendered by the chat template.
            chat = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": TEXTS[0]}]
            ids = json.loads((await call(app, "POST", "/tokenize", {"messages": chat,
                                                                    "add_generation_prompt": False}))[2])["tokens"]
            conversation = [json.loads((await call(app, "POST", path, body))[2]) for path, body in (
                ("/classify", {"messages": chat}), ("/v1/embeddings", {"messages": chat}),
                ("/classify", {"input_ids": ids}))]
            refusals = [await call(app, "POST", "/classify", body)
                        for body in ({"text": "a", "input_ids": [1]}, {"text": "a", "top_k": 1})]
            cut = await call(app, "POST", "/v1/embeddings", {"input": "a", "dimensions": labels + 1})
            return batch, one, embedded, vllm, v1, conversation, refusals, cut
        finally:
            await app.shutdown()

    batch, one, embedded, vllm, v1, conversation, refusals, cut = asyncio.run(go())
    assert [d["probs"] for d in v1["data"]] == [d["probs"] for d in vllm["data"]]  # SGLang's path of vLLM's route
    want = hf_scores(model_dir)
    assert len(batch) == len(TEXTS) and one["embedding"] == pytest.approx(batch[1]["embedding"], abs=1e-4)
    for got, ref, vector in zip(batch, want, embedded["data"]):
        assert len(got["embedding"]) == labels and got["meta_info"]["prompt_tokens"] > 0
        assert got["embedding"] == pytest.approx(ref, abs=1e-4)
        assert vector["embedding"] == pytest.approx(got["embedding"], abs=1e-4)
    assert [status for status, _, _ in refusals] == [400, 400] and cut[0] == 400
    assert vllm["model"] == "rm" and vllm["usage"]["prompt_tokens"] == sum(b["meta_info"]["prompt_tokens"]
                                                                           for b in batch)
    for entry, ref in zip(vllm["data"], want):
        probs = torch.tensor(ref).sigmoid() if labels == 1 else torch.tensor(ref).softmax(-1)
        assert entry["probs"] == pytest.approx(probs.tolist(), abs=1e-4) and entry["num_classes"] == labels
        assert entry["label"] == f"LABEL_{int(probs.argmax())}"
    by_messages, embedded_messages, by_ids = conversation
    scores = torch.tensor(by_ids["embedding"])
    want_probs = scores.sigmoid() if labels == 1 else scores.softmax(-1)
    assert by_messages["data"][0]["probs"] == pytest.approx(want_probs.tolist(), abs=1e-5)
    assert embedded_messages["data"][0]["embedding"] == pytest.approx(by_ids["embedding"], abs=1e-5)


def test_a_classifier_is_served_as_one_without_the_flag(tmp_path, default_model_dir):
    """As SGLang and vLLM tell by the architecture: /classify answers, generation is a 400 naming the flag,
    and a generation option is refused at start."""
    model_dir = build_tiny_model(tmp_path / "model", "llama-classifier", tokenizer_dir=default_model_dir,
                                 num_labels=1)

    async def go():
        app = await serve(model_dir, tmp_path)
        try:
            return [await call(app, "POST", path, body) for path, body in (
                ("/classify", {"text": TEXTS[0]}), ("/v1/completions", {"prompt": TEXTS[0]}))]
        finally:
            await app.shutdown()

    (classified, _, body), (refused, _, error) = asyncio.run(go())
    assert classified == 200 and len(json.loads(body)["embedding"]) == 1
    assert refused == 400 and "--is-embedding" in json.loads(error)["error"]["message"]
    with pytest.raises(ValueError, match="--reasoning-parser.*--is-embedding"):
        asyncio.run(serve(model_dir, tmp_path, reasoning_parser="qwen3"))
