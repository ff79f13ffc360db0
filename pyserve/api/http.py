"""Minimal ASGI plumbing: bodies, query strings, JSON and file responses,
list pages, CORS, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol
from urllib.parse import parse_qs

import msgspec

from pyserve.api.errors import APIError, bad_request

MAX_BODY_BYTES = 64 << 20

_json = msgspec.json.Encoder()


class Request:
    def __init__(self, scope: dict, receive: Callable[[], Awaitable[dict]]):
        self.scope = scope
        self.receive = receive
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}

    async def body(self) -> bytes:
        chunks, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError("client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(f"request body larger than {MAX_BODY_BYTES} bytes", 413)
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


# CORS as SGLang configures it: any origin, method and header, with credentials.
def with_cors(send, origin: str):
    """`send` with the CORS headers added to the response's status line."""
    extra = [(b"access-control-allow-origin", origin.encode("latin-1")),
             (b"access-control-allow-credentials", b"true"),
             (b"vary", b"Origin")]

    async def send_with_cors(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return send_with_cors


def preflight_response(headers: dict[str, str]) -> Response:
    response = Response(200, b"OK", "text/plain")
    response.headers = [
        (b"access-control-allow-methods", b"DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"),
        (b"access-control-allow-headers", headers.get("access-control-request-headers", "*").encode("latin-1")),
        (b"access-control-max-age", b"600"),
    ]
    return response
