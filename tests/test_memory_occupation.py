"""SGLang's /release_memory_occupation and /resume_memory_occupation, as a
colocated RL trainer calls them between rollouts: the KV cache's memory
leaves the process (its resident size drops by the pool's bytes) and the
weights' storage is given back; meanwhile requests wait, /health_generate
is a 503 and weight writes are refused; on resume the weights are read
again from the checkpoint on disk, and the server answers as before, on
the CPU's native 4-bit layers too."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from pyserve.asgi import create_app
from tests.conftest import ServerProcess
from tests.slow import slow_test
from tests.test_api_handlers import call
from tests.tiny_models import build_tiny_model

OPTIONS = {"dtype": "float32", "torchao_config": "none"}
PROMPT = {"input_ids": [5, 17, 42, 99, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                              "ignore_eos": True}}


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


async def post(app, path: str, body: dict):
    status, _, raw = await call(app, "POST", path, body)
    return status, (json.loads(raw) if raw else None)


def answer_of(model_dir, files) -> list[int]:
    """PROMPT's greedy tokens from a server started on `model_dir`."""
    async def go():
        app = create_app(model_path=str(model_dir), file_storage_path=str(files), **OPTIONS)
        await app.startup()
        try:
            return (await post(app, "/generate", PROMPT))[1]["output_ids"]
        finally:
            await app.shutdown()

    return asyncio.run(go())


