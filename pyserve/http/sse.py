"""Server-Sent Events responses, as OpenAI-compatible servers stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec

from pyserve.http.errors import APIError

logger = logging.getLogger("pyserve.http")
_json = msgspec.json.Encoder()


class EventStream:
    """A Server-Sent Events response: `data: {json}` frames, then `[DONE]`.

    The status line is sent before the first event, so an error raised by
    the events becomes an error event (`data: {"error": ...}`), as SGLang
    and vLLM report it, and the stream still ends with `[DONE]`. The
    headers tell proxies not to buffer or transform it (nginx reads
    X-Accel-Buffering), so each event reaches the client as it is made."""

    def __init__(self, events: AsyncIterator):
        self.status = 200
        self.events = events
        self.started = False

    async def send(self, send) -> None:
        await self._start(send)
        while True:
            try:
                event = await self.events.__anext__()
            except StopAsyncIteration:
                break
            except APIError as err:
                await send(_event_frame(err.body()))
                break
            except Exception:
                logger.exception("a streamed response failed")
                await send(_event_frame(APIError("internal server error", 500, "server_error").body()))
                break
            await send(_event_frame(event))
        await send(_DONE)

    async def _start(self, send) -> None:
        if not self.started:
            self.started = True
            await send({
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache, no-transform"),
                            (b"x-accel-buffering", b"no")],
            })

    async def end_with(self, send, err: APIError) -> None:
        """Close the stream with an error event, as if the events had raised it."""
        await self._start(send)
        await send(_event_frame(err.body()))
        await send(_DONE)


_DONE = {"type": "http.response.body", "body": b"data: [DONE]\n\n"}


def _event_frame(event) -> dict:
    return {"type": "http.response.body", "body": b"data: " + _json.encode(event) + b"\n\n", "more_body": True}


class DisconnectableStream(EventStream):
    """An SSE response that stops its generator when the client leaves, or
    when the drain time at shutdown ends (the stream then closes with an
    error event)."""

    def __init__(self, events: AsyncIterator, disconnect: asyncio.Future, shutdown: asyncio.Future):
        super().__init__(events)
        self.disconnect = disconnect
        self.shutdown = shutdown

    async def send(self, send) -> None:
        streaming = asyncio.ensure_future(super().send(send))
        done, _ = await asyncio.wait({streaming, self.disconnect, self.shutdown},
                                     return_when=asyncio.FIRST_COMPLETED)
        if streaming in done:
            streaming.result()
            return
        streaming.cancel()
        await asyncio.gather(streaming, return_exceptions=True)
        if self.disconnect in done:
            raise asyncio.CancelledError
        await self.end_with(send, shutting_down())

    async def close(self) -> None:
        self.disconnect.cancel()
        self.shutdown.cancel()
        await self.events.aclose()


def shutting_down() -> APIError:
    """What a request still running when the drain time ends gets."""
    return APIError("the server is shutting down", 503, "server_error")
