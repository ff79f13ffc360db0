"""Encoder models (BERT, XLM-RoBERTa, ModernBERT) served as embedding models, on tiny
checkpoints built with transformers' own classes (tests/encoder_models.py):
sentence-embedding models through the openai client, checked against
sentence-transformers on the same weights, and cross-encoder rerankers
through vLLM's /rerank and /score, SGLang's /v1/rerank and /classify,
checked against transformers' classifier on the same (query, document)
pairs. Float32; vectors and scores within 1e-4."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import openai
import pytest
import torch
from starlette.testclient import TestClient

from pyserve.asgi import create_app
from pyserve.model.encoders.bert import separator_of
from tests.encoder_models import build_tiny_embedding_gemma, build_tiny_encoder
from tests.test_api_handlers import call

transformers = pytest.importorskip("transformers")

TOL = 1e-4
TEXTS = ["The capital of France is Paris.", "a cat sat on the mat", "what is the big river in germany",
         "the sun", " ".join(["the big red dog sat on the small blue mat in the sun"] * 4)]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat", "berlin is a big city in germany",
             "the sky is blue"]


def serve(model_dir, tmp_path, **options):
    """The app (not yet started), served without --is-embedding, which an encoder turns on by itself;
    chunks of 8 tokens, which an encoder's prompts must ignore."""
    return create_app(model_path=str(model_dir), file_storage_path=str(tmp_path / "files"), dtype="float32",
                      chunked_prefill_size=8, **options)


@pytest.mark.parametrize("family, pooling", [("bert", "mean"), ("xlm-roberta", "cls"), ("modernbert", "mean")])
def test_embeddings_match_sentence_transformers(tmp_path, family, pooling):
    from sentence_transformers import SentenceTransformer

    model_dir = build_tiny_encoder(tmp_path / "model", family, pooling=pooling)
    want = SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS, convert_to_tensor=True)
    lengths = [len(ids) for ids in transformers.AutoTokenizer.from_pretrained(model_dir)(TEXTS)["input_ids"]]
    assert max(lengths) > 8  # longer than a prefill chunk: computed whole all the same
    with TestClient(serve(model_dir, tmp_path)) as http:
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="x", http_client=http)
        batch = client.embeddings.create(model="m", input=TEXTS)
        alone = [client.embeddings.create(model="m", input=text).data[0].embedding for text in TEXTS[:2]]
        too_long = http.post("/v1/embeddings", json={"input": " ".join(["the"] * 80)})
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    got = torch.tensor([entry.embedding for entry in batch.data])
    assert got.shape == want.shape and (got - want).abs().max() < TOL
    assert (torch.tensor(alone) - got[:2]).abs().max() < TOL
    assert batch.usage.prompt_tokens == sum(lengths)
    # The context is the checkpoint's positions (RoBERTa's past its padding id).
    assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]
    assert chat.status_code == 400 and "--is-embedding" in chat.json()["error"]["message"]


def hf_relevance(model_dir, pairs: list[tuple[str, str]]) -> list[float]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        inputs = tokenizer([a for a, _ in pairs], [b for _, b in pairs], return_tensors="pt", padding=True)
        return model(**inputs).logits[:, 0].sigmoid().tolist()


@pytest.mark.parametrize("family, pooling", [("bert", "cls"), ("xlm-roberta", "cls"), ("modernbert", "mean")])
def test_cross_encoder_scores_match_transformers(tmp_path, family, pooling):
    model_dir = build_tiny_encoder(tmp_path / "model", family, num_labels=1, pooling=pooling)
    want = hf_relevance(model_dir, [(QUERY, d) for d in DOCUMENTS])
    paired = hf_relevance(model_dir, list(zip(DOCUMENTS, reversed(DOCUMENTS))))

    async def go():
        app = serve(model_dir, tmp_path)
        await app.startup()
        try:
            answers = [json.loads((await call(app, "POST", path, body))[2]) for path, body in (
                ("/rerank", {"model": "rr", "query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
                ("/v2/rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False}),
                ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
                ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
                ("/v1/score", {"queries": DOCUMENTS, "documents": list(reversed(DOCUMENTS))}))]
            refusals = [await call(app, "POST", path, body) for path, body in (
                ("/score", {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS}),
                ("/score", {"text_1": QUERY, "text_2": []}),
                ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "instruct": "judge"}),
                ("/v1/score", {"query": QUERY, "items": DOCUMENTS, "label_token_ids": [1]}),
                ("/v1/completions", {"prompt": QUERY}))]
            return answers, refusals
        finally:
            await app.shutdown()

    (top, cohere, sglang, scored, pairwise), refusals = asyncio.run(go())
    best = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    assert [r["index"] for r in top["results"]] == best[:2] and top["model"] == "rr"
    assert [r["relevance_score"] for r in top["results"]] == pytest.approx([want[i] for i in best[:2]], abs=TOL)
    assert top["results"][0]["document"] == {"text": DOCUMENTS[best[0]]}
    assert [r["index"] for r in cohere["results"]] == best and "document" not in cohere["results"][0]
    assert [r["index"] for r in sglang] == best
    assert [r["score"] for r in sglang] == pytest.approx([want[i] for i in best], abs=TOL)
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=TOL)
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(paired, abs=TOL)
    # The pairs' tokens, as transformers' tokenizer encodes them together.
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokens = sum(len(ids) for ids in tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS)["input_ids"])
    assert scored["usage"]["prompt_tokens"] == tokens == top["usage"]["total_tokens"]
    for status, _, body in refusals:
        assert status == 400 and json.loads(body)["error"]["message"]


