"""Vertex AI's prediction route, as SGLang serves it: the instances' prompts
answered as one /generate batch, at /vertex_generate or at the paths a
Vertex container's environment names (AIP_PREDICT_ROUTE, and
AIP_HEALTH_ROUTE for its health checks)."""

from __future__ import annotations

import asyncio
import json

from pyserve.asgi import create_app
from tests.test_api_handlers import call

PREDICT = "/v1/endpoints/7/deployedModels/9:predict"
HEALTH = "/v1/endpoints/7/deployedModels/9"
PARAMETERS = {"sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}


def test_instances_are_answered_as_one_generate_batch(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("AIP_PREDICT_ROUTE", PREDICT)
    monkeypatch.setenv("AIP_HEALTH_ROUTE", HEALTH)

    async def go():
        app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path), max_total_tokens=4096)
        await app.startup()
        try:
            texts = ["The sea is", "Once upon"]
            generated = json.loads((await call(app, "POST", "/generate", {"text": texts, **PARAMETERS}))[2])
            predicted = [json.loads((await call(app, "POST", path, {
                "instances": [{"text": t} for t in texts], "parameters": PARAMETERS}))[2])
                for path in (PREDICT, "/vertex_generate")]
            ids = json.loads((await call(app, "POST", PREDICT, {"instances": [{"input_ids": [5, 17, 99]}],
                                                               "parameters": PARAMETERS}))[2])
            health = (await call(app, "GET", HEALTH))[0]
            empty = json.loads((await call(app, "POST", PREDICT, {"instances": []}))[2])
            refused = [await call(app, "POST", PREDICT, body) for body in (
                {"instances": [{"text": "a"}, {"input_ids": [5]}]},
                {"instances": [{"text": "a"}], "parameters": {"stream": True}},
                {"instances": [{"text": "a"}], "parameters": {"temperature": 0}},
            )]
            return generated, predicted, ids, health, empty, refused
        finally:
            await app.shutdown()

    generated, predicted, ids, health, empty, refused = asyncio.run(go())
    for answer in predicted:
        assert [p["text"] for p in answer["predictions"]] == [g["text"] for g in generated]
    assert len(ids["predictions"]) == 1 and len(ids["predictions"][0]["output_ids"]) == 5
    assert health == 200 and empty == {"predictions": []}
    for status, _, raw in refused:
        assert status == 400, raw
    assert "temperature" in json.loads(refused[2][2])["error"]["message"]
