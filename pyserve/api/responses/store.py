"""Responses of the Responses API kept under --file-storage-path.

`<root>/responses/<id>.json` is one stored response (the API layer's
record type: the Response object and the conversation it answered). Ids
are made here (`resp_` + 24 hex digits that sort by creation) and checked
against that shape before any path is built, so nothing a client sends
becomes a path. Writes go through aiofiles to a temporary name that is
then renamed into place, so a reader (or a restart) sees a whole record
or the previous one, never half of one.

A background response holds `<id>.lock` (an flock) while a process runs
it. The kernel drops the lock when that process dies, however it dies, so
a record still marked running whose lock is free was left behind by a
process that stopped.
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path
from typing import Generic, TypeVar

import aiofiles
import aiofiles.os
import msgspec

from pyserve.files.store import time_ordered_hex, write_replacing

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{24}$")

Record = TypeVar("Record", bound=msgspec.Struct)


def new_response_id() -> str:
    return f"resp_{time_ordered_hex()}"


class ResponseNotFound(KeyError):
    pass


class RunLock:
    """An exclusive flock on a response's lock file, held while it runs."""

    def __init__(self, fd: int, path: Path):
        self._fd = fd
        self._path = path

    def release(self) -> None:
        """Drop the lock and its file (the response is no longer running)."""
        if self._fd >= 0:
            self._path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


class ResponseStore(Generic[Record]):
    """Stored records of `record_type`, each named by its response id."""

    def __init__(self, root: str | Path, record_type: type[Record]):
        self.dir = Path(root) / "responses"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._decode = msgspec.json.Decoder(record_type).decode

    def _path(self, response_id: str, suffix: str) -> Path:
        if not RESPONSE_ID.match(response_id):
            raise ResponseNotFound(response_id)
        return self.dir / f"{response_id}{suffix}"

    async def save(self, response_id: str, record: Record) -> None:
        await write_replacing(self._path(response_id, ".json"), msgspec.json.encode(record))

    async def load(self, response_id: str) -> Record:
        """The stored record; ResponseNotFound when there is none."""
        try:
            async with aiofiles.open(self._path(response_id, ".json"), "rb") as f:
                return self._decode(await f.read())
        except FileNotFoundError:
            raise ResponseNotFound(response_id) from None

    async def delete(self, response_id: str) -> None:
        try:
            await aiofiles.os.remove(self._path(response_id, ".json"))
        except FileNotFoundError:
            raise ResponseNotFound(response_id) from None

    def try_lock(self, response_id: str) -> RunLock | None:
        """The response's run lock, or None when a process (this one
        included) holds it."""
        path = self._path(response_id, ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return RunLock(fd, path)
