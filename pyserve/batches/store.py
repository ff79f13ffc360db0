"""Batch records and their result files, kept on disk.

`<root>/batches/<id>.json` is the BatchRecord, which is the Batch object
as the API returns it; `<id>.output.jsonl` and `<id>.errors.jsonl` collect
result lines while the batch runs, and become files of the Files API when
it ends. Every write of either goes through BatchStore, and everything a
restart needs to resume is here.

Several processes (replicas) may share the directory: the one holding a
batch's lock (`<id>.lock`) runs it and alone writes its record and
results; another asks it to cancel through `<id>.cancel`.
"""

from __future__ import annotations

import enum
import fcntl
import os
import re
import time
from pathlib import Path
from typing import Any

import msgspec

from pyserve.files.store import time_ordered_hex

BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")
_SAVE_INTERVAL = 0.5  # seconds between saves of a running batch's counts


class BatchStatus(str, enum.Enum):
    """OpenAI's batch statuses: validating -> in_progress -> finalizing ->
    completed; or failed (invalid input), cancelling -> cancelled, expired."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def active(self) -> bool:
        """Not ended yet: a restart resumes it."""
        return self in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING,
                        BatchStatus.CANCELLING)

    @property
    def cancellable(self) -> bool:
        return self in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


class RequestCounts(msgspec.Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct, kw_only=True):
    """Why a batch failed, one per bad input line (line None: not a line's fault)."""

    code: str
    line: int | None
    message: str
    param: str | None = None


class BatchErrors(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[BatchError]


class BatchRecord(msgspec.Struct, kw_only=True):
    """A batch: the API's Batch object, field for field. Each status has its
    `<status>_at` time (validating has created_at)."""

    id: str
    object: str = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus = BatchStatus.VALIDATING
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None

    def enter(self, status: BatchStatus) -> None:
        """Move to `status`, stamping its `<status>_at` time."""
        self.status = status
        setattr(self, f"{status.value}_at", int(time.time()))


class BatchResponse(msgspec.Struct, kw_only=True):
    status_code: int
    request_id: str
    body: Any  # the route's response object, or its error body


class BatchResult(msgspec.Struct, kw_only=True):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str
    response: BatchResponse
    error: None = None


class BatchNotFound(KeyError):
    pass


class BatchLock:
    """An exclusive flock on `<id>.lock`, held while a process runs the
    batch. The kernel drops it when the process dies, however it dies, so
    another replica can resume the batch."""

    def __init__(self, fd: int):
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = -1


def new_batch_id() -> str:
    return f"batch_{time_ordered_hex()}"


_decode_record = msgspec.json.Decoder(BatchRecord).decode


class BatchStore:
    def __init__(self, root: str | Path):
        self.dir = Path(root) / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._last_save: dict[str, float] = {}

    def _path(self, batch_id: str, suffix: str) -> Path:
        if not BATCH_ID.match(batch_id):
            raise BatchNotFound(batch_id)
        return self.dir / f"{batch_id}{suffix}"

    def save(self, record: BatchRecord) -> None:
        # Small and frequent: a synchronous write-then-rename keeps it atomic.
        path = self._path(record.id, ".json")
        tmp = path.with_suffix(".json.tmp")
        tmp.write_bytes(msgspec.json.encode(record))
        os.replace(tmp, path)
        self._last_save[record.id] = time.monotonic()

    def save_progress(self, record: BatchRecord) -> None:
        """Save a running batch's counts, at most every _SAVE_INTERVAL: a
        crash loses none of the results (they are in the result files), only
        counts that the resume recounts from them."""
        if time.monotonic() - self._last_save.get(record.id, 0.0) >= _SAVE_INTERVAL:
            self.save(record)

    def load(self, batch_id: str) -> BatchRecord | None:
        """The record on disk; None if there is none (or it is unreadable)."""
        try:
            return _decode_record(self._path(batch_id, ".json").read_bytes())
        except (BatchNotFound, OSError, msgspec.DecodeError):
            return None

    def ids(self) -> list[str]:
        return [path.stem for path in self.dir.glob("batch_*.json")]

    def load_all(self) -> dict[str, BatchRecord]:
        records = {}
        for batch_id in self.ids():
            record = self.load(batch_id)
            if record is not None:
                records[record.id] = record
        return records

    def try_lock(self, batch_id: str) -> BatchLock | None:
        """The batch's lock, or None when another process (or task) holds it."""
        fd = os.open(self._path(batch_id, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return BatchLock(fd)

    def request_cancel(self, batch_id: str) -> None:
        """Ask the process running the batch to cancel it."""
        self._path(batch_id, ".cancel").touch()

    def cancel_requested(self, batch_id: str) -> bool:
        return self._path(batch_id, ".cancel").exists()

    def remove_markers(self, batch_id: str) -> None:
        """Drop the lock and cancel files of a batch that has ended. Whoever
        takes a lock checks the record afterwards, so a lock file that
        disappears under a late claimer does no harm."""
        for suffix in (".lock", ".cancel"):
            self._path(batch_id, suffix).unlink(missing_ok=True)

    def output_path(self, batch_id: str) -> Path:
        return self._path(batch_id, ".output.jsonl")

    def errors_path(self, batch_id: str) -> Path:
        return self._path(batch_id, ".errors.jsonl")

    def append_result(self, batch_id: str, result: BatchResult, ok: bool) -> None:
        """A result line to the output file (ok) or the error file. One
        whole line per write: a crash leaves at most one cut line."""
        with open(self.output_path(batch_id) if ok else self.errors_path(batch_id), "ab") as f:
            f.write(msgspec.json.encode(result) + b"\n")

    def finished_lines(self, batch_id: str) -> dict[str, bool]:
        """custom_id -> succeeded, for result lines already written. A line
        cut short by a crash is removed, so appends continue cleanly."""
        done: dict[str, bool] = {}
        for path, ok in ((self.output_path(batch_id), True), (self.errors_path(batch_id), False)):
            if not path.exists():
                continue
            data = path.read_bytes()
            whole = data[: data.rfind(b"\n") + 1]
            if len(whole) != len(data):
                path.write_bytes(whole)
            for line in whole.splitlines():
                done[msgspec.json.decode(line)["custom_id"]] = ok
        return done
