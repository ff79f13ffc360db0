"""Files and Batches with the official openai client against the app in
process (its answers are checked, not the server process): the seeds'
three batch scenarios, bad input, cancel, pagination. Path traversal is
tried on the shared real server (its HTTP server decodes the path); the
slow tests restart and kill -9 real servers."""

from __future__ import annotations

import io
import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, app_of_cli
from tests.slow import slow_test

JOKE = {"model": "m", "messages": [{"role": "user", "content": "Tell me a joke about programming"}],
        "max_tokens": 50}


def story(i: int, max_tokens: int) -> dict:
    return {
        "custom_id": f"request-{i}", "method": "POST", "url": "/chat/completions",
        "body": {"model": "m", "max_tokens": max_tokens, "messages": [
            {"role": "system", "content": f"{i}: You are a helpful AI assistant"},
            {"role": "user", "content": "Write a detailed story about topic. Make it very long."},
        ]},
    }


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("storage")


@pytest.fixture(scope="module")
def batch_server(storage):
    """The app on the embedded model, in process, and a TestClient of it."""
    with app_of_cli("--file-storage-path", str(storage), "--max-total-tokens", "8192") as http:
        yield http


@pytest.fixture(scope="module")
def bclient(batch_server):
    return openai.OpenAI(api_key="EMPTY", base_url=f"{batch_server.base_url}/v1", http_client=batch_server,
                         timeout=60)


def upload(client, data: bytes, name="batch_requests.jsonl"):
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def wait_for(client, batch_id, statuses, timeout=120.0):
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.time() < deadline, f"batch still {batch.status}"
        time.sleep(0.5)


def read_lines(client, file_id) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).read().decode().splitlines()]


def test_seed_two_requests_chat_batch(bclient):
    requests = [
        {"custom_id": "request-1", "method": "POST", "url": "/chat/completions", "body": JOKE},
        {"custom_id": "request-2", "method": "POST", "url": "/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "What is Python?"}], "max_tokens": 50}},
    ]
    file = upload(bclient, jsonl(requests))
    assert file.purpose == "batch" and file.bytes > 0
    batch = bclient.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "validating"
    batch = wait_for(bclient, batch.id, {"completed", "failed"})
    assert batch.status == "completed", batch.errors
    assert batch.request_counts.total == 2 and batch.request_counts.completed == 2
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    lines = read_lines(bclient, batch.output_file_id)
    assert sorted(line["custom_id"] for line in lines) == ["request-1", "request-2"]
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["id"].startswith("batch_req_")
        assert set(line["response"]) == {"status_code", "request_id", "body"}
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        assert isinstance(body["choices"], list) and body["choices"][0]["message"]["content"]
    deleted = bclient.files.delete(batch.output_file_id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        bclient.files.retrieve(batch.output_file_id)


def test_seed_twenty_requests_progress_is_visible(bclient):
    file = upload(bclient, jsonl([story(i, 64) for i in range(20)]))
    batch = bclient.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    seen = set()
    deadline = time.time() + 180
    while batch.status not in ("completed", "failed"):
        assert time.time() < deadline
        time.sleep(0.3)
        batch = bclient.batches.retrieve(batch.id)
        seen.add(batch.request_counts.completed)
    assert batch.status == "completed"
    assert batch.request_counts.total == 20 and batch.request_counts.completed == 20
    assert len(seen) > 2  # counts moved while it ran
    assert len(read_lines(bclient, batch.output_file_id)) == 20


def test_seed_cancel_large_batch(bclient, batch_server):
    file = upload(bclient, jsonl([story(i, 128) for i in range(5000)]))
    batch = bclient.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(bclient, batch.id, {"in_progress"})
    time.sleep(3)
    cancelled = bclient.batches.cancel(batch_id=batch.id)
    assert cancelled.status == "cancelling"
    final = wait_for(bclient, batch.id, {"cancelled"})
    assert final.cancelled_at and final.cancelling_at
    # The lines in flight are aborted and no other starts: the counts are
    # those the cancel answered with.
    assert final.request_counts == cancelled.request_counts, (cancelled.request_counts, final.request_counts)
    assert final.request_counts.total == 5000 and final.request_counts.completed < 5000
    if final.request_counts.completed:
        assert len(read_lines(bclient, final.output_file_id)) == final.request_counts.completed
    info = batch_server.get("/get_server_info").json()
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["kv_tokens_in_use"] == 0
    assert info["kv_tokens_cached"] == info["kv_tokens_cached_evictable"]
    assert bclient.files.delete(file.id).deleted


def test_completions_batch_with_n(bclient):
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "n": 2, "seed": 1}}
    file = upload(bclient, jsonl([line]))
    batch = bclient.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    batch = wait_for(bclient, batch.id, {"completed", "failed"})
    assert batch.status == "completed"
    (result,) = read_lines(bclient, batch.output_file_id)
    assert [c["index"] for c in result["response"]["body"]["choices"]] == [0, 1]