def test_bi_encoder_scores_pairs_by_cosine_similarity(tmp_path):
    """vLLM's /score and /rerank on an embedding model: the cosine of the texts' vectors; its /pooling."""
    model_dir = build_tiny_encoder(tmp_path / "model", "bert", pooling="mean")

    async def go():
        app = serve(model_dir, tmp_path)
        await app.startup()
        try:
            vectors = json.loads((await call(app, "POST", "/v1/embeddings", {"input": [QUERY] + DOCUMENTS}))[2])
            scored = json.loads((await call(app, "POST", "/score", {"text_1": QUERY, "text_2": DOCUMENTS}))[2])
            ranked = json.loads((await call(app, "POST", "/rerank", {"query": QUERY, "documents": DOCUMENTS}))[2])
            pooled = [json.loads((await call(app, "POST", "/pooling", {"input": [QUERY], "encoding_format": form}))[2])
                      for form in ("float", "base64")]
            return vectors, scored, ranked, pooled
        finally:
            await app.shutdown()

    vectors, scored, ranked, (floats, packed) = asyncio.run(go())
    # vLLM's /pooling: the same vector as /v1/embeddings, as floats or base64 float32.
    assert floats["data"][0]["object"] == "pooling" and floats["usage"]["prompt_tokens"] > 0
    assert floats["data"][0]["data"] == pytest.approx(vectors["data"][0]["embedding"], abs=TOL)
    unpacked = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4")
    assert unpacked.tolist() == pytest.approx(floats["data"][0]["data"], abs=1e-7)
    query, *documents = (torch.tensor(entry["embedding"]) for entry in vectors["data"])
    want = [torch.nn.functional.cosine_similarity(query, d, dim=0).item() for d in documents]
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=TOL)
    assert [r["index"] for r in ranked["results"]] == sorted(range(len(want)), key=lambda i: -want[i])


def test_encoder_refuses_what_it_cannot_run(tmp_path):
    """An encoder loaded to generate (by the loader, where the server would turn --is-embedding on),
    or with an option it cannot take, is refused at start, naming what."""
    from pyserve.model.loader import load_model

    model_dir = build_tiny_encoder(tmp_path / "model", "bert")
    with pytest.raises(ValueError, match="encoder model.*--is-embedding"):
        load_model(model_dir, torch.float32, "cpu")
    for option, match in (({"enable_lora": True}, "--enable-lora"), ({"torchao_config": "int8wo"}, "quantized mode")):
        app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path / "files"), **option)
        with pytest.raises(ValueError, match=match):
            asyncio.run(app.startup())


def test_separator_is_read_from_each_post_processor_shape():
    """Where a pair's second segment begins, as tokenizer.json writes it."""
    bert = {"type": "BertProcessing", "sep": ["[SEP]", 102], "cls": ["[CLS]", 101]}
    template = {"type": "TemplateProcessing",
                "pair": [{"SpecialToken": {"id": "[CLS]"}}, {"Sequence": {"id": "A"}}, {"SpecialToken": {"id": "[SEP]"}},
                         {"Sequence": {"id": "B"}}, {"SpecialToken": {"id": "[SEP]"}}],
                "special_tokens": {"[SEP]": {"ids": [3]}, "[CLS]": {"ids": [2]}}}
    assert separator_of(bert) == 102 and separator_of(template) == 3
    assert separator_of({"type": "Sequence", "processors": [{"type": "ByteLevel"}, template]}) == 3
    assert separator_of({"type": "ByteLevel"}) is None and separator_of(None) is None


def test_embedding_gemma_matches_sentence_transformers(tmp_path, default_model_dir):
    """A decoder trained to attend both ways (EmbeddingGemma: Gemma3TextModel,
    use_bidirectional_attention, sliding layers seeing 4 tokens either side)
    with Dense layers after its mean pooling, served without --is-embedding."""
    from sentence_transformers import SentenceTransformer

    model_dir = build_tiny_embedding_gemma(tmp_path / "gemma", default_model_dir)
    want = SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS, convert_to_tensor=True)
    with TestClient(serve(model_dir, tmp_path)) as http:
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="x", http_client=http)
        got = torch.tensor([entry.embedding for entry in client.embeddings.create(model="m", input=TEXTS).data])
    assert got.shape == want.shape and (got - want).abs().max() < TOL


def test_encoder_classifier_of_several_labels(tmp_path):
    """A BERT sequence classifier of three labels (a sentiment model): /classify answers transformers'
    probabilities and its id2label name; the rerank routes, which read one label's score, refuse it."""
    model_dir = build_tiny_encoder(tmp_path / "model", "bert", num_labels=3)
    config = json.loads((model_dir / "config.json").read_text())
    config["id2label"] = {"0": "negative", "1": "neutral", "2": "positive"}
    (model_dir / "config.json").write_text(json.dumps(config))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1) for text in TEXTS[:3]]

    async def go():
        app = serve(model_dir, tmp_path)
        await app.startup()
        try:
            classified = json.loads((await call(app, "POST", "/classify", {"input": TEXTS[:3]}))[2])
            return classified, await call(app, "POST", "/rerank", {"query": QUERY, "documents": DOCUMENTS})
        finally:
            await app.shutdown()

    classified, (status, _, body) = asyncio.run(go())
    for entry, probs in zip(classified["data"], want):
        assert entry["probs"] == pytest.approx(probs.tolist(), abs=TOL)
        assert entry["label"] == ["negative", "neutral", "positive"][int(probs.argmax())]
    assert status == 400 and "3 labels" in json.loads(body)["error"]["message"]
