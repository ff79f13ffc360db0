"""Two replicas on one --file-storage-path, in-process over scripted
engines: a batch runs in one of them only, the other takes it up when the
first stops, and a cancel sent to either reaches the one running it."""

from __future__ import annotations

import asyncio
import json

from tests.test_api_handlers import ScriptedEngine, call
from tests.test_api_handlers import tokenizer  # noqa: F401 (a fixture)
from tests.test_batch_service import line, put_file, services, wait_for

LINES = 12
SLOW = ["x"] * 20  # 0.2 s a line


def output_ids(output: bytes) -> list[str]:
    return sorted(json.loads(x)["custom_id"] for x in output.splitlines())


def two_replicas(tmp_path, tokenizer, default_model_dir, script_a=SLOW):
    """(app, files, batches, engine) of replicas A and B on one storage path."""
    replicas = []
    for script in (script_a, SLOW):
        engine = ScriptedEngine(tokenizer, script)
        replicas.append((*services(tmp_path, engine, default_model_dir), engine))
    return replicas


async def create(app, files) -> str:
    input_id = await put_file(files, [line(i) for i in range(LINES)])
    _, _, body = await call(app, "POST", "/v1/batches", {"input_file_id": input_id, "endpoint": "/v1/chat/completions"})
    return json.loads(body)["id"]


def test_a_batch_runs_in_one_replica_only(tmp_path, default_model_dir, tokenizer):  # noqa: F811
    async def scenario():
        (app_a, files, batches_a, engine_a), (app_b, _, batches_b, engine_b) = two_replicas(
            tmp_path, tokenizer, default_model_dir)
        batches_a.start()
        batches_b.start()
        batch_id = await create(app_a, files)
        seen_by_b = await wait_for(app_b, batch_id, {"in_progress"})  # B reads A's record
        batch = await wait_for(app_b, batch_id, {"completed"})
        _, _, output = await call(app_b, "GET", f"/v1/files/{batch['output_file_id']}/content")
        await batches_a.shutdown()
        await batches_b.shutdown()
        return seen_by_b, batch, output, engine_a, engine_b

    seen_by_b, batch, output, engine_a, engine_b = asyncio.run(scenario())
    assert seen_by_b["status"] == "in_progress"
    assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert output_ids(output) == sorted(f"r{i}" for i in range(LINES))
    assert len(engine_a.requests) == LINES and engine_b.requests == []


def test_the_other_replica_takes_up_a_batch_when_the_first_stops(tmp_path, default_model_dir, tokenizer):  # noqa: F811
    async def scenario():
        (app_a, files, batches_a, engine_a), (app_b, _, batches_b, engine_b) = two_replicas(
            tmp_path, tokenizer, default_model_dir)
        batches_a.start()
        batch_id = await create(app_a, files)
        while len(engine_a.requests) < 4:
            await asyncio.sleep(0.01)
        await batches_a.shutdown()  # A stops mid-batch: its lock is dropped
        batches_b.start()
        batch = await wait_for(app_b, batch_id, {"completed"})
        _, _, output = await call(app_b, "GET", f"/v1/files/{batch['output_file_id']}/content")
        await batches_b.shutdown()
        return batch, output, engine_a, engine_b

    batch, output, engine_a, engine_b = asyncio.run(scenario())
    assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert output_ids(output) == sorted(f"r{i}" for i in range(LINES))  # each line once
    assert 0 < len(engine_b.requests) < LINES  # B ran only what A had not finished


def test_a_cancel_sent_to_the_other_replica_reaches_the_runner(tmp_path, default_model_dir, tokenizer):  # noqa: F811
    async def scenario():
        (app_a, files, batches_a, engine_a), (app_b, _, batches_b, engine_b) = two_replicas(
            tmp_path, tokenizer, default_model_dir, script_a=SLOW * 5)
        batches_a.start()
        batches_b.start()
        batch_id = await create(app_a, files)
        await wait_for(app_b, batch_id, {"in_progress"})
        status, _, body = await call(app_b, "POST", f"/v1/batches/{batch_id}/cancel")
        batch = await wait_for(app_a, batch_id, {"cancelled"})
        await batches_a.shutdown()
        await batches_b.shutdown()
        return status, json.loads(body), batch, engine_a, engine_b

    status, answer, batch, engine_a, engine_b = asyncio.run(scenario())
    assert status == 200 and answer["status"] == "cancelling"
    assert batch["status"] == "cancelled" and batch["request_counts"]["completed"] < LINES
    assert engine_b.requests == []
    assert engine_a.closed  # the lines in flight were aborted
