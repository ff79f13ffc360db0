"""SGLang's POST /update_weights_from_disk: a server on one checkpoint
takes another of the same model in place and then answers as a server
started on it does (transformers' greedy tokens in float32; the same
tokens as a fresh server in a quantized CPU mode), with its prefix cache
dropped; requests in flight finish first or stop with abort_all_requests;
a checkpoint that does not fit is refused and changes nothing."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from pyserve.asgi import create_app
from tests.test_api_handlers import call
from tests.test_engine_vs_hf import hf_greedy
from tests.test_pause_generation import generating
from tests.slow import slow, slow_test
from tests.tiny_models import build_tiny_model

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 99, 300, 301]
GREEDY = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model_dir):
    """Two checkpoints of one tiny Llama (other seeds), and one of another size."""
    root = tmp_path_factory.mktemp("weights")
    first = build_tiny_model(root / "first", "llama", tokenizer_dir=default_model_dir, seed=1)
    second = build_tiny_model(root / "second", "llama", tokenizer_dir=default_model_dir, seed=2)
    wider = build_tiny_model(root / "wider", "llama", tokenizer_dir=default_model_dir, seed=3, intermediate_size=192)
    return first, second, wider


def _tokens(body: bytes) -> list[int]:
    return json.loads(body)["choices"][0]["token_ids"]


async def _serve(model_dir, tmp_path, **options):
    app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path), max_total_tokens=4096, **options)
    await app.startup()
    return app


def test_the_server_answers_as_the_new_checkpoint_does(checkpoints, tmp_path):
    first, second, wider = checkpoints

    async def go():
        app = await _serve(first, tmp_path, dtype="float32", torchao_config="none")
        try:
            before = _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
            status, _, raw = await call(app, "POST", "/update_weights_from_disk", {"model_path": str(second)})
            assert status == 200 and json.loads(raw)["success"] is True, raw
            after = _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
            refused = await call(app, "POST", "/update_weights_from_disk", {"model_path": str(wider)})
            missing = await call(app, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "none")})
            still = _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
            back = await call(app, "POST", "/update_weights_from_disk",
                              {"model_path": str(first), "weight_version": "step-2"})
            again = _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
            info = json.loads((await call(app, "GET", "/get_model_info"))[2])
            return before, after, refused, missing, still, back[0], again, info
        finally:
            await app.shutdown()

    before, after, refused, missing, still, back, again, info = asyncio.run(go())
    for model_dir, tokens in ((first, before), (second, after)):
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        assert tokens == hf_greedy(reference, PROMPT, 8)
    assert before != after
    status, _, raw = refused
    assert status == 400 and json.loads(raw)["success"] is False
    assert "another size or quantization" in json.loads(raw)["message"]
    assert missing[0] == 400
    assert still == after  # a refused checkpoint changed nothing
    assert back == 200 and again == before and info["weight_version"] == "step-2"


# int8wo's packed rows are as plain as float ones: slow; 8da4w's tiles and native layers by default.
@pytest.mark.parametrize("mode", ["8da4w", pytest.param("int8wo", marks=slow)])
def test_a_quantized_mode_is_rebuilt_from_the_new_checkpoint(checkpoints, tmp_path, mode):
    """The CPU modes' packed tiles and scales, and the native layers that
    read them, hold the new checkpoint's weights."""
    first, second, _ = checkpoints

    async def tokens(model_dir, update_to=None):
        app = await _serve(model_dir, tmp_path, torchao_config=mode)
        try:
            if update_to is not None:
                status, _, raw = await call(app, "POST", "/update_weights_from_disk", {"model_path": str(update_to)})
                assert status == 200, raw
            return _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
        finally:
            await app.shutdown()

    assert asyncio.run(tokens(first, update_to=second)) == asyncio.run(tokens(second))


