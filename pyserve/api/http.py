"""Minimal ASGI plumbing: bodies, JSON and SSE responses, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec

from pyserve.api.errors import APIError

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


class Response:
    def __init__(self, status: int, body: bytes, content_type: str = "application/json"):
        self.status = status
        self.body = body
        self.content_type = content_type

    async def send(self, send) -> None:
        await send({
            "type": "http.response.start",
            "status": self.status,
            "headers": [(b"content-type", self.content_type.encode()),
                        (b"content-length", str(len(self.body)).encode())],
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


def json_response(obj, status: int = 200) -> Response:
    return Response(status, _json.encode(obj))


def error_response(err: APIError) -> Response:
    return json_response(err.body(), err.status)


class EventStream:
    """A Server-Sent Events response: `data: {json}` frames, then `[DONE]`."""

    def __init__(self, events: AsyncIterator[dict]):
        self.status = 200
        self.events = events

    async def send(self, send) -> None:
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        })
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": b"data: " + _json.encode(event) + b"\n\n",
                            "more_body": True})
        except APIError as err:
            # Headers are gone already: report the error in the stream.
            await send({"type": "http.response.body", "body": b"data: " + _json.encode(err.body()) + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
