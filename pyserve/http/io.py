"""Minimal ASGI plumbing: the route path under a root path, bodies and
their JSON bounds, query strings, JSON and file responses, list pages,
disconnects."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol
from urllib.parse import parse_qs

import msgspec

from pyserve.http.errors import APIError, bad_request, from_msgspec

MAX_BODY_BYTES = 64 << 20
# Deeper JSON is refused before decoding: no request shape nests past a
# few levels, and the decoder recurses once per level.
MAX_JSON_DEPTH = 100

_json = msgspec.json.Encoder()


class Request:
    def __init__(self, scope: dict, receive: Callable[[], Awaitable[dict]], max_body_bytes: int = MAX_BODY_BYTES):
        self.scope = scope
        self.receive = receive
        self.max_body_bytes = max_body_bytes  # --max-payload-size
        self.method: str = scope["method"]
        self.path: str = route_path(scope)
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}

    def _too_large(self) -> APIError:
        return APIError(f"request body larger than {self.max_body_bytes} bytes", 413, code="payload_too_large")

    async def body(self) -> bytes:
        """The whole body; a 413 as soon as it is known to exceed the limit
        (from its Content-Length, before reading any of it)."""
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        chunks, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError("client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def stream(self):
        """The body chunk by chunk, for uploads that must not sit in memory."""
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError("client disconnected")
            yield message.get("body", b"")
            if not message.get("more_body", False):
                return

    async def wait_disconnect(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass

    def query(self) -> dict[str, str]:
        """The query string's parameters (the last value of a repeated one)."""
        return {k: v[-1] for k, v in parse_qs(self.scope.get("query_string", b"").decode()).items()}

    def query_values(self, name: str) -> list[str]:
        """Every value of a repeated query parameter (`?tags=a&tags=b`)."""
        return parse_qs(self.scope.get("query_string", b"").decode()).get(name, [])


def route_path(scope: dict) -> str:
    """The path to route: `path` less the `root_path` the app is mounted at.
    Servers differ in whether `path` includes `root_path` (ASGI says it
    does; Granian's url_path_prefix and older servers do not), so it is
    stripped only when there."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


# A JSON string (escapes included) or a bracket: strings are skipped whole,
# so brackets inside them do not count.
_JSON_NESTING = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # too few brackets to nest that deep
    depth = 0
    for match in _JSON_NESTING.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False


def decode_json(decoder: msgspec.json.Decoder, body: bytes):
    """`body` decoded into the decoder's type; a 400 for anything malformed."""
    if json_depth_exceeds(body):
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as e:
        raise from_msgspec(e) from None
    except UnicodeDecodeError as e:
        raise bad_request(f"invalid JSON body: not valid UTF-8 at byte {e.start}") from None


class Response:
    def __init__(self, status: int, body: bytes, content_type: str = "application/json"):
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers: list[tuple[bytes, bytes]] = []  # beyond content type and length

    async def send(self, send) -> None:
        await send({
            "type": "http.response.start",
            "status": self.status,
            "headers": [(b"content-type", self.content_type.encode()),
                        (b"content-length", str(len(self.body)).encode()),
                        *self.headers],
        })
        await send({"type": "http.response.body", "body": self.body})


class FileResponse:
    """A file's bytes, streamed from disk chunk by chunk."""

    def __init__(self, chunks: AsyncIterator[bytes], content_type: str = "application/octet-stream"):
        self.status = 200
        self.chunks = chunks
        self.content_type = content_type

    async def send(self, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", self.content_type.encode())]})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


class Listed(Protocol):
    id: str


def page(items: Sequence[Listed], query: dict[str, str], default_limit: int, max_limit: int) -> dict:
    """OpenAI's cursor pagination: `limit` items `after` an id."""
    try:
        limit = int(query.get("limit", default_limit))
    except ValueError:
        raise bad_request("limit must be an integer", "limit") from None
    if not 1 <= limit <= max_limit:
        raise bad_request(f"limit must be between 1 and {max_limit}", "limit")
    after = query.get("after")
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise bad_request(f"after: no item with id {after!r}", "after")
        items = items[ids.index(after) + 1 :]
    data = list(items[:limit])
    return {
        "object": "list", "data": data, "has_more": len(items) > limit,
        "first_id": data[0].id if data else None, "last_id": data[-1].id if data else None,
    }


def json_response(obj, status: int = 200) -> Response:
    return Response(status, _json.encode(obj))


def error_response(err: APIError) -> Response:
    return json_response(err.body(), err.status)
