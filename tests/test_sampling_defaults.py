"""--sampling-defaults (SGLang's; vLLM's --generation-config): a request
that leaves temperature, top_p, top_k, min_p or repetition_penalty out
samples with what the model's generation_config.json recommends, on every
generation route; what a request sets wins; `openai` keeps OpenAI's
defaults."""

from __future__ import annotations

import json
import logging

import pytest

from pyserve.api.generation.sampling import sampling_params
from pyserve.api.protocol.openai import ChatCompletionRequest
from tests.test_tokenize_api import tiny_server_http
from tests.tiny_models import build_tiny_model

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def recommending_model(tmp_path_factory, default_model_dir):
    """A tiny model whose generation_config.json recommends top_k 1 (so its
    recommendation samples as greedy decoding does) at temperature 0.8."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("recommending"), "llama", tokenizer_dir=default_model_dir)
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.8, "top_k": 1}))
    return model_dir


def test_requests_that_leave_settings_out_take_the_models(recommending_model, tmp_path, caplog):
    # The app in process: the routes' sampling is checked, not the server process.
    with caplog.at_level(logging.INFO, logger="pyserve"), \
            tiny_server_http(recommending_model, tmp_path, max_total_tokens=2048) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", http_client=srv)

        def chat(**extra):
            return client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16,
                                                  **extra).choices[0].message.content

        greedy = chat(temperature=0)
        assert chat(seed=1) == chat(seed=2) == greedy  # top_k 1, the model's
        free = {chat(seed=s, extra_body={"top_k": -1}) for s in range(3)}  # the request's own top_k wins
        assert free != {greedy}
        r = srv.post("/generate", json={"text": "Say something.", "sampling_params": {
            "max_new_tokens": 16, "seed": 3}})
        g = srv.post("/generate", json={"text": "Say something.", "sampling_params": {
            "max_new_tokens": 16, "temperature": 0}})
        assert r.json()["text"] == g.json()["text"]
    assert "generation_config.json's {'temperature': 0.8, 'top_k': 1}" in caplog.text


def test_openai_defaults_where_the_model_recommends_none_or_openai_is_asked():
    req = ChatCompletionRequest(model="m", messages=MESSAGES)
    plain = sampling_params(req, 16, 100)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty) == (1, 1, -1, 0, 1)
    model = sampling_params(req, 16, 100, defaults={"temperature": 0.6, "top_p": 0.95, "min_p": 0.05})
    assert (model.temperature, model.top_p, model.top_k, model.min_p) == (0.6, 0.95, -1, 0.05)
    asked = sampling_params(ChatCompletionRequest(model="m", messages=MESSAGES, temperature=1.0, min_p=0.0), 16, 100,
                            defaults={"temperature": 0.6, "min_p": 0.05})
    assert (asked.temperature, asked.min_p) == (1.0, 0.0)


def test_the_openai_choice_leaves_the_models_recommendation_out(recommending_model, tmp_path):
    import asyncio

    from pyserve.asgi import create_app
    from tests.test_api_handlers import call

    async def contents(**options) -> list[str]:
        app = create_app(model_path=str(recommending_model), file_storage_path=str(tmp_path), **options)
        await app.startup()
        try:
            _, _, info = await call(app, "GET", "/get_model_info")
            out = [json.loads(info)["preferred_sampling_params"]]
            for body in ({"temperature": 0}, {"seed": 1}, {"seed": 2}):
                _, _, raw = await call(app, "POST", "/v1/chat/completions",
                                       {"model": "m", "messages": MESSAGES, "max_tokens": 16, **body})
                out.append(json.loads(raw)["choices"][0]["message"]["content"])
            return out
        finally:
            await app.shutdown()

    preferred, greedy, *sampled = asyncio.run(contents(sampling_defaults="openai"))
    assert preferred is None
    assert sampled != [greedy, greedy]  # temperature 1 over the whole vocabulary
    # --preferred-sampling-params (SGLang's) sets what requests leave out, over either choice.
    preferred, greedy, *sampled = asyncio.run(contents(sampling_defaults="openai",
                                                       preferred_sampling_params='{"top_k": 1}'))
    assert preferred == {"top_k": 1}
    assert sampled == [greedy, greedy]


@pytest.mark.parametrize("value, problem", [
    ('{"temperature": 0.6, "top_k": 20}', None),
    ('{"temperature": 5}', "temperature must be between 0 and 2"),
    ('{"max_new_tokens": 5}', "sets max_new_tokens: it takes temperature, top_p"),
    ('{"top_p": "high"}', "takes numbers"),
    ('[0.6]', "must be a JSON object"),
    ("{temperature: 0.6}", "is not JSON"),
])
def test_preferred_sampling_params_are_checked_at_start(value, problem):
    from pyserve.server_args import ServerArgs

    args = ServerArgs(preferred_sampling_params=value)
    if problem is None:
        args.validate()
        assert args.preferred_sampling() == json.loads(value)
    else:
        with pytest.raises(ValueError, match=problem):
            args.validate()
