"""The Files API: upload (multipart, streamed to disk), list, retrieve,
content (streamed), delete."""

from __future__ import annotations

import python_multipart

from pyserve.http.errors import APIError, bad_request
from pyserve.http.io import FileResponse, Request, page
from pyserve.files.store import FileNotFound, FileObject, FileStore, FileTooLarge

PURPOSES = {"batch", "batch_output", "fine-tune", "assistants", "user_data", "evals", "vision"}


def not_found(file_id: str) -> APIError:
    return APIError(f"no file with id {file_id!r}", 404, param="file_id", code="file_not_found")


class _Upload:
    """Feeds a multipart body to the parser and collects its fields; the
    `file` field's bytes are handed on as they arrive, never held whole."""

    def __init__(self, boundary: bytes):
        self.fields: dict[str, bytes] = {}
        self.filename = "upload"
        self.has_file = False
        self.pending: list[bytes] = []  # file bytes parsed but not yet written
        self._header_field = b""
        self._headers: dict[bytes, bytes] = {}
        self._name = None
        self.parser = python_multipart.MultipartParser(boundary, {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda d, s, e: setattr(self, "_header_field", self._header_field + d[s:e]),
            "on_header_value": self._header_value,
            "on_header_end": lambda: setattr(self, "_header_field", b""),
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
        })

    def _part_begin(self):
        self._headers = {}
        self._name = None

    def _header_value(self, data, start, end):
        key = self._header_field.lower()
        self._headers[key] = self._headers.get(key, b"") + data[start:end]

    def _headers_finished(self):
        disposition = self._headers.get(b"content-disposition", b"").decode("latin-1")
        params = {}
        for piece in disposition.split(";")[1:]:
            key, _, value = piece.strip().partition("=")
            params[key.lower()] = value.strip().strip('"')
        self._name = params.get("name")
        if self._name == "file":
            self.has_file = True
            self.filename = params.get("filename", "upload")
        else:
            self.fields.setdefault(self._name, b"")

    def _data(self, data, start, end):
        if self._name == "file":
            self.pending.append(bytes(data[start:end]))
        elif self._name is not None:
            self.fields[self._name] += data[start:end]
            if len(self.fields[self._name]) > 4096:
                raise bad_request(f"form field {self._name!r} is too long")


async def upload(store: FileStore, request: Request) -> FileObject:
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data") or "boundary=" not in content_type:
        raise bad_request("upload a file as multipart/form-data with fields 'file' and 'purpose'")
    boundary = content_type.split("boundary=", 1)[1].split(";")[0].strip().strip('"')
    form = _Upload(boundary.encode())

    async def file_bytes():
        async for chunk in request.stream():
            try:
                form.parser.write(chunk)
            except python_multipart.exceptions.MultipartParseError as e:
                raise bad_request(f"malformed multipart body: {e}") from None
            while form.pending:
                yield form.pending.pop(0)
        form.parser.finalize()

    try:
        file_id, size = await store.write_data(file_bytes())
    except FileTooLarge as e:
        raise APIError(str(e), 413, param="file", code="file_too_large") from None
    purpose = form.fields.get("purpose", b"").decode("utf-8", "replace")
    if not form.has_file:
        await store.discard_data(file_id)
        raise bad_request("the form has no 'file' field", "file")
    if purpose not in PURPOSES:
        await store.discard_data(file_id)
        raise bad_request(f"purpose must be one of {sorted(PURPOSES)}", "purpose")
    return await store.write_meta(file_id, form.filename, purpose, size)


async def list_files(store: FileStore, request: Request) -> dict:
    q = request.query()
    items = await store.list(q.get("purpose"))
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", "order")
    if order == "asc":
        items.reverse()
    return page(items, q, default_limit=10000, max_limit=10000)


async def retrieve(store: FileStore, file_id: str) -> FileObject:
    try:
        return await store.get(file_id)
    except FileNotFound:
        raise not_found(file_id) from None


async def content(store: FileStore, file_id: str) -> FileResponse:
    try:
        await store.get(file_id)
        return FileResponse(store.read_chunks(file_id))
    except FileNotFound:
        raise not_found(file_id) from None


async def delete(store: FileStore, file_id: str) -> dict:
    try:
        return await store.delete(file_id)
    except FileNotFound:
        raise not_found(file_id) from None
