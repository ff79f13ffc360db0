"""SGLang's return_hidden_states on /generate (with
--enable-return-hidden-states): meta_info.hidden_states holds the prompt's
rows, then one row per output token the model read, each the final-norm
hidden state transformers computes at that position on the same tiny
weights (float32, within 1e-4); streamed as it comes, the prompt computed
whole however it is chunked or cached, and refused without the flag."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from pyserve.asgi import create_app
from tests.test_api_handlers import call
from tests.tiny_models import build_tiny_model

transformers = pytest.importorskip("transformers")

PROMPT = [1, 37, 101, 250, 12, 99, 400, 7, 63, 5, 201]
OTHER = [1, 80, 81, 82]
MAX_NEW = 6


def hf_rows(model_dir, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


def generate_body(**fields) -> dict:
    return {"sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}, **fields}


def test_hidden_states_match_transformers(tmp_path, default_model_dir):
    model_dir = build_tiny_model(tmp_path / "model", "llama", tokenizer_dir=default_model_dir)

    async def go():
        # Overlap on: the step launched after the last token must not add a row.
        app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path / "files"), dtype="float32",
                         enable_return_hidden_states=True, chunked_prefill_size=4, disable_overlap_schedule=False)
        await app.startup()
        try:
            plain = json.loads((await call(app, "POST", "/generate", generate_body(input_ids=PROMPT)))[2])
            # The prompt is now cached; a request for hidden states computes it again.
            whole = json.loads((await call(app, "POST", "/generate", generate_body(
                input_ids=[PROMPT, OTHER], return_hidden_states=[True, False])))[2])
            stream = (await call(app, "POST", "/generate", generate_body(input_ids=PROMPT, return_hidden_states=True,
                                                                         stream=True)))[2]
            return plain, whole, stream
        finally:
            await app.shutdown()

    plain, (asked, other), stream = asyncio.run(go())
    assert asked["output_ids"] == plain["output_ids"] and len(asked["output_ids"]) == MAX_NEW
    assert "hidden_states" not in plain["meta_info"] and "hidden_states" not in other["meta_info"]
    prompt_rows, *token_rows = asked["meta_info"]["hidden_states"]
    assert len(prompt_rows) == len(PROMPT) and len(token_rows) == MAX_NEW - 1
    want = hf_rows(model_dir, PROMPT + asked["output_ids"][:-1])
    got = torch.tensor(prompt_rows + token_rows)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-4
    events = [json.loads(line.removeprefix(b"data: ")) for line in stream.splitlines()
              if line.startswith(b"data: ") and line != b"data: [DONE]"]
    last_prompt, *last_tokens = events[-1]["meta_info"]["hidden_states"]
    assert (torch.tensor(last_prompt + last_tokens) - got).abs().max() < 1e-5
    # Each event holds the rows so far: the prompt's, then one per token read.
    counts = [len(e["meta_info"]["hidden_states"]) for e in events]
    assert counts == sorted(counts) and counts[0] >= 1


def test_hidden_states_need_the_flag(tmp_path, default_model_dir):
    model_dir = build_tiny_model(tmp_path / "model", "llama", tokenizer_dir=default_model_dir)

    async def go():
        app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path / "files"), dtype="float32")
        await app.startup()
        try:
            return [await call(app, "POST", path, body) for path, body in (
                ("/generate", generate_body(input_ids=PROMPT, return_hidden_states=True)),
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "return_hidden_states": True}))]
        finally:
            await app.shutdown()

    for status, _, body in asyncio.run(go()):
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == "return_hidden_states"
        assert "--enable-return-hidden-states" in error["message"]


def test_openai_routes_answer_the_last_hidden_state(tmp_path, default_model_dir):
    """SGLang's return_hidden_states on chat and completions: each choice's
    hidden_states is the last row /generate lists (the last output token
    read), on the choice, and on a stream's finish chunk."""
    import openai
    from starlette.testclient import TestClient

    model_dir = build_tiny_model(tmp_path / "model", "llama", tokenizer_dir=default_model_dir)
    app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path / "files"), dtype="float32",
                     enable_return_hidden_states=True)
    extra = {"return_hidden_states": True, "ignore_eos": True}
    messages = [{"role": "user", "content": "Name a colour."}]
    with TestClient(app) as http:
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="x", http_client=http)
        completion = client.completions.create(model="m", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                               extra_body=extra)
        streamed = [c for c in client.completions.create(model="m", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                                         stream=True, extra_body=extra)]
        chat = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                              extra_body=extra)
        chat_chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_NEW,
                                                          temperature=0, stream=True, extra_body=extra))
        chat_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        native = [http.post("/generate", json=generate_body(input_ids=ids, return_hidden_states=True)).json()
                  for ids in (PROMPT, chat_ids)]
        one_token = client.completions.create(model="m", prompt=PROMPT, max_tokens=1, extra_body=extra)
        plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
    want = [torch.tensor(answer["meta_info"]["hidden_states"][-1]) for answer in native]
    got = [completion.choices[0].model_extra["hidden_states"], streamed[-1].choices[0].model_extra["hidden_states"],
           chat.choices[0].model_extra["hidden_states"],
           chat_chunks[-1].choices[0].delta.model_extra["hidden_states"]]
    for vector, reference in zip(got, [want[0], want[0], want[1], want[1]]):
        assert (torch.tensor(vector) - reference).abs().max() < 1e-5
    # One token generated: no output token was read.
    assert one_token.choices[0].model_extra["hidden_states"] == []
    assert "hidden_states" not in plain.choices[0].model_extra