def test_requests_in_flight_finish_or_stop_and_arrivals_wait(checkpoints, tmp_path):
    first, second, _ = checkpoints
    long = {**GREEDY, "max_tokens": 400, "return_token_ids": False}

    async def go():
        app = await _serve(first, tmp_path, dtype="float32", torchao_config="none")
        try:
            running = asyncio.create_task(call(app, "POST", "/v1/completions", long))
            while app._engine.num_running < 1:
                await asyncio.sleep(0.01)
            update = asyncio.create_task(call(app, "POST", "/update_weights_from_disk", {"model_path": str(second)}))
            while app.http.ctx.gate.is_open:  # until the update closes it: arrivals then wait
                await asyncio.sleep(0.01)
            arriving = asyncio.create_task(call(app, "POST", "/v1/completions", GREEDY))
            finished = json.loads((await running)[2])
            assert (await update)[0] == 200
            arrived = _tokens((await arriving)[2])
            # Another update stops what runs instead of waiting for it.
            stopped_task = asyncio.create_task(call(app, "POST", "/v1/completions", long))
            while app._engine.num_running < 1:
                await asyncio.sleep(0.01)
            aborted = await call(app, "POST", "/update_weights_from_disk",
                                 {"model_path": str(first), "abort_all_requests": True})
            stopped = json.loads((await stopped_task)[2])
            return finished, arrived, aborted[0], stopped
        finally:
            await app.shutdown()

    finished, arrived, aborted, stopped = asyncio.run(go())
    assert finished["choices"][0]["finish_reason"] == "length" and finished["usage"]["completion_tokens"] == 400
    reference = transformers.AutoModelForCausalLM.from_pretrained(second, torch_dtype=torch.float32)
    assert arrived == hf_greedy(reference, PROMPT, 8)  # the request that waited ran on the new weights
    assert aborted == 200 and stopped["choices"][0]["finish_reason"] == "abort"


@slow_test  # two gloo ranks; the default suite swaps on one
def test_every_tensor_parallel_rank_takes_its_shard(checkpoints, tmp_path):
    first, second, wider = checkpoints

    async def go():
        app = await _serve(first, tmp_path, dtype="float32", torchao_config="none", tp_size=2, device="cpu")
        try:
            refused = (await call(app, "POST", "/update_weights_from_disk", {"model_path": str(wider)}))[0]
            status, _, raw = await call(app, "POST", "/update_weights_from_disk", {"model_path": str(second)})
            assert status == 200, raw
            return refused, _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
        finally:
            await app.shutdown()

    refused, tokens = asyncio.run(go())
    assert refused == 400  # found on rank 0, before any rank copied
    reference = transformers.AutoModelForCausalLM.from_pretrained(second, torch_dtype=torch.float32)
    assert tokens == hf_greedy(reference, PROMPT, 8)


def test_a_paused_engine_takes_new_weights_without_waiting_for_its_requests(checkpoints, tmp_path):
    """RL trainers' cycle: /pause_generation (retract), update, then
    /continue_generation. The paused request recomputes its KV on the new
    weights and goes on from the tokens it had; one paused in place keeps
    KV that a flush cannot drop, so only flush_cache false updates it."""
    first, second, _ = checkpoints
    long = {**GREEDY, "max_tokens": 60}

    async def go():
        app = await _serve(first, tmp_path, dtype="float32", torchao_config="none")
        try:
            running = asyncio.create_task(call(app, "POST", "/v1/completions", long))
            seq = await generating(app)
            assert (await call(app, "POST", "/pause_generation", {"mode": "retract"}))[0] == 200
            held = len(seq.output_ids)
            status, _, raw = await call(app, "POST", "/update_weights_from_disk", {"model_path": str(second)})
            assert status == 200, raw
            assert (await call(app, "POST", "/continue_generation", {}))[0] == 200
            tokens = _tokens((await running)[2])
            in_place = asyncio.create_task(call(app, "POST", "/v1/completions", long))
            while app._engine.num_running < 1:
                await asyncio.sleep(0.002)
            await call(app, "POST", "/pause_generation", {"mode": "in_place"})
            refused = await call(app, "POST", "/update_weights_from_disk", {"model_path": str(first)})
            kept = await call(app, "POST", "/update_weights_from_disk",
                              {"model_path": str(first), "flush_cache": False})
            await call(app, "POST", "/continue_generation", {})
            return held, tokens, refused, kept[0], json.loads((await in_place)[2])
        finally:
            await app.shutdown()

    held, tokens, (refused, _, raw), kept, finished = asyncio.run(go())
    old = transformers.AutoModelForCausalLM.from_pretrained(first, torch_dtype=torch.float32)
    new = transformers.AutoModelForCausalLM.from_pretrained(second, torch_dtype=torch.float32)
    assert 3 <= held < 60 and tokens[:held] == hf_greedy(old, PROMPT, held)
    assert tokens[held:] == hf_greedy(new, PROMPT + tokens[:held], 60 - held)
    assert refused == 400 and json.loads(raw)["success"] is False and "flush_cache" in json.loads(raw)["message"]
    assert kept == 200 and finished["usage"]["completion_tokens"] == 60
