"""SGLang's /v1/rerank on a causal LM, scored as SGLang scores
Qwen3-Reranker (P(yes) against P(no) after the judging prompt), checked
against transformers on the same tiny weights; vLLM's /rerank and
/v2/rerank (Jina's and Cohere's shape) with the same scores; and
/v1/score's and /v1/rerank's refusals."""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from pyserve.api.native.rerank import judging_prompt
from pyserve.asgi import create_app

QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Horses and cows are both animals.", "Paris is in France."]
INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory):
    """The app in process: these routes' answers, not the server process, are checked."""
    app = create_app(model_path=str(tiny_llama_dir), context_length=512, max_total_tokens=4096,
                     torchao_config="none", dtype="float32", file_storage_path=str(tmp_path_factory.mktemp("rerank")))
    with TestClient(app) as c:
        yield c


def hf_scores(model_dir, documents: list[str]) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    out = []
    for doc in documents:
        ids = tok(judging_prompt(INSTRUCT, QUERY, doc), return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            last = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
        out.append(torch.softmax(torch.stack([last[no], last[yes]]), 0)[1].item())
    return out


def test_rerank_scores_match_transformers_best_first(http, tiny_llama_dir):
    r = http.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    ranked = r.json()
    assert sorted(item["index"] for item in ranked) == [0, 1, 2]
    assert [item["score"] for item in ranked] == sorted((item["score"] for item in ranked), reverse=True)
    assert all(item["document"] == DOCS[item["index"]] for item in ranked)
    want = hf_scores(tiny_llama_dir, DOCS)
    for item in ranked:
        assert abs(item["score"] - want[item["index"]]) < 1e-4


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_vllms_rerank_shape_carries_the_same_scores(http, tiny_llama_dir, path):
    sglang = {item["index"]: item["score"] for item in
              http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()}
    r = http.post(path, json={"model": "reranker", "query": QUERY, "documents": DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "reranker" and body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
    best = sorted(sglang, key=lambda i: -sglang[i])[:2]
    assert [item["index"] for item in body["results"]] == best
    for item in body["results"]:
        assert item["relevance_score"] == sglang[item["index"]] and item["document"] == {"text": DOCS[item["index"]]}
    every = http.post(path, json={"query": QUERY, "documents": DOCS, "return_documents": False}).json()["results"]
    assert len(every) == 3 and all("document" not in item for item in every)
    r = http.post(path, json={"query": QUERY, "documents": DOCS, "top_n": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_n"


def test_rerank_top_n_and_no_documents(http):
    r = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 1, "return_documents": False})
    assert r.status_code == 200 and len(r.json()) == 1 and "document" not in r.json()[0]


@pytest.mark.parametrize("body, param", [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"query": QUERY}, "documents"),
    ({"query": QUERY, "documents": [1, 2]}, "documents[0]"),
    ({"query": QUERY, "documents": DOCS, "rerank_type": "x"}, "rerank_type"),
])
def test_bad_rerank_requests_are_400s(http, body, param):
    r = http.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"query": "q", "items": ["a"], "label_token_ids": [10 ** 8]}, "label_token_ids"),
    ({"query": "q", "items": [], "label_token_ids": [1]}, "items"),
    ({"items": ["a"], "label_token_ids": [1]}, "query"),
    ({"text_1": "a", "text_2": "b"}, "text_1"),
])
def test_score_errors_are_400s_naming_the_field(http, body, param):
    r = http.post("/v1/score", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_model_without_the_judging_prompt_tokens_cannot_rerank(tiny_llama_dir):
    """The label check, on a tokenizer without single "yes"/"no" or chatml markers."""
    from pyserve.api.native import rerank
    from pyserve.http.errors import APIError

    class Tokenizer:
        def token_to_id(self, token):
            return None

        def encode(self, text):
            return [1, 2]

    class Ctx:
        class engine:
            tokenizer = Tokenizer()

    with pytest.raises(APIError) as e:
        rerank._labels(Ctx())
    assert e.value.status == 400 and "cannot rerank" in e.value.message and e.value.param == "model"
