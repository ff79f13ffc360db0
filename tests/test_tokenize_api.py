"""POST /tokenize, POST /detokenize and GET /tokenizer_info through the
app, in process (a tiny random model with the default model's real
tokenizer: what is checked is the tokenizer's round trips, not any
answer)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from starlette.testclient import TestClient

from pyserve.asgi import create_app

TEXT = "Hello, world! Ünïcödé and   spaces\nand a new line."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a city."}]


@contextmanager
def tiny_server_http(model_dir, tmp_path, **options) -> Iterator[httpx.Client]:
    """The app on the tiny model (with these ServerArgs `options`), in
    process, and an HTTP client of it, for a module: these routes' answers,
    not the server process, are checked."""
    with TestClient(create_app(model_path=str(model_dir), file_storage_path=str(tmp_path), **options)) as c:
        yield c


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory):
    with tiny_server_http(tiny_llama_dir, tmp_path_factory.mktemp("tokenize")) as c:
        yield c


def tokenize(http, **body) -> dict:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prompt_round_trips(http):
    out = tokenize(http, prompt=TEXT, add_special_tokens=False)
    assert out["count"] == len(out["tokens"]) > 0
    assert all(isinstance(t, int) for t in out["tokens"])
    assert out["max_model_len"] == http.get("/tokenizer_info").json()["max_model_len"]
    back = http.post("/detokenize", json={"tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_the_v1_paths_are_the_same_routes(http):
    assert http.post("/v1/tokenize", json={"prompt": TEXT}).json() == tokenize(http, prompt=TEXT)
    ids = tokenize(http, prompt=TEXT, add_special_tokens=False)["tokens"]
    assert http.post("/v1/detokenize", json={"tokens": ids}).json() == {"prompt": TEXT}


def test_token_strs_only_when_asked(http):
    plain = tokenize(http, prompt=TEXT)
    assert plain.get("token_strs") is None
    out = tokenize(http, prompt="Hello world", add_special_tokens=False, return_token_strs=True)
    assert len(out["token_strs"]) == out["count"]
    # Byte-level BPE spells a leading space as "Ġ".
    assert "".join(out["token_strs"]).replace("Ġ", " ") == "Hello world"


def test_a_list_of_prompts_and_a_list_of_token_lists(http):
    texts = ["one", "two words", TEXT]
    out = tokenize(http, prompt=texts, add_special_tokens=False)
    assert out["count"] == [len(ids) for ids in out["tokens"]]
    assert out["tokens"] == [tokenize(http, prompt=t, add_special_tokens=False)["tokens"] for t in texts]
    back = http.post("/detokenize", json={"tokens": out["tokens"]}).json()
    assert back == {"prompt": texts}


def test_messages_are_the_prompt_a_chat_request_runs(http):
    out = tokenize(http, messages=MESSAGES)
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert out["count"] == chat["usage"]["prompt_tokens"]
    text = http.post("/detokenize", json={"tokens": out["tokens"]}).json()["prompt"]
    # The template's text, with the messages in order and the assistant's turn opened.
    assert text.index("Be brief.") < text.index("Name a city.")
    assert text.rstrip().endswith("assistant")
    # continue_final_message ends inside the last message instead.
    partial = MESSAGES + [{"role": "assistant", "content": "Paris is"}]
    cont = tokenize(http, messages=partial, add_generation_prompt=False, continue_final_message=True)
    assert http.post("/detokenize", json={"tokens": cont["tokens"]}).json()["prompt"].endswith("Paris is")
    # add_generation_prompt false: the messages alone, no assistant turn opened.
    bare = tokenize(http, messages=MESSAGES, add_generation_prompt=False)
    assert bare["tokens"] == out["tokens"][:bare["count"]] and bare["count"] < out["count"]


def test_tokenizer_info(http):
    info = http.get("/tokenizer_info").json()
    assert info["vocab_size"] > 1000 and info["max_model_len"] > 0
    assert isinstance(info["chat_template"], str) and "{%" in info["chat_template"]
    assert info["tokenizer_class"]
    last = info["vocab_size"] - 1
    assert http.post("/detokenize", json={"tokens": [last]}).status_code == 200


BAD_TOKENIZE = {
    "neither": ({}, "prompt"),
    "both": ({"prompt": "x", "messages": MESSAGES}, "messages"),
    "prompt not text": ({"prompt": 5}, "prompt"),
    "empty prompt list": ({"prompt": []}, "prompt"),
    "special tokens with messages": ({"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    "per-request template": ({"messages": MESSAGES, "chat_template": "{{ 1 }}"}, "chat_template"),
    "unknown field": ({"prompt": "x", "truncate": 5}, "truncate"),
}


@pytest.mark.parametrize("name", BAD_TOKENIZE)
def test_bad_tokenize_requests_are_400s(http, name):
    body, param = BAD_TOKENIZE[name]
    r = http.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("tokens", [[1, 10**9], [-1], [[1], [2, 10**9]], "abc", [1.5], [True]])
def test_bad_detokenize_requests_are_400s(http, tokens):
    r = http.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tokens"
    assert http.get("/health").status_code == 200


def test_out_of_vocabulary_ids_say_so(http):
    vocab = http.get("/tokenizer_info").json()["vocab_size"]
    r = http.post("/detokenize", json={"tokens": [1, vocab]})
    assert r.status_code == 400 and str(vocab) in r.json()["error"]["message"]
