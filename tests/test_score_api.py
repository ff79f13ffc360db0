"""POST /v1/score (SGLang's shape) through the app in process, on a tiny random
model in float32: each probability is checked against the same next-token
distribution read another way, SGLang's /generate top logprobs after
query + item."""

from __future__ import annotations

import math

import pytest

from tests.test_tokenize_api import tiny_server_http

QUERY = "Is the sky blue? Answer:"
ITEMS = [" yes", " no, it is green", " maybe"]


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory):
    with tiny_server_http(tiny_llama_dir, tmp_path_factory.mktemp("score")) as c:
        yield c


def score(http, **body) -> dict:
    r = http.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def next_token_top(http, ids: list[int], k: int = 4) -> dict[int, float]:
    """The k likeliest next tokens after `ids` and their log-probabilities,
    from /generate's first output position."""
    r = http.post("/generate", json={"input_ids": ids, "return_logprob": True, "top_logprobs_num": k,
                                     "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert r.status_code == 200, r.text
    return {token: logprob for logprob, token, _ in r.json()["meta_info"]["output_top_logprobs"][0]}


def ids_of(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_probabilities_are_the_next_token_distribution(http):
    tops = [next_token_top(http, ids_of(http, QUERY + item)) for item in ITEMS]
    # Labels the distributions rank differently: the top tokens of each item.
    labels = sorted({token for top in tops for token in list(top)[:2]})
    out = score(http, query=QUERY, items=ITEMS, label_token_ids=labels)
    assert out["object"] == "scoring" and len(out["scores"]) == len(ITEMS)
    for top, row in zip(tops, out["scores"]):
        assert len(row) == len(labels)
        for label, p in zip(labels, row):
            if label in top:
                assert math.isclose(p, math.exp(top[label]), rel_tol=1e-3), (label, p, top)
            else:  # not among this item's likeliest: less likely than its k-th
                assert p <= math.exp(min(top.values())) * (1 + 1e-3)
    assert out["usage"]["prompt_tokens"] == sum(len(ids_of(http, QUERY + item)) for item in ITEMS)


def test_softmax_normalizes_over_the_labels(http):
    top = next_token_top(http, ids_of(http, QUERY + ITEMS[0]))
    labels = list(top)[:3]
    [plain] = score(http, query=QUERY, items=ITEMS[0], label_token_ids=labels)["scores"]
    [soft] = score(http, query=QUERY, items=[ITEMS[0]], label_token_ids=labels, apply_softmax=True)["scores"]
    assert math.isclose(sum(soft), 1.0, rel_tol=1e-6)
    assert sum(plain) < 1
    for p, s in zip(plain, soft):
        assert math.isclose(s, p / sum(plain), rel_tol=1e-4)


def prompt_logprobs(http, ids: list[int]) -> list[float]:
    """Each prompt token's log-probability after the ones before it (the first has none), from /generate."""
    r = http.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                     "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert r.status_code == 200, r.text
    return [logprob for logprob, _, _ in r.json()["meta_info"]["input_token_logprobs"]]


def test_without_labels_each_item_is_scored_as_the_continuation(http):
    query = ids_of(http, "The sky is")
    special = len(ids_of(http, ""))  # a BOS the tokenizer adds, if any
    items = [ids_of(http, " blue")[special:], ids_of(http, " green and wide")[special:]]
    out = score(http, query=query, items=items)
    expected = []
    for item in items:
        logprobs = prompt_logprobs(http, query + item)
        expected.append(math.exp(sum(logprobs[len(query):])))
    assert len(out["scores"]) == len(items)
    for p, want in zip(out["scores"], expected):
        assert math.isclose(p, want, rel_tol=1e-3), (p, want)
    soft = score(http, query=query, items=items, apply_softmax=True)["scores"]
    assert math.isclose(sum(soft), 1.0, rel_tol=1e-6)
    assert math.isclose(soft[0] / soft[1], expected[0] / expected[1], rel_tol=1e-3)
    # Texts: the same, joined before they are tokenized.
    texts = score(http, query="The sky is", items=[" blue"])["scores"]
    assert texts[0] > 0


def test_item_first_and_token_ids(http):
    query_ids, item_ids = ids_of(http, QUERY), [ids_of(http, item) for item in ITEMS[:2]]
    for item_first in (False, True):
        joined = [item + query_ids if item_first else query_ids + item for item in item_ids]
        tops = [next_token_top(http, ids) for ids in joined]
        labels = [next(iter(top)) for top in tops]
        out = score(http, query=query_ids, items=item_ids, label_token_ids=labels, item_first=item_first)
        for i, top in enumerate(tops):
            assert math.isclose(out["scores"][i][i], math.exp(top[labels[i]]), rel_tol=1e-3)


def test_item_first_with_texts_puts_the_item_first(http):
    top = next_token_top(http, ids_of(http, ITEMS[1] + QUERY))
    label = next(iter(top))
    out = score(http, query=QUERY, items=[ITEMS[1]], label_token_ids=[label], item_first=True)
    assert math.isclose(out["scores"][0][0], math.exp(top[label]), rel_tol=1e-3)


BAD = {
    "empty items": ({"query": QUERY, "items": [], "label_token_ids": [1]}, "items"),
    "no items": ({"query": QUERY, "label_token_ids": [1]}, "items"),
    "no query": ({"items": ITEMS, "label_token_ids": [1]}, "query"),
    "continuation, item first": ({"query": QUERY, "items": ITEMS, "item_first": True}, "item_first"),
    "empty labels": ({"query": QUERY, "items": ITEMS, "label_token_ids": []}, "label_token_ids"),
    "label out of vocabulary": ({"query": QUERY, "items": ITEMS, "label_token_ids": [1, 10**9]}, "label_token_ids"),
    "negative label": ({"query": QUERY, "items": ITEMS, "label_token_ids": [-1]}, "label_token_ids"),
    "text query, id items": ({"query": QUERY, "items": [[1, 2]], "label_token_ids": [1]}, "items"),
    "id query, text items": ({"query": [1, 2], "items": ITEMS, "label_token_ids": [1]}, "items"),
    "item id out of vocabulary": ({"query": [1, 2], "items": [[10**9]], "label_token_ids": [1]}, "items"),
    "empty query and item": ({"query": "", "items": [""], "label_token_ids": [1]}, "items"),
    "past the context": ({"query": "word " * 3000, "items": ["x"], "label_token_ids": [1]}, "items"),
    "vLLM's shape": ({"text_1": "a", "text_2": ["b"]}, "text_1"),
    "unknown field": ({"query": QUERY, "items": ITEMS, "label_token_ids": [1], "top_k": 3}, "top_k"),
    "softmax not a bool": ({"query": QUERY, "items": ITEMS, "label_token_ids": [1], "apply_softmax": "yes"},
                           "apply_softmax"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_requests_are_400s_naming_the_field(http, name):
    body, param = BAD[name]
    r = http.post("/v1/score", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error
    assert http.get("/health").status_code == 200
