"""Files of the OpenAI Files API, kept under --file-storage-path.

Each file is `<root>/files/<id>.data` plus `<id>.json` (its FileObject).
Ids are made here (`file-` + 24 hex digits) and checked against that shape
before any path is built, so nothing a client sends becomes a path.
Writes go to a temporary name first and are renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiofiles
import aiofiles.os
import msgspec

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
CHUNK = 1 << 16


class FileObject(msgspec.Struct, kw_only=True):
    """A file's record: `<id>.json` on disk, and the Files API's body."""

    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    status_details: str | None = None


_decode_file = msgspec.json.Decoder(FileObject).decode


class FileNotFound(KeyError):
    pass


class FileTooLarge(ValueError):
    pass


def time_ordered_hex() -> str:
    """24 hex digits that sort in creation order: nanoseconds, then random."""
    return f"{time.time_ns():016x}"[-16:] + uuid.uuid4().hex[:8]


async def write_replacing(path: Path, data: bytes) -> None:
    """`path` holds `data` whole or keeps what it held: written to a name of
    this call's own, then renamed into place. A name per call, since a write
    cancelled mid-way (its thread still writing) must not share a file with
    the write that follows it; the cancelled one's file is removed."""
    tmp = path.with_suffix(f"{path.suffix}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        async with aiofiles.open(tmp, "wb") as f:
            await f.write(data)
        await aiofiles.os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def new_file_id() -> str:
    return f"file-{time_ordered_hex()}"


class FileStore:
    def __init__(self, root: str | Path, max_bytes: int):
        self.dir = Path(root) / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def _paths(self, file_id: str) -> tuple[Path, Path]:
        if not FILE_ID.match(file_id):
            raise FileNotFound(file_id)
        return self.dir / f"{file_id}.data", self.dir / f"{file_id}.json"

    async def write_data(self, chunks: AsyncIterator[bytes]) -> tuple[str, int]:
        """Stream `chunks` to disk under a new id; returns (id, size).
        The file is listed only once `write_meta` has run."""
        file_id = new_file_id()
        data_path, _ = self._paths(file_id)
        tmp = data_path.with_suffix(".part")
        size = 0
        try:
            async with aiofiles.open(tmp, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise FileTooLarge(f"the file is larger than the limit of {self.max_bytes} bytes")
                    await f.write(chunk)
            await aiofiles.os.replace(tmp, data_path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return file_id, size

    async def write_meta(self, file_id: str, filename: str, purpose: str, size: int) -> FileObject:
        _, meta_path = self._paths(file_id)
        meta = FileObject(id=file_id, bytes=size, created_at=int(time.time()),
                          filename=os.path.basename(filename) or "upload", purpose=purpose)
        await write_replacing(meta_path, msgspec.json.encode(meta))
        return meta

    async def adopt(self, path: Path, filename: str, purpose: str) -> FileObject:
        """Move a file written elsewhere by pyserve (a batch's output) into the store."""
        file_id = new_file_id()
        data_path, _ = self._paths(file_id)
        size = path.stat().st_size
        await aiofiles.os.replace(path, data_path)
        return await self.write_meta(file_id, filename, purpose, size)

    async def get(self, file_id: str) -> FileObject:
        _, meta_path = self._paths(file_id)
        try:
            async with aiofiles.open(meta_path, "rb") as f:
                return _decode_file(await f.read())
        except FileNotFoundError:
            raise FileNotFound(file_id) from None

    async def list(self, purpose: str | None = None) -> list[FileObject]:
        """All files, newest first."""
        out = []
        for meta_path in self.dir.glob("file-*.json"):
            try:
                meta = await self.get(meta_path.stem)
            except FileNotFound:
                continue
            if purpose is None or meta.purpose == purpose:
                out.append(meta)
        out.sort(key=lambda m: m.id, reverse=True)  # ids sort by creation time
        return out

    def data_path(self, file_id: str) -> Path:
        data_path, _ = self._paths(file_id)
        if not data_path.is_file():
            raise FileNotFound(file_id)
        return data_path

    async def read_chunks(self, file_id: str) -> AsyncIterator[bytes]:
        path = self.data_path(file_id)
        async with aiofiles.open(path, "rb") as f:
            while chunk := await f.read(CHUNK):
                yield chunk

    async def read_lines(self, file_id: str) -> AsyncIterator[bytes]:
        path = self.data_path(file_id)
        async with aiofiles.open(path, "rb") as f:
            async for line in f:
                yield line

    async def discard_data(self, file_id: str) -> None:
        data_path, _ = self._paths(file_id)
        if data_path.exists():
            await aiofiles.os.remove(data_path)

    async def delete(self, file_id: str) -> dict:
        data_path, meta_path = self._paths(file_id)
        if not meta_path.is_file():
            raise FileNotFound(file_id)
        await aiofiles.os.remove(meta_path)
        if data_path.exists():
            await aiofiles.os.remove(data_path)
        return {"id": file_id, "object": "file", "deleted": True}
