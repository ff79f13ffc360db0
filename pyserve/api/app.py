"""The ASGI application: routing, auth, body decoding, errors, access log.

Handlers get a decoded msgspec Struct and return a JSON-able dict or an
async iterator of SSE events. Whatever goes wrong becomes an OpenAI error
body; the server never answers with a traceback. A client that goes away
cancels its handler, which aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from pyserve.api import batches, chat, completions, files, native
from pyserve.api.errors import APIError, from_msgspec
from pyserve.api.http import EventStream, FileResponse, Request, Response, error_response, json_response
from pyserve.api.protocol import ChatCompletionRequest, CompletionRequest, NativeGenerateRequest
from pyserve.api.serving import ServingContext

logger = logging.getLogger("pyserve.http")


@dataclass
class Route:
    handler: Callable[..., Any]
    body_type: type | None = None  # msgspec Struct to decode the body into
    raw: bool = False  # the handler reads the Request itself (uploads, query strings)
    public: bool = False  # answered without an API key


# Path segments in braces are handed to the handler as keyword arguments.
ROUTES: dict[tuple[str, str], Route] = {
    ("POST", "/v1/chat/completions"): Route(chat.create, ChatCompletionRequest),
    ("POST", "/v1/completions"): Route(completions.create, CompletionRequest),
    ("GET", "/v1/models"): Route(native.models),
    ("POST", "/v1/files"): Route(files.upload, raw=True),
    ("GET", "/v1/files"): Route(files.list_files, raw=True),
    ("GET", "/v1/files/{file_id}"): Route(files.retrieve),
    ("DELETE", "/v1/files/{file_id}"): Route(files.delete),
    ("GET", "/v1/files/{file_id}/content"): Route(files.content),
    ("POST", "/v1/batches"): Route(batches.create, batches.CreateBatchRequest),
    ("GET", "/v1/batches"): Route(batches.list_batches, raw=True),
    ("GET", "/v1/batches/{batch_id}"): Route(batches.retrieve),
    ("POST", "/v1/batches/{batch_id}/cancel"): Route(batches.cancel),
    ("POST", "/generate"): Route(native.generate, NativeGenerateRequest),
    ("GET", "/get_model_info"): Route(native.model_info),
    ("GET", "/get_server_info"): Route(native.server_info),
    ("GET", "/version"): Route(lambda ctx: native.version()),
    ("GET", "/health"): Route(lambda ctx: None, public=True),
}


def match_path(pattern: str, path: str) -> dict[str, str] | None:
    want, got = pattern.split("/"), path.split("/")
    if len(want) != len(got):
        return None
    params = {}
    for w, g in zip(want, got):
        if w.startswith("{"):
            if not g:
                return None
            params[w[1:-1]] = g
        elif w != g:
            return None
    return params


class App:
    def __init__(self, ctx: ServingContext, api_key: str | None = None):
        self.ctx = ctx
        self.api_key = api_key
        self.decoders = {r.body_type: msgspec.json.Decoder(r.body_type) for r in ROUTES.values() if r.body_type}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            response = await self._dispatch(request)
        except APIError as err:
            response = error_response(err)
        except asyncio.CancelledError:
            logger.info("client %s disconnected from %s", _client(scope), request.path)
            return
        except Exception:
            logger.exception("unhandled error on %s %s", request.method, request.path)
            response = error_response(APIError("internal server error", 500, "server_error"))
        await self._respond(request, response, send)

    async def _dispatch(self, request: Request):
        route, params, path_known = None, {}, False
        for (method, pattern), candidate in ROUTES.items():
            found = match_path(pattern, request.path)
            if found is not None:
                path_known = True
                if method == request.method:
                    route, params = candidate, found
                    break
        if route is None:
            if path_known:
                raise APIError(f"method {request.method} is not allowed on {request.path}", 405)
            raise APIError(f"no route {request.method} {request.path}", 404, code="not_found")
        if self.api_key and not route.public:
            self._authorize(request)
        args: list = [request] if route.raw else []
        if route.body_type is not None:
            body = await request.body()
            try:
                args.append(self.decoders[route.body_type].decode(body))
            except msgspec.DecodeError as e:
                raise from_msgspec(e) from None
        # Generation can take long: if the client leaves, stop working for it.
        if route.raw:
            # The handler reads the body itself, so nothing else may
            # receive() meanwhile; an upload ends when its body does.
            return to_response(await _call(route.handler, self.ctx, *args, **params))
        work = asyncio.ensure_future(_call(route.handler, self.ctx, *args, **params))
        watcher = asyncio.ensure_future(request.wait_disconnect())
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
        if work not in done:
            watcher.cancel()
            raise asyncio.CancelledError
        result = work.result()
        if isinstance(result, AsyncIterator):
            return _Streaming(result, watcher)
        watcher.cancel()
        return to_response(result)

    def _authorize(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            raise APIError("invalid or missing API key", 401, "authentication_error", code="invalid_api_key")

    async def _respond(self, request: Request, response, send) -> None:
        try:
            await response.send(send)
        except (OSError, RuntimeError, asyncio.CancelledError):
            logger.info("client %s went away during %s", _client(request.scope), request.path)
        finally:
            if isinstance(response, _Streaming):
                await response.close()
        logger.info('%s - "%s %s HTTP/%s" %d', _client(request.scope), request.method, request.path,
                    request.scope.get("http_version", "1.1"), response.status)


def to_response(result):
    if result is None:
        return Response(200, b"")
    if isinstance(result, FileResponse):
        return result
    return json_response(result)


async def _call(handler, *args, **kwargs):
    result = handler(*args, **kwargs)
    if asyncio.iscoroutine(result):
        result = await result
    return result


def _client(scope) -> str:
    client = scope.get("client") or ("-", 0)
    return f"{client[0]}:{client[1]}"


class _Streaming(EventStream):
    """An SSE response that stops its generator when the client leaves."""

    def __init__(self, events: AsyncIterator[dict], disconnect: asyncio.Future):
        super().__init__(events)
        self.disconnect = disconnect

    async def send(self, send) -> None:
        streaming = asyncio.ensure_future(super().send(send))
        done, _ = await asyncio.wait({streaming, self.disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if streaming not in done:
            streaming.cancel()
            await asyncio.gather(streaming, return_exceptions=True)
            raise asyncio.CancelledError
        streaming.result()

    async def close(self) -> None:
        self.disconnect.cancel()
        await self.events.aclose()
