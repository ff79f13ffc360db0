"""The Batches API in-process, over a scripted engine: typed records on
disk in the API's shape, result lines written through the store, a resume
that skips finished lines. The same against the real server, kill -9
included, is tests/test_batches.py."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from pyserve.api.app import App
from pyserve.batches.runner import BatchManager
from pyserve.api.generation.serving import ServingContext
from pyserve.chat_template import ChatTemplate
from pyserve.batches.store import (
    BatchRecord, BatchResponse, BatchResult, BatchStatus, BatchStore, new_batch_id,
)
from pyserve.files.store import FileStore
from tests.test_api_handlers import ScriptedEngine, call
from tests.test_api_handlers import tokenizer  # noqa: F401 (a fixture)


def line(i: int, **body) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"hi {i}"}], **body}}


async def put_file(files: FileStore, lines: list[dict]) -> str:
    async def chunks():
        yield "".join(json.dumps(x) + "\n" for x in lines).encode()

    file_id, size = await files.write_data(chunks())
    return (await files.write_meta(file_id, "in.jsonl", "batch", size)).id


def services(root, engine, default_model_dir):
    ctx = ServingContext(engine, "served-model", ChatTemplate.for_model(default_model_dir))
    files = FileStore(root, 1 << 20)
    batches = BatchManager(ctx, files, BatchStore(root), concurrency=2)
    return App(ctx, files=files, batches=batches), files, batches


async def wait_for(app, batch_id: str, statuses: set[str]) -> dict:
    for _ in range(500):
        _, _, body = await call(app, "GET", f"/v1/batches/{batch_id}")
        batch = json.loads(body)
        if batch["status"] in statuses:
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch still {batch['status']}")


def test_a_batch_runs_to_completion_through_the_store(tmp_path, default_model_dir, tokenizer):  # noqa: F811
    async def scenario():
        app, files, batches = services(tmp_path, ScriptedEngine(tokenizer, ["a", "b"]), default_model_dir)
        input_id = await put_file(files, [line(0), line(1), line(2, temperature=9)])
        status, _, body = await call(app, "POST", "/v1/batches",
                                     {"input_file_id": input_id, "endpoint": "/v1/chat/completions"})
        assert status == 200 and json.loads(body)["status"] == "validating"
        batch = await wait_for(app, json.loads(body)["id"], {"completed", "failed"})
        _, _, listed = await call(app, "GET", "/v1/batches")
        _, _, output = await call(app, "GET", f"/v1/files/{batch['output_file_id']}/content")
        _, _, errors = await call(app, "GET", f"/v1/files/{batch['error_file_id']}/content")
        await batches.shutdown()
        return batch, json.loads(listed), output, errors

    batch, listed, output, errors = asyncio.run(scenario())
    assert batch["status"] == "completed", batch["errors"]
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert batch["in_progress_at"] and batch["finalizing_at"] and batch["completed_at"]
    assert [b["id"] for b in listed["data"]] == [batch["id"]] and listed["object"] == "list"
    results = [json.loads(x) for x in output.splitlines()]
    assert sorted(r["custom_id"] for r in results) == ["r0", "r1"]
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] == "ab" for r in results)
    (error,) = [json.loads(x) for x in errors.splitlines()]
    assert error["custom_id"] == "r2" and error["response"]["body"]["error"]["param"] == "temperature"
    on_disk = json.loads((tmp_path / "batches" / f"{batch['id']}.json").read_text())
    assert on_disk == batch  # the record on disk is the API's Batch object
    assert not (tmp_path / "batches" / f"{batch['id']}.output.jsonl").exists()  # handed to the Files API


def test_a_restart_resumes_without_running_finished_lines(tmp_path, default_model_dir, tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer, ["z"])

    async def scenario():
        app, files, batches = services(tmp_path, engine, default_model_dir)
        input_id = await put_file(files, [line(i) for i in range(4)])
        # What a killed server leaves: in progress, one line written, one cut short.
        record = BatchRecord(id=new_batch_id(), endpoint="/v1/chat/completions", input_file_id=input_id,
                             completion_window="24h", created_at=1, expires_at=2**40,
                             status=BatchStatus.IN_PROGRESS, in_progress_at=1)
        store = BatchStore(tmp_path)
        store.save(record)
        store.append_result(record.id, BatchResult(id="batch_req_1", custom_id="r1", response=BatchResponse(
            status_code=200, request_id="batch_req_1", body={})), ok=True)
        with open(store.output_path(record.id), "ab") as f:
            f.write(b'{"id": "batch_req_2", "custom_id": "r2", "resp')
        app, files, batches = services(tmp_path, engine, default_model_dir)
        batches.start()
        batch = await wait_for(app, record.id, {"completed", "failed"})
        _, _, output = await call(app, "GET", f"/v1/files/{batch['output_file_id']}/content")
        await batches.shutdown()
        return batch, output

    batch, output = asyncio.run(scenario())
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 4
    assert sorted(json.loads(x)["custom_id"] for x in output.splitlines()) == ["r0", "r1", "r2", "r3"]
    assert len(engine.requests) == 3  # r1 was done before the restart


def test_records_round_trip_and_unreadable_ones_are_skipped(tmp_path):
    store = BatchStore(tmp_path)
    record = BatchRecord(id=new_batch_id(), endpoint="/v1/completions", input_file_id="file-x",
                         completion_window="1h", created_at=5, expires_at=3605, metadata={"k": "v"})
    store.save(record)
    (tmp_path / "batches" / "batch_000000000000000000000000.json").write_text("{cut")
    assert BatchStore(tmp_path).load_all() == {record.id: record}
    raw = json.loads((tmp_path / "batches" / f"{record.id}.json").read_text())
    assert raw["status"] == "validating" and raw["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert msgspec.json.decode(json.dumps(raw), type=BatchRecord) == record


def test_entering_a_status_stamps_its_time():
    record = BatchRecord(id=new_batch_id(), endpoint="/v1/completions", input_file_id="file-x",
                         completion_window="1h", created_at=5, expires_at=3605)
    record.enter(BatchStatus.CANCELLING)
    assert record.status is BatchStatus.CANCELLING and record.cancelling_at
    assert BatchStatus.CANCELLING.active and not BatchStatus.CANCELLED.active


def test_progress_saves_are_spaced_out(tmp_path, monkeypatch):
    store = BatchStore(tmp_path)
    record = BatchRecord(id=new_batch_id(), endpoint="/v1/completions", input_file_id="file-x",
                         completion_window="1h", created_at=5, expires_at=3605)
    store.save(record)
    record.request_counts.completed = 1
    store.save_progress(record)  # right after a save: skipped
    assert BatchStore(tmp_path).load_all()[record.id].request_counts.completed == 0
    monkeypatch.setattr("pyserve.batches.store._SAVE_INTERVAL", 0.0)  # as if the interval went by
    store.save_progress(record)
    assert BatchStore(tmp_path).load_all()[record.id].request_counts.completed == 1


@pytest.mark.parametrize("batch_id", ["../x", "batch_nope"])
def test_ids_not_of_our_shape_are_never_paths(tmp_path, batch_id):
    with pytest.raises(KeyError):
        BatchStore(tmp_path).output_path(batch_id)