def test_request_errors_go_to_the_error_file(bclient):
    lines = [
        {"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", "body": JOKE},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}},
    ]
    batch = bclient.batches.create(input_file_id=upload(bclient, jsonl(lines)).id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_for(bclient, batch.id, {"completed", "failed"})
    assert batch.status == "completed"
    assert batch.request_counts.completed == 1 and batch.request_counts.failed == 1
    (error,) = read_lines(bclient, batch.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "temperature"


INVALID_INPUTS = {
    "malformed json": (["{not json"], "invalid_json_line"),
    "missing custom_id": ([{"method": "POST", "url": "/v1/chat/completions", "body": JOKE}],
                          "missing_required_parameter"),
    "duplicate custom_id": ([{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": JOKE}] * 2,
                            "duplicate_custom_id"),
    "wrong method": ([{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": JOKE}],
                     "invalid_method"),
    "wrong url": ([{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": JOKE}], "invalid_url"),
    "stream true": ([{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                      "body": dict(JOKE, stream=True)}], "invalid_request"),
}


@pytest.mark.parametrize("case", list(INVALID_INPUTS))
def test_invalid_input_fails_the_batch_with_line_errors(bclient, case):
    lines, code = INVALID_INPUTS[case]
    batch = bclient.batches.create(input_file_id=upload(bclient, jsonl(lines)).id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_for(bclient, batch.id, {"failed", "completed"}, timeout=20)
    assert batch.status == "failed" and batch.failed_at
    codes = [e.code for e in batch.errors.data]
    assert code in codes
    assert all(e.line for e in batch.errors.data if e.code == code)


def test_bad_batch_creation(bclient):
    file = upload(bclient, jsonl([{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": JOKE}]))
    with pytest.raises(openai.BadRequestError):
        bclient.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        bclient.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="soon")
    with pytest.raises(openai.NotFoundError):
        bclient.batches.create(input_file_id="file-000000000000000000000000", endpoint="/v1/chat/completions",
                               completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        bclient.batches.retrieve("batch_nope")


def test_file_list_pagination(bclient):
    ids = [upload(bclient, b"{}\n", name=f"p{i}.jsonl").id for i in range(3)]
    first = bclient.files.list(limit=2, order="asc", purpose="batch")
    everything = [f.id for f in bclient.files.list(order="asc", purpose="batch")]
    assert everything[-3:] == ids
    assert len(first.data) == 2 and first.has_more
    rest = bclient.files.list(limit=100, order="asc", purpose="batch", after=first.data[-1].id)
    assert [f.id for f in first.data] + [f.id for f in rest.data] == everything
    assert bclient.files.retrieve(ids[0]).filename == "p0.jsonl"


@pytest.mark.parametrize("path", [
    "/v1/files/..%2F..%2Fetc%2Fpasswd", "/v1/files/file-..%2F..%2Fpasswd/content",
    "/v1/files/%2Fetc%2Fpasswd/content", "/v1/batches/..%2Fbatches%2Fx",
])
def test_path_traversal_is_rejected(server, path):
    r = httpx.get(server.base_url + path)
    # the decoded path matches no route, or an id that is not of our shape
    assert r.status_code == 404
    assert r.json()["error"]["code"] in ("not_found", "file_not_found", "batch_not_found")
    assert "root:" not in r.text


def test_upload_needs_a_purpose_and_a_file(batch_server):
    r = batch_server.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = batch_server.post("/v1/files", data={"purpose": "batch"}, files={"other": ("a", b"x")})
    assert r.status_code == 400


def run_batch_then_kill_9(storage, lines: int, window: str, concurrency: int, kill_after: int) -> str:
    """Start a server, submit a batch, `kill -9` the server once `kill_after`
    requests are done; returns the batch id."""
    srv = ServerProcess("--file-storage-path", str(storage), "--batch-concurrency", str(concurrency))
    client = openai.OpenAI(api_key="EMPTY", base_url=f"{srv.base_url}/v1", timeout=60)
    batch = client.batches.create(input_file_id=upload(client, jsonl([story(i, 24) for i in range(lines)])).id,
                                  endpoint="/v1/chat/completions", completion_window=window)
    deadline = time.time() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < kill_after:
        assert time.time() < deadline
        time.sleep(0.2)
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait()
    srv.stop()
    return batch.id


@slow_test
def test_batch_resumes_after_kill_9(tmp_path):
    batch_id = run_batch_then_kill_9(tmp_path, 12, "24h", concurrency=2, kill_after=3)
    again = ServerProcess("--file-storage-path", str(tmp_path))
    try:
        client = openai.OpenAI(api_key="EMPTY", base_url=f"{again.base_url}/v1", timeout=60)
        done = wait_for(client, batch_id, {"completed", "failed"})
        assert done.status == "completed"
        assert done.request_counts.completed == 12
        ids = [line["custom_id"] for line in read_lines(client, done.output_file_id)]
        assert sorted(ids) == sorted(f"request-{i}" for i in range(12))  # each exactly once
    finally:
        again.stop()


@slow_test
def test_batch_past_its_window_after_downtime_ends_expired(tmp_path):
    """The server was down past the completion window: on restart the batch
    ends `expired`, keeping what it had finished."""
    batch_id = run_batch_then_kill_9(tmp_path, 12, "1h", concurrency=1, kill_after=2)
    record_path = tmp_path / "batches" / f"{batch_id}.json"
    record = json.loads(record_path.read_text())
    record["expires_at"] = int(time.time()) - 1  # the hour went by while it was down
    record_path.write_text(json.dumps(record))
    again = ServerProcess("--file-storage-path", str(tmp_path))
    try:
        client = openai.OpenAI(api_key="EMPTY", base_url=f"{again.base_url}/v1", timeout=60)
        done = wait_for(client, batch_id, {"expired", "completed", "failed"})
        assert done.status == "expired" and done.expired_at
        assert 2 <= done.request_counts.completed < 12
        assert len(read_lines(client, done.output_file_id)) == done.request_counts.completed
    finally:
        again.stop()


@slow_test
def test_upload_over_the_size_limit_is_refused(tmp_path):
    srv = ServerProcess("--file-storage-path", str(tmp_path), "--max-upload-size", "1000",
                        "--max-total-tokens", "1024")
    try:
        r = httpx.post(f"{srv.base_url}/v1/files", data={"purpose": "batch"},
                       files={"file": ("big.jsonl", b"x" * 5000)})
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
        assert httpx.get(f"{srv.base_url}/v1/files").json()["data"] == []
        assert not list((tmp_path / "files").iterdir())  # nothing left behind
        ok = httpx.post(f"{srv.base_url}/v1/files", data={"purpose": "batch"}, files={"file": ("s.jsonl", b"{}\n")})
        assert ok.status_code == 200
    finally:
        srv.stop()
