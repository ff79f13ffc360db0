"""LoRA adapters through the app: the openai client picks one by
`model`, /generate by SGLang's `lora_path`, /v1/models lists them beside
the base model, adapters load and unload at run time, an unknown one is a
404 naming those loaded, and a server without --enable-lora refuses
`lora_path` as an unknown field (a server process of its own)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.testclient import TestClient

from pyserve.asgi import create_app
from tests.conftest import ServerProcess
from tests.test_api_handlers import call
from tests.slow import slow_test
from tests.test_lora import make_adapter, reference_tokens

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

PROMPT = [5, 17, 99, 3, 42, 42]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("lora-api")
    adapters = {"alpha": make_adapter(tiny_llama_dir, root / "alpha", 1),
                "beta": make_adapter(tiny_llama_dir, root / "beta", 2, r=8, targets=["q_proj", "down_proj"])}
    # The app in process: the routes' answers are checked, not the server process.
    app = create_app(model_path=str(tiny_llama_dir), enable_lora=True, lora_paths=f"alpha={adapters['alpha']}",
                     max_lora_rank=8, max_loras_per_batch=2, file_storage_path=str(root / "storage"))
    with TestClient(app) as http:
        yield http, tiny_llama_dir, adapters


def completion(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    return out.choices[0]


def completion_tokens(client, model):
    return completion(client, model).token_ids


def test_openai_client_picks_adapters_by_model_name(lora_server):
    srv, model_dir, adapters = lora_server
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", http_client=srv)
    cards = {m.id: m for m in client.models.list().data}
    base_name = next(name for name, card in cards.items() if card.parent is None)
    assert set(cards) == {base_name, "alpha"} and cards["alpha"].parent == base_name

    assert completion_tokens(client, "alpha") == reference_tokens(model_dir, adapters["alpha"], PROMPT, 8)
    assert completion_tokens(client, base_name) == reference_tokens(model_dir, None, PROMPT, 8)

    with pytest.raises(openai.NotFoundError) as e:
        completion_tokens(client, "beta")
    assert "alpha" in str(e.value)

    r = srv.post("/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": adapters["beta"]})
    assert r.status_code == 200, r.text
    assert "beta" in {m.id for m in client.models.list().data}
    beta = completion(client, "beta")
    assert beta.token_ids == reference_tokens(model_dir, adapters["beta"], PROMPT, 8)
    # Responses name the adapter that answered, streamed or whole, as vLLM's do.
    chunks = client.completions.create(model="beta", prompt=PROMPT, max_tokens=2, stream=True)
    assert {c.model for c in chunks} == {"beta"}
    assert client.completions.create(model=base_name, prompt=PROMPT, max_tokens=2).model == base_name
    # SGLang's field on /generate names it too.
    r = srv.post("/generate", json={"input_ids": PROMPT, "lora_path": "beta", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == beta.text
    # A batch names one adapter per prompt (None: the base model).
    r = srv.post("/generate", json={"input_ids": [PROMPT] * 3, "lora_path": ["beta", None, "alpha"],
                                                     "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                         "ignore_eos": True}}, timeout=60)
    assert [o["output_ids"] for o in r.json()] == [beta.token_ids, reference_tokens(model_dir, None, PROMPT, 8),
                                                   reference_tokens(model_dir, adapters["alpha"], PROMPT, 8)]

    assert srv.post("/unload_lora_adapter", json={"lora_name": "beta"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        completion_tokens(client, "beta")
    r = srv.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert r.status_code == 404 and "alpha" in r.json()["error"]["message"]
    r = srv.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(model_dir)})
    assert r.status_code == 400 and "adapter" in r.json()["error"]["message"]
    r = srv.post("/load_lora_adapter", json={"lora_name": base_name, "lora_path": adapters["beta"]})
    assert r.status_code == 400 and "base model" in r.json()["error"]["message"]


@slow_test  # a server of its own for one refusal
def test_lora_path_is_an_unknown_field_without_enable_lora(tiny_llama_dir):
    srv = ServerProcess("--model-path", str(tiny_llama_dir))
    try:
        r = httpx.post(f"{srv.base_url}/v1/completions", json={"model": "x", "prompt": PROMPT, "max_tokens": 2,
                                                               "lora_path": "alpha"}, timeout=60)
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.base_url}/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nowhere"})
        assert r.status_code == 400
    finally:
        srv.stop()


def test_responses_and_messages_take_the_adapter_from_model(lora_server):
    srv, _, _ = lora_server
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", http_client=srv)
    base_name = next(m.id for m in client.models.list().data if m.parent is None)
    ask = [{"role": "user", "content": "Say hello"}]

    def chat(model):
        out = client.chat.completions.create(model=model, messages=ask, max_tokens=8, temperature=0)
        assert out.model == model
        return out.choices[0].message.content

    under_alpha = chat("alpha")
    assert under_alpha and under_alpha != chat(base_name)
    r = srv.post("/v1/messages", json={"model": "alpha", "max_tokens": 8, "messages": ask,
                                                        "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == under_alpha and r.json()["model"] == "alpha"
    r = srv.post("/v1/responses", json={"model": "alpha", "input": ask, "max_output_tokens": 8,
                                                         "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "alpha" and r.json()["output"][0]["content"][0]["text"] == under_alpha
    r = srv.post("/v1/responses", json={"model": base_name, "input": ask, "max_output_tokens": 8})
    assert r.status_code == 200 and r.json()["model"] == base_name, r.text
    r = srv.post("/v1/messages", json={"model": "gamma", "max_tokens": 8, "messages": ask})
    assert r.status_code == 404 and r.json()["type"] == "error" and "alpha" in r.json()["error"]["message"]
    r = srv.post("/v1/responses", json={"model": "gamma", "input": "Say hello"})
    assert r.status_code == 404 and "alpha" in r.json()["error"]["message"]


def test_every_served_name_reaches_the_base_model_and_responses_report_the_first(tiny_llama_dir, tmp_path):
    """vLLM's --served-model-name with several names, on a server whose
    other `model` names pick adapters: none of them is taken for one."""
    async def go():
        app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path), enable_lora=True,
                         served_model_name="tiny,org/tiny")
        await app.startup()
        try:
            body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
            answers = [await call(app, "POST", "/v1/completions", {**body, "model": m}) for m in ("tiny", "org/tiny")]
            listed = json.loads((await call(app, "GET", "/v1/models"))[2])
            retrieved = await call(app, "GET", "/v1/models/org/tiny")
            unknown = await call(app, "POST", "/v1/completions", {**body, "model": "other"})
            taken = await call(app, "POST", "/load_lora_adapter", {"lora_name": "org/tiny", "lora_path": "/x"})
            return answers, listed, retrieved[0], unknown[0], taken
        finally:
            await app.shutdown()

    answers, listed, retrieved, unknown, (status, _, raw) = asyncio.run(go())
    (s1, _, first), (s2, _, second) = answers
    assert s1 == s2 == 200
    assert [json.loads(a)["model"] for a in (first, second)] == ["tiny", "tiny"]
    assert json.loads(first)["choices"] == json.loads(second)["choices"]
    assert [c["id"] for c in listed["data"]] == ["tiny", "org/tiny"] and retrieved == 200
    assert unknown == 404  # an adapter name no adapter has
    assert status == 400 and "base model" in json.loads(raw)["error"]["message"]
