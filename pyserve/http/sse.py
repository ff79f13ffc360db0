"""Server-Sent Events responses, as OpenAI-compatible servers stream them,
or as Anthropic's API does (a route family's Dialect says which)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from pyserve.http.errors import APIError

logger = logging.getLogger("pyserve.http")
_json = msgspec.json.Encoder()


def _same(err: APIError) -> APIError:
    return err


@dataclass(frozen=True)
class Dialect:
    """How a route family writes its errors and streams. OpenAI's (the
    default): error bodies as APIError writes them, `data:` frames ended by
    `data: [DONE]`. Anthropic's: its own error bodies, and each frame named
    by its event's `type` (`event: message_start`), with no end marker."""

    error: Callable[[APIError], APIError] = _same  # the error as this family writes it
    named_events: bool = False


OPENAI = Dialect()


class ControlError(APIError):
    """An error of SGLang's control routes (corpora, weight updates):
    `{"success": false, "message"}`, as SGLang's clients read them."""

    def body(self) -> dict:
        return {"success": False, "message": self.message}


def _control_error(err: APIError) -> APIError:
    return err if isinstance(err, ControlError) else ControlError(err.message, err.status, err.type, err.param,
                                                                  err.code)


SGLANG_CONTROL = Dialect(_control_error)


class EventStream:
    """A Server-Sent Events response: `data: {json}` frames, then `[DONE]`.

    The status line is sent before the first event, so an error raised by
    the events becomes an error event (`data: {"error": ...}`), as SGLang
    and vLLM report it, and the stream still ends with `[DONE]`. The
    headers tell proxies not to buffer or transform it (nginx reads
    X-Accel-Buffering), so each event reaches the client as it is made."""

    def __init__(self, events: AsyncIterator, dialect: Dialect = OPENAI):
        self.status = 200
        self.events = events
        self.dialect = dialect
        self.started = False

    async def send(self, send) -> None:
        await self._start(send)
        while True:
            try:
                event = await self.events.__anext__()
            except StopAsyncIteration:
                break
            except APIError as err:
                await send(self._frame(self.dialect.error(err).body()))
                break
            except Exception:
                logger.exception("a streamed response failed")
                await send(self._frame(self.dialect.error(APIError("internal server error", 500,
                                                                   "server_error")).body()))
                break
            await send(self._frame(event))
        await send(self._end())

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
        await send(self._frame(self.dialect.error(err).body()))
        await send(self._end())

    def _frame(self, event) -> dict:
        data = b"data: " + _json.encode(event) + b"\n\n"
        if self.dialect.named_events:
            name = event["type"] if isinstance(event, dict) else event.type
            data = b"event: " + name.encode() + b"\n" + data
        return {"type": "http.response.body", "body": data, "more_body": True}

    def _end(self) -> dict:
        return {"type": "http.response.body", "body": b"" if self.dialect.named_events else b"data: [DONE]\n\n"}


class DisconnectableStream(EventStream):
    """An SSE response that stops its generator when the client leaves, or
    when the drain time at shutdown ends (the stream then closes with an
    error event)."""

    def __init__(self, events: AsyncIterator, disconnect: asyncio.Future, shutdown: asyncio.Future,
                 dialect: Dialect = OPENAI):
        super().__init__(events, dialect)
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
