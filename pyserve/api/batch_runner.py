"""Runs OpenAI batches as asyncio tasks.

A batch goes validating -> in_progress -> finalizing -> completed, or
failed (invalid input), cancelling -> cancelled, or expired. Its requests
go through the same handlers as online requests, at batch priority and at
most `concurrency` at a time, so interactive traffic keeps its latency.
Result lines are appended as requests finish and the record is saved as it
changes, so a restart resumes a batch where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import msgspec

from pyserve.api import chat, completions
from pyserve.api.errors import APIError, bad_request, from_msgspec
from pyserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pyserve.api.serving import ServingContext, new_id
from pyserve.engine.request import BATCH_PRIORITY
from pyserve.storage.batches import BatchStore, new_batch_id
from pyserve.storage.files import FileNotFound, FileStore

logger = logging.getLogger("pyserve.batches")

ENDPOINTS = {
    "/v1/chat/completions": (ChatCompletionRequest, chat.create),
    "/v1/completions": (CompletionRequest, completions.create),
}
ACTIVE = {"validating", "in_progress", "finalizing", "cancelling"}
_WINDOW = re.compile(r"^(\d+)([hm])$")
_SAVE_INTERVAL = 0.5  # seconds between saves of a running batch's counts


class BatchManager:
    def __init__(self, ctx: ServingContext, files: FileStore, store: BatchStore, concurrency: int):
        self.ctx = ctx
        self.files = files
        self.store = store
        self.concurrency = concurrency
        self.records = store.load_all()
        self.tasks: dict[str, asyncio.Task] = {}
        self._slots = asyncio.Semaphore(concurrency)  # shared by all batches
        self._last_save: dict[str, float] = {}

    # -- API -----------------------------------------------------------------

    async def create(self, input_file_id: str, endpoint: str, completion_window: str, metadata) -> dict:
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {sorted(ENDPOINTS)}", "endpoint")
        match = _WINDOW.match(completion_window or "")
        if not match or int(match.group(1)) == 0:
            raise bad_request("completion_window must look like '24h'", "completion_window")
        window = int(match.group(1)) * (3600 if match.group(2) == "h" else 60)
        if metadata is not None and (
            not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
        ):
            raise bad_request("metadata must be an object of strings", "metadata")
        try:
            await self.files.get(input_file_id)
        except FileNotFound:
            raise APIError(f"no file with id {input_file_id!r}", 404, param="input_file_id",
                           code="file_not_found") from None
        now = int(time.time())
        record = {
            "id": new_batch_id(), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + window, "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
        }
        self._save(record, force=True)
        self.records[record["id"]] = record
        self._spawn(record["id"])
        return record

    def get(self, batch_id: str) -> dict:
        try:
            return self.records[batch_id]
        except KeyError:
            raise APIError(f"no batch with id {batch_id!r}", 404, code="batch_not_found") from None

    def list(self) -> list[dict]:
        return sorted(self.records.values(), key=lambda r: r["id"], reverse=True)  # newest first

    async def cancel(self, batch_id: str) -> dict:
        record = self.get(batch_id)
        if record["status"] in ("validating", "in_progress"):
            record["status"] = "cancelling"
            record["cancelling_at"] = int(time.time())
            self._save(record, force=True)
            task = self.tasks.get(batch_id)
            if task is not None:
                task.cancel()
        elif record["status"] != "cancelling":
            raise APIError(f"cannot cancel a batch that is {record['status']}", 409, code="invalid_state")
        return record

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Resume the batches a previous run left active."""
        for batch_id, record in self.records.items():
            if record["status"] in ACTIVE:
                logger.info("Resuming batch %s (%s)", batch_id, record["status"])
                self._spawn(batch_id)

    async def shutdown(self) -> None:
        """Stop without changing any status, so the next start resumes."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, batch_id: str) -> None:
        task = asyncio.create_task(self._run(batch_id), name=f"batch-{batch_id}")
        self.tasks[batch_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(batch_id, None))

    def _save(self, record: dict, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_save.get(record["id"], 0.0) >= _SAVE_INTERVAL:
            self.store.save(record)
            self._last_save[record["id"]] = now

    # -- running -------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        record = self.records[batch_id]
        try:
            if record["status"] in ("validating", "in_progress"):
                lines = await self._read_input(record)
                if lines is None:
                    return
                if record["status"] == "validating":
                    record["status"] = "in_progress"
                    record["in_progress_at"] = int(time.time())
                    self._save(record, force=True)
                expired = await self._run_lines(record, lines)
                await self._finalize(record, "expired" if expired else "completed")
            elif record["status"] == "cancelling":
                await self._finalize(record, "cancelled")
            elif record["status"] == "finalizing":
                await self._finalize(record, "completed")
        except asyncio.CancelledError:
            if record["status"] == "cancelling":
                await self._finalize(record, "cancelled")
            else:
                raise  # server shutdown: keep the status for a resume
        except Exception as e:
            logger.exception("batch %s failed", batch_id)
            self._fail(record, [{"code": "internal_error", "line": None, "message": str(e), "param": None}])

    def _fail(self, record: dict, errors: list[dict]) -> None:
        record["status"] = "failed"
        record["failed_at"] = int(time.time())
        record["errors"] = {"object": "list", "data": errors}
        self._save(record, force=True)

    async def _read_input(self, record: dict) -> list[dict] | None:
        """Parse and check every input line; on any problem the batch fails
        with one error per bad line, as OpenAI reports them."""
        model_class, _ = ENDPOINTS[record["endpoint"]]
        errors, lines, seen = [], [], set()
        short = record["endpoint"].removeprefix("/v1")

        def error(code: str, line: int, message: str, param: str | None = None):
            errors.append({"code": code, "line": line, "message": message, "param": param})

        try:
            number = 0
            async for raw in self.files.read_lines(record["input_file_id"]):
                number += 1
                if not raw.strip():
                    continue
                try:
                    item = json.loads(raw)
                except ValueError:
                    error("invalid_json_line", number, "this line is not valid JSON")
                    continue
                if not isinstance(item, dict):
                    error("invalid_json_line", number, "each line must be a JSON object")
                    continue
                custom_id = item.get("custom_id")
                if not isinstance(custom_id, str) or not custom_id:
                    error("missing_required_parameter", number, "custom_id is required", "custom_id")
                    continue
                if custom_id in seen:
                    error("duplicate_custom_id", number, f"custom_id {custom_id!r} appears twice", "custom_id")
                    continue
                seen.add(custom_id)
                if item.get("method") != "POST":
                    error("invalid_method", number, "method must be POST", "method")
                    continue
                if item.get("url") not in (record["endpoint"], short):
                    error("invalid_url", number, f"url must be {record['endpoint']}, as the batch's endpoint", "url")
                    continue
                body = item.get("body")
                if not isinstance(body, dict):
                    error("invalid_request", number, "body must be a JSON object", "body")
                    continue
                if body.get("stream"):
                    error("invalid_request", number, "streaming is not supported in batches", "body.stream")
                    continue
                try:
                    msgspec.convert(body, model_class)
                except msgspec.ValidationError as e:
                    err = from_msgspec(e)
                    error("invalid_request", number, err.message, f"body.{err.param}" if err.param else "body")
                    continue
                lines.append({"custom_id": custom_id, "body": body})
        except FileNotFound:
            error("file_not_found", None, f"the input file {record['input_file_id']} no longer exists")
        if not errors and not lines:
            error("empty_file", None, "the input file has no requests")
        if errors:
            self._fail(record, errors)
            return None
        record["request_counts"]["total"] = len(lines)
        return lines

    async def _run_lines(self, record: dict, lines: list[dict]) -> bool:
        """Run what is not done yet; True if the batch expired first."""
        batch_id = record["id"]
        done = self.store.finished_lines(batch_id)
        counts = record["request_counts"]
        counts["completed"] = sum(done.values())
        counts["failed"] = len(done) - counts["completed"]
        todo = [line for line in lines if line["custom_id"] not in done]
        queue: asyncio.Queue = asyncio.Queue()
        for line in todo:
            queue.put_nowait(line)
        expired = False

        async def worker():
            nonlocal expired
            while not queue.empty():
                if time.time() > record["expires_at"]:
                    expired = True
                    return
                line = queue.get_nowait()
                async with self._slots:
                    await self._run_one(record, line)

        workers = [asyncio.create_task(worker()) for _ in range(min(self.concurrency, len(todo)))]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        return expired

    async def _run_one(self, record: dict, line: dict) -> None:
        model_class, handler = ENDPOINTS[record["endpoint"]]
        request_id = new_id("batch_req_")
        try:
            body = await handler(self.ctx, msgspec.convert(line["body"], model_class), priority=BATCH_PRIORITY)
            response, ok = {"status_code": 200, "request_id": request_id, "body": body}, True
        except APIError as e:
            response, ok = {"status_code": e.status, "request_id": request_id, "body": e.body()}, False
        result = {"id": request_id, "custom_id": line["custom_id"], "response": response, "error": None}
        path = self.store.output_path(record["id"]) if ok else self.store.errors_path(record["id"])
        # One whole line per write: a crash leaves at most one cut line.
        with open(path, "ab") as f:
            f.write(msgspec.json.encode(result) + b"\n")
        record["request_counts"]["completed" if ok else "failed"] += 1
        self._save(record)

    async def _finalize(self, record: dict, final_status: str) -> None:
        batch_id = record["id"]
        record["status"] = "finalizing" if final_status != "cancelled" else "cancelling"
        record["finalizing_at"] = record["finalizing_at"] or int(time.time())
        self._save(record, force=True)
        for path, key, purpose, suffix in (
            (self.store.output_path(batch_id), "output_file_id", "batch_output", "output"),
            (self.store.errors_path(batch_id), "error_file_id", "batch_output", "errors"),
        ):
            if path.exists() and record[key] is None:
                meta = await self.files.adopt(path, f"{batch_id}_{suffix}.jsonl", purpose)
                record[key] = meta["id"]
                self._save(record, force=True)
        record["status"] = final_status
        record[f"{final_status}_at"] = int(time.time())
        self._save(record, force=True)
        logger.info("Batch %s %s: %s", batch_id, final_status, record["request_counts"])
