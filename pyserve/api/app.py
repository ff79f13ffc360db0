"""The ASGI application: routing, auth, body decoding, errors, CORS,
access log, and the drain of requests in flight at shutdown.

Handlers get a decoded msgspec Struct and return a JSON-able dict or an
async iterator of SSE events. Whatever goes wrong becomes an OpenAI error
body (an Anthropic one on the Messages routes: a route's Dialect); the
server never answers with a traceback. A client that goes away
cancels its handler, which aborts its engine requests; so does the end of
the drain time at shutdown.

This is the app over a built engine; pyserve/asgi.py builds it (and the
engine) from the options, with the ASGI lifespan.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Callable

import msgspec

from pyserve.api.anthropic import routes as messages
from pyserve.api.anthropic.errors import ANTHROPIC
from pyserve.api.native import (
    adapters, classify, corpora, generate, memory, operations, parsers, pause, profile, rerank, score, sessions,
    tokenize, vertex, weight_sync, weights,
)
from pyserve.api.openai import chat, completions, embeddings
from pyserve.batches import routes as batches
from pyserve.files import routes as files
from pyserve.api.responses import routes as responses
from pyserve.batches.runner import BatchManager
from pyserve.http.drain import Drain
from pyserve.http.errors import APIError, bad_request
from pyserve.api.protocol.anthropic import CountTokensRequest, MessagesRequest
from pyserve.api.protocol.native import (
    AbortRequest, AddExternalCorpusRequest, CloseSessionRequest, LoadLoraAdapterRequest, NativeGenerateRequest,
    OpenSessionRequest, RemoveExternalCorpusRequest, UnloadLoraAdapterRequest,
)
from pyserve.http.io import (
    MAX_BODY_BYTES, FileResponse, Request, Response, decode_json, error_response, json_response,
)
from pyserve.api.protocol.openai import ChatCompletionRequest, CompletionRequest
from pyserve.http.proxy import CORS, TrustedProxies
from pyserve.api.responses.routes import ResponseManager
from pyserve.api.generation.serving import ServingContext
from pyserve.http.sse import OPENAI, SGLANG_CONTROL, Dialect, DisconnectableStream, shutting_down
from pyserve.files.store import FileStore

logger = logging.getLogger("pyserve.http")


@dataclass
class Route:
    handler: Callable[..., Any]
    body_type: type | None = None  # msgspec Struct to decode the body into
    raw: bool = False  # the handler reads the Request itself (uploads, query strings)
    public: bool = False  # answered without an API key
    # What the handler gets first: the App's ctx, files (FileStore), batches
    # (BatchManager) or responses (ResponseManager).
    service: str = "ctx"
    dialect: Dialect = OPENAI  # how its errors and streams are written (auth and body errors included)
    forwards: bool = False  # the handler reads the request and names the path whose route answers it


# SageMaker's one route (vLLM serves it): the body's shape names the route.
_INVOCATION_ROUTES = (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions"),
                      ("documents", "/v1/rerank"), ("input", "/v1/embeddings"))


async def _invocation_path(request: Request) -> str:
    """The route a POST /invocations body is for; that route then reads the
    body as if sent to it."""
    body = await request.body()
    try:
        fields = msgspec.json.decode(body) if body.strip() else {}
    except msgspec.DecodeError:
        fields = None
    path = next((p for key, p in _INVOCATION_ROUTES if isinstance(fields, dict) and key in fields), None)
    if path is None:
        raise APIError("POST /invocations takes a chat (messages), completion (prompt), rerank (query, documents) "
                       "or embedding (input) request body", 400, param="body")
    receive, replayed = request.receive, False

    async def replay() -> dict:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    request.receive = replay
    return path


# Path segments in braces are handed to the handler as keyword arguments;
# a last `{name:path}` takes the rest of the path, slashes included (model
# names such as "meta-llama/Llama-3.1-8B-Instruct").
ROUTES: dict[tuple[str, str], Route] = {
    ("POST", "/v1/chat/completions"): Route(chat.create, ChatCompletionRequest),
    ("POST", "/v1/completions"): Route(completions.create, CompletionRequest),
    ("POST", "/v1/embeddings"): Route(embeddings.create, embeddings.EmbeddingRequest),
    ("GET", "/v1/models"): Route(operations.models),
    ("GET", "/v1/models/{model:path}"): Route(operations.retrieve_model),
    ("POST", "/v1/files"): Route(files.upload, raw=True, service="files"),
    ("GET", "/v1/files"): Route(files.list_files, raw=True, service="files"),
    ("GET", "/v1/files/{file_id}"): Route(files.retrieve, service="files"),
    ("DELETE", "/v1/files/{file_id}"): Route(files.delete, service="files"),
    ("GET", "/v1/files/{file_id}/content"): Route(files.content, service="files"),
    ("POST", "/v1/batches"): Route(batches.create, batches.CreateBatchRequest, service="batches"),
    ("GET", "/v1/batches"): Route(batches.list_batches, raw=True, service="batches"),
    ("GET", "/v1/batches/{batch_id}"): Route(batches.retrieve, service="batches"),
    ("POST", "/v1/batches/{batch_id}/cancel"): Route(batches.cancel, service="batches"),
    ("POST", "/v1/responses"): Route(responses.create, dict, service="responses"),
    ("GET", "/v1/responses/{response_id}"): Route(responses.retrieve, raw=True, service="responses"),
    ("DELETE", "/v1/responses/{response_id}"): Route(responses.delete, service="responses"),
    ("POST", "/v1/responses/{response_id}/cancel"): Route(responses.cancel, service="responses"),
    ("GET", "/v1/responses/{response_id}/input_items"): Route(responses.input_items, raw=True,
                                                               service="responses"),
    ("POST", "/v1/messages"): Route(messages.create, MessagesRequest, dialect=ANTHROPIC),
    ("POST", "/v1/messages/count_tokens"): Route(messages.count_tokens, CountTokensRequest, dialect=ANTHROPIC),
    ("POST", "/generate"): Route(generate.generate, NativeGenerateRequest),
    ("POST", "/open_session"): Route(sessions.open_session, OpenSessionRequest),
    ("POST", "/close_session"): Route(sessions.close_session, CloseSessionRequest),
    ("POST", "/load_lora_adapter"): Route(adapters.load, LoadLoraAdapterRequest),
    ("POST", "/unload_lora_adapter"): Route(adapters.unload, UnloadLoraAdapterRequest),
    ("POST", "/v1/load_lora_adapter"): Route(adapters.load, LoadLoraAdapterRequest),
    ("POST", "/v1/unload_lora_adapter"): Route(adapters.unload, UnloadLoraAdapterRequest),
    ("POST", "/add_external_corpus"): Route(corpora.add, AddExternalCorpusRequest, dialect=SGLANG_CONTROL),
    ("POST", "/remove_external_corpus"): Route(corpora.remove, RemoveExternalCorpusRequest, dialect=SGLANG_CONTROL),
    ("GET", "/list_external_corpora"): Route(corpora.list_corpora, dialect=SGLANG_CONTROL),
    ("POST", "/tokenize"): Route(tokenize.tokenize, dict),
    ("POST", "/v1/tokenize"): Route(tokenize.tokenize, dict),
    ("POST", "/detokenize"): Route(tokenize.detokenize, dict),
    ("POST", "/v1/detokenize"): Route(tokenize.detokenize, dict),
    ("GET", "/tokenizer_info"): Route(tokenize.tokenizer_info),
    ("POST", "/v1/score"): Route(score.score, dict),
    ("POST", "/score"): Route(score.score, dict),
    ("POST", "/classify"): Route(classify.classify, dict),
    ("POST", "/v1/classify"): Route(classify.classify, dict),
    ("POST", "/encode"): Route(classify.encode, classify.ClassifyRequest),
    ("POST", "/pooling"): Route(classify.pooling, classify.PoolingRequest),
    ("POST", "/v1/rerank"): Route(rerank.rerank, dict),
    ("POST", "/rerank"): Route(rerank.scored_rerank, dict),
    ("POST", "/v2/rerank"): Route(rerank.scored_rerank, dict),
    ("GET", "/get_model_info"): Route(operations.model_info),
    ("GET", "/model_info"): Route(operations.model_info),
    ("GET", "/get_server_info"): Route(operations.server_info),
    ("GET", "/server_info"): Route(operations.server_info),
    ("GET", "/v1/loads"): Route(operations.loads),
    ("GET", "/get_load"): Route(operations.get_load),
    ("GET", "/metrics"): Route(operations.metrics),
    ("POST", "/flush_cache"): Route(operations.flush_cache),
    ("GET", "/flush_cache"): Route(operations.flush_cache),  # SGLang takes either method, as on the profile routes
    ("POST", "/configure_logging"): Route(operations.configure_logging, raw=True),
    ("POST", "/freeze_gc"): Route(operations.freeze_gc),
    ("GET", "/freeze_gc"): Route(operations.freeze_gc),
    ("POST", "/reset_prefix_cache"): Route(operations.flush_cache),
    ("POST", "/abort_request"): Route(operations.abort_request, AbortRequest),
    ("POST", "/parse_function_call"): Route(parsers.parse_function_call, parsers.ParseFunctionCallRequest),
    ("POST", "/separate_reasoning"): Route(parsers.separate_reasoning, parsers.SeparateReasoningRequest),
    ("POST", "/start_profile"): Route(profile.start_profile, raw=True),
    ("POST", "/stop_profile"): Route(profile.stop_profile, raw=True),
    ("GET", "/start_profile"): Route(profile.start_profile, raw=True),
    ("GET", "/stop_profile"): Route(profile.stop_profile, raw=True),
    ("POST", "/pause_generation"): Route(pause.pause_generation, raw=True, dialect=SGLANG_CONTROL),
    ("POST", "/continue_generation"): Route(pause.continue_generation, raw=True, dialect=SGLANG_CONTROL),
    ("POST", "/pause"): Route(pause.vllm_pause, raw=True),
    ("POST", "/resume"): Route(pause.vllm_resume),
    ("GET", "/is_paused"): Route(pause.vllm_is_paused),
    ("POST", "/update_weight_version"): Route(weights.update_weight_version, weights.UpdateWeightVersionRequest,
                                              dialect=SGLANG_CONTROL),
    ("GET", "/get_weight_version"): Route(weights.weight_version),
    ("POST", "/update_weights_from_disk"): Route(weights.update_weights_from_disk, weights.UpdateWeightsRequest,
                                                 dialect=SGLANG_CONTROL),
    ("POST", "/init_weights_update_group"): Route(weight_sync.init_weights_update_group,
                                                  weight_sync.InitWeightsUpdateGroupRequest, dialect=SGLANG_CONTROL),
    ("POST", "/update_weights_from_distributed"): Route(weight_sync.update_weights_from_distributed,
                                                        weight_sync.UpdateWeightsFromDistributedRequest,
                                                        dialect=SGLANG_CONTROL),
    ("POST", "/destroy_weights_update_group"): Route(weight_sync.destroy_weights_update_group, raw=True,
                                                     dialect=SGLANG_CONTROL),
    ("POST", "/update_weights_from_tensor"): Route(weight_sync.update_weights_from_tensor,
                                                   weight_sync.UpdateWeightsFromTensorRequest, dialect=SGLANG_CONTROL),
    ("POST", "/release_memory_occupation"): Route(memory.release_memory_occupation, memory.MemoryOccupationRequest),
    ("POST", "/resume_memory_occupation"): Route(memory.resume_memory_occupation, memory.MemoryOccupationRequest),
    ("POST", "/sleep"): Route(memory.vllm_sleep, raw=True),
    ("POST", "/wake_up"): Route(memory.vllm_wake_up, raw=True),
    ("GET", "/is_sleeping"): Route(memory.vllm_is_sleeping),
    ("GET", "/get_weights_by_name"): Route(weight_sync.get_weights_by_name, raw=True, dialect=SGLANG_CONTROL),
    ("POST", "/get_weights_by_name"): Route(weight_sync.get_weights_by_name, raw=True, dialect=SGLANG_CONTROL),
    ("GET", "/version"): Route(operations.version),
    ("GET", "/health"): Route(operations.health, public=True),
    ("GET", "/ping"): Route(operations.health, public=True),
    ("POST", "/invocations"): Route(_invocation_path, forwards=True),
    ("POST", vertex.PREDICT_PATH): Route(vertex.predict, vertex.VertexRequest),
    ("POST", "/ping"): Route(operations.health, public=True),
    ("GET", "/health_generate"): Route(operations.health_generate, public=True),
}
# Routes that generate text: an --is-embedding server answers them 400.
# (/v1/score and the rerank routes answer by the model they find.)
GENERATION_HANDLERS = (chat.create, completions.create, generate.generate, responses.create, messages.create,
                       vertex.predict)
# Routes that read or write text (/generate and /classify check their own fields): refused under
# --skip-tokenizer-init.
TEXT_HANDLERS = (chat.create, completions.create, embeddings.create, responses.create, score.score, messages.create,
                 messages.count_tokens, rerank.rerank, rerank.scored_rerank, tokenize.tokenize, tokenize.detokenize,
                 tokenize.tokenizer_info, batches.create)


def match_path(pattern: str, path: str) -> dict[str, str] | None:
    want, got = pattern.split("/"), path.split("/")
    if want[-1].endswith(":path}"):
        want[-1] = want[-1].replace(":path}", "}")
        got = got[: len(want) - 1] + ["/".join(got[len(want) - 1:])]
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
    """The ASGI app over the model (`ctx`) and, when served, the stores of
    the Files, Batches and Responses APIs. `cors` is off and no proxy is
    trusted unless given."""

    def __init__(self, ctx: ServingContext, api_key: str | None = None, files: FileStore | None = None,
                 batches: BatchManager | None = None, *, responses: ResponseManager | None = None,
                 cors: CORS | None = None, proxies: TrustedProxies | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, aliases: dict[str, str] | None = None):
        """`aliases`: paths answered by another path's route (Vertex AI's, vertex.vertex_paths)."""
        self.ctx = ctx
        self.aliases = aliases or {}
        self.max_body_bytes = max_body_bytes
        self.files = files
        self.batches = batches
        self.responses = responses
        self.api_key = api_key
        self.cors = cors or CORS([])
        self.proxies = proxies or TrustedProxies([])
        self.drain = Drain()
        self.decoders = {r.body_type: msgspec.json.Decoder(r.body_type) for r in ROUTES.values() if r.body_type}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        request = Request(scope, receive, self.max_body_bytes)
        allow_origin = self.cors.allowed(request.headers.get("origin"))
        if allow_origin is not None:
            send = CORS.wrap(send, allow_origin)
            if request.method == "OPTIONS" and "access-control-request-method" in request.headers:
                await self._respond(request, CORS.preflight(request.headers), send)
                return
        if self.drain.draining:
            await self._respond(request, error_response(shutting_down()), send)
            return
        with self.drain.track():
            try:
                response = await self._dispatch(request)
            except APIError as err:
                response = error_response(err)
            except asyncio.CancelledError:
                logger.info("client %s disconnected from %s", self._client(request), request.path)
                return
            except Exception:
                logger.exception("unhandled error on %s %s", request.method, request.path)
                response = error_response(APIError("internal server error", 500, "server_error"))
            await self._respond(request, response, send)

    async def _dispatch(self, request: Request):
        route, params = _match(request.method, self.aliases.get(request.path, request.path))
        if route.forwards:
            route, params = _match(request.method, await route.handler(request))
        try:
            return await self._run(request, route, params)
        except APIError as err:
            raise route.dialect.error(err) from None

    async def _run(self, request: Request, route: Route, params: dict[str, str]):
        if self.api_key and not route.public:
            self._authorize(request)
        if route.handler in GENERATION_HANDLERS:
            embeddings.refuse_generation(self.ctx)
        if route.handler in TEXT_HANDLERS and self.ctx.engine.tokenizer is None:
            raise bad_request("this server runs with --skip-tokenizer-init: it has no tokenizer to read or write "
                              "text; send input_ids to /generate")
        args: list = [getattr(self, route.service)]
        if route.raw:
            args.append(request)
        if route.body_type is not None:
            args.append(decode_json(self.decoders[route.body_type], await request.body()))
        # Generation can take long: if the client leaves, or the drain time
        # at shutdown ends, stop working for it.
        if route.raw:
            # The handler reads the body itself, so nothing else may
            # receive() meanwhile; an upload ends when its body does.
            return to_response(await _call(route.handler, *args, **params))
        work = asyncio.ensure_future(_call(route.handler, *args, **params))
        watcher = asyncio.ensure_future(request.wait_disconnect())
        shutdown = self.drain.stopped()
        try:
            done, _ = await asyncio.wait({work, watcher, shutdown}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
        if work not in done:
            watcher.cancel()
            shutdown.cancel()
            if shutdown in done:
                raise shutting_down()
            raise asyncio.CancelledError
        result = work.result()
        if isinstance(result, AsyncIterator):
            return DisconnectableStream(result, watcher, shutdown, route.dialect)
        watcher.cancel()
        shutdown.cancel()
        return to_response(result)

    def _authorize(self, request: Request) -> None:
        """`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`."""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError("invalid or missing API key", 401, "authentication_error", code="invalid_api_key")

    async def _respond(self, request: Request, response, send) -> None:
        try:
            await response.send(send)
        except (OSError, RuntimeError, asyncio.CancelledError):
            logger.info("client %s went away during %s", self._client(request), request.path)
        finally:
            if isinstance(response, DisconnectableStream):
                await response.close()
        access_log(request, self._client(request), response.status)

    def _client(self, request: Request) -> str:
        return self.proxies.client(request.scope, request.headers)


def _match(method: str, path: str) -> tuple[Route, dict[str, str]]:
    path_known = False
    for (route_method, pattern), route in ROUTES.items():
        found = match_path(pattern, path)
        if found is not None:
            path_known = True
            if route_method == method:
                return route, found
    if path_known:
        raise APIError(f"method {method} is not allowed on {path}", 405)
    raise APIError(f"no route {method} {path}", 404, code="not_found")


def to_response(result):
    if result is None:
        return Response(200, b"")
    if isinstance(result, (FileResponse, Response)):
        return result
    return json_response(result)


async def _call(handler, *args, **kwargs):
    result = handler(*args, **kwargs)
    if asyncio.iscoroutine(result):
        result = await result
    return result


def access_log(request: Request, client: str, status: int) -> None:
    """Uvicorn's access line, as SGLang's logs show it."""
    query = request.scope.get("query_string", b"").decode("latin-1")
    path = request.scope.get("root_path", "") + request.path
    target = f"{path}?{query}" if query else path
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    logger.info('INFO:     %s - "%s %s HTTP/%s" %d %s', client, request.method, target,
                request.scope.get("http_version", "1.1"), status, phrase)
