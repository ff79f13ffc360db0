"""Runs OpenAI batches as asyncio tasks.

A batch goes validating -> in_progress -> finalizing -> completed, or
failed (invalid input), cancelling -> cancelled, or expired (BatchStatus).
Its requests go through the same handlers as online requests, as batch
jobs (the engine runs them behind every interactive request) and at most
`concurrency` at a time, so interactive traffic keeps its latency. Result lines are appended as requests finish and the record
is saved as it changes, both through the BatchStore, so a restart resumes
a batch where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

import msgspec

from pyserve.api.openai import chat, completions
from pyserve.http.errors import APIError, bad_request, from_msgspec
from pyserve.http.io import json_depth_exceeds
from pyserve.api.protocol.openai import ChatCompletionRequest, CompletionRequest
from pyserve.api.generation.serving import ServingContext, new_id
from pyserve.batches.store import (
    BatchError, BatchErrors, BatchLock, BatchRecord, BatchResponse, BatchResult, BatchStatus, BatchStore,
    new_batch_id,
)
from pyserve.files.store import FileNotFound, FileStore

logger = logging.getLogger("pyserve.batches")

ENDPOINTS = {
    "/v1/chat/completions": (ChatCompletionRequest, chat.create),
    "/v1/completions": (CompletionRequest, completions.create),
}
_WINDOW = re.compile(r"^(\d+)([hm])$")
WATCH_INTERVAL = 1.0  # seconds between looks for batches to resume and cancels to honour


class BatchManager:
    """Creates, shows, cancels and runs batches.

    Records live on disk (BatchStore), shared by every replica pointed at
    the same --file-storage-path; a batch runs in the one process holding
    its lock, whose in-memory record is then the current one. Every second
    the manager takes up active batches nobody runs (a restart's, or a
    stopped replica's) and honours cancels other replicas asked for."""

    def __init__(self, ctx: ServingContext, files: FileStore, store: BatchStore, concurrency: int):
        self.ctx = ctx
        self.files = files
        self.store = store
        self.concurrency = concurrency
        self.running: dict[str, BatchRecord] = {}  # the batches this process runs
        self.tasks: dict[str, asyncio.Task] = {}
        self._locks: dict[str, BatchLock] = {}
        self._ended: set[str] = set()  # ids of ended batches, not read again
        self._slots = asyncio.Semaphore(concurrency)  # shared by all batches
        self._draining = False
        self._watcher: asyncio.Task | None = None

    # -- API -----------------------------------------------------------------

    async def create(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None) -> BatchRecord:
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {sorted(ENDPOINTS)}", "endpoint")
        match = _WINDOW.match(completion_window or "")
        if not match or int(match.group(1)) == 0:
            raise bad_request("completion_window must look like '24h'", "completion_window")
        window = int(match.group(1)) * (3600 if match.group(2) == "h" else 60)
        try:
            await self.files.get(input_file_id)
        except FileNotFound:
            raise APIError(f"no file with id {input_file_id!r}", 404, param="input_file_id",
                           code="file_not_found") from None
        now = int(time.time())
        record = BatchRecord(id=new_batch_id(), endpoint=endpoint, input_file_id=input_file_id,
                             completion_window=completion_window, created_at=now, expires_at=now + window,
                             metadata=metadata)
        lock = self.store.try_lock(record.id)  # a new id: nobody else holds it
        self.store.save(record)
        self._spawn(record, lock)
        return record

    def get(self, batch_id: str) -> BatchRecord:
        record = self.running.get(batch_id) or self.store.load(batch_id)
        if record is None:
            raise APIError(f"no batch with id {batch_id!r}", 404, code="batch_not_found")
        return record

    def list(self) -> list[BatchRecord]:
        records = self.store.load_all() | self.running
        return sorted(records.values(), key=lambda r: r.id, reverse=True)  # newest first

    async def cancel(self, batch_id: str) -> BatchRecord:
        record = self.get(batch_id)
        if record.status is BatchStatus.CANCELLING:
            return record
        if not record.status.cancellable:
            raise APIError(f"cannot cancel a batch that is {record.status.value}", 409, code="invalid_state")
        if batch_id in self.running:
            self._cancel_here(record)
            return record
        lock = self.store.try_lock(batch_id)
        if lock is None:  # another replica runs it: it cancels at its next look
            self.store.request_cancel(batch_id)
            return msgspec.structs.replace(record, status=BatchStatus.CANCELLING)
        record = self.store.load(batch_id)  # what it is now that it is ours
        if record.status.cancellable:
            record.enter(BatchStatus.CANCELLING)
            self.store.save(record)
        self._spawn(record, lock)  # ends it as cancelled
        return record

    def _cancel_here(self, record: BatchRecord) -> None:
        record.enter(BatchStatus.CANCELLING)
        self.store.save(record)
        self.tasks[record.id].cancel()

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Resume the batches a previous run left active, and keep watching."""
        self._watcher = asyncio.create_task(self._watch(), name="batch-watcher")

    def drain(self) -> None:
        """Take no new lines and no new batches; lines in flight go on."""
        self._draining = True

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop, giving lines in flight up to `timeout` seconds, without
        changing any status: the records are saved and the locks dropped,
        so the next start (or another replica) resumes them."""
        self.drain()
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        tasks = list(self.tasks.values())
        if tasks and timeout > 0:
            await asyncio.wait(tasks, timeout=timeout)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self) -> None:
        while not self._draining:
            for batch_id, record in list(self.running.items()):
                if record.status.cancellable and self.store.cancel_requested(batch_id):
                    self._cancel_here(record)
            self._claim()
            await asyncio.sleep(WATCH_INTERVAL)

    def _claim(self) -> None:
        """Run the active batches that no process runs."""
        for batch_id in self.store.ids():
            if batch_id in self.running or batch_id in self._ended:
                continue
            record = self.store.load(batch_id)
            if record is None or not record.status.active:
                self._ended.add(batch_id)
                continue
            lock = self.store.try_lock(batch_id)
            if lock is None:
                continue  # another replica runs it
            record = self.store.load(batch_id)  # as its last runner left it
            if record is None or not record.status.active:
                lock.release()
                continue
            logger.info("Resuming batch %s (%s)", batch_id, record.status.value)
            self._spawn(record, lock)

    def _spawn(self, record: BatchRecord, lock: BatchLock) -> None:
        self.running[record.id] = record
        self._locks[record.id] = lock
        task = asyncio.create_task(self._run(record), name=f"batch-{record.id}")
        self.tasks[record.id] = task
        task.add_done_callback(lambda _: self._stopped(record.id))

    def _stopped(self, batch_id: str) -> None:
        """Its task ended: save the record as it is and drop the lock."""
        self.tasks.pop(batch_id, None)
        record = self.running.pop(batch_id)
        if record.status.active:
            self.store.save(record)  # counts as they are, for whoever resumes it
        self._locks.pop(batch_id).release()
        if not record.status.active:
            self._ended.add(batch_id)
            self.store.remove_markers(batch_id)

    # -- running -------------------------------------------------------------

    async def _run(self, record: BatchRecord) -> None:
        try:
            if record.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
                lines = await self._read_input(record)
                if lines is None:
                    return
                if record.status is BatchStatus.VALIDATING:
                    record.enter(BatchStatus.IN_PROGRESS)
                    self.store.save(record)
                outcome = await self._run_lines(record, lines)
                if outcome == "stopped":
                    return  # drained: the status stays, for a resume
                await self._finalize(record, BatchStatus.EXPIRED if outcome == "expired" else BatchStatus.COMPLETED)
            elif record.status is BatchStatus.CANCELLING:
                await self._finalize(record, BatchStatus.CANCELLED)
            elif record.status is BatchStatus.FINALIZING:
                await self._finalize(record, BatchStatus.COMPLETED)
        except asyncio.CancelledError:
            if record.status is BatchStatus.CANCELLING:
                await self._finalize(record, BatchStatus.CANCELLED)
            else:
                raise  # server shutdown: keep the status for a resume
        except Exception as e:
            logger.exception("batch %s failed", record.id)
            self._fail(record, [BatchError(code="internal_error", line=None, message=str(e))])

    def _fail(self, record: BatchRecord, errors: list[BatchError]) -> None:
        record.errors = BatchErrors(data=errors)
        record.enter(BatchStatus.FAILED)
        self.store.save(record)

    async def _read_input(self, record: BatchRecord) -> list[dict] | None:
        """Parse and check every input line; on any problem the batch fails
        with one error per bad line, as OpenAI reports them."""
        model_class, _ = ENDPOINTS[record.endpoint]
        errors: list[BatchError] = []
        lines, seen = [], set()
        short = record.endpoint.removeprefix("/v1")

        def error(code: str, line: int | None, message: str, param: str | None = None):
            errors.append(BatchError(code=code, line=line, message=message, param=param))

        try:
            number = 0
            async for raw in self.files.read_lines(record.input_file_id):
                number += 1
                if not raw.strip():
                    continue
                try:
                    if json_depth_exceeds(raw):
                        raise ValueError("nested too deep")
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
                if item.get("url") not in (record.endpoint, short):
                    error("invalid_url", number, f"url must be {record.endpoint}, as the batch's endpoint", "url")
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
            error("file_not_found", None, f"the input file {record.input_file_id} no longer exists")
        if not errors and not lines:
            error("empty_file", None, "the input file has no requests")
        if errors:
            self._fail(record, errors)
            return None
        record.request_counts.total = len(lines)
        return lines

    async def _run_lines(self, record: BatchRecord, lines: list[dict]) -> str:
        """Run what is not done yet: "done", "expired" (the window passed
        first) or "stopped" (the manager drains)."""
        done = self.store.finished_lines(record.id)
        counts = record.request_counts
        counts.completed = sum(done.values())
        counts.failed = len(done) - counts.completed
        todo = [line for line in lines if line["custom_id"] not in done]
        queue: asyncio.Queue = asyncio.Queue()
        for line in todo:
            queue.put_nowait(line)
        expired = False
        ran = 0

        async def worker():
            nonlocal expired, ran
            while not queue.empty() and not self._draining:
                if time.time() > record.expires_at:
                    expired = True
                    return
                line = queue.get_nowait()
                async with self._slots:
                    if self._draining:
                        return
                    await self._run_one(record, line)
                    ran += 1

        workers = [asyncio.create_task(worker()) for _ in range(min(self.concurrency, len(todo)))]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        if expired:
            return "expired"
        return "done" if ran == len(todo) else "stopped"

    async def _run_one(self, record: BatchRecord, line: dict) -> None:
        model_class, handler = ENDPOINTS[record.endpoint]
        request_id = new_id("batch_req_")
        try:
            body = await handler(self.ctx, msgspec.convert(line["body"], model_class), batch=True)
            response, ok = BatchResponse(status_code=200, request_id=request_id, body=body), True
        except APIError as e:
            response, ok = BatchResponse(status_code=e.status, request_id=request_id, body=e.body()), False
        result = BatchResult(id=request_id, custom_id=line["custom_id"], response=response)
        self.store.append_result(record.id, result, ok)
        if ok:
            record.request_counts.completed += 1
        else:
            record.request_counts.failed += 1
        self.store.save_progress(record)

    async def _finalize(self, record: BatchRecord, final: BatchStatus) -> None:
        """Hand the result files to the Files API, then end in `final`. A
        cancelled batch stays `cancelling` meanwhile, as OpenAI shows it."""
        if final is not BatchStatus.CANCELLED:
            record.status = BatchStatus.FINALIZING
        record.finalizing_at = record.finalizing_at or int(time.time())  # kept when a restart finalizes again
        self.store.save(record)
        if record.output_file_id is None:
            record.output_file_id = await self._publish(record, self.store.output_path(record.id), "output")
            self.store.save(record)
        if record.error_file_id is None:
            record.error_file_id = await self._publish(record, self.store.errors_path(record.id), "errors")
            self.store.save(record)
        record.enter(final)
        self.store.save(record)
        logger.info("Batch %s %s: %s", record.id, final.value, msgspec.to_builtins(record.request_counts))

    async def _publish(self, record: BatchRecord, path: Path, name: str) -> str | None:
        """The result file at `path` moved into the Files API: its file id
        (None when the batch wrote no such lines)."""
        if not path.exists():
            return None
        return (await self.files.adopt(path, f"{record.id}_{name}.jsonl", "batch_output")).id
