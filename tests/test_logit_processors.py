"""SGLang's custom logit processors (--enable-custom-logit-processor), sent
as SGLang's CustomLogitProcessor.to_str() writes them: a processor that
bans tokens answers transformers' greedy tokens with those tokens
suppressed; each row gets its own custom_params and `__req__` (its output
so far, drafts included under speculation); a processor that raises ends
its own request only; and a server without the option refuses one without
unpickling it."""

from __future__ import annotations

import asyncio
import base64
import json
import pickle

import pytest
import torch

from pyserve.asgi import create_app
from tests.test_api_handlers import call
from tests.test_sessions import OPTIONS, serve

dill = pytest.importorskip("dill")
transformers = pytest.importorskip("transformers")


class BanTokens:
    """SGLang's DisallowedTokensLogitsProcessor, as a client writes one."""

    def __call__(self, logits, custom_param_list):
        for i, params in enumerate(custom_param_list):
            logits[i, params["token_ids"]] = -float("inf")
        return logits


class Script:
    """Forces each row's `tokens`, one per output token so far (`__req__`)."""

    def __call__(self, logits, custom_param_list):
        for i, params in enumerate(custom_param_list):
            wanted = params["tokens"][len(params["__req__"].output_ids) % len(params["tokens"])]
            logits[i, :] = -float("inf")
            logits[i, wanted] = 0.0
        return logits


class Broken:
    def __call__(self, logits, custom_param_list):
        raise RuntimeError("the client's processor failed")


def to_str(cls) -> str:
    """CustomLogitProcessor.to_str()."""
    return json.dumps({"callable": dill.dumps(cls).hex()})


async def generate(app, body: dict):
    status, _, raw = await call(app, "POST", "/generate", body)
    return status, json.loads(raw)


def test_a_banning_processor_answers_as_transformers_with_those_tokens_suppressed(tiny_llama_dir, tmp_path):
    prompt = [5, 17, 42, 99, 7]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.inference_mode():
        plain = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    banned = sorted(set(plain[:3]))
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                           suppress_tokens=banned)[0, len(prompt):].tolist()

    async def scenario(app):
        return await generate(app, {"input_ids": prompt, "custom_logit_processor": to_str(BanTokens),
                                    "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True,
                                                        "custom_params": {"token_ids": banned}}})

    status, out = serve(tiny_llama_dir, tmp_path, scenario, enable_custom_logit_processor=True)
    assert status == 200, out
    assert out["output_ids"] == want and not set(banned) & set(out["output_ids"])


@pytest.mark.parametrize("speculative", [{}, {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}],
                         ids=["plain", "ngram"])
def test_each_row_gets_its_own_params_and_output_so_far(tiny_llama_dir, tmp_path, speculative):
    # Repeating scripts: n-gram drafts them, and the verify rows see the drafts as output.
    scripts = [[11, 12, 13], [30, 31]]

    async def scenario(app):
        return await generate(app, {
            "input_ids": [[5, 6, 7], [8, 9]], "custom_logit_processor": to_str(Script),
            "sampling_params": [{"temperature": t, "max_new_tokens": 12, "ignore_eos": True,
                                 "custom_params": {"tokens": s}} for s, t in zip(scripts, (0, 0.8))]})

    status, out = serve(tiny_llama_dir, tmp_path, scenario, enable_custom_logit_processor=True, **speculative)
    assert status == 200, out
    for script, answer in zip(scripts, out):
        assert answer["output_ids"] == [script[k % len(script)] for k in range(12)]
    if speculative:
        assert sum(a["meta_info"]["spec_accept_token_num"] for a in out) > 0


def test_the_openai_routes_take_it_through_extra_body(tiny_llama_dir, tmp_path):
    from starlette.testclient import TestClient

    openai = pytest.importorskip("openai")
    extra = {"custom_logit_processor": to_str(Script), "custom_params": {"tokens": [21, 22]}, "ignore_eos": True,
             "return_token_ids": True}
    app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path),
                     enable_custom_logit_processor=True, **OPTIONS)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        completion = client.completions.create(model="m", prompt="Hello", max_tokens=5, extra_body=extra)
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                              extra_body=extra)
        streamed = [c.choices[0].text for c in client.completions.create(model="m", prompt="Hello", max_tokens=5,
                                                                        stream=True, extra_body=extra)]
    assert completion.choices[0].model_extra["token_ids"] == [21, 22, 21, 22, 21]
    assert chat.choices[0].model_extra["token_ids"] == [21, 22, 21, 22, 21]
    assert "".join(streamed) == completion.choices[0].text


def test_a_processor_that_raises_ends_its_own_request_only(tiny_llama_dir, tmp_path):
    async def scenario(app):
        good = generate(app, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}})
        bad = generate(app, {"input_ids": [8, 9], "custom_logit_processor": to_str(Broken),
                             "sampling_params": {"max_new_tokens": 30}})
        return await asyncio.gather(good, bad)

    (good, answer), (bad, error) = serve(tiny_llama_dir, tmp_path, scenario, enable_custom_logit_processor=True)
    assert good == 200 and len(answer["output_ids"]) == 30
    assert bad == 500 and "error" in error


class _Touch:
    """A pickle that would create `path` when unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_what_cannot_be_served_is_a_400_and_nothing_is_unpickled_without_the_option(tiny_llama_dir, tmp_path):
    marker = tmp_path / "unpickled"
    payload = json.dumps({"callable": pickle.dumps(_Touch(str(marker))).hex()})
    good = to_str(BanTokens)
    cases = [  # (the option, body, param, a phrase of the message)
        (False, {"custom_logit_processor": payload}, "custom_logit_processor", "--enable-custom-logit-processor"),
        (True, {"custom_logit_processor": "not json"}, "custom_logit_processor", "to_str()"),
        (True, {"custom_logit_processor": json.dumps({"callable": base64.b16encode(b"junk").decode()})},
         "custom_logit_processor", "to_str()"),
        (True, {"sampling_params": {"custom_params": {"token_ids": [1]}}}, "sampling_params.custom_params",
         "custom_logit_processor"),
        (True, {"custom_logit_processor": good, "sampling_params": {"regex": "[a-z]+",
                                                                    "custom_params": {"token_ids": [1]}}},
         "custom_logit_processor", "grammar"),
    ]

    def cases_of(enabled: bool):
        async def scenario(app):
            return [await generate(app, {"input_ids": [5, 6], **body}) for on, body, _, _ in cases if on == enabled]
        return scenario

    answers = serve(tiny_llama_dir, tmp_path, cases_of(False)) + \
        serve(tiny_llama_dir, tmp_path, cases_of(True), enable_custom_logit_processor=True)
    ordered = [c for c in cases if not c[0]] + [c for c in cases if c[0]]
    for (status, body), (_, _, param, phrase) in zip(answers, ordered):
        assert status == 400 and body["error"]["param"] == param and phrase in body["error"]["message"], body
    assert not marker.exists()