def test_released_memory_leaves_and_comes_back_read_from_disk(tmp_path, default_model_dir):
    served = build_tiny_model(tmp_path / "served", "llama", tokenizer_dir=default_model_dir, seed=1)
    other = build_tiny_model(tmp_path / "other", "llama", tokenizer_dir=default_model_dir, seed=2)

    async def go():
        # A pool of ~100 MB (2 layers x 2 KV heads x 16 x float32, K and V): its leaving shows in the RSS.
        app = create_app(model_path=str(served), file_storage_path=str(tmp_path / "files"),
                         max_total_tokens=200_000, **OPTIONS)
        await app.startup()
        try:
            engine = app.http.ctx.engine
            before = (await post(app, "/generate", PROMPT))[1]["output_ids"]
            other_answer = None
            pool = engine.runner.rank_model.kv_buffer
            pool_bytes = sum(t.untyped_storage().nbytes() for t in pool.k_pages + pool.v_pages)
            resident = resident_bytes()
            assert await post(app, "/release_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
            freed = resident - resident_bytes()
            waiting = asyncio.create_task(post(app, "/generate", PROMPT))
            health = await call(app, "GET", "/health_generate")
            await asyncio.sleep(0.3)
            assert not waiting.done()  # it waits at the gate
            assert (await post(app, "/release_memory_occupation", {"tags": ["weights"]}))[0] == 200
            refused = [await post(app, "/update_weights_from_disk", {"model_path": str(other)}),
                       await post(app, "/get_weights_by_name", {"name": "model.norm.weight"})]
            # What the trainer's side would do: the checkpoint on disk changes while the weights are out.
            for name in ("model.safetensors", "config.json"):
                shutil.copy(other / name, served / name)
            assert await post(app, "/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)
            assert not waiting.done()  # the KV cache is still out
            assert await post(app, "/resume_memory_occupation", {}) == (200, None)  # all that is out
            grown = resident_bytes() - resident  # the pool back, nothing more (the weights' read let go)
            status, after = await asyncio.wait_for(waiting, 30)
            other_answer = after["output_ids"]
            again = (await post(app, "/generate", PROMPT))[1]["output_ids"]
            healthy = await call(app, "GET", "/health_generate")
            return before, other_answer, again, freed, grown, pool_bytes, health, refused, healthy
        finally:
            await app.shutdown()

    before, after, again, freed, grown, pool_bytes, health, refused, healthy = asyncio.run(go())
    assert freed > 0.8 * pool_bytes and grown < 0.3 * pool_bytes, (freed, grown, pool_bytes)
    assert health[0] == 503 and b"resume_memory_occupation" in health[2]
    for status, error in refused:  # in SGLang's control shape: {"success": false, "message"}
        assert status == 400 and "released" in error["message"], error

    assert after == again == answer_of(other, tmp_path / "files2") != before  # the other checkpoint's
    assert healthy[0] == 200


def test_the_native_4bit_layers_answer_the_same_after_a_release(default_model_dir, tmp_path):
    prompt = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}

    async def go():
        # The embedded model, in its CPU default.
        app = create_app(file_storage_path=str(tmp_path), max_total_tokens=200_000)
        await app.startup()
        try:
            rank_model = app.http.ctx.engine.runner.rank_model
            native = rank_model.native_layers is not None
            pool = rank_model.kv_buffer
            pool_bytes = sum(t.untyped_storage().nbytes() for t in pool.k_pages + pool.v_pages)
            before = (await post(app, "/generate", prompt))[1]["output_ids"]  # the native layers read the pool
            resident = resident_bytes()
            assert (await post(app, "/release_memory_occupation", {"tags": None}))[0] == 200
            freed = resident - resident_bytes()
            assert (await post(app, "/resume_memory_occupation", {"tags": None}))[0] == 200
            grown = resident_bytes() - resident
            after = (await post(app, "/generate", prompt))[1]["output_ids"]
            return native, before, after, rank_model.native_layers is not None, freed, grown, pool_bytes
        finally:
            await app.shutdown()

    native, before, after, rebuilt, freed, grown, pool_bytes = asyncio.run(go())
    assert after == before
    assert rebuilt == native
    assert freed > 0.8 * pool_bytes and grown < 0.3 * pool_bytes, (freed, grown, pool_bytes)


@pytest.mark.parametrize("level", [1, 2])
def test_vllms_sleep_keeps_the_weights_in_host_memory_at_level_1_only(tmp_path, default_model_dir, level):
    served = build_tiny_model(tmp_path / "served", "llama", tokenizer_dir=default_model_dir, seed=1)
    other = build_tiny_model(tmp_path / "other", "llama", tokenizer_dir=default_model_dir, seed=2)

    async def go():
        app = create_app(model_path=str(served), file_storage_path=str(tmp_path / "files"), **OPTIONS)
        await app.startup()
        try:
            before = (await post(app, "/generate", PROMPT))[1]["output_ids"]
            bad = await post(app, "/sleep?level=3", {})
            asleep = [(await call(app, "POST", f"/sleep?level={level}"))[0],
                      json.loads((await call(app, "GET", "/is_sleeping"))[2])]
            for name in ("model.safetensors", "config.json"):  # the checkpoint on disk changes meanwhile
                shutil.copy(other / name, served / name)
            waking = [(await call(app, "POST", "/wake_up?tags=weights"))[0],
                      json.loads((await call(app, "GET", "/is_sleeping"))[2]),
                      (await call(app, "POST", "/wake_up?tags=kv_cache"))[0],
                      json.loads((await call(app, "GET", "/is_sleeping"))[2])]
            after = (await post(app, "/generate", PROMPT))[1]["output_ids"]
            return before, bad, asleep, waking, after
        finally:
            await app.shutdown()

    before, bad, asleep, waking, after = asyncio.run(go())
    assert bad[0] == 400 and bad[1]["error"]["param"] == "level"
    assert asleep == [200, {"is_sleeping": True}]
    assert waking == [200, {"is_sleeping": True}, 200, {"is_sleeping": False}]
    other_answer = answer_of(other, tmp_path / "files2")
    assert after == (before if level == 1 else other_answer) and before != other_answer


def test_a_checkpoint_that_cannot_be_read_leaves_the_weights_released(tmp_path, default_model_dir):
    served = build_tiny_model(tmp_path / "served", "llama", tokenizer_dir=default_model_dir, seed=1)

    async def go():
        app = create_app(model_path=str(served), file_storage_path=str(tmp_path / "files"), **OPTIONS)
        await app.startup()
        try:
            before = (await post(app, "/generate", PROMPT))[1]["output_ids"]
            await post(app, "/release_memory_occupation", {"tags": ["weights"]})
            served.rename(tmp_path / "moved")
            failed = await post(app, "/resume_memory_occupation", {"tags": ["weights"]})
            still = json.loads((await call(app, "GET", "/is_sleeping"))[2])
            (tmp_path / "moved").rename(served)
            resumed = await post(app, "/resume_memory_occupation", {"tags": ["weights"]})
            # Not stuck at a gate that a lost record keeps closed.
            after = (await asyncio.wait_for(post(app, "/generate", PROMPT), 60))[1]["output_ids"]
            return before, failed, still, resumed, after
        finally:
            await app.shutdown()

    before, (status, _), still, resumed, after = asyncio.run(go())
    assert status == 400 and still == {"is_sleeping": True}
    assert resumed == (200, None) and after == before


@pytest.mark.parametrize("body, param", [({"tags": ["gpu"]}, "tags"), ({"tags": []}, "tags"),
                                         ({"tag": "kv_cache"}, "tag")])
def test_what_cannot_be_released_is_a_400_naming_the_field(tiny_llama_dir, tmp_path, body, param):
    async def go():
        app = create_app(model_path=str(tiny_llama_dir), file_storage_path=str(tmp_path), **OPTIONS)
        await app.startup()
        try:
            return await post(app, "/release_memory_occupation", body), app.http.ctx.gate.is_open
        finally:
            await app.shutdown()

    (status, error), still_open = asyncio.run(go())
    assert status == 400 and error["error"]["param"] == param
    assert still_open


@slow_test
def test_every_tensor_parallel_rank_releases_and_resumes(tiny_llama_dir):
    server = ServerProcess("--model", str(tiny_llama_dir), "--tp-size", "2", "--dtype", "float32",
                           "--torchao-config", "none", "--max-total-tokens", "4096")
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            before = http.post("/generate", json=PROMPT).json()["output_ids"]
            released = http.post("/release_memory_occupation", json={"tags": None})
            health = http.get("/health_generate")
            resumed = http.post("/resume_memory_occupation", json={"tags": None})
            after = http.post("/generate", json=PROMPT).json()["output_ids"]
    finally:
        server.stop()
    assert released.status_code == 200 and resumed.status_code == 200, (released.text, resumed.text)
    assert health.status_code == 503
    assert after == before
